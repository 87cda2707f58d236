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

import dataclasses
from typing import Any, Dict, NamedTuple, Optional

import torch

from ..._core.validation import FLOAT_DTYPES, check_tensor
from ...contracts.policy_loss import entropy_quantile_threshold
from ...ops.advantages import group_advantages
from ...options import PolicyLossMetrics
from .._backend import current_backend
from .._errors import caller_names
from ._grpo_loss import (
    CLIPPED,
    TRL_LOSS_TYPES,
    LossInputs,
    LossPlan,
    check_inputs,
    entropy_bonus,
    fused_loss,
    make_plan,
)
from ._names import ADV_NAMES, LOSS_NAMES

__all__ = [
    "compute_grpo_advantages",
    "grpo_loss_trl",
    "reduce_trl_metrics",
    "trl_entropy_threshold",
    "TrlMetric",
    "TRL_LOSS_TYPES",
]

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
# The GRPO loss (GRPOTrainer._compute_loss); its pieces are in _grpo_loss
# ---------------------------------------------------------------------------------------


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
    plan = make_plan(
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
    x = check_inputs(
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
    if plan.shaping is not None and x.threshold is None:
        threshold = trl_entropy_threshold(entropies, completion_mask, plan.top_q, plan.process_group)
        x = dataclasses.replace(x, threshold=threshold.detach().reshape(()).float())
    with caller_names(LOSS_NAMES):
        loss, metrics, extra = fused_loss(x, plan, validate, backend)
    policy_loss_value = loss.detach()
    if plan.post != 1.0:
        loss = loss / plan.post
    if plan.entropy_coef != 0.0:
        loss = loss - plan.entropy_coef * entropy_bonus(x.entropies, x.mask, x.threshold, plan)
    if not return_trl_metrics:
        return loss, metrics
    return loss, metrics, _trl_metric_values(metrics, plan, x, extra, policy_loss_value)


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


def _trl_metric_values(metrics: PolicyLossMetrics, plan: LossPlan, x: LossInputs, extra, policy_loss_value):
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
    if plan.loss_type in CLIPPED:
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
