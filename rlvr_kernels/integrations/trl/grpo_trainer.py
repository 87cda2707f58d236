"""TRL's ``trl.trainer.grpo_trainer.GRPOTrainer`` computations as functions (TRL 1.16):
the advantages of ``_generate_and_score_completions`` (:func:`compute_grpo_advantages`)
and the loss of ``_compute_loss`` (:func:`grpo_loss_trl`), each one fused op call.

TRL computes both inline, so these are not signature drop-ins: they take the tensors TRL
has at that point and the ``GRPOConfig`` fields, under TRL's names, and match TRL's code
to 1e-6 (tests/advantages/test_peers_trl.py and tests/policy_loss/test_peers_trl.py run
TRL's own source on the same inputs). Groups are contiguous: rows ``[k·G, (k+1)·G)`` are
the G completions of prompt k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from ...contracts.policy_loss import entropy_quantile_threshold
from ...ops._validation import (
    FLOAT_DTYPES,
    MASK_DTYPES,
    check_int,
    check_like,
    check_number,
    check_tensor,
    checks_enabled,
)
from ...ops.advantages import group_advantages
from ...ops.policy_loss import policy_loss
from ...options import PolicyLossMetrics, TokenShaping, resolve_policy_loss_options
from .._backend import current_backend
from .._errors import caller_names

__all__ = ["compute_grpo_advantages", "grpo_loss_trl", "TRL_LOSS_TYPES"]

# group_advantages' argument names -> TRL's
ADV_NAMES = {"scores": "rewards_per_func", "group_size": "num_generations", "scale": "scale_rewards"}

# ---------------------------------------------------------------------------------------
# Advantages (GRPOTrainer._generate_and_score_completions)
# ---------------------------------------------------------------------------------------

_SCALE_REWARDS = ("group", "batch", "none")
_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def compute_grpo_advantages(
    rewards_per_func: torch.Tensor,
    num_generations: int,
    reward_weights: Optional[torch.Tensor] = None,
    scale_rewards: str = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Advantages ``[B]`` from ``rewards_per_func [B, n_funcs]`` (NaN = the function gave None).

    ``sum_then_normalize``: r = nansum_k w_k r_k, (r − mean_group)/(std + 1e-4) with the std
    per group or over the batch (``scale_rewards``), or no division (``"none"``).
    ``normalize_then_sum``: each function normalised per group, weighted sum, then
    whitened over the batch (TRL reads no ``scale_rewards`` there). Rows where every
    function gave NaN get 0.
    """
    if multi_objective_aggregation not in _AGGREGATIONS:
        raise ValueError(
            f"multi_objective_aggregation: expected 'sum_then_normalize' or 'normalize_then_sum', "
            f"got {multi_objective_aggregation!r}"
        )
    if scale_rewards not in _SCALE_REWARDS:
        raise ValueError(f"scale_rewards: expected one of {_SCALE_REWARDS}, got {scale_rewards!r}")
    check_tensor("rewards_per_func", rewards_per_func, dtypes=FLOAT_DTYPES)
    if reward_weights is not None:
        check_tensor("reward_weights", reward_weights, dtypes=FLOAT_DTYPES)
    # TRL's result has the dtype of `rewards_per_func * reward_weights` (float32 weights by default).
    out_dtype = torch.promote_types(
        rewards_per_func.dtype, reward_weights.dtype if reward_weights is not None else torch.float32
    )
    if multi_objective_aggregation == "normalize_then_sum":
        kw = dict(estimator="gdpo")
    elif scale_rewards == "none":
        kw = dict(estimator="dr_grpo", scale=None)
    else:
        kw = dict(estimator="grpo", scale=scale_rewards)
    with caller_names(ADV_NAMES):
        out = group_advantages(
            rewards_per_func,
            group_size=num_generations,
            preset="trl",
            reward_weights=reward_weights,
            out_dtype=out_dtype,
            backend=current_backend(),
            **kw,
        )
    return out.advantages


# ---------------------------------------------------------------------------------------
# The GRPO loss (GRPOTrainer._compute_loss)
# ---------------------------------------------------------------------------------------

TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")
_TRL_NOT_FUSED = ("vespo",)
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# GSPO's log s_i clamp (10 in verl) is off for TRL: a bound no finite mean log-ratio reaches.
_NO_GSPO_CLAMP = 1e30

