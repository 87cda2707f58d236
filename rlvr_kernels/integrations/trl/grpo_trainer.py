"""TRL's ``trl.trainer.grpo_trainer.GRPOTrainer`` computations as functions (TRL 1.16):
the advantages of ``_generate_and_score_completions`` (:func:`compute_grpo_advantages`)
and the loss of ``_compute_loss`` (:func:`grpo_loss_trl`, with TRL's metric set:
:func:`reduce_trl_metrics`), each one fused op call (plus per-sequence torch terms where
TRL's sequence-level gradient couples a sequence's tokens; see grpo_loss_trl).

TRL computes both inline, so these are not signature drop-ins: they take the tensors TRL
has at that point and the ``GRPOConfig`` fields, under TRL's names, and match TRL's code
to 1e-6 (tests/advantages/test_peers_trl.py and tests/policy_loss/test_peers_trl.py run
TRL's own source on the same inputs). Groups are contiguous: rows ``[k·G, (k+1)·G)`` are
the G completions of prompt k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch

from ..._core.validation import (
    FLOAT_DTYPES,
    MASK_DTYPES,
    check_int,
    check_like,
    check_number,
    check_tensor,
    checks_enabled,
)
from ...contracts.policy_loss import entropy_quantile_threshold
from ...ops.advantages import group_advantages
from ...ops.policy_loss import policy_loss
from ...options import PolicyLossMetrics, TokenShaping, resolve_policy_loss_options
from .._backend import current_backend
from .._errors import caller_names

__all__ = [
    "compute_grpo_advantages",
    "grpo_loss_trl",
    "reduce_trl_metrics",
    "trl_entropy_threshold",
    "TrlMetric",
    "TRL_LOSS_TYPES",
]

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

TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
_ITEMS_NORMALISED = ("dapo", "cispo", "vespo")  # TRL divides these by num_items_in_batch
# GSPO's log s_i clamp (10 in verl) is off for TRL: a bound no finite mean log-ratio reaches.
_NO_GSPO_CLAMP = 1e30
# Off-policy / zero-ratio tokens are dropped through the op's token_mis weight (see _keep_logprobs):
# a kept token's rollout log-prob is its old one (weight exactly 1, inside [1/C, C]); a dropped
# token's is 40 below (the clamped weight e^20 > C: weight exactly 0).
_MIS_CAP = 2.0
_DROP_GAP = 40.0

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


class TrlMetric(NamedTuple):
    """One metric TRL logs, as this process's local value and the cross-process reduction
    TRL applies to it (:func:`reduce_trl_metrics` applies it).

    reduce = "masked_mean": ``value`` is ``[local_sum, local_count]`` (fp32, shape [2]);
                            TRL's ``global_masked_mean``: all-reduce (sum), then
                            sum / max(count, 1).
             "nanmin" / "nanmax": ``value`` is 0-d (NaN when this process has no value);
                            TRL's ``nanmin(gather(...))`` / ``nanmax``.
             "nanmean":     ``value`` is 0-d; TRL's ``gather(...).nanmean()``.
    """

    value: torch.Tensor
    reduce: str


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
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    top_entropy_quantile: float = 1.0,
    entropies: Optional[torch.Tensor] = None,
    entropy_threshold: Optional[torch.Tensor] = None,
    process_group: Any = None,
    entropy_coef: float = 0.0,
    importance_sampling_ratio: Optional[torch.Tensor] = None,
    vllm_importance_sampling_correction: Optional[bool] = None,
    off_policy_mask_threshold: Optional[float] = None,
    sampling_per_token_logps: Optional[torch.Tensor] = None,
    max_completion_length: Optional[int] = None,
    num_items_in_batch=None,
    gradient_accumulation_steps: int = 1,
    num_processes: int = 1,
    steps_per_generation: int = 1,
    training: bool = True,
    return_trl_metrics: bool = False,
    validate: bool = True,
    backend: Optional[str] = None,
):
    """The loss ``GRPOTrainer._compute_loss`` returns (value and gradient), from the
    tensors it has, in one fused ``policy_loss`` call (preset "trl": no δ clamp, k3 KL
    without clamps, no clamp of GSPO's log s), and the metrics TRL logs.

    Arguments are TRL's names (``GRPOConfig`` fields and ``_compute_loss`` locals), with
    TRL's defaults: ``completion_mask`` is TRL's ``mask`` (``completion_mask * tool_mask``
    when tools are used); ``advantages`` ``[B]``, ``[B, 1]`` or ``[B, T]``;
    ``old_per_token_logps=None`` means ``per_token_logps.detach()`` as TRL;
    ``epsilon_low`` is ``GRPOConfig.epsilon`` and ``epsilon_high`` defaults to it;
    ``gradient_accumulation_steps`` is TRL's ``current_gradient_accumulation_steps``;
    ``training=False`` is TRL's eval mode (no accumulation scaling); ``entropy_coef`` is
    the coefficient TRL applies this step (``apply_coef``, for the adaptive controller
    too). ``importance_sampling_ratio`` is ``inputs["importance_sampling_ratio"]``: it
    multiplies the policy term when ``vllm_importance_sampling_correction`` (TRL's
    ``use_vllm and vllm_importance_sampling_correction``; None: whenever it is given),
    and vespo reads it in its gamma weights whatever that flag. ``sampling_per_token_logps``
    is ``inputs.get("sampling_per_token_logps")`` for the off-policy mask (None: the old
    log-probs, as TRL). ``backend``: None for the one of the innermost ``use_backend`` block.

    ``top_entropy_quantile`` < 1 with several processes: TRL's threshold is the quantile
    over every process's valid-token entropies. Give either ``process_group`` (a
    ``torch.distributed`` group, or ``torch.distributed.group.WORLD``: the entropies are
    all-gathered as TRL's ``pad_across_processes`` + ``gather``, a collective every process
    must enter) or ``entropy_threshold`` (a 0-d tensor computed by the caller, e.g. with
    :func:`trl_entropy_threshold`). With one process neither is needed.

    Mapping (TRL → ``policy_loss``):
      * grpo/bnpo/dr_grpo/dapo/luspo, token level → "ppo" with clip ε_low/ε_high;
        sequence level → "gspo" with log s unclamped. TRL's ``delta`` (clamp(ρ, max=δ) of
        the unclipped branch): for δ > 1 + ε_high it is the dual clip c = δ
        (``gspo_dual_clip`` at sequence level); for 1 <= δ <= 1 + ε_high it is the ratio
        clip [1 − ε_low, δ] with the dual clip c = 1 + ε_high (for A > 0 the upper bound
        becomes δ; for A < 0 the upper bound never matters and c caps the ratio at
        1 + ε_high, TRL's clip(ρ) above δ): exact, value and gradient. (δ < 1 raises.)
        TRL's gradient at sequence level flows through the sequence mean of δ, so token t
        gets m_t/n_i · Σ_u of the per-token derivatives: the token form's gradient when the
        pg multiplier (advantage · IS ratio · masks) is uniform within each sequence.
        Otherwise the logps pass through an autograd identity whose backward takes that
        per-sequence mean, and a plain KL term (per-token gradient) moves to a second call.
      * cispo, token level with ε_high >= 1 (TRL recommends 5) → "cispo" with the bounds
        [0, ε_high] (clip_low = 1, clip_high = ε_high − 1). Sequence level → "reinforce" with
        the advantages times the detached per-sequence clamp(s_i, max=ε_high) (a [B] torch
        pre-computation: TRL's clamped ratio is a constant of the loss); token level with
        ε_high < 1 (an upper bound below 1 the op's clip range cannot express) likewise with
        the per-token clamp(ρ, max=ε_high) (one elementwise torch pass).
      * sapo, token level → "sapo" with TRL's temperatures. Sequence level: TRL's term is a
        function of the sequence ratio s_i alone whose gradient reaches every token through
        the sequence mean, so it is computed in torch (per-sequence values, one broadcast),
        the op giving the rest (KL, metrics).
      * vespo → "reinforce" with the advantages times TRL's detached per-sequence gamma
        weight φ(w) (``get_gamma_weights``, a [B] torch pre-computation from Σ δ·m and the
        IS ratio: a constant of the loss, so −φ·A·logp is REINFORCE on φ·A).
      * aggregation: grpo/sapo seq-mean-token-mean over all B rows (empty ones count, as
        TRL's ``.mean()``), bnpo token-mean, dr_grpo Σ/(B·max_completion_length), luspo
        seq-mean-token-sum over B rows, each ÷ gradient_accumulation_steps in training;
        dapo/cispo/vespo Σ / (clamp(num_items_in_batch, 1) / num_processes ·
        gradient_accumulation_steps / steps_per_generation) (without the last two factors
        in eval).
      * ``beta`` → k3 to ``ref_per_token_logps``, unclamped. ``use_bias_correction_kl``
        (TRL's default) multiplies it by the differentiable ratio coef_1: at token level the
        op's ``kl_ratio_correction`` (exp(δ), value and gradient, fused). At sequence level
        TRL's coef_1 = s_i sends the KL's gradient through the sequence mean of δ (the KL
        varies within a sequence, so no per-token form equals it): that term is computed in
        torch (k3 · s_i, a few elementwise ops) and aggregated as TRL does.
      * ``top_entropy_quantile`` < 1 → ``TokenShaping(entropy_quantile=top_entropy_quantile)``
        (the pg term only on tokens at or above the (1 − q) entropy quantile,
        torch.quantile's rule), with the threshold of all processes (above).
      * ``importance_sampling_ratio`` (TRL's vLLM correction, ``[B, T]`` or ``[B, 1]``, any
        mode) and ``off_policy_mask_threshold`` (TRL's off-policy sequence mask, computed
        per sequence in torch as ``get_off_policy_mask``): the non-zero ratios are folded
        into the advantages (exact: every pg term is positively homogeneous in A); the
        zeros and the masked sequences drop their pg term through the op's ``token_mis``
        weight (exactly 0 or 1), so TRL's clip metrics, which see neither, still count them.
      * ``entropy_coef`` ≠ 0: TRL's bonus is a token mean over the (entropy-masked)
        completion tokens whatever the loss type's normaliser, so it is a separate torch
        term ``− coef · Σ H·m / max(Σ m, 1) / accumulation`` (gradient to ``entropies``).

    Not supported (NotImplementedError, naming the option): ``delta`` < 1 (the clip bound
    δ − 1 would be negative; TRL's docs ask for delta > 1 + ε_high), and ``delta`` <=
    1 + ε_high with ε_high = 0 (the dual clip would need c = 1); and, without the argument
    it needs, ``top_entropy_quantile`` < 1 with ``num_processes`` > 1 and neither
    ``process_group`` nor ``entropy_threshold`` (the threshold needs every process's
    entropies: the message says which argument to pass).

    Returns ``(loss, metrics)``, or ``(loss, metrics, trl_metrics)`` with
    ``return_trl_metrics=True``. ``metrics``: the op's :class:`PolicyLossMetrics` (detached
    0-d tensors, this process; ``kl`` / ``kl_loss`` / ``pg_loss`` replaced by the torch
    terms where those compute them). ``trl_metrics``: ``{name: TrlMetric}`` under TRL's
    metric names, the local values a trainer reduces across processes as TRL does
    (:func:`reduce_trl_metrics`), exactly the names ``_compute_loss`` logs for these settings:

    - ``"policy_loss"``: the loss before the accumulation divisor and the entropy bonus.
      TRL logs it only when its entropy bonus is enabled (``trainer._entropy_bonus_enabled``);
      a trainer drops it otherwise.
    - ``"kl"`` (beta != 0): the (bias-corrected) per-token k3 over valid tokens.
    - ``"entropy"`` (when ``entropies`` is given; TRL always has them): over valid tokens.
    - grpo/bnpo/dr_grpo/dapo/luspo: ``"clip_ratio/low_mean"``, ``"clip_ratio/high_mean"``,
      ``"clip_ratio/region_mean"``, ``"clip_ratio/low_min"``, ``"clip_ratio/high_max"``
      (from the op's clip-side metrics); cispo: ``"cispo_clip_ratio"``; vespo:
      ``"vespo/phi_seq_mean"``.
    A trainer patch does ``for name, v in reduce_trl_metrics(trl_metrics,
    self.accelerator).items(): self._metrics[mode][name].append(v)`` (every process, in
    the same order), dropping ``"policy_loss"`` as above.
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
        vespo=(vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg),
        top_entropy_quantile=top_entropy_quantile,
        entropy_threshold=entropy_threshold,
        process_group=process_group,
        entropy_coef=entropy_coef,
        off_policy_mask_threshold=off_policy_mask_threshold,
        max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch,
        gradient_accumulation_steps=gradient_accumulation_steps,
        num_processes=num_processes,
        steps_per_generation=steps_per_generation,
        training=training,
    )
    if vllm_importance_sampling_correction is None:
        vllm_importance_sampling_correction = importance_sampling_ratio is not None
    x = _validate(
        per_token_logps,
        old_per_token_logps,
        advantages,
        completion_mask,
        ref_per_token_logps,
        entropies,
        importance_sampling_ratio,
        bool(vllm_importance_sampling_correction),
        sampling_per_token_logps,
        entropy_threshold,
        plan,
        validate,
    )
    with caller_names(LOSS_NAMES):
        loss, metrics, extra = _fused_loss(x, plan, validate, backend)
    policy_loss_value = loss.detach()
    if plan.post != 1.0:
        loss = loss / plan.post
    if plan.entropy_coef != 0.0:
        loss = loss - plan.entropy_coef * _entropy_bonus(x.entropies, x.mask, x.threshold, plan)
    if not return_trl_metrics:
        return loss, metrics
    return loss, metrics, _trl_metric_values(metrics, plan, x, extra, policy_loss_value)


@dataclass(frozen=True)
class _Plan:
    """What a call's TRL settings ask of ``policy_loss``: its option fields, aggregation
    keywords, the divisor applied after it, and what the call needs from its tensors."""

    fields: Dict[str, Any]  # resolve_policy_loss_options fields
    loss_type: str = "dapo"
    agg_kw: Dict[str, Any] = field(default_factory=dict)  # global_num_tokens / _seqs, loss_scale_factor
    post: float = 1.0  # TRL's accumulation divisor, after the op
    seq_level: bool = False
    shaping: Optional[TokenShaping] = None
    top_q: float = 1.0
    process_group: Any = None
    beta: float = 0.0
    bias_kl: bool = False  # use_bias_correction_kl with beta != 0
    entropy_coef: float = 0.0
    accum: float = 1.0  # the entropy bonus's accumulation divisor
    eps_high: float = 0.2
    high_never: bool = False  # delta <= 1 + ε_high: TRL's min(ρ, δ) never exceeds 1 + ε_high
    tau: Tuple[float, float] = (1.0, 1.05)
    vespo: Tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)
    opsm: Optional[float] = None
    num_processes: int = 1


def _plan(logps, **c) -> _Plan:
    """TRL's settings -> ``policy_loss`` options, checked first (each error names the
    setting), in the order ``_compute_loss`` reads them. ``logps`` gives B only."""
    loss_type = c["loss_type"]
    if loss_type not in TRL_LOSS_TYPES:
        raise ValueError(f"loss_type: expected one of TRL's {TRL_LOSS_TYPES}, got {loss_type!r}")
    level = c["importance_sampling_level"]
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level: expected 'token' or 'sequence', got {level!r}")
    opsm = c["off_policy_mask_threshold"]
    if opsm is not None:
        opsm = check_number("off_policy_mask_threshold", opsm)
    eps_low = check_number("epsilon_low", c["epsilon_low"])
    eps_high = eps_low if c["epsilon_high"] is None else check_number("epsilon_high", c["epsilon_high"])
    beta = check_number("beta", c["beta"])
    top_q = check_number("top_entropy_quantile", c["top_entropy_quantile"], minimum=0.0, maximum=1.0, open_low=True)
    entropy_coef = check_number("entropy_coef", c["entropy_coef"])
    accum_steps = check_int("gradient_accumulation_steps", c["gradient_accumulation_steps"], minimum=1)
    num_processes = check_int("num_processes", c["num_processes"], minimum=1)
    spg = check_int("steps_per_generation", c["steps_per_generation"], minimum=1)
    vespo = tuple(check_number(n, v) for n, v in zip(_VESPO_NAMES, c["vespo"]))
    seq_level = level == "sequence"
    accum = float(accum_steps) if c["training"] else 1.0

    fields, high_never = _loss_fields(loss_type, eps_low, eps_high, c["delta"], seq_level, c)
    if not isinstance(c["use_bias_correction_kl"], bool):
        raise TypeError(f"use_bias_correction_kl: expected a bool, got {type(c['use_bias_correction_kl']).__name__}")
    bias_kl = beta != 0.0 and c["use_bias_correction_kl"]
    if beta != 0.0 and not (bias_kl and seq_level):  # (sequence level: the torch term, see grpo_loss_trl)
        fields.update(kl="k3", kl_coef=beta, kl_ratio_correction=bias_kl)
    shaping = None
    if top_q < 1.0:
        if num_processes > 1 and c["process_group"] is None and c["entropy_threshold"] is None:
            raise NotImplementedError(
                "top_entropy_quantile: with num_processes > 1 TRL's threshold is the quantile over all "
                "processes' tokens; pass process_group= (a torch.distributed group) or entropy_threshold="
            )
        shaping = TokenShaping(entropy_quantile=top_q)
        fields["shaping"] = shaping
    elif c["entropy_threshold"] is not None:
        raise ValueError("entropy_threshold: only used with top_entropy_quantile < 1")

    B = logps.shape[0] if isinstance(logps, torch.Tensor) and logps.dim() else 0
    agg_kw, post = _aggregation(loss_type, fields, B, accum, num_processes, spg, c)
    return _Plan(
        fields=fields,
        loss_type=loss_type,
        agg_kw=agg_kw,
        post=post,
        seq_level=seq_level,
        shaping=shaping,
        top_q=top_q,
        process_group=c["process_group"],
        beta=beta,
        bias_kl=bias_kl,
        entropy_coef=entropy_coef,
        accum=accum,
        eps_high=eps_high,
        high_never=high_never,
        tau=(check_number("sapo_temperature_pos", c["sapo_temperature_pos"]), c["sapo_temperature_neg"]),
        vespo=vespo,
        opsm=opsm,
        num_processes=num_processes,
    )


_VESPO_NAMES = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")


def _loss_fields(loss_type, eps_low, eps_high, delta, seq_level, c) -> Tuple[Dict[str, Any], bool]:
    """The loss type's options (the clip family, CISPO, SAPO, or REINFORCE for what a
    per-sequence weight turns into it), and whether TRL never sees the high clip side."""
    if loss_type in _CLIPPED:
        fields = dict(loss_type="gspo" if seq_level else "ppo", clip_low=eps_low, clip_high=eps_high)
        high_never = False
        if delta is not None:
            delta = check_number("delta", delta)
            if delta > 1 + eps_high:
                fields["clip_ratio_c"] = delta
            else:
                if delta < 1 or not eps_high > 0:
                    raise NotImplementedError(
                        f"delta: fused for delta > 1 + epsilon_high, or 1 <= delta <= 1 + epsilon_high with "
                        f"epsilon_high > 0; got delta={delta}, epsilon_high={eps_high}"
                    )
                # A > 0: the upper clip bound becomes δ; A < 0: c = 1 + ε_high caps the ratio.
                fields.update(clip_high=delta - 1.0, clip_ratio_c=1.0 + eps_high)
                high_never = True
            fields["gspo_dual_clip"] = seq_level
        if seq_level:
            fields["gspo_log_clamp"] = _NO_GSPO_CLAMP
        return fields, high_never
    if loss_type == "cispo":
        if seq_level or eps_high < 1:  # the detached clamped ratio as a weight (see _fused_loss)
            return dict(loss_type="reinforce"), False
        return dict(loss_type="cispo", clip_low=1.0, clip_high=eps_high - 1.0), False
    if loss_type == "vespo":
        return dict(loss_type="reinforce"), False
    check_number("sapo_temperature_pos", c["sapo_temperature_pos"])
    tau_neg = check_number("sapo_temperature_neg", c["sapo_temperature_neg"])
    if seq_level:  # the pg term in torch (see _fused_loss); the op gives KL and metrics
        return dict(loss_type="reinforce"), False
    return dict(loss_type="sapo", tau_pos=c["sapo_temperature_pos"], tau_neg=tau_neg), False


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
    # dapo, cispo, vespo
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
    raw_adv: torch.Tensor  # TRL's advantages, [B, 1] or [B, T] (what its metrics read)
    advantages: torch.Tensor  # [B] or [B, T] for the op, non-zero IS ratios folded in
    mask: torch.Tensor
    ref: Optional[torch.Tensor]
    entropies: Optional[torch.Tensor]
    is_ratio: Optional[torch.Tensor]  # TRL's importance_sampling_ratio (vespo's gamma weights read it)
    pg_ratio: Optional[torch.Tensor]  # the ratio when it multiplies the pg term (folded into advantages)
    keep: Optional[torch.Tensor]  # [B, T] bool: tokens whose pg term stays (off-policy mask, ratio != 0)
    threshold: Optional[torch.Tensor]  # the entropy threshold (0-d fp32), with top_entropy_quantile < 1


def _validate(
    logps, old, advantages, mask, ref, entropies, ratio, apply_ratio, sampling, threshold, plan: _Plan, validate
) -> _Inputs:
    """Shapes, devices and dtypes first (each error names TRL's argument), then values.
    The tensors only this wrapper reads are checked here; the op checks the others (its
    errors renamed to TRL's names). (Long for the checks of every optional tensor.)"""
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
    if sampling is not None:
        check_like("sampling_per_token_logps", sampling, logps, "per_token_logps", dtypes=FLOAT_DTYPES)
    if plan.beta != 0.0 and ref is None:
        raise ValueError("ref_per_token_logps: beta != 0 needs the reference log-probs")
    if entropies is None:
        if plan.shaping is not None:
            raise ValueError("entropies: top_entropy_quantile < 1 needs the per-token entropies")
        if plan.entropy_coef != 0.0:
            raise ValueError("entropies: entropy_coef != 0 needs the per-token entropies")
    if threshold is not None:
        check_tensor("entropy_threshold", threshold, dtypes=FLOAT_DTYPES, like=logps, like_name="per_token_logps")
        if threshold.numel() != 1:
            raise ValueError(f"entropy_threshold: expected one element, got shape {tuple(threshold.shape)}")

    old = logps.detach() if old is None else old
    raw_adv = advantages if advantages.dim() == 2 else advantages[:, None]  # TRL's unsqueeze(1)
    adv = raw_adv[:, 0] if raw_adv.shape[1] == 1 and raw_adv.shape != logps.shape else raw_adv
    r = None if ratio is None else (ratio if ratio.dim() == 2 else ratio[:, None]).detach()
    zeros = True  # whether the ratio may hold zeros (they need the keep mask); known when checked
    if r is not None and checks_enabled(validate, r, mask) and r.numel():
        valid = (mask != 0) if r.shape == logps.shape else (mask != 0).any(-1).reshape(r.shape)
        negative, zeros = torch.stack([(~(r >= 0) & valid).any(), (r == 0).any()]).tolist()  # one host sync
        if negative:
            raise ValueError(
                "importance_sampling_ratio: expected ratios >= 0 on valid tokens (the fold into the "
                "advantages is exact for non-negative ratios only)"
            )
    keep = None
    if plan.opsm is not None:
        keep = _off_policy_mask(raw_adv, logps, old if sampling is None else sampling, mask, plan.opsm)
    use_ratio = r is not None and apply_ratio and plan.loss_type != "vespo"
    if use_ratio and zeros:
        nonzero = r != 0
        keep = nonzero if keep is None else keep & nonzero
        adv = _fold_ratio(adv, torch.where(nonzero, r, torch.ones_like(r)), shape)
    elif use_ratio:  # (truncate modes: no zero, a plain fold)
        adv = _fold_ratio(adv, r, shape)
    if keep is not None:
        keep = keep.expand(shape)
    if plan.shaping is not None and threshold is None:
        threshold = trl_entropy_threshold(entropies, mask, plan.top_q, plan.process_group)
    return _Inputs(
        logps=logps,
        old=old,
        raw_adv=raw_adv,
        advantages=adv,
        mask=mask,
        ref=ref if plan.beta != 0.0 else None,
        entropies=entropies,
        is_ratio=r,
        pg_ratio=r if use_ratio else None,
        keep=keep,
        threshold=None if threshold is None else threshold.detach().reshape(()).float(),
    )


def _fold_ratio(adv: torch.Tensor, r: torch.Tensor, shape) -> torch.Tensor:
    """A · ratio, with TRL's broadcasting (``r`` [B, 1] per sequence or [B, T] per token)."""
    if r.shape[1] == 1 and tuple(r.shape) != tuple(shape):
        return (adv * r[:, 0]) if adv.dim() == 1 else adv * r
    return (adv[:, None] if adv.dim() == 1 else adv) * r


@torch.no_grad()
def _off_policy_mask(advantages, logps, sampling, mask, threshold) -> torch.Tensor:
    """TRL's ``GRPOTrainer.get_off_policy_mask`` (DeepSeek-V3.2's off-policy sequence mask),
    as a bool keep flag: [B, 1] (or [B, T] for token advantages)."""
    kl_div = torch.nan_to_num(sampling - logps.detach(), nan=0.0)
    seq_kl_sum = (kl_div * mask).sum(dim=1, keepdim=True)
    avg_seq_kl = seq_kl_sum / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return (advantages >= 0) | (avg_seq_kl <= threshold)


@torch.no_grad()
def _gamma_weights(x: _Inputs, plan: _Plan) -> torch.Tensor:
    """TRL's ``GRPOTrainer.get_gamma_weights`` (VESPO): φ(w) = e^λ·w^k·e^{−λw} per sequence,
    [B, 1], detached; w the sequence ratio Σ clamp(δ)·m plus the summed log IS ratio."""
    k_pos, lambda_pos, k_neg, lambda_neg = plan.vespo
    lower_clamp = math.log(1e-8)
    log_ratio = torch.clamp(x.logps.detach() - x.old, -20.0, 20.0)
    seq_log_ratio = torch.sum(log_ratio * x.mask, dim=-1, keepdim=True)
    if x.is_ratio is not None:
        log_is_ratio = torch.clamp(torch.log(x.is_ratio), lower_clamp, 20.0)
        seq_log_ratio += torch.sum(log_is_ratio, dim=-1, keepdim=True)
    log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
    w_seq = torch.exp(log_w_seq)
    is_nonneg_adv = x.raw_adv >= 0
    k_seq = torch.where(is_nonneg_adv, k_pos, k_neg)
    lambda_seq = torch.where(is_nonneg_adv, lambda_pos, lambda_neg).clamp(min=1e-4)
    log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _seq_log_ratio(x: _Inputs) -> torch.Tensor:
    """TRL's sequence-level log importance weight (Σ δ·m / max(n, 1)), [B, 1], differentiable."""
    log_ratio = x.logps - x.old
    return ((log_ratio * x.mask).sum(-1) / x.mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def _fused_loss(x: _Inputs, plan: _Plan, validate, backend):
    """The op call (two at sequence level with a pg multiplier that varies inside a
    sequence and a plain KL term), the per-sequence pre-computations and the torch terms
    (see grpo_loss_trl's mapping). Returns (loss before TRL's accumulation divisor,
    metrics, the extra values TRL's metrics read). (Long: one branch per TRL option that
    is not a plain op option.)"""
    fields = dict(plan.fields)
    adv = x.advantages
    extra: Dict[str, torch.Tensor] = {}
    torch_terms = []  # (per-token term [B, T] (or [B, 1]), name of the metric it replaces)
    seq_lr = _seq_log_ratio(x) if plan.seq_level else None
    if plan.loss_type == "vespo":
        phi = _gamma_weights(x, plan)
        extra["phi"] = phi
        adv = _fold_ratio(adv, phi, x.logps.shape)
    elif plan.loss_type == "cispo" and fields["loss_type"] == "reinforce":
        coef_1 = torch.exp(seq_lr.detach() if plan.seq_level else x.logps.detach() - x.old)
        extra["cispo_clipped"] = (coef_1 > plan.eps_high) & (x.raw_adv > 0)
        adv = _fold_ratio(adv, torch.clamp(coef_1, max=plan.eps_high), x.logps.shape)
    elif plan.loss_type == "sapo" and plan.seq_level:
        coef_1 = torch.exp(seq_lr)
        tau_pos, tau_neg = plan.tau
        temperatures = torch.where(x.raw_adv > 0, tau_pos, tau_neg)
        pg = -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * x.raw_adv
        for m in _pg_masks(x):
            pg = pg * m
        torch_terms.append((pg, "pg_loss"))
        adv = torch.zeros_like(adv)
    if plan.bias_kl and plan.seq_level:
        ref, lp = x.ref, x.logps
        per_token_kl = (torch.exp(ref - lp) - (ref - lp) - 1) * torch.exp(seq_lr)
        extra["kl"] = per_token_kl
        torch_terms.append((plan.beta * per_token_kl, "kl_loss"))

    # Sequence level with a pg multiplier that varies inside a sequence (token advantages,
    # a token IS ratio or mask, the entropy mask): TRL's gradient reaches every token through
    # the sequence mean, so it is the token form's gradient averaged over the sequence's tokens.
    # (Only the clipped family: cispo's and vespo's sequence weights are detached, sapo's
    # term is the torch one.)
    spread = plan.seq_level and plan.loss_type in _CLIPPED
    spread = spread and (adv.dim() == 2 or plan.shaping is not None or x.keep is not None)
    split_kl = spread and "kl" in fields  # the KL gradient stays per token: its own call
    if split_kl:
        kl_fields = {k: v for k, v in fields.items() if k in ("agg", "kl", "kl_coef")}
        kl_opts = resolve_policy_loss_options("trl", loss_type="reinforce", **kl_fields)
        fields.pop("kl"), fields.pop("kl_coef"), fields.pop("kl_ratio_correction")
    roll = None
    if x.keep is not None:
        fields.update(rollout_correction="token_mis", rollout_threshold=_MIS_CAP)
        roll = _keep_logprobs(x.old, x.keep)
    opts = resolve_policy_loss_options("trl", **fields)
    logps = _SequenceMeanGrad.apply(x.logps, x.mask) if spread else x.logps
    loss, metrics = policy_loss(
        logps,
        x.old,
        adv,
        x.mask,
        options=opts,
        ref_logprobs=x.ref if "kl" in fields else None,
        rollout_logprobs=roll,
        entropy=x.entropies,
        entropy_threshold=x.threshold,
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
    for term, name in torch_terms:
        agg = _trl_aggregate(term, x.mask, plan)
        loss = loss + agg
        value = agg.detach().float()
        if name == "kl_loss":
            valid = (x.mask != 0).to(term.dtype)
            kl_mean = (extra["kl"] * valid).sum() / valid.sum().clamp(min=1.0)
            metrics = metrics._replace(kl_loss=value / plan.beta, kl=kl_mean.detach().float())
        else:
            metrics = metrics._replace(pg_loss=value)
    return loss, metrics, extra


def _pg_masks(x: _Inputs):
    """The multipliers TRL applies to its pg term after the loss type (for a torch pg term):
    the off-policy mask, the entropy mask, the IS ratio (folded / kept as the op gets them)."""
    out = []
    if x.threshold is not None:
        out.append(((x.entropies.detach().float() >= x.threshold) & (x.mask != 0)).to(x.logps.dtype))
    if x.keep is not None:
        out.append(x.keep.to(x.logps.dtype))
    if x.pg_ratio is not None:
        out.append(x.pg_ratio.to(x.logps.dtype))
    return out


def _keep_logprobs(old: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Rollout log-probs for the op's token_mis weight that keep exactly the ``keep`` tokens:
    the old log-prob (weight e^0 = 1 inside [1/C, C]) or 40 below it (e^20 > C: weight 0)."""
    old = old.detach()
    return torch.where(keep, old, old - _DROP_GAP)


def _trl_aggregate(per_token: torch.Tensor, mask: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """TRL's normaliser of ``_compute_loss`` for the loss type, on a torch per-token term
    (broadcast to [B, T]); before the accumulation divisor (plan.post), as the op's loss."""
    m = mask.to(per_token.dtype) if mask.dtype == torch.bool else mask
    x = per_token.expand(mask.shape) * m
    t = plan.loss_type
    if t in ("grpo", "sapo"):
        return (x.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if t == "bnpo":
        return x.sum() / m.sum().clamp(min=1.0)
    if t == "dr_grpo":
        return x.sum() / (x.shape[0] * plan.agg_kw["loss_scale_factor"])
    if t == "luspo":
        return x.sum(-1).mean()
    return x.sum() / plan.agg_kw["global_num_tokens"]


def _entropy_bonus(entropies, mask, threshold, plan: _Plan) -> torch.Tensor:
    """TRL's entropy bonus: Σ H·m / max(Σ m, 1) / accumulation over the (entropy-masked)
    completion tokens, whatever the loss type's normaliser (gradient to ``entropies``)."""
    eff = mask != 0
    if threshold is not None:
        eff = eff & (entropies.detach().float() >= threshold)
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


# ---------------------------------------------------------------------------------------
# top_entropy_quantile across processes (GRPOTrainer.get_high_entropy_mask)
# ---------------------------------------------------------------------------------------


def trl_entropy_threshold(
    entropies: torch.Tensor, mask: torch.Tensor, top_entropy_quantile: float, process_group: Any = None
) -> torch.Tensor:
    """TRL's entropy threshold of ``get_high_entropy_mask``: ``torch.quantile`` at
    1 − ``top_entropy_quantile`` of the valid-token entropies (fp32) of every process in
    ``process_group`` (None: this process only), as a 0-d fp32 tensor; +inf when no
    process has a valid token (TRL then masks every token). With a group this is a
    collective: every process of the group must call it (as TRL's ``gather``).

    The gather is TRL's: each process's count is all-gathered, the local values padded to
    the largest count and all-gathered, the padding dropped; ranks in order. With no group
    the op's own sort-based quantile is used (the same rule; it also runs under
    torch.compile and beyond torch.quantile's 16M-element limit)."""
    valid = mask != 0
    if process_group is None:
        return entropy_quantile_threshold(entropies, valid, top_entropy_quantile)
    import torch.distributed as dist

    local = entropies.detach()[valid].float()
    world = dist.get_world_size(process_group)
    count = torch.tensor([local.numel()], device=local.device, dtype=torch.int64)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=process_group)
    sizes = [int(c) for c in counts]
    longest = max(sizes + [0])
    padded = torch.zeros(longest, dtype=torch.float32, device=local.device)
    padded[: local.numel()] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=process_group)
    gathered = torch.cat([p[:n] for p, n in zip(parts, sizes)])
    if gathered.numel() == 0:
        return torch.full((), float("inf"), device=entropies.device)
    return torch.quantile(gathered, 1 - top_entropy_quantile)


# ---------------------------------------------------------------------------------------
# TRL's metrics
# ---------------------------------------------------------------------------------------


def _trl_metric_values(metrics: PolicyLossMetrics, plan: _Plan, x: _Inputs, extra, policy_loss_value):
    """TRL's metric names → :class:`TrlMetric` (local value + TRL's reduction), as
    ``_compute_loss`` logs them for this call's settings:

    - ``"policy_loss"`` (nanmean): the loss before the accumulation divisor and the entropy
      bonus. TRL logs it only when its entropy bonus is enabled
      (``trainer._entropy_bonus_enabled``); a trainer drops it otherwise.
    - ``"kl"`` (masked_mean, when beta != 0): the (bias-corrected) per-token k3 over valid tokens.
    - ``"entropy"`` (masked_mean, when ``entropies`` is given): over valid tokens.
    - clipped loss types: ``"clip_ratio/low_mean"``, ``"clip_ratio/high_mean"``,
      ``"clip_ratio/region_mean"`` (masked_mean), ``"clip_ratio/low_min"`` (nanmin),
      ``"clip_ratio/high_max"`` (nanmax); cispo: ``"cispo_clip_ratio"`` (masked_mean);
      vespo: ``"vespo/phi_seq_mean"`` (masked_mean).
    Token level (or token advantages): means over valid tokens, extrema over the per-
    sequence means of sequences with a valid token (NaN without one, as TRL's NaN rows).
    Sequence level with [B] / [B, 1] advantages: TRL's values are per sequence, empty
    sequences included (ratio 1: never clipped), so means are over the B rows.
    """
    f32 = dict(dtype=torch.float32, device=metrics.num_tokens.device)
    ntok = metrics.num_tokens
    nseq = metrics.num_seqs
    B = float(x.logps.shape[0])
    per_seq = x.raw_adv.shape[1] == 1 and plan.seq_level  # TRL's x.shape[1] == 1

    def masked_mean(sum_, count):
        return TrlMetric(
            torch.stack([sum_.to(**f32).reshape(()), torch.as_tensor(count, **f32).reshape(())]), "masked_mean"
        )

    def token_mean(mean):
        return masked_mean(mean * ntok, ntok)

    nan = torch.full((), float("nan"), **f32)
    out = {"policy_loss": TrlMetric(policy_loss_value.detach().to(**f32).reshape(()), "nanmean")}
    if plan.beta != 0.0:
        if "kl" in extra:
            valid = (x.mask != 0).to(extra["kl"].dtype)
            out["kl"] = masked_mean((extra["kl"].detach() * valid).sum(), valid.sum())
        else:
            out["kl"] = token_mean(metrics.kl)
    if x.entropies is not None:
        out["entropy"] = token_mean(metrics.entropy_mean)
    if plan.loss_type in _CLIPPED:
        zero = torch.zeros((), **f32)
        if per_seq:
            low = masked_mean(metrics.seq_clipfrac_low_mean * nseq, B)
            high = masked_mean(metrics.seq_clipfrac_high_mean * nseq, B)
            empty_rows = nseq < B
            low_min = torch.where(
                empty_rows, torch.minimum(metrics.seq_clipfrac_low_min, zero), metrics.seq_clipfrac_low_min
            )
            high_max = metrics.seq_clipfrac_high_max
            if B == 0:
                low_min, high_max = nan, nan
        else:
            low = token_mean(metrics.pg_clipfrac_low)
            high = token_mean(metrics.pg_clipfrac_high)
            has = nseq > 0
            low_min = torch.where(has, metrics.seq_clipfrac_low_min, nan)
            high_max = torch.where(has, metrics.seq_clipfrac_high_max, nan)
        if plan.high_never:  # TRL measures min(ρ, δ) with δ <= 1 + ε_high
            high = TrlMetric(high.value * torch.tensor([0.0, 1.0], **f32), "masked_mean")
            high_max = torch.where(torch.isnan(high_max), high_max, zero)
        out["clip_ratio/low_mean"] = low
        out["clip_ratio/high_mean"] = high
        out["clip_ratio/region_mean"] = TrlMetric(
            torch.stack([low.value[0] + high.value[0], low.value[1]]), "masked_mean"
        )
        out["clip_ratio/low_min"] = TrlMetric(low_min, "nanmin")
        out["clip_ratio/high_max"] = TrlMetric(high_max, "nanmax")
    elif plan.loss_type == "cispo":
        if "cispo_clipped" in extra:
            out["cispo_clip_ratio"] = _masked_mean_like_trl(extra["cispo_clipped"].float(), x.mask, masked_mean)
        else:
            out["cispo_clip_ratio"] = token_mean(metrics.pg_clipfrac_high)
    elif plan.loss_type == "vespo":
        out["vespo/phi_seq_mean"] = _masked_mean_like_trl(extra["phi"], x.mask, masked_mean)
    return out


def _masked_mean_like_trl(v: torch.Tensor, mask: torch.Tensor, masked_mean) -> TrlMetric:
    """TRL's ``global_masked_mean`` local (sum, count) of a [B, 1] or [B, T] tensor."""
    if v.shape[1] == 1:
        return masked_mean(v.sum(), float(v.shape[0]))
    return masked_mean((v * mask).sum(), mask.sum())


def reduce_trl_metrics(trl_metrics: Dict[str, TrlMetric], accelerator: Any = None) -> Dict[str, float]:
    """The floats TRL appends to ``self._metrics[mode][name]``, from
    ``grpo_loss_trl(..., return_trl_metrics=True)``'s third result: each metric reduced
    across processes as TRL does, through ``accelerator`` (an ``accelerate.Accelerator``:
    ``reduce(..., reduction="sum")`` and ``gather``; None: this process only). Every
    process must call it (collectives), in the same order of names (a dict's order)."""
    out = {}
    for name, m in trl_metrics.items():
        v = m.value
        if m.reduce == "masked_mean":
            totals = accelerator.reduce(v, reduction="sum") if accelerator is not None else v
            out[name] = (totals[0] / totals[1].clamp(min=1.0)).item()
            continue
        g = accelerator.gather(v.reshape(1)) if accelerator is not None else v.reshape(1)
        if m.reduce == "nanmean":
            out[name] = g.nanmean().item()
            continue
        g = g[~torch.isnan(g)]
        if g.numel() == 0:
            out[name] = float("nan")
        else:
            out[name] = (g.min() if m.reduce == "nanmin" else g.max()).item()
    return out
