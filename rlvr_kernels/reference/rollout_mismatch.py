"""The spec of ``rollout_mismatch`` (docs/rollout-mismatch.md) in plain torch, fp64-capable.

Stages, mirrored by the C++ and Triton kernels:
  1. :func:`valid_tokens` — each valid token's Δ = train − rollout, train, rollout and its
     sequence id, for the padded ``[B, L]`` and the packed ``[T]`` layouts alike;
  2. :func:`sequence_sums` — per sequence: valid count, Σ Δ, Σ |Δ|, max |Δ|, Σ train, Σ rollout;
  3. :func:`token_metrics` — the means, extrema and fractions over the valid tokens;
  4. :func:`sequence_metrics` — the means and extrema over the B sequences.
Computed in float32 (float64 when an input is float64), like the kernels.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .._core.layout import compute_dtype, sanitized_offsets
from ..contracts.rollout_mismatch import LOG_RATIO_BOUND, MismatchOut, RolloutMismatch


def valid_tokens(
    train: torch.Tensor,
    rollout: torch.Tensor,
    mask: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(delta, train, rollout, seq_id)`` of the valid tokens (1-D, in token order) and B.
    Padded: row b is sequence b. Packed: sequence b covers ``[cu'[b], cu'[b+1])`` of the
    sanitised offsets (``_core.layout``); tokens outside every span are not valid."""
    cdt = compute_dtype(torch.promote_types(train.dtype, rollout.dtype))
    if cu_seqlens is None:
        B, L = train.shape
        seq = torch.arange(B, device=train.device).repeat_interleave(L)
    else:
        T = train.shape[0]
        cu = sanitized_offsets(cu_seqlens, T)
        B = cu.numel() - 1
        seq = torch.searchsorted(cu, torch.arange(T, device=train.device), right=True) - 1
    keep = (seq >= 0) & (seq < B)
    if mask is not None:
        keep &= mask.reshape(-1) != 0
    tr, ro = train.reshape(-1)[keep].to(cdt), rollout.reshape(-1)[keep].to(cdt)
    return tr - ro, tr, ro, seq[keep], B


def sequence_sums(delta, train, rollout, seq, B) -> Dict[str, torch.Tensor]:
    """Per-sequence ``[B]`` sums over the valid tokens (0 for a sequence without one)."""

    def total(v):
        return torch.zeros(B, dtype=delta.dtype, device=delta.device).index_add_(0, seq, v)

    count = torch.zeros(B, dtype=torch.int64, device=delta.device).index_add_(0, seq, torch.ones_like(seq))
    abs_max = torch.zeros(B, dtype=delta.dtype, device=delta.device)
    abs_max.scatter_reduce_(0, seq, delta.abs(), reduce="amax", include_self=True)
    return dict(
        count=count,
        delta=total(delta),
        abs=total(delta.abs()),
        abs_max=abs_max,
        train=total(train),
        rollout=total(rollout),
    )


def token_metrics(delta: torch.Tensor, ratio_low: float, ratio_high: float) -> Dict[MismatchOut, torch.Tensor]:
    """The token-level entries of :class:`MismatchOut` over the N valid tokens (N > 0)."""
    ratio = torch.exp(delta)
    low, high = (ratio < ratio_low).to(delta.dtype), (ratio > ratio_high).to(delta.dtype)
    # verl's chi2_token: ρ from the clamped log-ratio, squared.
    rho = torch.exp(delta.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return {
        MismatchOut.ABS_DIFF_MEAN: delta.abs().mean(),
        MismatchOut.ABS_DIFF_MAX: delta.abs().max(),
        MismatchOut.K1: (-delta).mean(),
        MismatchOut.K2: (0.5 * delta.square()).mean(),
        MismatchOut.K3: (ratio - delta - 1).mean(),
        MismatchOut.RATIO_MEAN: ratio.mean(),
        MismatchOut.RATIO_MIN: ratio.min(),
        MismatchOut.RATIO_MAX: ratio.max(),
        MismatchOut.RATIO_FRAC_LOW: low.mean(),
        MismatchOut.RATIO_FRAC_HIGH: high.mean(),
        MismatchOut.RATIO_FRAC_OUTSIDE: (low + high).mean(),
        MismatchOut.CHI2_TOKEN: rho.square().mean() - 1,
    }


def sequence_metrics(sums: Dict[str, torch.Tensor]) -> Dict[MismatchOut, torch.Tensor]:
    """The sequence-level entries of :class:`MismatchOut`, over all B sequences (B > 0)."""
    n = sums["count"].to(sums["delta"].dtype)

    def mean(v):  # a sequence's mean over its valid tokens, 0 without one (verl's masked_mean)
        return torch.where(n > 0, v / n.clamp(min=1), torch.zeros_like(v))

    # verl's mean(rollout) − mean(train), formed from Σ Δ (no cancellation of two large sums).
    log_ppl_diff = -mean(sums["delta"])
    train_log_ppl, rollout_log_ppl = -mean(sums["train"]), -mean(sums["rollout"])
    seq_ratio = torch.exp(sums["delta"])
    chi2 = torch.exp(2 * sums["delta"].clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return {
        MismatchOut.SEQ_ABS_DIFF_MEAN: mean(sums["abs"]).mean(),
        MismatchOut.LOG_PPL_DIFF: log_ppl_diff.mean(),
        MismatchOut.LOG_PPL_ABS_DIFF: log_ppl_diff.abs().mean(),
        MismatchOut.LOG_PPL_DIFF_MAX: log_ppl_diff.max(),
        MismatchOut.LOG_PPL_DIFF_MIN: log_ppl_diff.min(),
        MismatchOut.PPL_RATIO: torch.exp(log_ppl_diff).mean(),
        MismatchOut.CHI2_SEQ: chi2.mean() - 1,
        MismatchOut.TRAINING_PPL: torch.exp(train_log_ppl).mean(),
        MismatchOut.TRAINING_LOG_PPL: train_log_ppl.mean(),
        MismatchOut.ROLLOUT_PPL: torch.exp(rollout_log_ppl).mean(),
        MismatchOut.ROLLOUT_LOG_PPL: rollout_log_ppl.mean(),
        MismatchOut.SEQ_RATIO_MEAN: seq_ratio.mean(),
        MismatchOut.SEQ_RATIO_MIN: seq_ratio.min(),
        MismatchOut.SEQ_RATIO_MAX: seq_ratio.max(),
    }


def rollout_mismatch(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    ratio_bounds: Tuple[float, float] = (1 / 1.1, 1.1),
) -> RolloutMismatch:
    """The metrics of docs/rollout-mismatch.md: every entry 0 when no token is valid."""
    delta, train, rollout, seq, B = valid_tokens(
        train_logprobs.detach(), rollout_logprobs.detach(), response_mask, cu_seqlens
    )
    sums = sequence_sums(delta, train, rollout, seq, B)
    zero = delta.new_zeros(())
    out = dict.fromkeys(MismatchOut, zero)
    if delta.numel():
        out.update(token_metrics(delta, *ratio_bounds))
        out.update(sequence_metrics(sums))
    n = sums["count"].to(delta.dtype)
    per_seq = torch.where(n > 0, sums["abs"] / n.clamp(min=1), torch.zeros_like(n))
    return RolloutMismatch(
        sums["count"].sum(),
        *(out[m] for m in MismatchOut),
        per_seq,
        sums["abs_max"],
        sums["delta"],
    )