# policy_loss' argument (and option) names -> grpo_loss_trl's (TRL's)
LOSS_NAMES = {
    "logprobs": "per_token_logps",
    "old_logprobs": "old_per_token_logps",
    "mask": "completion_mask",
    "ref_logprobs": "ref_per_token_logps",
    "entropy": "entropies",
    "global_num_tokens": "num_items_in_batch",
    "loss_scale_factor": "max_completion_length",
    "clip_low": "epsilon_low",
    "clip_high": "epsilon_high",
    "clip_ratio_c": "delta",
    "kl_coef": "beta",
    "tau_pos": "sapo_temperature_pos",
    "tau_neg": "sapo_temperature_neg",
    "entropy_quantile": "top_entropy_quantile",
}


def grpo_loss_trl(
    per_token_logps: torch.Tensor,
    old_per_token_logps: Optional[torch.Tensor],
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    delta: Optional[float] = None,
    importance_sampling_level: str = "token",
    beta: float = 0.0,
    ref_per_token_logps: Optional[torch.Tensor] = None,
    use_bias_correction_kl: bool = True,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    top_entropy_quantile: float = 1.0,
    entropies: Optional[torch.Tensor] = None,
    entropy_coef: float = 0.0,
    importance_sampling_ratio: Optional[torch.Tensor] = None,
    off_policy_mask_threshold: Optional[float] = None,
    max_completion_length: Optional[int] = None,
    num_items_in_batch=None,
    gradient_accumulation_steps: int = 1,
    num_processes: int = 1,
    steps_per_generation: int = 1,
    training: bool = True,
    validate: bool = True,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, PolicyLossMetrics]:
    """The loss ``GRPOTrainer._compute_loss`` returns (value and gradient), from the
    tensors it has, in one fused ``policy_loss`` call (preset "trl": no δ clamp, k3 KL
    without clamps, no clamp of GSPO's log s).

    Arguments are TRL's names (``GRPOConfig`` fields and ``_compute_loss`` locals), with
    TRL's defaults: ``completion_mask`` is TRL's ``mask`` (``completion_mask * tool_mask``
    when tools are used); ``advantages`` ``[B]``, ``[B, 1]`` or ``[B, T]``;
    ``old_per_token_logps=None`` means ``per_token_logps.detach()`` as TRL;
    ``epsilon_low`` is ``GRPOConfig.epsilon`` and ``epsilon_high`` defaults to it;
    ``gradient_accumulation_steps`` is TRL's ``current_gradient_accumulation_steps``;
    ``training=False`` is TRL's eval mode (no accumulation scaling); ``entropy_coef`` is
    the coefficient TRL applies this step (``apply_coef``, for the adaptive controller
    too). ``backend``: None for the one of the innermost ``use_backend`` block.

    Mapping (TRL → ``policy_loss``):
      * grpo/bnpo/dr_grpo/dapo/luspo, token level → "ppo" with clip ε_low/ε_high and
        ``delta`` as the dual-clip bound c: TRL's clamp(ρ, max=δ) of the unclipped branch
        equals the dual clip when δ >= 1 + ε_high (smaller δ raises NotImplementedError);
        sequence level → "gspo" with log s unclamped (``delta`` not supported there). TRL's
        gradient flows through the sequence mean of δ, so token t gets m_t/n_i · Σ_u of the
        per-token derivatives: the token form's gradient when the pg multiplier (advantage ·
        IS ratio · entropy mask) is uniform within each sequence, as with [B] advantages and
        a [B, 1] ratio. Otherwise (token advantages, a [B, T] ratio, the entropy mask) the
        logps pass through an autograd identity whose backward takes that per-sequence
        mean, and the KL term (per-token gradient) moves to a second call.
      * cispo (token level) → "cispo" with the bounds [0, ε_high] (clip_low = 1,
        clip_high = ε_high − 1; needs ε_high >= 1, TRL recommends 5).
      * sapo (token level) → "sapo" with TRL's temperatures.
      * aggregation: grpo/sapo seq-mean-token-mean over all B rows (empty ones count, as
        TRL's ``.mean()``), bnpo token-mean, dr_grpo Σ/(B·max_completion_length), luspo
        seq-mean-token-sum over B rows, each ÷ gradient_accumulation_steps in training;
        dapo/cispo Σ / (clamp(num_items_in_batch, 1) / num_processes ·
        gradient_accumulation_steps / steps_per_generation) (without the last two factors
        in eval).
      * ``beta`` → k3 to ``ref_per_token_logps``, unclamped, *without* TRL's bias
        correction: TRL's default ``use_bias_correction_kl=True`` multiplies the KL by the
        (differentiable) importance ratio, which the fused op does not, so with ``beta``
        != 0 that default raises NotImplementedError; pass ``use_bias_correction_kl=False``
        (as ``GRPOConfig(use_bias_correction_kl=False)``). With ``beta == 0`` TRL computes
        no KL and the option changes nothing.
      * ``top_entropy_quantile`` < 1 → ``TokenShaping(entropy_quantile=top_entropy_quantile)``
        (the pg term only on tokens at or above the batch's (1 − q) entropy quantile,
        torch.quantile's rule).
      * ``importance_sampling_ratio`` (TRL's vLLM correction, ``[B, T]`` or ``[B, 1]``, any
        mode): folded into the advantages, exact because every loss type above is
        positively homogeneous in A (pg(w·A) = w·pg(A), w >= 0). For
        ``token_truncate``/``sequence_truncate`` without ``clip_min`` the kernel can compute
        the ratio itself: ``policy_loss(..., rollout_correction="token_tis"/"seq_tis",
        rollout_logprobs=sampling_per_token_logps, rollout_threshold=clip_max)`` (log w
        clamped to ±20 there, which TRL does not).
      * ``entropy_coef`` ≠ 0: TRL's bonus is a token mean over the (entropy-masked)
        completion tokens whatever the loss type's normaliser, so it is a separate torch
        term ``− coef · Σ H·m / max(Σ m, 1) / accumulation`` (gradient to ``entropies``).

    Not supported (NotImplementedError, naming the option): loss_type "vespo", cispo/sapo
    at sequence level, ``delta`` at sequence level or below 1 + ε_high,
    ``top_entropy_quantile`` < 1 with ``num_processes`` > 1 (TRL's threshold is over all
    ranks), ``use_bias_correction_kl=True`` with ``beta`` != 0, and
    ``off_policy_mask_threshold`` (TRL's off-policy sequence mask).

    Returns ``(loss, metrics)``: metrics from the kernel (detached 0-d tensors, this
    process only). TRL's "kl" = ``metrics.kl``, "entropy" = ``metrics.entropy_mean``,
    "clip_ratio/region_mean" = ``metrics.pg_clipfrac`` at token level (TRL takes a
    per-sequence mean at sequence level; with zeros in ``importance_sampling_ratio`` our
    clip fractions leave those tokens out); TRL's "policy_loss" = ``metrics.pg_loss +
    beta · metrics.kl_loss``.
    """
    backend = current_backend(backend)
    plan = _plan(
        per_token_logps,
        loss_type=loss_type,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        delta=delta,
        importance_sampling_level=importance_sampling_level,
        beta=beta,
        use_bias_correction_kl=use_bias_correction_kl,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        top_entropy_quantile=top_entropy_quantile,
        entropy_coef=entropy_coef,
        off_policy_mask_threshold=off_policy_mask_threshold,
        max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch,
        gradient_accumulation_steps=gradient_accumulation_steps,
        num_processes=num_processes,
        steps_per_generation=steps_per_generation,
        training=training,
    )
    x = _validate(
        per_token_logps,
        old_per_token_logps,
        advantages,
        completion_mask,
        ref_per_token_logps,
        entropies,
        importance_sampling_ratio,
        plan,
        validate,
    )
    with caller_names(LOSS_NAMES):
        loss, metrics = _fused_loss(x, plan, validate, backend)
    if plan.post != 1.0:
        loss = loss / plan.post
    if plan.entropy_coef != 0.0:
        loss = loss - plan.entropy_coef * _entropy_bonus(entropies, completion_mask, plan)
    return loss, metrics


