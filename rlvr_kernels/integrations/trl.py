"""Drop-ins for TRL's GRPO computations (TRL 1.16), built on the fused ops.

TRL computes advantages inline in ``GRPOTrainer._generate_and_score_completions`` and in
the async rollout worker, and the loss inline in ``GRPOTrainer._compute_loss``; these
functions are those computations as functions, matching them to 1e-6
(tests/advantages/test_peers_trl.py and tests/policy_loss/test_peers_trl.py run TRL's own code on
the same inputs). Groups are contiguous: rows ``[k·G, (k+1)·G)`` are the G completions
of prompt k.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..ops._validation import checks_enabled
from ..ops.advantages import group_advantages
from ..ops.logprobs import logprobs_from_logits
from ..ops.policy_loss import policy_loss
from ..options import PolicyLossMetrics, TokenShaping, resolve_policy_loss_options
from ..reference.policy_loss import entropy_quantile_threshold

__all__ = [
    "compute_grpo_advantages",
    "compute_async_grpo_advantages",
    "grpo_loss_trl",
    "selective_log_softmax",
    "entropy_from_logits",
    "selective_log_softmax_and_entropy",
]


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
    whitened over the batch. Rows where every function gave NaN get 0.
    """
    if multi_objective_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
        raise ValueError(
            "multi_objective_aggregation: expected 'sum_then_normalize' or 'normalize_then_sum', "
            f"got {multi_objective_aggregation!r}"
        )
    # TRL's result has the dtype of `rewards_per_func * reward_weights` (float32 weights by default).
    out_dtype = torch.promote_types(
        rewards_per_func.dtype, reward_weights.dtype if reward_weights is not None else torch.float32
    )
    if multi_objective_aggregation == "normalize_then_sum":
        out = group_advantages(
            rewards_per_func,
            group_size=num_generations,
            preset="trl",
            estimator="gdpo",
            reward_weights=reward_weights,
            out_dtype=out_dtype,
        )
    else:
        estimator = "dr_grpo" if scale_rewards == "none" else "grpo"
        scale = None if scale_rewards == "none" else scale_rewards
        out = group_advantages(
            rewards_per_func,
            group_size=num_generations,
            preset="trl",
            estimator=estimator,
            scale=scale,
            reward_weights=reward_weights,
            out_dtype=out_dtype,
        )
    return out.advantages


def compute_async_grpo_advantages(rewards_per_func: torch.Tensor, num_generations: int) -> torch.Tensor:
    """TRL AsyncGRPO's rollout-worker advantages: per group, (r − mean)/(std + 1e-8) with
    the population std over the scorable completions; unscorable ones get 0."""
    # The worker works in float64 (`np.array(all_rewards, dtype=float)`), the sum over reward
    # functions included: a float32 sum can merge two rewards that TRL tells apart.
    rewards_per_func = rewards_per_func.to(torch.float64)
    return group_advantages(rewards_per_func, group_size=num_generations, preset="trl_async").advantages


# ---------------------------------------------------------------------------------------
# The GRPO loss (GRPOTrainer._compute_loss)
# ---------------------------------------------------------------------------------------

TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# GSPO's log s_i clamp (10 in verl) is off for TRL: a bound no finite mean log-ratio reaches.
_NO_GSPO_CLAMP = 1e30


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
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    top_entropy_quantile: float = 1.0,
    entropies: Optional[torch.Tensor] = None,
    entropy_coef: float = 0.0,
    importance_sampling_ratio: Optional[torch.Tensor] = None,
    max_completion_length: Optional[int] = None,
    num_items_in_batch=None,
    gradient_accumulation_steps: int = 1,
    num_processes: int = 1,
    steps_per_generation: int = 1,
    training: bool = True,
    validate: bool = True,
    backend: str = "auto",
) -> Tuple[torch.Tensor, PolicyLossMetrics]:
    """The loss ``GRPOTrainer._compute_loss`` returns (value and gradient), from the
    tensors it has, in one fused ``policy_loss`` call (preset "trl": no δ clamp, k3 KL
    without clamps, no clamp of GSPO's log s).

    Arguments are TRL's names (``GRPOConfig`` fields and ``_compute_loss`` locals):
    ``completion_mask`` is TRL's ``mask`` (``completion_mask * tool_mask`` when tools are
    used); ``advantages`` ``[B]``, ``[B, 1]`` or ``[B, T]``; ``old_per_token_logps=None``
    means ``per_token_logps.detach()`` as TRL; ``epsilon_low`` is ``GRPOConfig.epsilon``
    and ``epsilon_high`` defaults to it; ``gradient_accumulation_steps`` is TRL's
    ``current_gradient_accumulation_steps``; ``training=False`` is TRL's eval mode (no
    accumulation scaling); ``entropy_coef`` is the coefficient TRL applies this step
    (``apply_coef``, for the adaptive controller too).

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
      * ``beta`` → k3 to ``ref_per_token_logps``, unclamped; ``top_entropy_quantile`` < 1
        → ``TokenShaping(entropy_quantile=top_entropy_quantile)`` (the pg term only on
        tokens at or above the batch's (1 − q) entropy quantile, torch.quantile's rule).
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

    Not supported (NotImplementedError): loss_type "vespo", cispo/sapo at sequence level,
    ``delta`` at sequence level or below 1 + ε_high, ``top_entropy_quantile`` < 1 with
    ``num_processes`` > 1 (TRL's threshold is over all ranks), and TRL's
    ``off_policy_mask_threshold`` / ``use_bias_correction_kl`` (no arguments for them).

    Returns ``(loss, metrics)``: metrics from the kernel (detached 0-d tensors, this
    process only). TRL's "kl" = ``metrics.kl``, "entropy" = ``metrics.entropy_mean``,
    "clip_ratio/region_mean" = ``metrics.pg_clipfrac`` at token level (TRL takes a
    per-sequence mean at sequence level; with zeros in ``importance_sampling_ratio`` our
    clip fractions leave those tokens out); TRL's "policy_loss" = ``metrics.pg_loss +
    beta · metrics.kl_loss``.
    """
    if loss_type not in TRL_LOSS_TYPES:
        raise NotImplementedError(f"loss_type: rlvr_kernels fuses TRL's {TRL_LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(
            f"importance_sampling_level: expected 'token' or 'sequence', got {importance_sampling_level!r}"
        )
    eps_low = float(epsilon_low)
    eps_high = eps_low if epsilon_high is None else float(epsilon_high)
    seq_level = importance_sampling_level == "sequence"
    B = per_token_logps.shape[0]
    accum = gradient_accumulation_steps if training else 1

    fields = {}
    if loss_type in _CLIPPED:
        fields.update(loss_type="gspo" if seq_level else "ppo", clip_low=eps_low, clip_high=eps_high)
        if delta is not None:
            if seq_level:
                raise NotImplementedError("delta: TRL's two-sided clipping at sequence level is not fused")
            if not delta >= 1 + eps_high or not delta > 1:
                raise NotImplementedError(
                    f"delta: fused as the dual clip only when delta >= 1 + epsilon_high (= {1 + eps_high}), got {delta}"
                )
            fields["clip_ratio_c"] = float(delta)
        if seq_level:
            fields["gspo_log_clamp"] = _NO_GSPO_CLAMP
    elif seq_level:
        raise NotImplementedError(
            f"importance_sampling_level='sequence' with loss_type={loss_type!r} is not fused "
            "(only the clipped GRPO family maps to GSPO)"
        )
    elif loss_type == "cispo":
        if eps_high < 1:
            raise NotImplementedError(
                f"epsilon_high: CISPO's clamp(ρ, max=epsilon_high) is fused for epsilon_high >= 1, got {eps_high}"
            )
        fields.update(loss_type="cispo", clip_low=1.0, clip_high=eps_high - 1.0)
    else:  # sapo
        fields.update(loss_type="sapo", tau_pos=float(sapo_temperature_pos), tau_neg=float(sapo_temperature_neg))

    if beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError("ref_per_token_logps: beta != 0 needs the reference log-probs")
        fields.update(kl="k3", kl_coef=float(beta))
    shaping = None
    if top_entropy_quantile < 1.0:
        if entropies is None:
            raise ValueError("entropies: top_entropy_quantile < 1 needs the per-token entropies")
        if num_processes > 1:
            raise NotImplementedError(
                "top_entropy_quantile: TRL's threshold is the quantile over all processes' "
                "tokens; the fused op takes this process's tokens only"
            )
        shaping = TokenShaping(entropy_quantile=float(top_entropy_quantile))
        fields["shaping"] = shaping

    # Aggregation and TRL's normalisers.
    kw = {}
    post = float(accum)
    if loss_type in ("grpo", "sapo"):
        fields["agg"], kw["global_num_seqs"] = "seq-mean-token-mean", B
    elif loss_type == "bnpo":
        fields["agg"] = "token-mean"
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("max_completion_length: loss_type='dr_grpo' divides by B · max_completion_length")
        fields["agg"] = "seq-mean-token-sum-norm"
        kw.update(global_num_seqs=B, loss_scale_factor=max_completion_length)
    elif loss_type == "luspo":
        fields["agg"], kw["global_num_seqs"] = "seq-mean-token-sum", B
    else:  # dapo, cispo
        if num_items_in_batch is None:
            raise ValueError(f"num_items_in_batch: loss_type={loss_type!r} normalises by it")
        if isinstance(num_items_in_batch, torch.Tensor):
            normalizer = num_items_in_batch.clamp(min=1.0) / num_processes
        else:
            normalizer = max(num_items_in_batch, 1.0) / num_processes
        if training:
            normalizer = normalizer * gradient_accumulation_steps / steps_per_generation
        fields["agg"], kw["global_num_tokens"] = "token-mean", normalizer
        post = 1.0

    adv = advantages
    if adv.dim() == 2 and adv.shape[1] == 1 and adv.shape != per_token_logps.shape:
        adv = adv[:, 0]
    if importance_sampling_ratio is not None:
        adv = _fold_ratio(adv, importance_sampling_ratio, per_token_logps.shape, completion_mask, validate)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps

    # Sequence level with a pg multiplier that varies inside a sequence (token advantages,
    # a token IS ratio, the entropy mask): TRL's gradient reaches every token through the
    # sequence mean, so it is the token form's gradient averaged over the sequence's tokens.
    spread = seq_level and (adv.dim() == 2 or shaping is not None)
    if spread and beta != 0.0:  # the KL gradient stays per token: its own call
        kl_fields = {k: v for k, v in fields.items() if k in ("agg", "kl", "kl_coef")}
        kl_opts = resolve_policy_loss_options("trl", loss_type="reinforce", **kl_fields)
        fields.pop("kl"), fields.pop("kl_coef")
    opts = resolve_policy_loss_options("trl", **fields)
    logps = _SequenceMeanGrad.apply(per_token_logps, completion_mask) if spread else per_token_logps
    loss, metrics = policy_loss(
        logps,
        old,
        adv,
        completion_mask,
        options=opts,
        ref_logprobs=ref_per_token_logps if "kl" in fields else None,
        entropy=entropies,
        validate=validate,
        backend=backend,
        **kw,
    )
    if spread and beta != 0.0:
        zeros = torch.zeros(B, dtype=torch.float32, device=per_token_logps.device)
        kl_loss, kl_metrics = policy_loss(
            per_token_logps,
            old,
            zeros,
            completion_mask,
            options=kl_opts,
            ref_logprobs=ref_per_token_logps,
            validate=validate,
            backend=backend,
            **kw,
        )
        loss = loss + kl_loss
        metrics = metrics._replace(kl_loss=kl_metrics.kl_loss, kl=kl_metrics.kl)
    if post != 1.0:
        loss = loss / post
    if entropy_coef != 0.0:
        if entropies is None:
            raise ValueError("entropies: entropy_coef != 0 needs the per-token entropies")
        eff = completion_mask != 0
        if shaping is not None:
            thr = entropy_quantile_threshold(entropies, eff, shaping.entropy_quantile)
            eff = eff & (entropies.detach().float() >= thr)
        effm = eff.to(entropies.dtype)
        bonus = (entropies * effm).sum() / effm.sum().clamp(min=1.0) / accum
        loss = loss - entropy_coef * bonus
    return loss, metrics


