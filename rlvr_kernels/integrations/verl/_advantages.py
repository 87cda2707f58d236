"""The body of the verl outcome-advantage drop-ins (``core_algos.compute_*_outcome_advantage``):
verl's checks, its uid grouping and one ``group_advantages`` call."""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

from ..._core.validation import FLOAT_DTYPES, MASK_DTYPES, check_tensor, checks_enabled
from ...ops.advantages import group_advantages
from ...ops.groups import uids_to_group_index
from .._backend import current_backend
from .._errors import caller_names

# group_advantages' argument names -> the advantage drop-ins' (for its error messages).
ADV_NAMES = {
    "scores": "token_level_rewards",
    "group_index": "index",
    "uids": "index",
    "eps": "epsilon",
    "reward_weights": "config.gdpo_reward_weights",
}


def check_rewards(token_level_rewards, response_mask) -> None:
    check_tensor("token_level_rewards", token_level_rewards, dtypes=FLOAT_DTYPES, ndim=(2,))
    check_tensor(
        "response_mask",
        response_mask,
        dtypes=MASK_DTYPES,
        ndim=(2,),
        like=token_level_rewards,
        like_name="token_level_rewards",
    )
    if response_mask.shape[0] != token_level_rewards.shape[0]:
        raise ValueError(
            f"response_mask: expected {token_level_rewards.shape[0]} rows (like token_level_rewards), "
            f"got shape {tuple(response_mask.shape)}"
        )


def group_ids(index, bs: int, device) -> Tuple[torch.Tensor, int]:
    with caller_names(ADV_NAMES):
        group_index, num_groups = uids_to_group_index(index, device=device, return_num_groups=True)
    if group_index.shape[0] != bs:
        raise ValueError(f"index: expected one uid per row of token_level_rewards ({bs}), got {group_index.shape[0]}")
    return group_index, num_groups


def check_finite_scores(name: str, scores: torch.Tensor) -> None:
    """verl turns a non-finite reward into NaN advantages for its whole group; we refuse
    it, naming the row (a [bs] reduction, far cheaper than the advantages themselves)."""
    if checks_enabled(True, scores) and scores.numel() and not bool(torch.isfinite(scores).all()):
        bad = ~torch.isfinite(scores)
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{name}: non-finite reward {float(scores.reshape(scores.shape[0], -1)[row].sum())} at row {row}"
        )


def outcome(token_level_rewards, response_mask, index, **options) -> Tuple[torch.Tensor, torch.Tensor]:
    check_rewards(token_level_rewards, response_mask)
    scores = token_level_rewards.sum(dim=-1)
    check_finite_scores("token_level_rewards", scores)
    group_index, num_groups = group_ids(index, scores.shape[0], scores.device)
    # verl computes `scores.unsqueeze(-1) * response_mask`: the product's dtype.
    out_dtype = torch.promote_types(scores.dtype, response_mask.dtype)
    with caller_names(ADV_NAMES):
        out = group_advantages(
            scores,
            group_index,
            num_groups=num_groups,
            preset="verl",
            response_mask=response_mask,
            out_dtype=out_dtype,
            backend=current_backend(),
            **options,
        )
    return out.token_advantages, out.token_advantages


def gdpo_outcome(
    token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo, config, non_tensor_batch, batch
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``compute_gdpo_outcome_advantage``'s body (its docstring says what it reads)."""
    check_rewards(token_level_rewards, response_mask)
    keys = config.get("gdpo_reward_keys", None) if config is not None else None
    if keys and non_tensor_batch is not None and batch is not None:
        # verl: np.asarray(comp, dtype=np.float32), which also takes DataProto's dtype=object arrays.
        cols = []
        for k in keys:
            try:
                cols.append(torch.from_numpy(np.asarray(non_tensor_batch[k], dtype=np.float32)))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"non_tensor_batch[{k!r}]: expected one number per sample ({e})") from None
        terms = torch.stack(cols, dim=1)
        weights = config.get("gdpo_reward_weights", None)
        weights = torch.tensor(list(weights), dtype=torch.float32) if weights is not None else None
        terms = terms.to(token_level_rewards.device)
        weights = weights.to(token_level_rewards.device) if weights is not None else None
        terms_name = "non_tensor_batch"
    else:
        terms, weights, terms_name = token_level_rewards.sum(dim=-1), None, "token_level_rewards"
    check_finite_scores(terms_name, terms)
    group_index, num_groups = group_ids(index, terms.shape[0], terms.device)
    # verl's result has the dtype of its per-term GRPO output, `term_scores.unsqueeze(-1) * response_mask`.
    out_dtype = torch.promote_types(terms.dtype, response_mask.dtype)
    with caller_names(dict(ADV_NAMES, scores=terms_name)):
        out = group_advantages(
            terms,
            group_index,
            num_groups=num_groups,
            preset="verl",
            estimator="gdpo",
            eps=epsilon,
            scale="group" if norm_adv_by_std_in_grpo else "none",
            reward_weights=weights,
            response_mask=response_mask,
            out_dtype=out_dtype,
            backend=current_backend(),
        )
    return out.token_advantages, out.token_advantages