@dataclass(frozen=True)
class _Plan:
    """What a call's TRL settings ask of ``policy_loss``: its option fields, aggregation
    keywords, the divisor applied after it, and what the call needs from its tensors."""

    fields: Dict[str, Any]  # resolve_policy_loss_options fields
    agg_kw: Dict[str, Any] = field(default_factory=dict)  # global_num_tokens / _seqs, loss_scale_factor
    post: float = 1.0  # TRL's accumulation divisor, after the op
    seq_level: bool = False
    shaping: Optional[TokenShaping] = None
    beta: float = 0.0
    entropy_coef: float = 0.0
    accum: float = 1.0  # the entropy bonus's accumulation divisor


def _plan(logps, **c) -> _Plan:
    """TRL's settings -> ``policy_loss`` options, checked first (each error names the
    setting), in the order ``_compute_loss`` reads them. ``logps`` gives B only."""
    loss_type = c["loss_type"]
    if loss_type in _TRL_NOT_FUSED:
        raise NotImplementedError(f"loss_type: rlvr_kernels fuses TRL's {TRL_LOSS_TYPES}, got {loss_type!r}")
    if loss_type not in TRL_LOSS_TYPES:
        raise ValueError(f"loss_type: expected one of TRL's {TRL_LOSS_TYPES + _TRL_NOT_FUSED}, got {loss_type!r}")
    level = c["importance_sampling_level"]
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level: expected 'token' or 'sequence', got {level!r}")
    if c["off_policy_mask_threshold"] is not None:
        raise NotImplementedError(
            "off_policy_mask_threshold: TRL's off-policy sequence mask is not fused; pass None (TRL's default)"
        )
    eps_low = check_number("epsilon_low", c["epsilon_low"])
    eps_high = eps_low if c["epsilon_high"] is None else check_number("epsilon_high", c["epsilon_high"])
    beta = check_number("beta", c["beta"])
    top_q = check_number("top_entropy_quantile", c["top_entropy_quantile"], minimum=0.0, maximum=1.0, open_low=True)
    entropy_coef = check_number("entropy_coef", c["entropy_coef"])
    accum_steps = check_int("gradient_accumulation_steps", c["gradient_accumulation_steps"], minimum=1)
    num_processes = check_int("num_processes", c["num_processes"], minimum=1)
    spg = check_int("steps_per_generation", c["steps_per_generation"], minimum=1)
    seq_level = level == "sequence"
    accum = float(accum_steps) if c["training"] else 1.0

    fields = _loss_fields(loss_type, eps_low, eps_high, c["delta"], seq_level, c)
    if beta != 0.0:
        if not isinstance(c["use_bias_correction_kl"], bool):
            raise TypeError(
                f"use_bias_correction_kl: expected a bool, got {type(c['use_bias_correction_kl']).__name__}"
            )
        if c["use_bias_correction_kl"]:
            raise NotImplementedError(
                "use_bias_correction_kl: TRL's bias-corrected KL (the KL term times the differentiable "
                "importance ratio, TRL's default) is not fused; with beta != 0 pass use_bias_correction_kl=False "
                "(GRPOConfig(use_bias_correction_kl=False)) for TRL's plain k3 KL"
            )
        fields.update(kl="k3", kl_coef=beta)
    shaping = None
    if top_q < 1.0:
        if num_processes > 1:
            raise NotImplementedError(
                "top_entropy_quantile: TRL's threshold is the quantile over all processes' "
                "tokens; the fused op takes this process's tokens only"
            )
        shaping = TokenShaping(entropy_quantile=top_q)
        fields["shaping"] = shaping

    B = logps.shape[0] if isinstance(logps, torch.Tensor) and logps.dim() else 0
    agg_kw, post = _aggregation(loss_type, fields, B, accum, num_processes, spg, c)
    return _Plan(
        fields=fields,
        agg_kw=agg_kw,
        post=post,
        seq_level=seq_level,
        shaping=shaping,
        beta=beta,
        entropy_coef=entropy_coef,
        accum=accum,
    )


