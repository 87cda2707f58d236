"""Drop-ins for ``verl.trainer.ppo.core_algos`` (verl 0.9), built on the fused ops.

Each function takes and returns what verl's function of the same name does, and matches
it to 1e-6 (tests/test_integrations_verl.py runs both). verl sums ``token_level_rewards``
over the response to get one score per sample, groups samples by ``index`` (uid strings)
and returns ``(advantages, returns)``, both ``[bs, response_length]`` and equal.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import torch

from ..ops.advantages import group_advantages
from ..ops.groups import uids_to_group_index

__all__ = [
    "compute_grpo_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_gdpo_outcome_advantage",
]


def _outcome(token_level_rewards, response_mask, index, **options) -> Tuple[torch.Tensor, torch.Tensor]:
    scores = token_level_rewards.sum(dim=-1)
    group_index, num_groups = uids_to_group_index(index, device=scores.device, return_num_groups=True)
    # verl computes `scores.unsqueeze(-1) * response_mask`: the product's dtype.
    out_dtype = torch.promote_types(scores.dtype, response_mask.dtype)
    out = group_advantages(scores, group_index, num_groups=num_groups, preset="verl", response_mask=response_mask,
                           out_dtype=out_dtype, **options)  # fmt: skip
    return out.token_advantages, out.token_advantages


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Optional[Any] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GRPO (or Dr.GRPO when ``norm_adv_by_std_in_grpo=False``); singletons: mean 0, std 1."""
    estimator = "grpo" if norm_adv_by_std_in_grpo else "dr_grpo"
    return _outcome(token_level_rewards, response_mask, index, estimator=estimator, eps=epsilon)


def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Optional[Any] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorised GRPO: the same numbers as the loop (its singletons also use 0/1)."""
    return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon,
                                          norm_adv_by_std_in_grpo, config)  # fmt: skip


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    config: Optional[Any] = None,
    **kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """RLOO, n/(n−1)·(r − μ); a singleton keeps its raw score (verl's loop)."""
    return _outcome(token_level_rewards, response_mask, index, estimator="rloo")


def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    config: Optional[Any] = None,
    **kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorised RLOO, which (unlike its loop) gives singletons A = 0."""
    return _outcome(token_level_rewards, response_mask, index, estimator="rloo", singleton="zero")


def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    config: Optional[Any] = None,
    **kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """OPO: r − Σ len·r / Σ len over the group, len = Σ_t response_mask."""
    return _outcome(token_level_rewards, response_mask, index, estimator="opo")


def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config: Optional[Any] = None,
    **kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GPG: α·(r − μ)/f_norm with α = B / #{r ≠ 0} (verl overrides the ``alpha`` argument)."""
    adv, _ = _outcome(token_level_rewards, response_mask, index, estimator="gpg")
    if f_norm != 1.0:
        adv = adv / f_norm
    return adv, adv


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    config: Optional[Any] = None,
    **kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: r − μ, whitened over all valid tokens of the batch."""
    return _outcome(token_level_rewards, response_mask, index, estimator="reinforce_pp_baseline")


def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Optional[Any] = None,
    non_tensor_batch: Optional[dict] = None,
    batch: Optional[dict] = None,
    **kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GDPO: per-reward-term GRPO, weighted sum, token whitening.

    With ``config.gdpo_reward_keys`` and ``non_tensor_batch``/``batch``, the reward terms
    are read as verl does (one score per sample per key, weights from
    ``config.gdpo_reward_weights``); otherwise ``token_level_rewards`` is the only term.
    """
    keys = config.get("gdpo_reward_keys", None) if config is not None else None
    if keys and non_tensor_batch is not None and batch is not None:
        # verl: np.asarray(comp, dtype=np.float32), which also takes DataProto's dtype=object arrays.
        terms = torch.stack([torch.from_numpy(np.asarray(non_tensor_batch[k], dtype=np.float32)) for k in keys], dim=1)
        weights = config.get("gdpo_reward_weights", None)
        weights = torch.tensor(list(weights), dtype=torch.float32) if weights is not None else None
        terms = terms.to(token_level_rewards.device)
        weights = weights.to(token_level_rewards.device) if weights is not None else None
    else:
        terms, weights = token_level_rewards.sum(dim=-1), None
    group_index, num_groups = uids_to_group_index(index, device=terms.device, return_num_groups=True)
    # verl's result has the dtype of its per-term GRPO output, `term_scores.unsqueeze(-1) * response_mask`.
    out_dtype = torch.promote_types(terms.dtype, response_mask.dtype)
    out = group_advantages(terms, group_index, num_groups=num_groups, preset="verl", estimator="gdpo", eps=epsilon,
                           scale="group" if norm_adv_by_std_in_grpo else "none", reward_weights=weights,
                           response_mask=response_mask, out_dtype=out_dtype)  # fmt: skip
    return out.token_advantages, out.token_advantages
