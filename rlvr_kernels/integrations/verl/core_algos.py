"""Drop-ins for ``verl.trainer.ppo.core_algos`` (verl 0.9): the outcome-advantage
estimators, ``compute_policy_loss_{vanilla,gspo,cispo,sapo,gpg}``, ``kl_penalty`` and
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
from the forward; a masked sum's gradient is one multiply by the mask).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from ..._core.layout import safe_div as _safe_div  # 0 where verl's divisor is 0 (verl gives NaN)
from ..._core.validation import FLOAT_DTYPES, MASK_DTYPES, check_tensor, checks_enabled
from ...ops.advantages import group_advantages
from ...ops.groups import uids_to_group_index
from ...ops.policy_loss import policy_loss
from .._backend import current_backend
from .._errors import caller_names
from ._config import AGG_MODES, ActorLossConfig, batch_info, read_actor_config

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
    "compute_policy_loss_gspo",
    "compute_policy_loss_cispo",
    "compute_policy_loss_sapo",
    "compute_policy_loss_gpg",
    "kl_penalty",
    "agg_loss",
]

# group_advantages' argument names -> the advantage drop-ins' (for its error messages).
_ADV_NAMES = {
    "scores": "token_level_rewards",
    "group_index": "index",
    "uids": "index",
    "eps": "epsilon",
    "reward_weights": "config.gdpo_reward_weights",
}
# policy_loss' argument names -> verl's.
PG_NAMES = {
    "logprobs": "log_prob",
    "old_logprobs": "old_log_prob",
    "mask": "response_mask",
    "ref_logprobs": "ref_log_prob",
    "rollout_logprobs": "rollout_log_probs",
    "global_num_tokens": "batch_num_tokens",
    "global_num_seqs": "global_batch_size",
}


# =======================================================================================
# Outcome advantages
# =======================================================================================


def _check_rewards(token_level_rewards, response_mask) -> None:
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


def _group_ids(index, bs: int, device) -> Tuple[torch.Tensor, int]:
    with caller_names(_ADV_NAMES):
        group_index, num_groups = uids_to_group_index(index, device=device, return_num_groups=True)
    if group_index.shape[0] != bs:
        raise ValueError(f"index: expected one uid per row of token_level_rewards ({bs}), got {group_index.shape[0]}")
    return group_index, num_groups


def _check_finite_scores(name: str, scores: torch.Tensor) -> None:
    """verl turns a non-finite reward into NaN advantages for its whole group; we refuse
    it, naming the row (a [bs] reduction, far cheaper than the advantages themselves)."""
    if checks_enabled(True, scores) and scores.numel() and not bool(torch.isfinite(scores).all()):
        bad = ~torch.isfinite(scores)
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{name}: non-finite reward {float(scores.reshape(scores.shape[0], -1)[row].sum())} at row {row}"
        )


def _outcome(token_level_rewards, response_mask, index, **options) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_rewards(token_level_rewards, response_mask)
    scores = token_level_rewards.sum(dim=-1)
    _check_finite_scores("token_level_rewards", scores)
    group_index, num_groups = _group_ids(index, scores.shape[0], scores.device)
    # verl computes `scores.unsqueeze(-1) * response_mask`: the product's dtype.
    out_dtype = torch.promote_types(scores.dtype, response_mask.dtype)
    with caller_names(_ADV_NAMES):
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
    return _outcome(token_level_rewards, response_mask, index, estimator=estimator, eps=epsilon)


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
    return _outcome(token_level_rewards, response_mask, index, estimator="rloo")


def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Optional[Any] = None,
    **kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorised RLOO, which (unlike its loop) gives singletons A = 0."""
    return _outcome(token_level_rewards, response_mask, index, estimator="rloo", singleton="zero")