def _loss_fields(loss_type, eps_low, eps_high, delta, seq_level, c) -> Dict[str, Any]:
    """The loss type's options: the clip family, CISPO or SAPO."""
    if loss_type in _CLIPPED:
        fields = dict(loss_type="gspo" if seq_level else "ppo", clip_low=eps_low, clip_high=eps_high)
        if delta is not None:
            if seq_level:
                raise NotImplementedError("delta: TRL's two-sided clipping at sequence level is not fused")
            delta = check_number("delta", delta)
            if not delta >= 1 + eps_high or not delta > 1:
                raise NotImplementedError(
                    f"delta: fused as the dual clip only when delta >= 1 + epsilon_high (= {1 + eps_high}), got {delta}"
                )
            fields["clip_ratio_c"] = delta
        if seq_level:
            fields["gspo_log_clamp"] = _NO_GSPO_CLAMP
        return fields
    if seq_level:
        raise NotImplementedError(
            f"importance_sampling_level='sequence' with loss_type={loss_type!r} is not fused "
            "(only the clipped GRPO family maps to GSPO)"
        )
    if loss_type == "cispo":
        if eps_high < 1:
            raise NotImplementedError(
                f"epsilon_high: CISPO's clamp(ρ, max=epsilon_high) is fused for epsilon_high >= 1, got {eps_high}"
            )
        return dict(loss_type="cispo", clip_low=1.0, clip_high=eps_high - 1.0)
    tau_pos = check_number("sapo_temperature_pos", c["sapo_temperature_pos"])
    tau_neg = check_number("sapo_temperature_neg", c["sapo_temperature_neg"])
    return dict(loss_type="sapo", tau_pos=tau_pos, tau_neg=tau_neg)


