"""Drop-ins for ``verl.trainer.ppo.core_algos`` (verl 0.9): the outcome-advantage
estimators, ``compute_policy_loss_{vanilla,gspo,cispo,sapo,gpg,dppo_tv,dppo_kl,geo_mean,dro,clip_cov,kl_cov}``,
``kl_penalty`` and
``agg_loss``, with verl's signatures and numbers (to 1e-6 in fp32;
tests/advantages/test_peers_verl.py and tests/policy_loss/test_peers_verl.py run both).

Advantages: verl sums ``token_level_rewards`` over the response to get one score per
sample, groups samples by ``index`` (uid strings) and returns ``(advantages, returns)``,
both ``[bs, response_length]`` and equal; here one ``group_advantages`` call.

Policy losses: one ``policy_loss`` call each (see the section note below), except GPG.

``kl_penalty``, ``agg_loss`` and GPG's loss (−logπ·A) are elementwise work and one
masked reduction, so they run as lean torch, the same on every backend: verl's formulas
in verl's order (the same values, bit for bit, on the fast paths), with fewer
temporaries, and autograd functions whose backward is one pass (k3's derivative is kept
from the forward; a masked sum's gradient is one multiply by the mask): the
integrations' one lean-torch implementation of them, ``integrations._torch_math``.

This module holds verl's names only; what they share lives in ``_advantages`` (the
advantage body) and ``_losses`` (the policy-loss body, shared with ``losses``).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from ..._core.validation import FLOAT_DTYPES, MASK_DTYPES, check_tensor
from .._torch_math import aggregate, kl_estimate
from ._advantages import gdpo_outcome, outcome
from ._losses import agg_kwargs, bypass_body, policy_loss_body

__all__ = [
    "compute_grpo_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_gdpo_outcome_advantage",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_gspo",
    "compute_policy_loss_cispo",
    "compute_policy_loss_sapo",
    "compute_policy_loss_gpg",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_dro",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
    "kl_penalty",
    "agg_loss",
]


# =======================================================================================
# Outcome advantages
# =======================================================================================


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Optional[Any] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GRPO (or Dr.GRPO when ``norm_adv_by_std_in_grpo=False``); singletons: mean 0, std 1."""
    estimator = "grpo" if norm_adv_by_std_in_grpo else "dr_grpo"
    return outcome(token_level_rewards, response_mask, index, estimator=estimator, eps=epsilon)


def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Optional[Any] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorised GRPO: the same numbers as the loop (its singletons also use 0/1)."""
    return compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo, config
    )


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Optional[Any] = None,
    **kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """RLOO, n/(n−1)·(r − μ); a singleton keeps its raw score (verl's loop)."""
    return outcome(token_level_rewards, response_mask, index, estimator="rloo")


def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Optional[Any] = None,
    **kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorised RLOO, which (unlike its loop) gives singletons A = 0."""
    return outcome(token_level_rewards, response_mask, index, estimator="rloo", singleton="zero")


def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Optional[Any] = None,
    **kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """OPO: r − Σ len·r / Σ len over the group, len = Σ_t response_mask."""
    return outcome(token_level_rewards, response_mask, index, estimator="opo")


def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config: Optional[Any] = None,
    **kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GPG: α·(r − μ)/f_norm with α = B / #{r ≠ 0} (verl overrides the ``alpha`` argument)."""
    adv, _ = outcome(token_level_rewards, response_mask, index, estimator="gpg")
    if f_norm != 1.0:
        adv = adv / f_norm
    return adv, adv


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    epsilon: float = 1e-6,
    config: Optional[Any] = None,
    **kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: r − μ, whitened over all valid tokens of the batch."""
    return outcome(token_level_rewards, response_mask, index, estimator="reinforce_pp_baseline")


def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
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
    return gdpo_outcome(
        token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo, config, non_tensor_batch, batch
    )


# =======================================================================================
# Policy losses: compute_policy_loss_* (the mapping onto policy_loss: see ``_losses``)
# =======================================================================================


def _policy_loss_dropin(loss_mode: str, doc: str, agg_default: str = "token-mean"):
    """The drop-in ``compute_policy_loss_<loss_mode>``: verl's signature (``agg_default``
    is verl's default ``loss_agg_mode``), ``doc`` as its docstring, one ``_losses`` body
    (``bypass_body`` for bypass_mode, ``policy_loss_body`` for the others)."""
    body = bypass_body if loss_mode == "bypass_mode" else functools.partial(policy_loss_body, loss_mode)

    def dropin(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = agg_default,
        config: Optional[Any] = None,
        rollout_is_weights: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Dict[str, Any]]:
        return body(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)

    dropin.__name__ = dropin.__qualname__ = f"compute_policy_loss_{loss_mode}"
    dropin.__doc__ = doc
    return dropin


compute_policy_loss_vanilla = _policy_loss_dropin(
    "vanilla",
    """PPO clip with verl's dual clip (c = ``config.get("clip_ratio_c", 3.0)``) and δ
clamped to ±20; returns ``(pg_loss, {"actor/pg_clipfrac", "actor/ppo_kl",
"actor/pg_clipfrac_lower"})`` with float metrics (one host sync).""",
)


compute_policy_loss_gspo = _policy_loss_dropin(
    "gspo",
    """GSPO: the sequence ratio exp(mean_t δ) in verl's token form, log s clamped at 10.""",
    agg_default="seq-mean-token-mean",
)