def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Optional[Any] = None,
    **kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """OPO: r − Σ len·r / Σ len over the group, len = Σ_t response_mask."""
    return _outcome(token_level_rewards, response_mask, index, estimator="opo")


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
    adv, _ = _outcome(token_level_rewards, response_mask, index, estimator="gpg")
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
    return _outcome(token_level_rewards, response_mask, index, estimator="reinforce_pp_baseline")


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
    _check_rewards(token_level_rewards, response_mask)
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
    _check_finite_scores(terms_name, terms)
    group_index, num_groups = _group_ids(index, terms.shape[0], terms.device)
    # verl's result has the dtype of its per-term GRPO output, `term_scores.unsqueeze(-1) * response_mask`.
    out_dtype = torch.promote_types(terms.dtype, response_mask.dtype)
    with caller_names(dict(_ADV_NAMES, scores=terms_name)):
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


# =======================================================================================
# Policy losses: compute_policy_loss_*
# =======================================================================================
#
# How verl's pieces map onto one ``policy_loss`` call (preset="verl": δ clamped to ±20,
# dual clip c from the config, k3 clamps, log s_i clamped at 10 for GSPO):
#   vanilla → loss_type="ppo" (clip_ratio_c = config.get("clip_ratio_c", 3.0)),
#   gspo → "gspo", cispo → "cispo", sapo → "sapo" (always aggregated seq-mean-token-mean,
#   as verl does), gpg → "reinforce";
#   agg_loss(**config.global_batch_info) → agg, dp_size, global_num_tokens
#   (batch_num_tokens), global_num_seqs (global_batch_size), loss_scale_factor.
#
# ``rollout_is_weights`` (a tensor verl computes before the actor) is folded into the
# advantages: every loss type above is positively homogeneous in A per token —
# pg(w·A) = w·pg(A) for w >= 0 (the clip and dual-clip branches and SAPO's temperature
# depend only on the sign of A, CISPO and GPG are linear) — so the loss and its gradient
# are exact for any non-negative weights (verl's are exp(...) or 0). Negative weights
# would flip PPO's max/min and SAPO's temperature: they are rejected. The clip-fraction
# metrics see sign(w·A), which is 0 where w = 0 (IcePop); verl counts those tokens with
# their own A, so the float-metric drop-ins recompute the clip fractions with the raw
# advantages (a second, gradient-free call) when some valid weight is 0.

# verl loss_mode → our loss_type.
LOSS_MODES = {"vanilla": "ppo", "gspo": "gspo", "cispo": "cispo", "sapo": "sapo", "gpg": "reinforce"}


def pg_options(cfg: ActorLossConfig, loss_mode: str, agg: str, **extra):
    """The ``PolicyLossOptions`` of verl's ``loss_mode`` with the config's clip ratios /
    temperatures (memoised per config content)."""
    if loss_mode not in LOSS_MODES:
        raise NotImplementedError(
            f"config.policy_loss.loss_mode: rlvr_kernels fuses verl's {tuple(LOSS_MODES)}, got {loss_mode!r}"
        )
    return cfg.options(LOSS_MODES[loss_mode], agg, **extra)


def check_agg_mode(loss_agg_mode, name: str = "loss_agg_mode") -> str:
    if loss_agg_mode not in AGG_MODES:
        # verl's own message (its callers match on it), naming the argument.
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode} ({name}: expected one of {AGG_MODES})")
    return loss_agg_mode


def _count(name: str, value):
    """A global count of verl's ``global_batch_info``: None, a number >= 0 or a 1-element tensor."""
    if value is None or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < float("inf")):
        raise ValueError(f"{name}: expected a finite count >= 0 (or a 1-element tensor), got {value!r}")
    return value