def _fold_ratio(adv: torch.Tensor, ratio: torch.Tensor, shape, mask, validate) -> torch.Tensor:
    """A · ratio, with TRL's broadcasting ([B, 1] per sequence, [B, T] per token)."""
    if not isinstance(ratio, torch.Tensor):
        raise TypeError(f"importance_sampling_ratio: expected a torch.Tensor, got {type(ratio).__name__}")
    B = shape[0]
    r = ratio.detach()
    if checks_enabled(validate) and r.numel() and bool((~(r >= 0) & (mask != 0).reshape(shape)).any()):
        raise ValueError(
            "importance_sampling_ratio: expected ratios >= 0 on valid tokens (the fold into the "
            "advantages is exact for non-negative ratios only)"
        )
    if r.dim() == 2 and r.shape[1] == 1 and tuple(r.shape) != tuple(shape):
        r = r[:, 0]
    if r.dim() == 1 and r.shape[0] == B and tuple(r.shape) != tuple(shape):
        return (adv * r) if adv.dim() == 1 else adv * r[:, None]
    if tuple(r.shape) != tuple(shape):
        raise ValueError(
            f"importance_sampling_ratio: expected [B, T] = {tuple(shape)} or [B, 1], got {tuple(ratio.shape)}"
        )
    return (adv[:, None] if adv.dim() == 1 else adv) * r


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