compute_policy_loss_cispo = _policy_loss_dropin(
    "cispo",
    """CISPO: −sg(clip(ρ, 1 − ε_low, 1 + ε_high))·A·logπ.""",
)


compute_policy_loss_sapo = _policy_loss_dropin(
    "sapo",
    """SAPO's soft gate with ``config.tau_pos``/``tau_neg``; like verl, always aggregated
``seq-mean-token-mean`` whatever ``loss_agg_mode`` says (clip fractions are 0).""",
    agg_default="seq-mean-token-mean",
)


compute_policy_loss_gpg = _policy_loss_dropin(
    "gpg",
    """GPG: −A·logπ; returns ``(pg_loss, {})`` like verl.""",
)


compute_policy_loss_dppo_tv = _policy_loss_dropin(
    "dppo_tv",
    """DPPO-Binary-TV: −A·sg(min(ρ, c))·logπ·keep, keep = p − p_old <= δ_high (A > 0) or
>= −δ_low (A <= 0), δ from clip_ratio(_low/_high), c = ``config.get("clip_ratio_c",
20.0)``, δ clamped to ±20 in ρ; ``actor/pg_clipfrac`` = the masked-out fraction,
``actor/pg_clipfrac_lower`` = kept with ρ > c.""",
)


compute_policy_loss_dppo_kl = _policy_loss_dropin(
    "dppo_kl",
    """DPPO-Binary-KL: as ``compute_policy_loss_dppo_tv`` with the binary KL
p_old·log(p_old/p) + (1 − p_old)·log((1 − p_old + 1e-8)/(1 − p + 1e-8)) as the
divergence: keep = KL <= δ_high or p <= p_old (A > 0), KL <= δ_low or p >= p_old
(A <= 0).""",
)


compute_policy_loss_geo_mean = _policy_loss_dropin(
    "geo_mean",
    """GMPO: mean over rows of −Ā_i·exp(Σ_t m·δ_min / n_i), δ_min = δ clipped above at
ε_high for A > 0 and below at −ε_low for A < 0 (δ = logπ − logπ_old unclamped),
Ā_i = Σ_t m·A / n_i; ``loss_agg_mode`` and ``global_batch_info`` unused (verl); the
sequence IS weight is the geometric mean of ``rollout_is_weights``.
``actor/pg_clipfrac`` / ``_lower``: δ outside [−ε_low, ε_high] with A > 0 / A < 0.""",
)


compute_policy_loss_dro = _policy_loss_dropin(
    "dro",
    """DRO: −(logπ·A − ½·β·(logπ − logπ_old)²) (·w), β = ``config.policy_loss.dro_beta`` > 0,
aggregated by ``loss_agg_mode``; metric ``actor/ppo_kl``.""",
)


compute_policy_loss_clip_cov = _policy_loss_dropin(
    "clip_cov",
    """Clip-Cov: max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high)) (·w), 0 on the tokens verl's
covariance rule selects (``config.policy_loss.clip_cov_ratio`` / ``clip_cov_lb`` /
``clip_cov_ub``; torch.randperm from the global RNG, as verl), aggregated by
``loss_agg_mode``; δ unclamped. ``actor/pg_clipfrac``: the selected fraction;
``actor/ppo_kl``.""",
)