def agg_kwargs(
    loss_agg_mode,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
    *,
    prefix: str = "",
) -> Dict[str, Any]:
    """verl ``agg_loss`` arguments → ``policy_loss`` keyword arguments (verl's errors
    included); ``prefix`` is where the caller put them (e.g. "config.global_batch_info.")."""
    check_agg_mode(loss_agg_mode)
    dp = 1 if dp_size is None else dp_size
    if isinstance(dp, torch.Tensor) and dp.numel() == 1:
        dp = int(dp)
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"{prefix}dp_size: expected an int >= 1, got {dp_size!r}")
    seq = loss_agg_mode.startswith("seq-mean")
    if loss_agg_mode == "token-mean" and batch_num_tokens is None and dp > 1:
        raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
    if seq and global_batch_size is None and dp > 1:
        raise ValueError("global_batch_size is required when dp_size > 1")
    norm = loss_agg_mode == "seq-mean-token-sum-norm"
    lsf = loss_scale_factor if norm else None  # verl divides by it only in this mode
    if lsf is not None and (isinstance(lsf, bool) or not isinstance(lsf, (int, float)) or not 0 < lsf < float("inf")):
        raise ValueError(f"{prefix}loss_scale_factor: expected a finite number > 0, got {lsf!r}")
    token_mean = loss_agg_mode == "token-mean"
    return dict(
        dp_size=dp,
        global_num_tokens=_count(f"{prefix}batch_num_tokens", batch_num_tokens) if token_mean else None,
        global_num_seqs=_count(f"{prefix}global_batch_size", global_batch_size) if seq else None,
        loss_scale_factor=lsf,
    )


def out_dtype(*tensors) -> torch.dtype:
    """The floating dtype verl's arithmetic on these tensors would produce."""
    dt = None
    for t in tensors:
        if t is not None and t.dtype.is_floating_point:
            dt = t.dtype if dt is None else torch.promote_types(dt, t.dtype)
    return dt or torch.float32


def check_pg_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights=None) -> None:
    """The tensors a policy loss touches before the op does, checked under the caller's names."""
    check_tensor("log_prob", log_prob, dtypes=FLOAT_DTYPES, ndim=(2,))
    check_tensor("old_log_prob", old_log_prob, dtypes=FLOAT_DTYPES)
    check_tensor("advantages", advantages, dtypes=FLOAT_DTYPES)
    check_tensor("response_mask", response_mask, dtypes=MASK_DTYPES)
    if rollout_is_weights is not None:
        check_tensor("rollout_is_weights", rollout_is_weights, dtypes=FLOAT_DTYPES, like=log_prob, like_name="log_prob")


def fold_is_weights(advantages, weights, mask, shape, validate=True):
    """A·w: the loss and gradient of every verl loss type times w (see the section note)."""
    if weights is None:
        return advantages
    try:
        full = torch.broadcast_shapes(weights.shape, shape)
    except RuntimeError:
        full = None
    if full != tuple(shape):
        raise ValueError(
            f"rollout_is_weights: expected a shape broadcastable to {tuple(shape)}, got {tuple(weights.shape)}"
        )
    if checks_enabled(validate, weights):
        bad = ~(weights.detach() >= 0) & (mask != 0)  # negative or NaN on a valid token
        if bool(bad.any()):
            idx = tuple(int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"rollout_is_weights: expected weights >= 0 on valid tokens, got "
                f"{float(weights.detach().expand(shape)[idx])} at {idx}"
            )
    return advantages * weights.detach()


def any_zero_weight(weights, mask) -> bool:
    return weights is not None and bool(((weights.detach() == 0) & (mask != 0)).any())


def float_metrics(pairs) -> Dict[str, float]:
    """One host sync for all the metrics (verl calls .item() per metric)."""
    if not pairs:
        return {}
    values = torch.stack([v.float() for _, v in pairs]).tolist()
    return {k: v for (k, _), v in zip(pairs, values)}


