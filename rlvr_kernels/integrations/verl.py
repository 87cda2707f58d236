"""Drop-ins for ``verl.trainer.ppo.core_algos`` (verl 0.9), built on the fused ops.

Each function takes and returns what verl's function of the same name does, and matches
it to 1e-6 (tests/advantages/test_peers_verl.py and tests/policy_loss/test_peers_verl.py run both).

Advantages: verl sums ``token_level_rewards`` over the response to get one score per
sample, groups samples by ``index`` (uid strings) and returns ``(advantages, returns)``,
both ``[bs, response_length]`` and equal.

Policy loss: ``compute_policy_loss_{vanilla,gspo,cispo,sapo,gpg}``, ``kl_penalty`` and
``agg_loss`` with verl's signatures, and :func:`policy_loss_verl`, the whole actor loss
of verl's ``ppo_loss`` (pg + kl_loss_coef·kl − entropy_coeff·entropy) in one fused call.
Their verl signatures have no ``backend`` argument: :func:`use_backend` picks one.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from ..ops._dispatch import check_backend
from ..ops._validation import checks_enabled
from ..ops.advantages import group_advantages
from ..ops.groups import uids_to_group_index
from ..ops.logprobs import linear_logprobs as _linear_logprobs
from ..ops.logprobs import logprobs_from_logits as _logprobs_from_logits
from ..ops.policy_loss import policy_loss as _policy_loss
from ..options import PolicyLossOptions, resolve_policy_loss_options

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
    "policy_loss_verl",
    "logprobs_from_logits",
    "entropy_from_logits",
    "linear_cross_entropy",
    "use_backend",
]


def _outcome(token_level_rewards, response_mask, index, **options) -> Tuple[torch.Tensor, torch.Tensor]:
    scores = token_level_rewards.sum(dim=-1)
    group_index, num_groups = uids_to_group_index(index, device=scores.device, return_num_groups=True)
    # verl computes `scores.unsqueeze(-1) * response_mask`: the product's dtype.
    out_dtype = torch.promote_types(scores.dtype, response_mask.dtype)
    out = group_advantages(
        scores,
        group_index,
        num_groups=num_groups,
        preset="verl",
        response_mask=response_mask,
        out_dtype=out_dtype,
        **options,
    )
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
    return compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo, config
    )


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
    )
    return out.token_advantages, out.token_advantages


# =======================================================================================
# Policy loss: core_algos.compute_policy_loss_*, kl_penalty, agg_loss, and the actor loss
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

_BACKEND: ContextVar[str] = ContextVar("rlvr_kernels_verl_backend", default="auto")

_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_BATCH_INFO_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")
# verl kl_penalty names → our fused estimators (the same numbers and gradients).
_KL_FUSED = {
    "kl": "k1",
    "k1": "k1",
    "mse": "k2",
    "k2": "k2",
    "mse+": "k2",
    "k2+": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
    "low_var_kl+": "k3+",
    "k3+": "k3+",
}
# verl loss_mode → our loss_type.
_LOSS_MODES = {"vanilla": "ppo", "gspo": "gspo", "cispo": "cispo", "sapo": "sapo", "gpg": "reinforce"}


@contextlib.contextmanager
def use_backend(backend: str):
    """Run the policy-loss and log-prob drop-ins of this module on ``backend`` ("auto", "reference",
    "cpu", "triton") inside the ``with`` block (verl's signatures leave no room for it)."""
    check_backend(backend)
    token = _BACKEND.set(backend)
    try:
        yield
    finally:
        _BACKEND.reset(token)


def _get(config, name, default=None):
    """``config.get(name, default)`` for ActorConfig / DictConfig / dict, else ``getattr``."""
    getter = getattr(config, "get", None)
    if callable(getter):
        return getter(name, default)
    return getattr(config, name, default)


def _clip_eps(config) -> Tuple[float, float]:
    eps = _get(config, "clip_ratio", None)
    low, high = _get(config, "clip_ratio_low", None), _get(config, "clip_ratio_high", None)
    low = eps if low is None else low
    high = eps if high is None else high
    if low is None or high is None:
        raise ValueError("config: expected clip_ratio (or clip_ratio_low and clip_ratio_high), as verl's ActorConfig")
    return float(low), float(high)


def _batch_info(config) -> Dict[str, Any]:
    info = dict(_get(config, "global_batch_info", None) or {})
    unknown = sorted(set(info) - set(_BATCH_INFO_KEYS))
    if unknown:
        raise TypeError(
            f"config.global_batch_info: unexpected keys {unknown}; verl's agg_loss takes {_BATCH_INFO_KEYS}"
        )
    return info


def _as_int(name, value) -> int:
    if isinstance(value, torch.Tensor):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    return value


def _agg_kwargs(loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    """verl ``agg_loss`` arguments → ``policy_loss`` keyword arguments (verl's errors included)."""
    if loss_agg_mode not in _AGG_MODES:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    dp = _as_int("dp_size", 1 if dp_size is None else dp_size)
    seq = loss_agg_mode.startswith("seq-mean")
    if loss_agg_mode == "token-mean" and batch_num_tokens is None and dp > 1:
        raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
    if seq and global_batch_size is None and dp > 1:
        raise ValueError("global_batch_size is required when dp_size > 1")
    return dict(
        dp_size=dp,
        global_num_tokens=batch_num_tokens if loss_agg_mode == "token-mean" else None,
        global_num_seqs=global_batch_size if seq else None,
        loss_scale_factor=loss_scale_factor if loss_agg_mode == "seq-mean-token-sum-norm" else None,
    )


def _out_dtype(*tensors) -> torch.dtype:
    """The floating dtype verl's arithmetic on these tensors would produce."""
    dt = None
    for t in tensors:
        if t is not None and t.dtype.is_floating_point:
            dt = t.dtype if dt is None else torch.promote_types(dt, t.dtype)
    return dt or torch.float32


def _check_is_weights(weights, mask, shape, validate=True):
    if not isinstance(weights, torch.Tensor):
        raise TypeError(f"rollout_is_weights: expected a torch.Tensor or None, got {type(weights).__name__}")
    try:
        full = torch.broadcast_shapes(weights.shape, shape)
    except RuntimeError:
        full = None
    if full != tuple(shape):
        raise ValueError(
            f"rollout_is_weights: expected a shape broadcastable to {tuple(shape)}, got {tuple(weights.shape)}"
        )
    if checks_enabled(validate):
        bad = ~(weights.detach() >= 0) & (mask != 0)  # negative or NaN on a valid token
        if bool(bad.any()):
            idx = tuple(int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"rollout_is_weights: expected weights >= 0 on valid tokens, got "
                f"{float(weights.detach().expand(shape)[idx])} at {idx}"
            )


def _fold_is_weights(advantages, weights, mask, shape, validate=True):
    """A·w: the loss and gradient of every verl loss type times w (see the section note)."""
    if weights is None:
        return advantages
    _check_is_weights(weights, mask, shape, validate)
    return advantages * weights.detach()


def _any_zero_weight(weights, mask) -> bool:
    return weights is not None and bool(((weights.detach() == 0) & (mask != 0)).any())


def _pg_options(loss_mode: str, config, agg: str, **extra) -> PolicyLossOptions:
    if loss_mode not in _LOSS_MODES:
        raise NotImplementedError(f"loss_mode: rlvr_kernels fuses verl's {tuple(_LOSS_MODES)}, got {loss_mode!r}")
    loss_type = _LOSS_MODES[loss_mode]
    fields = dict(loss_type=loss_type, agg=agg, **extra)
    if loss_type in ("ppo", "gspo", "cispo"):
        fields["clip_low"], fields["clip_high"] = _clip_eps(config)
    if loss_type == "ppo":
        fields["clip_ratio_c"] = float(_get(config, "clip_ratio_c", 3.0))
    if loss_type == "sapo":
        fields["tau_pos"], fields["tau_neg"] = float(_get(config, "tau_pos")), float(_get(config, "tau_neg"))
    return resolve_policy_loss_options("verl", **fields)


def _float_metrics(pairs) -> Dict[str, float]:
    """One host sync for all the metrics (verl calls .item() per metric)."""
    if not pairs:
        return {}
    values = torch.stack([v.float() for _, v in pairs]).tolist()
    return {k: v for (k, _), v in zip(pairs, values)}


def _verl_policy_loss(
    loss_mode, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
):
    if config is None:
        raise ValueError(
            "config: verl's policy losses read the clip ratios and global_batch_info from the actor config; got None"
        )
    agg = "seq-mean-token-mean" if loss_mode == "sapo" else loss_agg_mode  # verl's SAPO ignores loss_agg_mode
    opts = _pg_options(loss_mode, config, agg)
    agg_kw = _agg_kwargs(agg, **_batch_info(config))
    backend = _BACKEND.get()
    adv = _fold_is_weights(advantages, rollout_is_weights, response_mask, log_prob.shape)
    loss, m = _policy_loss(log_prob, old_log_prob, adv, response_mask, options=opts, backend=backend, **agg_kw)
    loss = loss.to(_out_dtype(log_prob, old_log_prob, advantages, rollout_is_weights))
    if loss_mode == "gpg":
        return loss, {}
    clip = m
    if loss_mode != "sapo" and _any_zero_weight(rollout_is_weights, response_mask):
        with torch.no_grad():  # verl's clip fractions count zero-weight tokens with their own A
            _, clip = _policy_loss(
                log_prob.detach(), old_log_prob, advantages, response_mask, options=opts, backend=backend, **agg_kw
            )
    return loss, _float_metrics(
        [
            ("actor/pg_clipfrac", clip.pg_clipfrac),
            ("actor/ppo_kl", m.ppo_kl),
            ("actor/pg_clipfrac_lower", clip.pg_clipfrac_lower),
        ]
    )


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[Any] = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """PPO clip with verl's dual clip (c = ``config.get("clip_ratio_c", 3.0)``) and δ
    clamped to ±20; returns ``(pg_loss, {"actor/pg_clipfrac", "actor/ppo_kl",
    "actor/pg_clipfrac_lower"})`` with float metrics (one host sync)."""
    return _verl_policy_loss(
        "vanilla", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
    )


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Optional[Any] = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """GSPO: the sequence ratio exp(mean_t δ) in verl's token form, log s clamped at 10."""
    return _verl_policy_loss(
        "gspo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
    )


def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[Any] = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """CISPO: −sg(clip(ρ, 1 − ε_low, 1 + ε_high))·A·logπ."""
    return _verl_policy_loss(
        "cispo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
    )


def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Optional[Any] = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """SAPO's soft gate with ``config.tau_pos``/``tau_neg``; like verl, always aggregated
    ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says (clip fractions are 0)."""
    return _verl_policy_loss(
        "sapo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
    )


def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[Any] = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """GPG: −A·logπ; returns ``(pg_loss, {})`` like verl."""
    return _verl_policy_loss(
        "gpg", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
    )


def _kl_unfused(logprob, ref_logprob, kind):
    """The verl estimators our kernels do not carry ("abs", and the straight-through "+"
    forms of "k1"/"kl"/"abs"): plain torch, same formulas and gradients."""
    base = kind[:-1] if kind.endswith("+") else kind
    x = logprob - ref_logprob
    if base in ("kl", "k1"):
        value = x
    elif base == "abs":
        value = x.abs()
    elif base == "full":
        raise NotImplementedError("kl_penalty: 'full' needs every token's logits (verl raises too)")
    else:
        raise NotImplementedError(f"kl_penalty: unknown estimator {kind!r}")
    if not kind.endswith("+"):
        return value
    k2 = 0.5 * x.square()  # the value of `base`, the gradient of k2
    return k2 - k2.detach() + value.detach()


def kl_penalty(logprob: torch.FloatTensor, ref_logprob: torch.FloatTensor, kl_penalty) -> torch.FloatTensor:
    """Per-token KL estimate with verl's values and gradient (w.r.t. ``logprob``; the
    reference log-probs are constants): "kl"/"k1", "mse"/"k2", "low_var_kl"/"k3"
    (x = ref − logp clamped to ±20, result clamped to ±10), a "+" suffix = that value with
    k2's gradient. k1/k2/k3/k3+ run in the fused kernel (value and derivative in one pass);
    "abs" and "k1+"/"abs+" are plain torch."""
    kind = _KL_FUSED.get(kl_penalty)
    same = isinstance(ref_logprob, torch.Tensor) and ref_logprob.shape == logprob.shape
    if kind is None or not same or logprob.numel() == 0 or not logprob.dtype.is_floating_point:
        if kind is not None:  # broadcasting or empty inputs: the same formulas in torch
            return _kl_torch(logprob, ref_logprob, kind)
        return _kl_unfused(logprob, ref_logprob, kl_penalty)
    flat = logprob.reshape(-1)
    cu = torch.tensor([0, flat.numel()], dtype=torch.int64, device=flat.device)
    opts = resolve_policy_loss_options("verl", loss_type="reinforce", kl=kind, kl_coef=1.0, agg="none")
    zero = torch.zeros(1, dtype=torch.float32, device=flat.device)
    per_token, _ = _policy_loss(
        flat,
        flat.detach(),
        zero,
        None,
        options=opts,
        ref_logprobs=ref_logprob.reshape(-1),
        cu_seqlens=cu,
        validate=False,
        backend=_BACKEND.get(),
    )
    return per_token.reshape(logprob.shape).to(_out_dtype(logprob, ref_logprob))


def _kl_torch(logprob, ref_logprob, kind):
    x = logprob - ref_logprob
    k2 = 0.5 * x.square()
    if kind == "k1":
        return x
    if kind == "k2":
        return k2
    y = torch.clamp(-x, min=-20, max=20)
    k3 = torch.clamp(torch.exp(y) - y - 1, min=-10, max=10)
    return k3 if kind == "k3" else k2 - k2.detach() + k3.detach()


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Optional[int] = None,
    global_batch_size: Optional[int] = None,
    loss_scale_factor: Optional[int] = None,
):
    """verl's ``agg_loss`` in the fused kernel (the loss matrix is run as REINFORCE with
    A = −1, whose per-token loss is the matrix itself): token-mean (by ``batch_num_tokens``
    or the local count), token-sum, seq-mean-token-sum / -mean (by ``global_batch_size`` or
    the sequences with a valid token), seq-mean-token-sum-norm (÷ ``loss_scale_factor``,
    default ``loss_mask.shape[-1]``); all × ``dp_size``. The mask is binary (m ≠ 0); a
    count of 0 gives 0 where verl divides by it."""
    return _agg_loss(
        loss_mat,
        loss_mask,
        loss_agg_mode,
        _BACKEND.get(),
        dp_size,
        batch_num_tokens,
        global_batch_size,
        loss_scale_factor,
    )


def _agg_loss(
    loss_mat,
    loss_mask,
    loss_agg_mode,
    backend,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    kw = _agg_kwargs(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    x = loss_mat if loss_mat.dim() == 2 else loss_mat.reshape(-1, loss_mat.shape[-1] if loss_mat.dim() else 1)
    mask = loss_mask if loss_mask.shape == x.shape else loss_mask.expand(loss_mat.shape).reshape(x.shape)
    if kw["loss_scale_factor"] is None and loss_agg_mode == "seq-mean-token-sum-norm":
        kw["loss_scale_factor"] = loss_mask.shape[-1]
    opts = resolve_policy_loss_options(None, loss_type="reinforce", agg=loss_agg_mode)
    minus_one = torch.full((x.shape[0],), -1.0, dtype=torch.float32, device=x.device)
    loss, _ = _policy_loss(x, x.detach(), minus_one, mask, options=opts, validate=False, backend=backend, **kw)
    return loss.to(_out_dtype(loss_mat, loss_mask))


def _parse_is_threshold(spec) -> float:
    """verl's rollout_is_threshold: a float (TIS cap) or "lower_upper" (IcePop)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_is_threshold: expected a float or a string, got {type(spec).__name__}")
    if isinstance(spec, str):
        if "_" in spec.strip():
            raise NotImplementedError(
                f"rollout_is_threshold={spec!r} is verl's IcePop, which keeps the raw weight inside the bounds "
                "(rlvr_kernels' token_mis/seq_mis use weight 1 there): compute verl's rollout_is_weights and pass them "
                "as rollout_is_weights instead"
            )
        spec = float(spec)
    if not spec > 0:
        raise ValueError(f"rollout_is_threshold: expected an upper bound > 0, got {spec!r}")
    return float(spec)


def policy_loss_verl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any,
    *,
    entropy: Optional[torch.Tensor] = None,
    ref_log_prob: Optional[torch.Tensor] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    rollout_log_probs: Optional[torch.Tensor] = None,
    rollout_is: Optional[str] = None,
    rollout_is_threshold=2.0,
    dp_size=None,
    batch_num_tokens=None,
    global_batch_size=None,
    return_tensors: bool = False,
    validate: bool = True,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """verl's actor loss (``verl.workers.utils.losses.ppo_loss``) in one fused call:
    ``pg_loss − entropy_coeff·agg(entropy) + kl_loss_coef·agg(kl_penalty)``, every term
    aggregated with ``config.loss_agg_mode`` and ``config.global_batch_info`` (SAPO's pg
    term always seq-mean-token-mean, as verl; then the KL/entropy terms take a second
    call when the modes differ).

    ``config`` is read as verl's ActorConfig: ``policy_loss.loss_mode`` (vanilla, gspo,
    cispo, sapo, gpg), clip ratios, ``clip_ratio_c``, ``tau_pos``/``tau_neg``,
    ``loss_agg_mode``, ``loss_scale_factor``, ``entropy_coeff``, ``use_kl_loss``,
    ``kl_loss_coef``, ``kl_loss_type``, ``global_batch_info``. ``dp_size``,
    ``batch_num_tokens``, ``global_batch_size`` override ``global_batch_info`` (what
    ppo_loss copies there from its data). The entropy term is present iff ``entropy`` is
    given (it gets the gradient −entropy_coeff·∂agg); ``ref_log_prob`` is needed with
    ``use_kl_loss``.

    Rollout correction, either
      * ``rollout_is_weights``: verl's precomputed weights (any non-negative tensor), folded
        into the advantages (exact; see the section note), or
      * ``rollout_log_probs`` with ``rollout_is`` = "token" / "sequence" and a float
        ``rollout_is_threshold``: verl's TIS weights, computed inside the kernel from
        ``old_log_prob − rollout_log_probs`` (the numbers of verl's
        compute_rollout_correction_weights). verl's IcePop ("lower_upper" threshold) and
        ``rollout_is_batch_normalize`` are not fused: pass their weights as a tensor.

    Returns ``(loss, metrics)`` with ppo_loss's keys: "actor/pg_clipfrac",
    "actor/ppo_kl", "actor/pg_clipfrac_lower" (not for gpg), "actor/pg_loss",
    "actor/entropy_loss" (with ``entropy``), "kl_loss" and "kl_coef" (with use_kl_loss).
    Floats by default (one host sync); ``return_tensors=True`` gives detached 0-d tensors
    and no sync — then, with zero entries in ``rollout_is_weights``, the clip fractions
    leave those tokens out (verl counts them).
    """
    backend = _BACKEND.get() if backend is None else backend
    check_backend(backend)
    loss_cfg = _get(config, "policy_loss", None)
    loss_mode = _get(loss_cfg, "loss_mode", "vanilla") if loss_cfg is not None else "vanilla"
    agg_mode = _get(config, "loss_agg_mode", "token-mean")
    info = _batch_info(config)
    given = dict(dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    for k, v in given.items():
        if v is not None:
            info[k] = v
    info["loss_scale_factor"] = _get(config, "loss_scale_factor", None)  # as ppo_loss does
    pg_agg = "seq-mean-token-mean" if loss_mode == "sapo" else agg_mode
    pg_kw, kw = _agg_kwargs(pg_agg, **info), _agg_kwargs(agg_mode, **info)

    use_kl = bool(_get(config, "use_kl_loss", False))
    kl_coef = float(_get(config, "kl_loss_coef", 0.0)) if use_kl else 0.0
    kl_type = _get(config, "kl_loss_type", "low_var_kl") if use_kl else None
    if use_kl and ref_log_prob is None:
        raise ValueError("ref_log_prob: config.use_kl_loss needs the reference log-probs")
    kl_fused = _KL_FUSED.get(kl_type) if use_kl else None
    ent_coef = float(_get(config, "entropy_coeff", 0.0)) if entropy is not None else 0.0

    rc = {}
    if rollout_log_probs is not None or rollout_is is not None:
        if rollout_is_weights is not None:
            raise ValueError(
                "rollout_is_weights: give either the weights or rollout_log_probs with rollout_is, not both"
            )
        if rollout_is not in ("token", "sequence") or rollout_log_probs is None:
            raise ValueError(
                f"rollout_is: expected 'token' or 'sequence' together with rollout_log_probs, "
                f"got rollout_is={rollout_is!r}"
            )
        rc = dict(
            rollout_correction="token_tis" if rollout_is == "token" else "seq_tis",
            rollout_threshold=_parse_is_threshold(rollout_is_threshold),
        )
    adv = _fold_is_weights(advantages, rollout_is_weights, response_mask, log_prob.shape, validate)

    fuse_rest = pg_agg == agg_mode
    extra = dict(rc)
    if fuse_rest and kl_fused is not None:
        extra.update(kl=kl_fused, kl_coef=kl_coef)
    if fuse_rest and ent_coef != 0:
        extra.update(entropy_coef=ent_coef)
    opts = _pg_options(loss_mode, config, pg_agg, **extra)
    loss, m = _policy_loss(
        log_prob,
        old_log_prob,
        adv,
        response_mask,
        options=opts,
        ref_logprobs=ref_log_prob if "kl" in extra else None,
        rollout_logprobs=rollout_log_probs if rc else None,
        entropy=entropy if "entropy_coef" in extra else None,
        validate=validate,
        backend=backend,
        **pg_kw,
    )
    pg_loss, kl_loss = m.pg_loss, m.kl_loss
    if not fuse_rest and (kl_fused is not None or ent_coef != 0):
        # SAPO with another loss_agg_mode: KL and entropy in a second call (A = 0, no pg term).
        rest = resolve_policy_loss_options(
            "verl",
            loss_type="reinforce",
            agg=agg_mode,
            entropy_coef=ent_coef or None,
            **({"kl": kl_fused, "kl_coef": kl_coef} if kl_fused else {}),
        )
        zeros = torch.zeros(log_prob.shape[0], dtype=torch.float32, device=log_prob.device)
        loss2, m2 = _policy_loss(
            log_prob,
            old_log_prob,
            zeros,
            response_mask,
            options=rest,
            ref_logprobs=ref_log_prob if kl_fused else None,
            entropy=entropy if ent_coef != 0 else None,
            validate=validate,
            backend=backend,
            **kw,
        )
        loss = loss + loss2
        kl_loss = m2.kl_loss
    if use_kl and kl_fused is None:
        kl_mat = kl_penalty(log_prob, ref_log_prob, kl_type)  # plain-torch estimators
        kl_val = _agg_loss(kl_mat, response_mask, agg_mode, backend, **info)
        loss = loss + kl_val * kl_coef
        kl_loss = kl_val.detach()

    clip = m
    if not return_tensors and loss_mode not in ("sapo", "gpg") and _any_zero_weight(rollout_is_weights, response_mask):
        with torch.no_grad():
            _, clip = _policy_loss(
                log_prob.detach(),
                old_log_prob,
                advantages,
                response_mask,
                options=_pg_options(loss_mode, config, pg_agg),
                validate=False,
                backend=backend,
                **pg_kw,
            )
    pairs = []
    if loss_mode != "gpg":
        pairs += [
            ("actor/pg_clipfrac", clip.pg_clipfrac),
            ("actor/ppo_kl", m.ppo_kl),
            ("actor/pg_clipfrac_lower", clip.pg_clipfrac_lower),
        ]
    pairs.append(("actor/pg_loss", pg_loss))
    if entropy is not None:
        with torch.no_grad():
            pairs.append(("actor/entropy_loss", _agg_loss(entropy.detach(), response_mask, agg_mode, backend, **info)))
    if use_kl:
        pairs.append(("kl_loss", kl_loss))
    metrics = {k: v.detach() for k, v in pairs} if return_tensors else _float_metrics(pairs)
    if use_kl:
        metrics["kl_coef"] = _get(config, "kl_loss_coef", 0.0)
    return loss, metrics


# ------------------------------------------------------------------ log-probs
def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """verl ``utils.torch_functional.logprobs_from_logits``: log p of ``labels [...]`` from
    ``logits [..., V]``, in the logits' dtype (computed in fp32, one pass, no ``[N, V]``
    temporaries). ``inplace_backward`` is accepted for signature compatibility; the backward
    writes only the logits' gradient in any case."""
    logp = _logprobs_from_logits(logits, labels, backend=_BACKEND.get())
    return logp.to(logits.dtype)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """verl ``utils.torch_functional.entropy_from_logits``: logsumexp(z) − Σ softmax(z)·z per
    row, in the logits' dtype. (When the log-probs are needed too, one call of
    :func:`rlvr_kernels.logprobs_from_logits` with ``return_entropy=True`` reads the logits once.)"""
    ignored = torch.full(logits.shape[:-1], -100, dtype=torch.int64, device=logits.device)
    _, entropy = _logprobs_from_logits(logits, ignored, return_entropy=True, backend=_BACKEND.get())
    return entropy.to(logits.dtype)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """verl ``utils.kernel.linear_cross_entropy``: ``(log-probs, entropy)`` of ``labels`` from
    ``hidden [..., H]`` and the (vocab-parallel, with ``dist_process_group``) LM head
    ``weight [V, H]``, fp32, shaped like ``labels``. Runs on CPU and GPU; only
    ``reduction="none"`` (what verl's actor uses)."""
    if reduction != "none":
        raise NotImplementedError(f"reduction: only 'none' is supported, got {reduction!r}")
    lead = labels.shape
    logp, entropy = _linear_logprobs(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1),
        temperature=temperature,
        return_entropy=True,
        process_group=dist_process_group,
        backend=_BACKEND.get(),
    )
    return logp.reshape(lead), entropy.reshape(lead)