compute_policy_loss_kl_cov = _policy_loss_dropin(
    "kl_cov",
    """KL-Cov: −A·ρ (·w), plus ``config.policy_loss.ppo_kl_coef``·|δ| (·w) on the top
``kl_cov_ratio`` of the valid tokens by covariance (torch.topk, as verl), aggregated by
``loss_agg_mode``; δ unclamped. ``actor/ppo_kl``: mean |δ|.""",
)


compute_policy_loss_bypass_mode = _policy_loss_dropin(
    "bypass_mode",
    """verl's bypass mode (``old_log_prob`` is the rollout policy's): the rollout correction
of ``config.policy_loss.rollout_correction`` against the current log-probs inside the
loss (its rejection always; its IS weights with ``loss_type="reinforce"``), then PPO clip
(``"ppo_clip"``, as ``compute_policy_loss_vanilla``) or −A·logπ·w (``"reinforce"``) on the
kept tokens; ``rollout_is_weights`` ignored (verl). Metrics: the loss's and verl's
"rollout_corr/..." of the current policy.""",
)


# =======================================================================================
# kl_penalty
# =======================================================================================


def kl_penalty(logprob: torch.FloatTensor, ref_logprob: torch.FloatTensor, kl_penalty) -> torch.FloatTensor:
    """Per-token KL estimate with verl's values and gradient: "kl"/"k1", "abs",
    "mse"/"k2", "low_var_kl"/"k3" (x = ref − logp clamped to ±20, result clamped to ±10),
    a "+" suffix = that value with k2's gradient. Same-shaped, same-dtype k3 / k3+ run
    in one autograd function (``_torch_math``); everything else is verl's own expression."""
    if not isinstance(kl_penalty, str):
        raise TypeError(f"kl_penalty: expected an estimator name (str), got {type(kl_penalty).__name__}")
    check_tensor("logprob", logprob, dtypes=FLOAT_DTYPES)
    if not isinstance(ref_logprob, torch.Tensor):
        raise TypeError(f"ref_logprob: expected a torch.Tensor, got {type(ref_logprob).__name__}")
    try:
        torch.broadcast_shapes(logprob.shape, ref_logprob.shape)
    except RuntimeError:
        raise ValueError(
            f"ref_logprob: expected a shape broadcastable with logprob's {tuple(logprob.shape)}, "
            f"got {tuple(ref_logprob.shape)}"
        ) from None
    return kl_estimate(logprob, ref_logprob, kl_penalty)


# =======================================================================================
# agg_loss
# =======================================================================================


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Optional[int] = None,
    global_batch_size: Optional[int] = None,
    loss_scale_factor: Optional[int] = None,
):
    """verl's ``agg_loss``: token-mean (by ``batch_num_tokens`` or the local count),
    token-sum, seq-mean-token-sum / -mean (by ``global_batch_size`` or the sequences with
    a valid token), seq-mean-token-sum-norm (÷ ``loss_scale_factor``, default
    ``loss_mask.shape[-1]``, as verl); all × ``dp_size``. The mask weights the tokens as
    in verl's ``masked_sum`` (bool, or any number). A count of 0 gives 0 where verl
    divides by it (NaN), so no input gives NaN from the aggregation itself."""
    check_tensor("loss_mat", loss_mat, dtypes=FLOAT_DTYPES)
    check_tensor("loss_mask", loss_mask, dtypes=MASK_DTYPES, like=loss_mat, like_name="loss_mat")
    try:
        torch.broadcast_shapes(loss_mat.shape, loss_mask.shape)
    except RuntimeError:
        raise ValueError(
            f"loss_mask: expected a shape broadcastable with loss_mat's {tuple(loss_mat.shape)}, "
            f"got {tuple(loss_mask.shape)}"
        ) from None
    kw = agg_kwargs(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    return aggregate(
        loss_mat,
        loss_mask,
        loss_agg_mode,
        kw["dp_size"],
        kw["global_num_tokens"],
        kw["global_num_seqs"],
        kw["loss_scale_factor"],
    )