def _compute_policy_loss(
    loss_mode: str, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
):
    """The one body of every ``compute_policy_loss_*`` drop-in."""
    cfg = read_actor_config(config)
    agg = "seq-mean-token-mean" if loss_mode == "sapo" else check_agg_mode(loss_agg_mode)  # verl's SAPO ignores it
    opts = pg_options(cfg, loss_mode, agg)
    agg_kw = agg_kwargs(agg, **batch_info(config), prefix="config.global_batch_info.")
    check_pg_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    if loss_mode == "gpg":
        return _gpg_loss(log_prob, advantages, response_mask, agg, rollout_is_weights, agg_kw), {}
    backend = current_backend()
    with caller_names(PG_NAMES):
        adv = fold_is_weights(advantages, rollout_is_weights, response_mask, log_prob.shape)
        loss, m = policy_loss(log_prob, old_log_prob, adv, response_mask, options=opts, backend=backend, **agg_kw)
        loss = loss.to(out_dtype(log_prob, old_log_prob, advantages, rollout_is_weights))
        clip = m
        if loss_mode != "sapo" and any_zero_weight(rollout_is_weights, response_mask):
            with torch.no_grad():  # verl's clip fractions count zero-weight tokens with their own A
                _, clip = policy_loss(
                    log_prob.detach(), old_log_prob, advantages, response_mask, options=opts, backend=backend, **agg_kw
                )
    return loss, float_metrics(
        [
            ("actor/pg_clipfrac", clip.pg_clipfrac),
            ("actor/ppo_kl", m.ppo_kl),
            ("actor/pg_clipfrac_lower", clip.pg_clipfrac_lower),
        ]
    )


class _NegLogpTimesAdv(torch.autograd.Function):
    """verl's ``-log_prob * advantages`` (the same number: negation is exact) for constant
    advantages, with a backward of one multiply (autograd's: a multiply and a negation)."""

    @staticmethod
    def forward(ctx, log_prob: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(advantages)
        ctx.shape = log_prob.shape
        return torch.mul(log_prob, advantages).neg_()

    @staticmethod
    def backward(ctx, grad):
        (advantages,) = ctx.saved_tensors
        g = torch.mul(grad, advantages).neg_()
        return (g if tuple(g.shape) == tuple(ctx.shape) else g.sum_to_size(ctx.shape)), None


def _broadcasts_to(t: torch.Tensor, shape) -> bool:
    try:
        return torch.broadcast_shapes(t.shape, shape) == tuple(shape)
    except RuntimeError:
        return False


def _gpg_loss(log_prob, advantages, response_mask, agg, rollout_is_weights, agg_kw) -> torch.Tensor:
    """GPG, −logπ·A (·w), aggregated: no ratio, no clip and no metrics, so elementwise
    work and one masked reduction, run as verl writes it (the same bits) with the lean
    aggregation below; like verl it reads neither old_log_prob nor the sign of w."""
    for name, t in (
        ("advantages", advantages),
        ("response_mask", response_mask),
        ("rollout_is_weights", rollout_is_weights),
    ):
        if t is not None and not _broadcasts_to(t, log_prob.shape):
            raise ValueError(
                f"{name}: expected a shape broadcastable to log_prob's {tuple(log_prob.shape)}, got {tuple(t.shape)}"
            )
    agg_args = (agg_kw["dp_size"], agg_kw["global_num_tokens"], agg_kw["global_num_seqs"], agg_kw["loss_scale_factor"])
    if (
        log_prob.device.type == "cpu"
        and response_mask.dtype == torch.bool
        and response_mask.shape == log_prob.shape == advantages.shape
        and rollout_is_weights is None
        and not advantages.requires_grad
    ):
        # The mask folded into the advantages first, c = A·m (A or 0: the same numbers as
        # verl's masked products), so the per-token losses −logπ·c are already masked and
        # are summed as they are: three fresh [B, L] buffers in all, forward and backward.
        # A non-finite result (maybe a NaN on padding, which verl's where zeroes) is redone
        # verl's way below.
        c = _times_mask(advantages.detach(), response_mask.view(torch.uint8))
        loss = aggregate(_NegLogpTimesAdv.apply(log_prob, c), response_mask, agg, *agg_args, masked=True)
        if bool(torch.isfinite(loss)):
            return loss
    if advantages.requires_grad:
        pg_losses = -log_prob * advantages
    else:
        pg_losses = _NegLogpTimesAdv.apply(log_prob, advantages)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return aggregate(pg_losses, response_mask, agg, *agg_args)


def _policy_loss_dropin(loss_mode: str, default_agg: str, doc: str):
    """``compute_policy_loss_<loss_mode>`` with verl's signature (its ``loss_agg_mode``
    default is ``default_agg``), running :func:`_compute_policy_loss`."""

    def compute_policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = default_agg,
        config: Optional[Any] = None,
        rollout_is_weights: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Dict[str, Any]]:
        return _compute_policy_loss(
            loss_mode, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
        )

    compute_policy_loss.__name__ = compute_policy_loss.__qualname__ = f"compute_policy_loss_{loss_mode}"
    compute_policy_loss.__doc__ = doc
    return compute_policy_loss