def _aggregation(loss_type, fields, B, accum, num_processes, spg, c) -> Tuple[Dict[str, Any], float]:
    """TRL's normaliser per loss type: the op's aggregation (set in ``fields``), its
    keywords, and the divisor applied to the op's loss."""
    if loss_type in ("grpo", "sapo"):
        fields["agg"] = "seq-mean-token-mean"
        return dict(global_num_seqs=B), accum
    if loss_type == "bnpo":
        fields["agg"] = "token-mean"
        return {}, accum
    if loss_type == "dr_grpo":
        if c["max_completion_length"] is None:
            raise ValueError("max_completion_length: loss_type='dr_grpo' divides by B · max_completion_length")
        length = check_int("max_completion_length", c["max_completion_length"], minimum=1)
        fields["agg"] = "seq-mean-token-sum-norm"
        return dict(global_num_seqs=B, loss_scale_factor=length), accum
    if loss_type == "luspo":
        fields["agg"] = "seq-mean-token-sum"
        return dict(global_num_seqs=B), accum
    # dapo, cispo
    items = c["num_items_in_batch"]
    if items is None:
        raise ValueError(f"num_items_in_batch: loss_type={loss_type!r} normalises by it")
    if isinstance(items, torch.Tensor):
        if items.numel() != 1:
            raise ValueError(f"num_items_in_batch: expected a number or a one-element tensor, got {tuple(items.shape)}")
        normalizer = items.clamp(min=1.0) / num_processes
    else:
        normalizer = max(check_number("num_items_in_batch", items), 1.0) / num_processes
    if c["training"]:
        normalizer = normalizer * c["gradient_accumulation_steps"] / spg
    fields["agg"] = "token-mean"
    return dict(global_num_tokens=normalizer), 1.0


@dataclass(frozen=True)
class _Inputs:
    """The call's tensors, checked, as the op takes them."""

    logps: torch.Tensor
    old: torch.Tensor
    advantages: torch.Tensor  # [B] or [B, T], the IS ratio folded in
    mask: torch.Tensor
    ref: Optional[torch.Tensor]
    entropies: Optional[torch.Tensor]


def _validate(logps, old, advantages, mask, ref, entropies, ratio, plan: _Plan, validate) -> _Inputs:
    """Shapes, devices and dtypes first (each error names TRL's argument), then values.
    The tensors only this wrapper reads are checked here; the op checks the others (its
    errors renamed to TRL's names)."""
    check_tensor("per_token_logps", logps, dtypes=FLOAT_DTYPES, ndim=(2,))
    check_like("completion_mask", mask, logps, "per_token_logps", dtypes=MASK_DTYPES)
    shape = tuple(logps.shape)
    B = shape[0]
    check_tensor("advantages", advantages, dtypes=FLOAT_DTYPES, like=logps, like_name="per_token_logps")
    if tuple(advantages.shape) not in ((B,), (B, 1), shape):
        raise ValueError(
            f"advantages: expected [B] = {(B,)}, [B, 1] = {(B, 1)} or [B, T] = {shape}, got {tuple(advantages.shape)}"
        )
    if ratio is not None:
        check_tensor("importance_sampling_ratio", ratio, dtypes=FLOAT_DTYPES, like=logps, like_name="per_token_logps")
        if tuple(ratio.shape) not in ((B,), (B, 1), shape):
            raise ValueError(
                f"importance_sampling_ratio: expected [B, T] = {shape} or [B, 1] = {(B, 1)} (or [B]), "
                f"got {tuple(ratio.shape)}"
            )
    if plan.beta != 0.0 and ref is None:
        raise ValueError("ref_per_token_logps: beta != 0 needs the reference log-probs")
    if entropies is None:
        if plan.shaping is not None:
            raise ValueError("entropies: top_entropy_quantile < 1 needs the per-token entropies")
        if plan.entropy_coef != 0.0:
            raise ValueError("entropies: entropy_coef != 0 needs the per-token entropies")

    adv = advantages
    if adv.dim() == 2 and adv.shape[1] == 1 and adv.shape != logps.shape:
        adv = adv[:, 0]
    if ratio is not None:
        r = ratio.detach()
        # Values only after every shape is known good.
        if checks_enabled(validate, r, mask) and r.numel():
            valid = (mask != 0) if r.shape == logps.shape else (mask != 0).any(-1).reshape(r.shape)
            if bool((~(r >= 0) & valid).any()):
                raise ValueError(
                    "importance_sampling_ratio: expected ratios >= 0 on valid tokens (the fold into the "
                    "advantages is exact for non-negative ratios only)"
                )
        adv = _fold_ratio(adv, r, shape)
    return _Inputs(
        logps=logps,
        old=logps.detach() if old is None else old,
        advantages=adv,
        mask=mask,
        ref=ref if plan.beta != 0.0 else None,
        entropies=entropies,
    )