# ------------------------------------------------------------------ log-probs
def _row_targets(logits, index, row_mask):
    if index.dim() != logits.dim() - 1:
        raise NotImplementedError(
            f"index: only one target per position (shape {tuple(logits.shape[:-1])}) is supported, got "
            f"{tuple(index.shape)}; gather several log-probs with logits.log_softmax(-1) instead"
        )
    if row_mask is not None:
        index = torch.where(row_mask.to(torch.bool), index, torch.full_like(index, -100))
    return index


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0, row_mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """TRL ``trainer.utils.selective_log_softmax``: log-softmax of ``logits / temperature``
    gathered at ``index`` (shape ``logits.shape[:-1]``), in the logits' dtype; positions
    where ``row_mask`` is 0 give 0. Computed in fp32 in one pass over each row."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    logp = logprobs_from_logits(logits, _row_targets(logits, index, row_mask), temperature)
    return logp.to(logits.dtype)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """TRL ``trainer.utils.entropy_from_logits``: the entropy of every row of ``logits``, in
    the logits' dtype (``chunk_size`` is accepted and unused: nothing ``[N, V]`` is built)."""
    ignored = torch.full(logits.shape[:-1], -100, dtype=torch.int64, device=logits.device)
    _, entropy = logprobs_from_logits(logits, ignored, return_entropy=True)
    return entropy.to(logits.dtype)


def selective_log_softmax_and_entropy(
    logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0, row_mask: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both of the above from one read of the logits (what ``GRPOTrainer`` computes when it
    needs entropies), fp32. Entropies are computed on every row, masked or not."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    return logprobs_from_logits(logits, _row_targets(logits, index, row_mask), temperature, return_entropy=True)