compute_policy_loss_vanilla = _policy_loss_dropin(
    "vanilla",
    "token-mean",
    """PPO clip with verl's dual clip (c = ``config.get("clip_ratio_c", 3.0)``) and δ
    clamped to ±20; returns ``(pg_loss, {"actor/pg_clipfrac", "actor/ppo_kl",
    "actor/pg_clipfrac_lower"})`` with float metrics (one host sync).""",
)
compute_policy_loss_gspo = _policy_loss_dropin(
    "gspo",
    "seq-mean-token-mean",
    """GSPO: the sequence ratio exp(mean_t δ) in verl's token form, log s clamped at 10.""",
)
compute_policy_loss_cispo = _policy_loss_dropin(
    "cispo", "token-mean", """CISPO: −sg(clip(ρ, 1 − ε_low, 1 + ε_high))·A·logπ."""
)
compute_policy_loss_sapo = _policy_loss_dropin(
    "sapo",
    "seq-mean-token-mean",
    """SAPO's soft gate with ``config.tau_pos``/``tau_neg``; like verl, always aggregated
    ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says (clip fractions are 0).""",
)
compute_policy_loss_gpg = _policy_loss_dropin(
    "gpg", "token-mean", """GPG: −A·logπ; returns ``(pg_loss, {})`` like verl."""
)


# =======================================================================================
# kl_penalty
# =======================================================================================

KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")


class _K3(torch.autograd.Function):
    """verl's k3 ("low_var_kl") and k3+ in one forward: the value is verl's expression in
    verl's order (bit for bit); the backward is one multiply by a derivative kept from the
    forward. k3: d/dlogp = −(e^y − 1) where neither of verl's clamps (y = ref − logp to
    ±20, the value to ±10) is active, else 0 — clamp's gradient passes at the bounds, as
    torch's does. k3+: the gradient of k2, logp − ref (verl's straight-through)."""

    @staticmethod
    def forward(ctx, logprob: torch.Tensor, ref_logprob: torch.Tensor, plus: bool) -> torch.Tensor:
        # Three [B, L] buffers (kl, y, ratio), reused in place: on CPU each fresh buffer of
        # this size costs page faults comparable to the arithmetic.
        grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        kl = torch.sub(ref_logprob, logprob)
        y = kl.clamp(-20, 20)
        ratio = torch.exp(y)
        if plus:
            value = ratio.sub_(y).sub_(1)  # verl: (ratio - kl - 1), with kl clamped
            if grad:
                ctx.save_for_backward(kl.neg_())  # k2's derivative, logp − ref
        else:
            drop = torch.ne(y, kl) if grad else None  # y clamped (or NaN: no gradient, as clamp's)
            value = torch.sub(ratio, y, out=kl).sub_(1)
            if grad:
                drop.logical_or_(value > 10)  # (the value is >= 0 up to rounding: -10 never binds)
                ctx.save_for_backward(ratio.sub_(1).neg_().masked_fill_(drop, 0.0))
        return value.clamp_(-10, 10)

    @staticmethod
    def backward(ctx, grad):
        (derivative,) = ctx.saved_tensors
        g = grad * derivative
        return (g if ctx.needs_input_grad[0] else None), (-g if ctx.needs_input_grad[1] else None), None