def _fold_ratio(adv: torch.Tensor, r: torch.Tensor, shape) -> torch.Tensor:
    """A · ratio, with TRL's broadcasting ([B, 1] per sequence, [B, T] per token); shapes
    already checked."""
    if r.dim() == 2 and r.shape[1] == 1 and tuple(r.shape) != tuple(shape):
        r = r[:, 0]
    if r.dim() == 1 and tuple(r.shape) != tuple(shape):
        return (adv * r) if adv.dim() == 1 else adv * r[:, None]
    return (adv[:, None] if adv.dim() == 1 else adv) * r


def _fused_loss(x: _Inputs, plan: _Plan, validate, backend) -> Tuple[torch.Tensor, PolicyLossMetrics]:
    """The op call (two at sequence level with a pg multiplier that varies inside a
    sequence and a KL term: see grpo_loss_trl's mapping)."""
    fields = dict(plan.fields)
    # Sequence level with a pg multiplier that varies inside a sequence (token advantages,
    # a token IS ratio, the entropy mask): TRL's gradient reaches every token through the
    # sequence mean, so it is the token form's gradient averaged over the sequence's tokens.
    spread = plan.seq_level and (x.advantages.dim() == 2 or plan.shaping is not None)
    split_kl = spread and plan.beta != 0.0  # the KL gradient stays per token: its own call
    if split_kl:
        kl_fields = {k: v for k, v in fields.items() if k in ("agg", "kl", "kl_coef")}
        kl_opts = resolve_policy_loss_options("trl", loss_type="reinforce", **kl_fields)
        fields.pop("kl"), fields.pop("kl_coef")
    opts = resolve_policy_loss_options("trl", **fields)
    logps = _SequenceMeanGrad.apply(x.logps, x.mask) if spread else x.logps
    loss, metrics = policy_loss(
        logps,
        x.old,
        x.advantages,
        x.mask,
        options=opts,
        ref_logprobs=x.ref if "kl" in fields else None,
        entropy=x.entropies,
        validate=validate,
        backend=backend,
        **plan.agg_kw,
    )
    if split_kl:
        zeros = torch.zeros(x.logps.shape[0], dtype=torch.float32, device=x.logps.device)
        kl_loss, kl_metrics = policy_loss(
            x.logps,
            x.old,
            zeros,
            x.mask,
            options=kl_opts,
            ref_logprobs=x.ref,
            validate=validate,
            backend=backend,
            **plan.agg_kw,
        )
        loss = loss + kl_loss
        metrics = metrics._replace(kl_loss=kl_metrics.kl_loss, kl=kl_metrics.kl)
    return loss, metrics


def _entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """TRL's entropy bonus: Σ H·m / max(Σ m, 1) / accumulation over the (entropy-masked)
    completion tokens, whatever the loss type's normaliser (gradient to ``entropies``)."""
    eff = mask != 0
    if plan.shaping is not None:
        # The op's own threshold rule (torch.quantile's), computed as the op computes it.
        thr = entropy_quantile_threshold(entropies, eff, plan.shaping.entropy_quantile)
        eff = eff & (entropies.detach().float() >= thr)
    effm = eff.to(entropies.dtype)
    return (entropies * effm).sum() / effm.sum().clamp(min=1.0) / plan.accum


class _SequenceMeanGrad(torch.autograd.Function):
    """Identity forward; backward replaces each valid token's gradient by its sequence's
    mean (over valid tokens) — the chain rule through TRL's sequence-level log-ratio mean."""

    @staticmethod
    def forward(ctx, logps, mask):
        ctx.save_for_backward(mask)
        return logps.view_as(logps)

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        m = (mask != 0).to(grad.dtype)
        per_seq = (grad * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
        return per_seq * m, None