def _kl_torch(logprob, ref_logprob, kind: str):
    """verl's ``kl_penalty`` formulas as written there (for the estimators other than
    k3, and for broadcast or mixed-dtype inputs)."""
    base = kind[:-1] if kind.endswith("+") else kind
    if base in ("kl", "k1"):
        value = logprob - ref_logprob
    elif base == "abs":
        value = (logprob - ref_logprob).abs()
    elif base in ("mse", "k2"):
        value = 0.5 * (logprob - ref_logprob).square()
    elif base in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        value = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    elif base == "full":
        raise NotImplementedError("kl_penalty: 'full' needs every token's logits (verl raises too)")
    else:
        raise NotImplementedError(f"kl_penalty: unknown estimator {kind!r}; verl's are {KL_KINDS} (+ a '+' suffix)")
    if not kind.endswith("+") or kind in ("mse", "k2"):
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()  # straight-through: the value of `base`, the gradient of k2
    return k2 - k2.detach() + value.detach()


def kl_penalty(logprob: torch.FloatTensor, ref_logprob: torch.FloatTensor, kl_penalty) -> torch.FloatTensor:
    """Per-token KL estimate with verl's values and gradient: "kl"/"k1", "abs",
    "mse"/"k2", "low_var_kl"/"k3" (x = ref − logp clamped to ±20, result clamped to ±10),
    a "+" suffix = that value with k2's gradient. Same-shaped, same-dtype k3 / k3+ run
    in :class:`_K3`; everything else is verl's own expression."""
    if not isinstance(kl_penalty, str):
        raise TypeError(f"kl_penalty: expected an estimator name (str), got {type(kl_penalty).__name__}")
    check_tensor("logprob", logprob, dtypes=FLOAT_DTYPES)
    if not isinstance(ref_logprob, torch.Tensor):
        raise TypeError(f"ref_logprob: expected a torch.Tensor, got {type(ref_logprob).__name__}")
    if kl_penalty in ("low_var_kl", "k3", "low_var_kl+", "k3+") and (
        ref_logprob.shape == logprob.shape
        and ref_logprob.dtype == logprob.dtype
        and ref_logprob.device == logprob.device
    ):
        return _K3.apply(logprob, ref_logprob, kl_penalty.endswith("+"))
    try:
        torch.broadcast_shapes(logprob.shape, ref_logprob.shape)
    except RuntimeError:
        raise ValueError(
            f"ref_logprob: expected a shape broadcastable with logprob's {tuple(logprob.shape)}, "
            f"got {tuple(ref_logprob.shape)}"
        ) from None
    return _kl_torch(logprob, ref_logprob, kl_penalty)


# =======================================================================================
# agg_loss
# =======================================================================================


class _MaskedSum(torch.autograd.Function):
    """verl's ``masked_sum``, Σ where(m ≠ 0, x, 0)·m over ``dim`` (None: everything), as
    Σ x·m: where x is finite the products are the same numbers (x·1 = x, x·0 = ±0), so
    the sum has the same bits. A bool mask is read as uint8 (no copy): float × uint8 is
    vectorised on CPU, float × bool and bool → float are not, and every fresh buffer of
    this size costs page faults, so forward and backward allocate one each (verl: a
    ``where``, a product and a cast forward, two backward). Only when the sum is not
    finite (a NaN / inf somewhere, maybe on padding, which verl's ``where`` zeroes) is it
    redone verl's way; on CUDA, where that check would be a host sync, verl's way always.
    The backward is grad·m."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
        m = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        total = None
        if x.device.type == "cpu":
            total = _sum(_times_mask(x, m), dim)
            if not bool(torch.isfinite(total).all()):
                total = None
        if total is None:
            total = _sum(torch.where(m != 0, x, 0.0).mul_(m), dim)
        ctx.save_for_backward(m)
        ctx.dim, ctx.x_shape = dim, x.shape
        return total

    @staticmethod
    def backward(ctx, grad):
        (m,) = ctx.saved_tensors
        if ctx.dim is not None:
            grad = grad.unsqueeze(ctx.dim)
        g = _times_mask(grad, m)
        if tuple(g.shape) != tuple(ctx.x_shape):
            g = g.expand(torch.broadcast_shapes(g.shape, ctx.x_shape)).sum_to_size(ctx.x_shape)
        return g, None, None


def _times_mask(t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """t·m in t's dtype as one fresh buffer: the mask cast into it, then multiplied in place
    (``torch.mul`` of mixed dtypes casts into a temporary first: two buffers)."""
    dtype = torch.promote_types(t.dtype, m.dtype)
    if dtype == m.dtype or torch.broadcast_shapes(t.shape, m.shape) != m.shape:
        return torch.mul(t, m)
    return m.to(dtype).mul_(t)


def _sum(t: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    return t.sum() if dim is None else t.sum(dim)


def _masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    dt = torch.promote_types(x.dtype, mask.dtype)
    if dt != x.dtype:  # a float mask wider than x: verl's product is in the wider dtype
        x = x.to(dt)
    return _MaskedSum.apply(x, mask, dim)


def _counts(mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """``mask.sum(dim)`` (int64 for bool masks, as verl's); for a bool mask
    ``count_nonzero``, which does not first cast the whole mask to int64 as ``sum`` does."""
    if mask.dtype == torch.bool:
        return torch.count_nonzero(mask) if dim is None else torch.count_nonzero(mask, dim)
    return mask.sum() if dim is None else mask.sum(dim)


def _times(loss: torch.Tensor, dp: int) -> torch.Tensor:
    """loss · dp_size, skipped for 1 (x·1 = x: one small op fewer on the common path)."""
    return loss if dp == 1 else loss * dp


def _local_div(num: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """num / count for a count of tokens or sequences of a bool mask: when it is 0 nothing
    was summed (num = 0), so dividing by max(count, 1) gives verl's value or 0 in two ops."""
    return num / count.clamp(min=1)


def aggregate(x, mask, mode, dp, batch_num_tokens, global_batch_size, loss_scale_factor, masked=False):
    """verl's ``agg_loss`` arithmetic, in its order, with :func:`_masked_sum` for the
    token-level reductions and 0 for a count of 0. A bool mask (what verl's ppo_loss
    passes) takes shortcuts that give the same bits with fewer small ops: a row without
    a valid token has a per-sequence loss of exactly 0, so verl's masked sum over
    sequences is the plain sum, and the sequence count is ``count_nonzero``. ``masked``:
    x is already x·m (the mask only counts)."""
    local = mask.dtype == torch.bool

    def msum(dim=None):
        return _sum(x, dim) if masked else _masked_sum(x, mask, dim)

    if mode == "token-mean":
        total = msum()
        if batch_num_tokens is None:
            n = _counts(mask)
            return _times((_local_div(total, n) if local else _safe_div(total, n)), dp)
        return _times(_safe_div(total, batch_num_tokens), dp)
    if mode == "token-sum":
        return _times(msum(), dp)
    seq_losses = msum(-1)
    counts = _counts(mask, -1)
    if mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (counts + 1e-8)
    if local:
        total = seq_losses.sum()
        if global_batch_size is None:
            loss = _times(_local_div(total, torch.count_nonzero(counts)), dp)
        else:
            loss = _times(_safe_div(total, global_batch_size), dp)
    else:
        seq_mask = (counts > 0).float()
        gbs = seq_mask.sum() if global_batch_size is None else global_batch_size
        loss = _times(_safe_div(torch.where(seq_mask.bool(), seq_losses, 0.0).mul(seq_mask).sum(), gbs), dp)
    if mode == "seq-mean-token-sum-norm":
        scale = mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        if scale != 0:  # 0 only as the default L of an empty response: no tokens, loss 0
            loss = loss / scale
    return loss


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
