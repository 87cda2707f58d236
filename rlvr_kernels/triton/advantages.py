"""Masked group advantages in Triton (docs/advantages.md): the CUDA backend of ``group_advantages``
(contract: :mod:`rlvr_kernels.ops.advantages`; parameters:
:class:`rlvr_kernels.contracts.GroupAdvantagesParams`).

Design:
- Group membership comes from a stable sort of the per-sample keys (the group id, or
  ``num_groups`` for excluded samples) and ``searchsorted`` offsets: no atomics, so the
  statistics are bitwise reproducible.
- ``_group_stats_kernel``: one program per group walks its segment twice (mean, then
  Σ(r − μ)², min/max and the OPO / pass@k extras) — never Σr² − (Σr)²/n.
- ``_moments_kernel``: one program, fixed-order blocked float64 sums of weighted moments
  over B (batch σ, GPG's α, the whitening mean/variance).
- ``_sample_kernel`` forms A_i, ``_whiten_kernel`` whitens it, and
  ``_padded_tokens_kernel`` / ``_packed_tokens_kernel`` write A_i · m_{i,t}; the packed
  kernel finds each token's sequence by a binary search in the sanitised offsets.
- Data parallel (``group_partials``, ``group_apply``; float64 whatever the scores):
  ``_partials_kernel``, one program per group over its sorted segment, writes the rank's
  accumulators; ``_merge_kernel``, one program per group, merges the W ranks' rows in rank
  order and finishes the statistics; ``_merged_batch_kernel`` sums over the groups in a fixed
  order (batch σ, GPG's α); ``_affine_kernel`` and ``_affine_sample_kernel`` form each
  sample's A = (r − b)·f before the token kernels above.
Compute dtype ``CDT``: float64 for float64 scores, float32 otherwise (as the other Triton
kernels); token values are formed in float64 for a float64 output, else in float32.
All pointer arithmetic is int64; every load and store is masked, and indices that could
come from unvalidated input (group ids, offsets) are clamped or sanitised before they
address memory.
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._core.layout import sanitized_offsets
from ..contracts.advantages import NUM_PARTIAL_COLUMNS, Baseline, GroupAdvantagesParams, PartialColumn, Scale, Whiten

# The branch codes as constexprs the kernels compare against (contracts.advantages).
BASELINE_NONE = tl.constexpr(int(Baseline.NONE))
BASELINE_MEAN = tl.constexpr(int(Baseline.MEAN))
BASELINE_RLOO = tl.constexpr(int(Baseline.RLOO))
BASELINE_OPO = tl.constexpr(int(Baseline.OPO))
BASELINE_PASSK = tl.constexpr(int(Baseline.PASSK))
BASELINE_GPG = tl.constexpr(int(Baseline.GPG))
SCALE_NONE = tl.constexpr(int(Scale.NONE))
SCALE_GROUP = tl.constexpr(int(Scale.GROUP))
SCALE_BATCH = tl.constexpr(int(Scale.BATCH))


@triton.jit
def _divide(x, sigma, eps, EPS_IN_SQRT: tl.constexpr):
    # A zero divisor only happens with eps = 0 and all scores equal (x = 0 too): give 0.
    if EPS_IN_SQRT:
        d = tl.sqrt(sigma * sigma + eps)
    else:
        d = sigma + eps
    return tl.where(d > 0.0, x / tl.where(d > 0.0, d, 1.0), 0.0)


@triton.jit
def _passk_values(n_neg_i, n, passk_k, eps, EPS_IN_SQRT: tl.constexpr):
    """pass@k advantages (correct, incorrect) of a group with n valid samples, n_neg of them
    incorrect, in float64 (a handful of scalar flops per group): R̄ close to 1 would
    otherwise lose the small 1 − R̄ to cancellation. Written with a = 1 − R̄ = C(n_neg, k)/C(n, k)."""
    n_neg = n_neg_i.to(tl.float64)
    nd = n.to(tl.float64)
    # C(n_neg, k)/C(n, k) = Π_{j<k} (n_neg − j)/(n − j); C(a, b) = 0 when a < b.
    all_neg = nd * 0.0 + 1.0
    drop = tl.where(n_neg >= 1.0, 1.0, 0.0).to(tl.float64)  # C(n_neg − 1, k − 1)/C(n − 1, k − 1)
    for jj in range(0, passk_k):
        jf = jj * 1.0
        all_neg = all_neg * tl.maximum(n_neg - jf, 0.0) / tl.maximum(nd - jf, 1.0)
        if jj < passk_k - 1:
            drop = drop * tl.maximum(n_neg - 1.0 - jf, 0.0) / tl.maximum(nd - 1.0 - jf, 1.0)
    s = tl.sqrt(all_neg * (1.0 - all_neg))
    enough = nd >= passk_k
    eps64 = nd * 0.0 + eps
    pos = _divide(all_neg, s, eps64, EPS_IN_SQRT)
    neg = _divide(all_neg - drop, s, eps64, EPS_IN_SQRT)
    return tl.where(enough, pos, 0.0), tl.where(enough, neg, 0.0)


@triton.jit
def _group_stats_kernel(
    scores_ptr,  # [B] float, any float dtype
    order_ptr,  # [B] int64: samples sorted by group, excluded ones last
    offsets_ptr,  # [G + 1] int64: group g owns order[offsets[g]:offsets[g + 1]]
    weight_ptr,  # [B] CDT token weights (OPO), read only if HAS_WEIGHT
    mean_ptr,
    std_ptr,
    ext_a_ptr,
    ext_b_ptr,  # [G] CDT outputs
    count_ptr,  # [G] int64 output
    degenerate_ptr,  # [G] int8 output
    passk_k,
    eps,
    STD_UNBIASED: tl.constexpr,
    EPS_IN_SQRT: tl.constexpr,
    BASELINE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    CDT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    begin = tl.load(offsets_ptr + g)
    end = tl.load(offsets_ptr + g + 1)
    n = end - begin
    lanes = tl.arange(0, BLOCK)

    # Shifted by the group's first score: a constant group sums to exactly 0, so its mean
    # is exact and its A is exactly 0 (not 1 ulp over a 1-ulp σ).
    first = tl.load(order_ptr + begin, mask=n > 0, other=0)  # an empty group reads nothing
    shift = tl.load(scores_ptr + first, mask=n > 0, other=0.0).to(CDT)
    acc = tl.zeros([BLOCK], dtype=CDT)
    for start in range(begin, end, BLOCK):
        j = start + lanes
        inside = j < end
        idx = tl.load(order_ptr + j, mask=inside, other=0)
        x = tl.load(scores_ptr + idx, mask=inside, other=0.0).to(CDT)
        acc += tl.where(inside, x - shift, 0.0)
    nf = n.to(CDT)
    mu = shift + tl.sum(acc, axis=0) / tl.maximum(nf, 1.0)

    m2 = tl.zeros([BLOCK], dtype=CDT)
    lo = tl.full([BLOCK], float("inf"), CDT)
    hi = tl.full([BLOCK], float("-inf"), CDT)
    wr = tl.zeros([BLOCK], dtype=CDT)
    ws = tl.zeros([BLOCK], dtype=CDT)
    neg = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(begin, end, BLOCK):
        j = start + lanes
        inside = j < end
        idx = tl.load(order_ptr + j, mask=inside, other=0)
        x = tl.load(scores_ptr + idx, mask=inside, other=0.0).to(CDT)
        d = tl.where(inside, x - mu, 0.0)
        m2 += d * d
        lo = tl.minimum(lo, tl.where(inside, x, float("inf")))
        hi = tl.maximum(hi, tl.where(inside, x, float("-inf")))
        if BASELINE == BASELINE_OPO:  # length-weighted baseline
            if HAS_WEIGHT:
                w = tl.load(weight_ptr + idx, mask=inside, other=0.0).to(CDT)
            else:
                w = tl.where(inside, 1.0, 0.0).to(CDT)
            wr += w * x
            ws += w
        if BASELINE == BASELINE_PASSK:  # count incorrect samples (r <= 0)
            neg += (inside & (x <= 0.0)).to(tl.int32)
    m2s = tl.sum(m2, axis=0)
    if STD_UNBIASED:
        denom = nf - 1.0
    else:
        denom = nf
    sd = tl.where(denom > 0.0, tl.sqrt(m2s / tl.maximum(denom, 1.0)), 0.0)
    tl.store(mean_ptr + g, mu)
    tl.store(std_ptr + g, sd)
    tl.store(count_ptr + g, n)
    tl.store(degenerate_ptr + g, ((n == 0) | (tl.min(lo, axis=0) == tl.max(hi, axis=0))).to(tl.int8))

    if BASELINE == BASELINE_OPO:
        sw = tl.sum(ws, axis=0)
        tl.store(ext_a_ptr + g, tl.where(sw > 0.0, tl.sum(wr, axis=0) / tl.where(sw > 0.0, sw, 1.0), mu))
    if BASELINE == BASELINE_PASSK:
        pos, negv = _passk_values(tl.sum(neg, axis=0), n, passk_k, eps, EPS_IN_SQRT)
        tl.store(ext_a_ptr + g, pos.to(CDT))
        tl.store(ext_b_ptr + g, negv.to(CDT))


@triton.jit
def _moments_kernel(
    values_ptr,  # [B] float
    weight_ptr,  # [B] float weights (0 = excluded)
    out_ptr,  # [4] CDT: Σw, weighted mean, Σw(x − mean)², Σw·[x ≠ 0]
    B,
    BLOCK: tl.constexpr,
):
    # float64 accumulation: one program over B values, where fp32 sums would leave an
    # ulp-sized mean error that whitening (÷ sqrt(var + 1e-8)) amplifies.
    lanes = tl.arange(0, BLOCK)
    sw = tl.zeros([BLOCK], dtype=tl.float64)
    swx = tl.zeros([BLOCK], dtype=tl.float64)
    nz = tl.zeros([BLOCK], dtype=tl.float64)
    for start in range(0, B, BLOCK):
        i = lanes.to(tl.int64) + start
        inside = i < B
        w = tl.load(weight_ptr + i, mask=inside, other=0.0).to(tl.float64)
        # An excluded value may be NaN or inf (an unscorable sample): 0·NaN would poison the sums.
        x = tl.load(values_ptr + i, mask=inside & (w != 0.0), other=0.0).to(tl.float64)
        sw += w
        swx += w * x
        nz += tl.where(x != 0.0, w, 0.0)
    W = tl.sum(sw, axis=0)
    mean = tl.sum(swx, axis=0) / tl.where(W > 0.0, W, 1.0)
    m2 = tl.zeros([BLOCK], dtype=tl.float64)
    for start in range(0, B, BLOCK):
        i = lanes.to(tl.int64) + start
        inside = i < B
        w = tl.load(weight_ptr + i, mask=inside, other=0.0).to(tl.float64)
        x = tl.load(values_ptr + i, mask=inside & (w != 0.0), other=0.0).to(tl.float64)
        m2 += w * (x - mean) * (x - mean)
    out_dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + 0, W.to(out_dt))
    tl.store(out_ptr + 1, mean.to(out_dt))
    tl.store(out_ptr + 2, tl.sum(m2, axis=0).to(out_dt))
    tl.store(out_ptr + 3, tl.sum(nz, axis=0).to(out_dt))


@triton.jit
def _sample_kernel(
    scores_ptr,  # [B] float
    group_ptr,  # [B] int64 group ids
    ok_ptr,  # [B] int8: valid, finite and in range
    mean_ptr,
    std_ptr,
    ext_a_ptr,
    ext_b_ptr,  # [G] CDT group statistics
    count_ptr,  # [G] int64
    degenerate_ptr,  # [G] int8
    moments_ptr,  # [4] CDT from _moments_kernel over the valid scores (batch σ, GPG α)
    adv_ptr,  # [B] CDT output
    keep_ptr,  # [B] int8 output
    B,
    G,
    eps,
    BASELINE: tl.constexpr,
    SCALE: tl.constexpr,
    STD_UNBIASED: tl.constexpr,
    EPS_IN_SQRT: tl.constexpr,
    SINGLETON_RAW: tl.constexpr,
    CDT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < B
    ok = tl.load(ok_ptr + i, mask=inside, other=0) != 0
    g = tl.load(group_ptr + i, mask=inside, other=0)
    g = tl.minimum(tl.maximum(g, 0), tl.maximum(G - 1, 0))  # never address outside [0, G)
    x = tl.load(scores_ptr + i, mask=ok, other=0.0).to(CDT)
    n = tl.load(count_ptr + g, mask=ok, other=0).to(CDT)
    mu = tl.load(mean_ptr + g, mask=ok, other=0.0)
    sd = tl.load(std_ptr + g, mask=ok, other=0.0)
    deg = tl.load(degenerate_ptr + g, mask=ok, other=1) != 0

    if BASELINE == BASELINE_NONE:
        a = x
    elif BASELINE == BASELINE_PASSK:
        a = tl.where(x > 0.0, tl.load(ext_a_ptr + g, mask=ok, other=0.0), tl.load(ext_b_ptr + g, mask=ok, other=0.0))
    else:
        W = tl.load(moments_ptr + 0)
        if BASELINE == BASELINE_MEAN:
            if SCALE == SCALE_GROUP:
                a = _divide(x - mu, sd, eps, EPS_IN_SQRT)
            elif SCALE == SCALE_BATCH:
                m2 = tl.load(moments_ptr + 2)
                if STD_UNBIASED:
                    denom = W - 1.0
                else:
                    denom = W
                batch_sd = tl.where(denom > 0.0, tl.sqrt(m2 / tl.maximum(denom, 1e-30)), 0.0)
                a = _divide(x - mu, batch_sd, eps, EPS_IN_SQRT)
            else:
                a = x - mu
            if SCALE == SCALE_NONE:
                lone = x
            else:
                lone = _divide(x, 1.0, eps, EPS_IN_SQRT)  # verl's loop rule: mean 0, std 1
        elif BASELINE == BASELINE_RLOO:
            a = n / tl.maximum(n - 1.0, 1.0) * (x - mu)
            lone = x
        elif BASELINE == BASELINE_OPO:
            a = x - tl.load(ext_a_ptr + g, mask=ok, other=0.0)
            lone = x
        else:  # GPG: α = B_valid / max(#{valid r ≠ 0}, 1)
            alpha = W / tl.maximum(tl.load(moments_ptr + 3), 1.0)
            a = alpha * (x - mu)
            lone = alpha * x
        if SINGLETON_RAW:
            a = tl.where(n == 1.0, lone, a)
        else:
            a = tl.where(n == 1.0, 0.0, a)
    a = tl.where(ok, a, 0.0)
    tl.store(adv_ptr + i, a.to(CDT), mask=inside)
    tl.store(keep_ptr + i, (ok & ~deg).to(tl.int8), mask=inside)


@triton.jit
def _whiten_kernel(
    adv_ptr,  # [B] CDT, whitened in place
    weight_ptr,  # [B] CDT whitening weights
    moments_ptr,  # [4] CDT from _moments_kernel over adv
    B,
    eps,
    EPS_IN_SQRT: tl.constexpr,
    BLOCK: tl.constexpr,
    STD_UNBIASED: tl.constexpr = True,  # variance ÷(Σw − 1), else ÷Σw
    EPS_CLAMP: tl.constexpr = False,  # eps a floor of the divisor (OpenRLHF), not an addend
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < B
    W = tl.load(moments_ptr + 0)
    mean = tl.load(moments_ptr + 1)
    if STD_UNBIASED:
        var = tl.where(W > 1.0, tl.load(moments_ptr + 2) / tl.maximum(W - 1.0, 1e-30), 0.0)
    else:
        var = tl.where(W > 0.0, tl.load(moments_ptr + 2) / tl.maximum(W, 1e-30), 0.0)
    x = tl.load(adv_ptr + i, mask=inside, other=0.0)
    w = tl.load(weight_ptr + i, mask=inside, other=0.0)
    if EPS_CLAMP:
        if EPS_IN_SQRT:
            d = tl.sqrt(tl.maximum(var, eps))
        else:
            d = tl.maximum(tl.sqrt(var), eps)
        y = tl.where(d > 0.0, (x - mean) / tl.where(d > 0.0, d, 1.0), 0.0)
    else:
        y = _divide(x - mean, tl.sqrt(var), eps, EPS_IN_SQRT)
    tl.store(adv_ptr + i, tl.where(w > 0.0, y, 0.0), mask=inside)


@triton.jit
def _row_sum_kernel(
    mask_ptr,  # [B, L] padded or [T] packed mask, any dtype
    cu_ptr,  # [B + 1] int64 sanitised offsets (PACKED only)
    out_ptr,  # [B] token counts (the compute dtype)
    B,
    L,
    PACKED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if PACKED:  # sanitised: 0 <= begin <= end <= T
        begin = tl.load(cu_ptr + row)
        end = tl.load(cu_ptr + row + 1)
    else:
        begin = row * L
        end = begin + L
    acc = tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty)
    for start in range(begin, end, BLOCK):
        t = start + tl.arange(0, BLOCK)
        acc += tl.load(mask_ptr + t, mask=t < end, other=0).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


@triton.jit
def _padded_tokens_kernel(
    adv_ptr,  # [B] compute dtype
    mask_ptr,  # [B, L] contiguous, any dtype
    out_ptr,  # [B, L] contiguous, out dtype
    B,
    L,
    TDT: tl.constexpr,  # token math: float64 for a float64 output, else float32
    BLOCK_B: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
    a = tl.load(adv_ptr + rows, mask=rows < B, other=0.0).to(TDT)
    inside = (rows[:, None] < B) & (cols[None, :] < L)
    offs = rows[:, None] * L + cols[None, :]
    m = tl.load(mask_ptr + offs, mask=inside, other=0).to(TDT)
    tl.store(out_ptr + offs, a[:, None] * m, mask=inside)


@triton.jit
def _packed_tokens_kernel(
    adv_ptr,  # [B] compute dtype
    cu_ptr,  # [B + 1] int64 sanitised offsets
    mask_ptr,  # [T] mask, read only if HAS_MASK
    out_ptr,  # [T] out dtype
    B,
    T,
    HAS_MASK: tl.constexpr,
    TDT: tl.constexpr,  # token math: float64 for a float64 output, else float32
    SEARCH_STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = t < T
    # Largest i in [0, B] with cu[i] <= t; tokens before cu[0] or from cu[B] on get 0.
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + B
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        c = tl.load(cu_ptr + mid, mask=inside, other=0).to(tl.int64)
        go = c <= t
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    first = tl.load(cu_ptr + 0).to(tl.int64)
    covered = inside & (lo < B) & (t >= first)
    a = tl.load(adv_ptr + lo, mask=covered, other=0.0).to(TDT)
    if HAS_MASK:
        a = a * tl.load(mask_ptr + t, mask=covered, other=0).to(TDT)
    tl.store(out_ptr + t, a, mask=inside)


_BLOCK = 1024


def _check_shapes(
    scores, group_index, valid, lengths, response_mask, cu_seqlens, p: GroupAdvantagesParams, op="group_advantages"
):
    """The shape relations the kernels rely on (the C++ kernel's TORCH_CHECKs); returns T
    of a packed layout (else -1)."""

    def need(cond, message):
        if not cond:
            raise ValueError(f"{op}: {message}")

    need(scores.dim() == 1 and scores.is_floating_point(), f"scores must be a 1-D float tensor [B], got {scores.shape}")
    B = scores.shape[0]
    need(0 <= p.num_groups <= 2**31 - 1, f"num_groups must be in [0, 2^31 - 1], got {p.num_groups}")
    need(0 <= p.group_size <= 2**31 - 1, f"group_size must be in [0, 2^31 - 1], got {p.group_size}")
    need(p.baseline != Baseline.PASSK or p.passk_k >= 1, f"passk_k must be >= 1, got {p.passk_k}")
    if p.group_size > 0:
        need(group_index is None, "group_index must be None with group_size > 0")
        need(p.num_groups * p.group_size == B, f"num_groups x group_size must be B = {B}")
    else:
        need(group_index is not None, "group_index is required with group_size = 0")
        need(
            group_index.shape == (B,) and not group_index.is_floating_point(),
            f"group_index must be integer [B] = [{B}], got {group_index.shape}",
        )
    for name, t in (("valid", valid), ("lengths", lengths)):
        need(t is None or t.shape == (B,), f"{name} must be [B] = [{B}], got {None if t is None else t.shape}")
    if cu_seqlens is not None:
        need(cu_seqlens.shape == (B + 1,), f"cu_seqlens must be [B + 1] = [{B + 1}], got {cu_seqlens.shape}")
        need(not cu_seqlens.is_floating_point(), f"cu_seqlens must hold integers, got {cu_seqlens.dtype}")
        if response_mask is not None:
            need(response_mask.dim() == 1, f"a packed response_mask must be [T], got {response_mask.shape}")
            return response_mask.shape[0]
        need(0 <= p.num_tokens <= 2**31 - 1, f"num_tokens must be in [0, 2^31 - 1], got {p.num_tokens}")
        return p.num_tokens
    if response_mask is not None:
        need(
            response_mask.dim() == 2 and response_mask.shape[0] == B,
            f"a padded response_mask must be [B, L] with B = {B}, got {response_mask.shape}",
        )
    return -1


def group_advantages(scores, group_index, valid, lengths, response_mask, cu_seqlens, fparams, iparams, out_dtype):
    """The Triton kernels under the contract of ``rlvr_kernels_C::group_advantages``, in the
    reference's stages: token counts → group statistics → per-sample advantages (and
    whitening) → broadcast to tokens."""
    p = GroupAdvantagesParams.unpack(fparams, iparams)
    T = _check_shapes(scores, group_index, valid, lengths, response_mask, cu_seqlens, p)
    B = scores.shape[0]
    cdt_torch = torch.float64 if scores.dtype == torch.float64 else torch.float32
    # Sanitised offsets: in bounds and disjoint, whatever the input.
    cu = sanitized_offsets(cu_seqlens, T).contiguous() if cu_seqlens is not None else None

    scores, group_index, ok = _samples(scores, group_index, valid, p)

    weights = None  # token weights w_i: needed by OPO and token whitening
    if p.baseline == Baseline.OPO or p.whiten == Whiten.TOKENS:
        weights = _token_counts(B, lengths, response_mask, cu, cdt_torch)
    stats = _group_stats(scores, group_index, ok, weights, p, cdt_torch)
    adv, keep8 = _sample_advantages(scores, group_index, ok, weights, stats, p, cdt_torch)
    token_adv = _broadcast_to_tokens(adv, response_mask, cu, T, out_dtype)
    return (
        adv.to(out_dtype),
        token_adv,
        stats.mean.to(out_dtype),
        stats.sd.to(out_dtype),
        stats.count,
        stats.degenerate.bool(),
        keep8.bool(),
    )


def _samples(scores, group_index, valid, p: GroupAdvantagesParams):
    """Contiguous scores, every sample's int64 group id, and whether it counts (mask, finite
    score, id in [0, num_groups))."""
    scores = scores.contiguous()
    if p.group_size > 0:  # contiguous groups: ids are cheap to make on the device
        group_index = torch.arange(scores.shape[0], device=scores.device) // p.group_size
    group_index = group_index.long().contiguous()
    ok = torch.isfinite(scores) & (group_index >= 0) & (group_index < p.num_groups)
    if valid is not None:
        ok &= valid.bool()
    return scores, group_index, ok


def _segments(group_index, ok, G):
    """(order, offsets): a stable sort of the samples by group id (excluded ones last), group
    g owning order[offsets[g]:offsets[g + 1]], its samples in sample order."""
    key = torch.where(ok, group_index, torch.full_like(group_index, G))
    sorted_key, order = torch.sort(key, stable=True)
    offsets = torch.searchsorted(sorted_key, torch.arange(G + 1, device=key.device, dtype=sorted_key.dtype))
    return order, offsets


def _token_counts(B, lengths, response_mask, cu, cdt_torch):
    """[B] tokens per sample (reference ``token_counts``): ``lengths``, else the packed
    spans, else the mask's row sums; None without any layout (every weight 1)."""
    if lengths is not None:
        return lengths.to(cdt_torch).contiguous()
    packed = cu is not None
    if packed and response_mask is None:
        return (cu[1:] - cu[:-1]).to(cdt_torch)
    if response_mask is None or B == 0:
        return None
    weights = torch.empty(B, dtype=cdt_torch, device=response_mask.device)
    m = response_mask.contiguous()
    _row_sum_kernel[(B,)](
        m, cu if packed else weights, weights, B, 1 if packed else m.shape[1], PACKED=packed, BLOCK=_BLOCK
    )
    return weights


class _GroupStats(NamedTuple):
    mean: torch.Tensor
    sd: torch.Tensor
    ext_a: torch.Tensor  # the baseline's extra per-group values (pass@k, OPO, ...)
    ext_b: torch.Tensor
    count: torch.Tensor
    degenerate: torch.Tensor


def _group_stats(scores, group_index, ok, weights, p: GroupAdvantagesParams, cdt_torch) -> _GroupStats:
    """Per-group count, mean, std and the baseline's extras, one program per group over its
    segment of a stable sort by group id (each group's samples stay in sample order)."""
    dev, G = scores.device, p.num_groups
    cf = dict(dtype=cdt_torch, device=dev)
    order, offsets = _segments(group_index, ok, G)
    st = _GroupStats(
        mean=torch.zeros(G, **cf),
        sd=torch.zeros(G, **cf),
        ext_a=torch.zeros(G, **cf),
        ext_b=torch.zeros(G, **cf),
        count=torch.zeros(G, dtype=torch.int64, device=dev),
        degenerate=torch.ones(G, dtype=torch.int8, device=dev),
    )
    if G > 0:
        _group_stats_kernel[(G,)](
            scores,
            order,
            offsets,
            weights if weights is not None else st.mean,
            st.mean,
            st.sd,
            st.ext_a,
            st.ext_b,
            st.count,
            st.degenerate,
            int(p.passk_k),
            float(p.eps),
            STD_UNBIASED=bool(p.std_unbiased),
            EPS_IN_SQRT=bool(p.eps_in_sqrt),
            BASELINE=int(p.baseline),
            HAS_WEIGHT=weights is not None,
            CDT=_tl_dtype(cdt_torch),
            BLOCK=64,
        )
    return st


def _sample_advantages(scores, group_index, ok, weights, st: _GroupStats, p: GroupAdvantagesParams, cdt_torch):
    """(advantages [B], keep flags [B] int8): each sample against its group's statistics
    (batch moments first where the baseline or scale needs them), then whitening."""
    dev, B, G = scores.device, scores.shape[0], p.num_groups
    cf = dict(dtype=cdt_torch, device=dev)
    adv = torch.zeros(B, **cf)
    keep8 = torch.zeros(B, dtype=torch.int8, device=dev)
    if B == 0:
        return adv, keep8
    ok_f = ok.to(cdt_torch)
    moments = torch.zeros(4, **cf)
    if (p.baseline == Baseline.MEAN and p.scale == Scale.BATCH) or p.baseline == Baseline.GPG:
        _moments_kernel[(1,)](scores, ok_f, moments, B, BLOCK=_BLOCK)
    _sample_kernel[(triton.cdiv(B, _BLOCK),)](
        scores,
        group_index,
        ok.to(torch.int8),
        st.mean,
        st.sd,
        st.ext_a,
        st.ext_b,
        st.count,
        st.degenerate,
        moments,
        adv,
        keep8,
        B,
        G,
        float(p.eps),
        BASELINE=int(p.baseline),
        SCALE=int(p.scale),
        STD_UNBIASED=bool(p.std_unbiased),
        EPS_IN_SQRT=bool(p.eps_in_sqrt),
        SINGLETON_RAW=bool(p.singleton_raw),
        CDT=_tl_dtype(cdt_torch),
        BLOCK=_BLOCK,
    )
    if p.whiten != Whiten.OFF:
        wts = ok_f * weights if (p.whiten == Whiten.TOKENS and weights is not None) else ok_f
        wmom = torch.zeros(4, **cf)
        _moments_kernel[(1,)](adv, wts, wmom, B, BLOCK=_BLOCK)
        _whiten_kernel[(triton.cdiv(B, _BLOCK),)](
            adv,
            wts,
            wmom,
            B,
            float(p.whiten_eps),
            EPS_IN_SQRT=bool(p.whiten_eps_in_sqrt),
            BLOCK=_BLOCK,
            STD_UNBIASED=bool(p.whiten_std_unbiased),
            EPS_CLAMP=bool(p.whiten_eps_clamp),
        )
    return adv, keep8


def _broadcast_to_tokens(adv, response_mask, cu, T, out_dtype):
    """Token advantages (reference ``broadcast_to_tokens``): [T] packed, shaped like the
    padded mask, or empty without a layout."""
    dev, B = adv.device, adv.shape[0]
    tdt = _tl_dtype(out_dtype)
    if cu is not None:
        token_adv = torch.empty(T, dtype=out_dtype, device=dev)
        if T > 0:
            m = response_mask.contiguous() if response_mask is not None else token_adv
            _packed_tokens_kernel[(triton.cdiv(T, _BLOCK),)](
                adv,
                cu,
                m,
                token_adv,
                B,
                T,
                HAS_MASK=response_mask is not None,
                TDT=tdt,
                SEARCH_STEPS=max(1, math.ceil(math.log2(B + 1)) + 1),
                BLOCK=_BLOCK,
            )
        return token_adv
    if response_mask is None:
        return torch.empty(0, dtype=out_dtype, device=dev)
    token_adv = torch.empty(response_mask.shape, dtype=out_dtype, device=dev)
    if token_adv.numel() > 0:
        L = response_mask.shape[1]
        block_l = min(1024, max(16, triton.next_power_of_2(L)))
        block_b = max(1, 2048 // block_l)
        grid = (triton.cdiv(B, block_b), triton.cdiv(L, block_l))
        _padded_tokens_kernel[grid](
            adv, response_mask.contiguous(), token_adv, B, L, TDT=tdt, BLOCK_B=block_b, BLOCK_L=block_l
        )
    return token_adv


# ------------------------------------------------------------------ data parallel: partials and apply
# group_partials / group_apply (reference: rlvr_kernels.reference.advantages), in float64
# whatever the scores' dtype. Column c of a row of partials is PartialColumn(c).
P_N = tl.constexpr(int(PartialColumn.N))
P_FIRST = tl.constexpr(int(PartialColumn.FIRST))
P_S = tl.constexpr(int(PartialColumn.S))
P_S2 = tl.constexpr(int(PartialColumn.S2))
P_DIFFERS = tl.constexpr(int(PartialColumn.DIFFERS))
P_WX = tl.constexpr(int(PartialColumn.WX))
P_W = tl.constexpr(int(PartialColumn.W))
P_INCORRECT = tl.constexpr(int(PartialColumn.INCORRECT))
P_NONZERO = tl.constexpr(int(PartialColumn.NONZERO))
P_COLUMNS = tl.constexpr(NUM_PARTIAL_COLUMNS)


@triton.jit
def _partials_kernel(
    scores_ptr,  # [B] float
    order_ptr,  # [B] int64: samples sorted by group, excluded ones last
    offsets_ptr,  # [G + 1] int64: group g owns order[offsets[g]:offsets[g + 1]]
    weight_ptr,  # [B] float64 token weights, read only if HAS_WEIGHT
    out_ptr,  # [G, P_COLUMNS] float64 output
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    begin = tl.load(offsets_ptr + g)
    end = tl.load(offsets_ptr + g + 1)
    n = end - begin
    lanes = tl.arange(0, BLOCK)
    first = tl.load(order_ptr + begin, mask=n > 0, other=0)  # an empty group reads nothing
    x1 = tl.load(scores_ptr + first, mask=n > 0, other=0.0).to(tl.float64)
    s = tl.zeros([BLOCK], dtype=tl.float64)
    s2 = tl.zeros([BLOCK], dtype=tl.float64)
    wx = tl.zeros([BLOCK], dtype=tl.float64)
    ws = tl.zeros([BLOCK], dtype=tl.float64)
    incorrect = tl.zeros([BLOCK], dtype=tl.float64)
    nonzero = tl.zeros([BLOCK], dtype=tl.float64)
    differs = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(begin, end, BLOCK):
        j = start + lanes
        inside = j < end
        idx = tl.load(order_ptr + j, mask=inside, other=0)
        x = tl.load(scores_ptr + idx, mask=inside, other=0.0).to(tl.float64)
        d = tl.where(inside, x - x1, 0.0)
        s += d
        s2 += d * d
        differs = tl.maximum(differs, (d != 0.0).to(tl.int32))
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + idx, mask=inside, other=0.0).to(tl.float64)
            wx += w * x
            ws += w
        incorrect += tl.where(inside & (x <= 0.0), 1.0, 0.0)
        nonzero += tl.where(inside & (x != 0.0), 1.0, 0.0)
    row = out_ptr + g * P_COLUMNS
    tl.store(row + P_N, n.to(tl.float64))
    tl.store(row + P_FIRST, x1)
    tl.store(row + P_S, tl.sum(s, axis=0))
    tl.store(row + P_S2, tl.sum(s2, axis=0))
    tl.store(row + P_DIFFERS, tl.max(differs, axis=0).to(tl.float64))
    tl.store(row + P_WX, tl.sum(wx, axis=0))
    tl.store(row + P_W, tl.sum(ws, axis=0))
    tl.store(row + P_INCORRECT, tl.sum(incorrect, axis=0))
    tl.store(row + P_NONZERO, tl.sum(nonzero, axis=0))


@triton.jit
def _merge_kernel(
    partials_ptr,  # [W, G, P_COLUMNS] float64
    merged_ptr,  # [G, P_COLUMNS] float64 output: the W rows merged in rank order
    mean_ptr,
    std_ptr,
    m2_ptr,  # [G] float64 outputs
    count_ptr,  # [G] int64 output
    degenerate_ptr,  # [G] int8 output
    W,
    G,
    STD_UNBIASED: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    n = tl.zeros([1], dtype=tl.float64).sum(axis=0)
    first = n
    s = n
    s2 = n
    differs = n
    wx = n
    ws = n
    incorrect = n
    nonzero = n
    G64 = g * 0 + G  # int64 row arithmetic
    for r in range(0, W):  # rank order: the batch concatenated rank after rank
        row = partials_ptr + (r * G64 + g) * P_COLUMNS
        nb = tl.load(row + P_N)
        fb = tl.load(row + P_FIRST)
        sb = tl.load(row + P_S)
        s2b = tl.load(row + P_S2)
        db = tl.load(row + P_DIFFERS)
        # b's sums re-shifted to x₁ (Δ = x₁' − x₁); a side without samples contributes nothing.
        delta = fb - first
        both = (n > 0.0) & (nb > 0.0)
        only_b = (n == 0.0) & (nb > 0.0)
        s2 = tl.where(both, s2 + (s2b + 2.0 * delta * sb + nb * delta * delta), tl.where(only_b, s2b, s2))
        s = tl.where(both, s + (sb + nb * delta), tl.where(only_b, sb, s))
        differs = tl.where(
            both, tl.where((differs != 0.0) | (db != 0.0) | (delta != 0.0), 1.0, 0.0), tl.where(only_b, db, differs)
        )
        first = tl.where(only_b, fb, first)
        keep_b = nb > 0.0
        wx = tl.where(keep_b, wx + tl.load(row + P_WX), wx)
        ws = tl.where(keep_b, ws + tl.load(row + P_W), ws)
        incorrect = tl.where(keep_b, incorrect + tl.load(row + P_INCORRECT), incorrect)
        nonzero = tl.where(keep_b, nonzero + tl.load(row + P_NONZERO), nonzero)
        n = n + nb
    has = n > 0.0
    d = s / tl.where(has, n, 1.0)
    mu = tl.where(has, first + d, 0.0)
    m2 = tl.maximum(s2 - s * d, 0.0)
    if STD_UNBIASED:
        denom = n - 1.0
    else:
        denom = n
    sd = tl.where(denom > 0.0, tl.sqrt(m2 / tl.where(denom > 0.0, denom, 1.0)), 0.0)
    out = merged_ptr + g * P_COLUMNS
    tl.store(out + P_N, n)
    tl.store(out + P_FIRST, first)
    tl.store(out + P_S, s)
    tl.store(out + P_S2, s2)
    tl.store(out + P_DIFFERS, differs)
    tl.store(out + P_WX, wx)
    tl.store(out + P_W, ws)
    tl.store(out + P_INCORRECT, incorrect)
    tl.store(out + P_NONZERO, nonzero)
    tl.store(mean_ptr + g, mu)
    tl.store(std_ptr + g, sd)
    tl.store(m2_ptr + g, m2)
    tl.store(count_ptr + g, n.to(tl.int64))
    tl.store(degenerate_ptr + g, ((~has) | (differs == 0.0)).to(tl.int8))


@triton.jit
def _merged_batch_kernel(
    merged_ptr,  # [G, P_COLUMNS] float64
    mean_ptr,
    m2_ptr,  # [G] float64
    out_ptr,  # [2] float64 output: batch σ (Chan et al., from the groups' moments), GPG's α
    G,
    STD_UNBIASED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program: fixed-order blocked sums over the groups.
    lanes = tl.arange(0, BLOCK)
    sn = tl.zeros([BLOCK], dtype=tl.float64)
    snmu = tl.zeros([BLOCK], dtype=tl.float64)
    snz = tl.zeros([BLOCK], dtype=tl.float64)
    for start in range(0, G, BLOCK):
        k = lanes.to(tl.int64) + start
        inside = k < G
        n = tl.load(merged_ptr + k * P_COLUMNS + P_N, mask=inside, other=0.0)
        sn += n
        snmu += n * tl.load(mean_ptr + k, mask=inside, other=0.0)
        snz += tl.load(merged_ptr + k * P_COLUMNS + P_NONZERO, mask=inside, other=0.0)
    n_valid = tl.sum(sn, axis=0)
    mean = tl.sum(snmu, axis=0) / tl.where(n_valid > 0.0, n_valid, 1.0)
    total = tl.zeros([BLOCK], dtype=tl.float64)
    for start in range(0, G, BLOCK):
        k = lanes.to(tl.int64) + start
        inside = k < G
        n = tl.load(merged_ptr + k * P_COLUMNS + P_N, mask=inside, other=0.0)
        mu = tl.load(mean_ptr + k, mask=inside, other=0.0)
        total += tl.load(m2_ptr + k, mask=inside, other=0.0) + n * (mu - mean) * (mu - mean)
    if STD_UNBIASED:
        denom = n_valid - 1.0
    else:
        denom = n_valid
    ok = (n_valid > 0.0) & (denom > 0.0)
    sigma = tl.where(ok, tl.sqrt(tl.sum(total, axis=0) / tl.where(ok, denom, 1.0)), 0.0)
    tl.store(out_ptr + 0, sigma)
    tl.store(out_ptr + 1, n_valid / tl.maximum(tl.sum(snz, axis=0), 1.0))


@triton.jit
def _affine_kernel(
    merged_ptr,  # [G, P_COLUMNS] float64
    mean_ptr,
    std_ptr,  # [G] float64
    batch_ptr,  # [2] float64: batch σ, GPG's α
    eps_ptr,  # [1] float64
    b_ptr,
    f_ptr,  # [G] float64 outputs: A = (r − b)·f; pass@k: b for r > 0, else f
    G,
    passk_k,
    BASELINE: tl.constexpr,
    SCALE: tl.constexpr,
    EPS_IN_SQRT: tl.constexpr,
    SINGLETON_RAW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = k < G
    n = tl.load(merged_ptr + k * P_COLUMNS + P_N, mask=inside, other=0.0)
    mu = tl.load(mean_ptr + k, mask=inside, other=0.0)
    sd = tl.load(std_ptr + k, mask=inside, other=0.0)
    eps = tl.load(eps_ptr) + n * 0.0
    one = n * 0.0 + 1.0
    if BASELINE == BASELINE_PASSK:
        incorrect = tl.load(merged_ptr + k * P_COLUMNS + P_INCORRECT, mask=inside, other=0.0)
        b, f = _passk_values(incorrect, n, passk_k, eps, EPS_IN_SQRT)
    else:
        alpha = tl.load(batch_ptr + 1)
        b = mu
        f = one
        lone = one
        if BASELINE == BASELINE_NONE:
            b = n * 0.0
        elif BASELINE == BASELINE_MEAN:
            if SCALE == SCALE_GROUP:
                f = _divide(one, sd, eps, EPS_IN_SQRT)
            elif SCALE == SCALE_BATCH:
                f = _divide(one, tl.load(batch_ptr + 0) + n * 0.0, eps, EPS_IN_SQRT)
            if SCALE != SCALE_NONE:
                lone = _divide(one, one, eps, EPS_IN_SQRT)  # verl's loop rule: mean 0, std 1
        elif BASELINE == BASELINE_RLOO:
            f = n / tl.where(n > 1.0, n - 1.0, 1.0)
        elif BASELINE == BASELINE_OPO:  # no tokens at all: equal weights
            w = tl.load(merged_ptr + k * P_COLUMNS + P_W, mask=inside, other=0.0)
            wx = tl.load(merged_ptr + k * P_COLUMNS + P_WX, mask=inside, other=0.0)
            b = tl.where(w > 0.0, wx / tl.where(w > 0.0, w, 1.0), mu)
        else:  # GPG
            f = alpha * one
            lone = alpha * one
        if BASELINE != BASELINE_NONE:
            b = tl.where(n == 1.0, 0.0, b)
            if SINGLETON_RAW:
                f = tl.where(n == 1.0, lone, f)
            else:
                f = tl.where(n == 1.0, 0.0, f)
    tl.store(b_ptr + k, b, mask=inside)
    tl.store(f_ptr + k, f, mask=inside)


@triton.jit
def _affine_sample_kernel(
    scores_ptr,  # [B] float
    group_ptr,  # [B] int64 group ids
    ok_ptr,  # [B] int8: valid, finite and in range
    b_ptr,
    f_ptr,  # [G] float64 affine map
    degenerate_ptr,  # [G] int8
    adv_ptr,  # [B] float64 output
    keep_ptr,  # [B] int8 output
    B,
    G,
    PASSK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < B
    ok = tl.load(ok_ptr + i, mask=inside, other=0) != 0
    g = tl.load(group_ptr + i, mask=inside, other=0)
    g = tl.minimum(tl.maximum(g, 0), tl.maximum(G - 1, 0))  # never address outside [0, G)
    x = tl.load(scores_ptr + i, mask=ok, other=0.0).to(tl.float64)
    b = tl.load(b_ptr + g, mask=ok, other=0.0)
    f = tl.load(f_ptr + g, mask=ok, other=0.0)
    deg = tl.load(degenerate_ptr + g, mask=ok, other=1) != 0
    if PASSK:
        a = tl.where(x > 0.0, b, f)
    else:
        a = (x - b) * f
    tl.store(adv_ptr + i, tl.where(ok, a, 0.0), mask=inside)
    tl.store(keep_ptr + i, (ok & ~deg).to(tl.int8), mask=inside)


def group_partials(scores, group_index, valid, lengths, response_mask, cu_seqlens, fparams, iparams):
    """The Triton kernel under the contract of ``rlvr_kernels_C::group_partials``: this rank's
    ``[num_groups, 9]`` float64 partials, one program per group over its segment of a stable
    sort by group id."""
    p = GroupAdvantagesParams.unpack(fparams, iparams)
    T = _check_shapes(scores, group_index, valid, lengths, response_mask, cu_seqlens, p, op="group_partials")
    G = p.num_groups
    cu = sanitized_offsets(cu_seqlens, T).contiguous() if cu_seqlens is not None else None
    scores, group_index, ok = _samples(scores, group_index, valid, p)
    out = torch.zeros(G, NUM_PARTIAL_COLUMNS, dtype=torch.float64, device=scores.device)
    weights = None
    if p.baseline == Baseline.OPO:
        weights = _token_counts(scores.shape[0], lengths, response_mask, cu, torch.float64)
        if weights is None:  # no layout: every weight 1
            weights = torch.ones(scores.shape[0], dtype=torch.float64, device=scores.device)
    if G > 0:
        order, offsets = _segments(group_index, ok, G)
        _partials_kernel[(G,)](
            scores,
            order,
            offsets,
            weights if weights is not None else out,
            out,
            HAS_WEIGHT=weights is not None,
            BLOCK=64,
        )
    return out


def group_apply(scores, group_index, valid, lengths, response_mask, cu_seqlens, partials, fparams, iparams, out_dtype):
    """The Triton kernels under the contract of ``rlvr_kernels_C::group_apply``: W ranks'
    partials merged in rank order (one program per group), the batch scalars over the groups
    in a fixed order, each group's affine map, then each sample's advantage and the token
    broadcast."""
    p = GroupAdvantagesParams.unpack(fparams, iparams)
    T = _check_shapes(scores, group_index, valid, lengths, response_mask, cu_seqlens, p, op="group_apply")
    G = p.num_groups
    if p.whiten != Whiten.OFF:
        raise ValueError("group_apply: whiten must be OFF (whitening after the baseline needs every rank's advantages)")
    if partials.dtype != torch.float64 or partials.dim() != 3 or partials.shape[1:] != (G, NUM_PARTIAL_COLUMNS):
        raise ValueError(
            f"group_apply: partials must be float64 [W, num_groups = {G}, {NUM_PARTIAL_COLUMNS}], "
            f"got {partials.dtype} {tuple(partials.shape)}"
        )
    cu = sanitized_offsets(cu_seqlens, T).contiguous() if cu_seqlens is not None else None
    scores, group_index, ok = _samples(scores, group_index, valid, p)
    dev, B = scores.device, scores.shape[0]
    f64 = dict(dtype=torch.float64, device=dev)
    mean, sd = torch.zeros(G, **f64), torch.zeros(G, **f64)
    count = torch.zeros(G, dtype=torch.int64, device=dev)
    degenerate = torch.ones(G, dtype=torch.int8, device=dev)
    adv = torch.zeros(B, **f64)
    keep8 = torch.zeros(B, dtype=torch.int8, device=dev)
    if G > 0:
        merged = torch.empty(G, NUM_PARTIAL_COLUMNS, **f64)
        m2 = torch.empty(G, **f64)
        std_unbiased = bool(p.std_unbiased)
        W = partials.shape[0]
        _merge_kernel[(G,)](
            partials.contiguous(), merged, mean, sd, m2, count, degenerate, W, G, STD_UNBIASED=std_unbiased
        )
        batch = torch.zeros(2, **f64)
        _merged_batch_kernel[(1,)](merged, mean, m2, batch, G, STD_UNBIASED=std_unbiased, BLOCK=_BLOCK)
        b, f = torch.empty(G, **f64), torch.empty(G, **f64)
        _affine_kernel[(triton.cdiv(G, _BLOCK),)](
            merged,
            mean,
            sd,
            batch,
            torch.tensor([float(p.eps)], **f64),
            b,
            f,
            G,
            int(p.passk_k),
            BASELINE=int(p.baseline),
            SCALE=int(p.scale),
            EPS_IN_SQRT=bool(p.eps_in_sqrt),
            SINGLETON_RAW=bool(p.singleton_raw),
            BLOCK=_BLOCK,
        )
        if B > 0:
            _affine_sample_kernel[(triton.cdiv(B, _BLOCK),)](
                scores,
                group_index,
                ok.to(torch.int8),
                b,
                f,
                degenerate,
                adv,
                keep8,
                B,
                G,
                PASSK=p.baseline == Baseline.PASSK,
                BLOCK=_BLOCK,
            )
    token_adv = _broadcast_to_tokens(adv, response_mask, cu, T, out_dtype)
    return (
        adv.to(out_dtype),
        token_adv,
        mean.to(out_dtype),
        sd.to(out_dtype),
        count,
        degenerate.bool(),
        keep8.bool(),
    )


def _tl_dtype(dtype: torch.dtype):
    """The Triton compute/output type: fp64 for fp64, else fp32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def aot_specs():
    """Variants compiled ahead of time by ``python -m rlvr_kernels.triton.aot`` (see there for the
    spec format): every statistics plan, the per-sample, whitening and token kernels, in fp32 and
    (statistics and per-sample kernels) fp64 compute."""
    k = sys.modules[__name__]

    pi64, pi8 = "*i64", "*i8"
    for cdt, tag in ((tl.float32, ""), (tl.float64, ",fp64")):
        pc = "*fp64" if cdt is tl.float64 else "*fp32"
        for baseline in (Baseline.MEAN, Baseline.OPO, Baseline.PASSK):
            sig = dict(
                scores_ptr="*fp64" if cdt is tl.float64 else "*bf16",
                order_ptr=pi64,
                offsets_ptr=pi64,
                weight_ptr=pc,
                mean_ptr=pc,
                std_ptr=pc,
                ext_a_ptr=pc,
                ext_b_ptr=pc,
                count_ptr=pi64,
                degenerate_ptr=pi8,
                passk_k="i32",
                eps="fp32",
            )
            const = dict(
                STD_UNBIASED=True,
                EPS_IN_SQRT=False,
                BASELINE=int(baseline),
                HAS_WEIGHT=baseline == Baseline.OPO,
                CDT=cdt,
                BLOCK=64,
            )
            yield f"_group_stats_kernel[baseline={int(baseline)}{tag}]", k._group_stats_kernel, sig, const
        plans = ((Baseline.MEAN, Scale.GROUP), (Baseline.MEAN, Scale.BATCH), (Baseline.GPG, Scale.NONE))
        for baseline, scale in plans + ((Baseline.PASSK, Scale.NONE),):
            sig = dict(
                scores_ptr=pc,
                group_ptr=pi64,
                ok_ptr=pi8,
                mean_ptr=pc,
                std_ptr=pc,
                ext_a_ptr=pc,
                ext_b_ptr=pc,
                count_ptr=pi64,
                degenerate_ptr=pi8,
                moments_ptr=pc,
                adv_ptr=pc,
                keep_ptr=pi8,
                B="i32",
                G="i32",
                eps="fp32",
            )
            const = dict(
                BASELINE=int(baseline),
                SCALE=int(scale),
                STD_UNBIASED=True,
                EPS_IN_SQRT=False,
                SINGLETON_RAW=True,
                CDT=cdt,
                BLOCK=1024,
            )
            name = f"_sample_kernel[baseline={int(baseline)},scale={int(scale)}{tag}]"
            yield name, k._sample_kernel, sig, const
        yield (
            f"_moments_kernel{tag and '[fp64]'}",
            k._moments_kernel,
            dict(values_ptr=pc, weight_ptr=pc, out_ptr=pc, B="i32"),
            dict(BLOCK=1024),
        )
        yield (
            f"_whiten_kernel{tag and '[fp64]'}",
            k._whiten_kernel,
            dict(adv_ptr=pc, weight_ptr=pc, moments_ptr=pc, B="i32", eps="fp32"),
            dict(EPS_IN_SQRT=True, BLOCK=1024, STD_UNBIASED=True, EPS_CLAMP=False),
        )
        # OpenRLHF's whitening: population variance, eps a floor under the sqrt.
        yield (
            f"_whiten_kernel[population,clamp]{tag and '[fp64]'}",
            k._whiten_kernel,
            dict(adv_ptr=pc, weight_ptr=pc, moments_ptr=pc, B="i32", eps="fp32"),
            dict(EPS_IN_SQRT=True, BLOCK=1024, STD_UNBIASED=False, EPS_CLAMP=True),
        )
    p32 = "*fp32"
    for packed in (False, True):
        sig = dict(mask_ptr=p32, cu_ptr=pi64, out_ptr=p32, B="i32", L="i32")
        yield f"_row_sum_kernel[packed={packed}]", k._row_sum_kernel, sig, dict(PACKED=packed, BLOCK=1024)
    for mask in ("*fp32", "*i1"):
        sig = dict(adv_ptr=p32, mask_ptr=mask, out_ptr=p32, B="i32", L="i32")
        const = dict(TDT=tl.float32, BLOCK_B=2, BLOCK_L=1024)
        yield f"_padded_tokens_kernel[mask={mask}]", k._padded_tokens_kernel, sig, const
    sig = dict(adv_ptr="*fp64", mask_ptr="*fp32", out_ptr="*fp64", B="i32", L="i32")
    const = dict(TDT=tl.float64, BLOCK_B=2, BLOCK_L=1024)
    yield "_padded_tokens_kernel[fp64]", k._padded_tokens_kernel, sig, const
    sig = dict(adv_ptr=p32, cu_ptr=pi64, mask_ptr="*i1", out_ptr="*bf16", B="i32", T="i64")
    const = dict(HAS_MASK=True, TDT=tl.float32, SEARCH_STEPS=14, BLOCK=1024)
    yield "_packed_tokens_kernel", k._packed_tokens_kernel, sig, const
    # data parallel: partials and apply (float64)
    p64 = "*fp64"
    for weights in (False, True):
        sig = dict(scores_ptr=p32, order_ptr=pi64, offsets_ptr=pi64, weight_ptr=p64, out_ptr=p64)
        const = dict(HAS_WEIGHT=weights, BLOCK=64)
        yield f"_partials_kernel[weights={weights}]", k._partials_kernel, sig, const
    sig = dict(
        partials_ptr=p64,
        merged_ptr=p64,
        mean_ptr=p64,
        std_ptr=p64,
        m2_ptr=p64,
        count_ptr=pi64,
        degenerate_ptr=pi8,
        W="i32",
        G="i32",
    )
    yield "_merge_kernel", k._merge_kernel, sig, dict(STD_UNBIASED=True)
    sig = dict(merged_ptr=p64, mean_ptr=p64, m2_ptr=p64, out_ptr=p64, G="i32")
    yield "_merged_batch_kernel", k._merged_batch_kernel, sig, dict(STD_UNBIASED=True, BLOCK=1024)
    for baseline, scale in plans + ((Baseline.OPO, Scale.NONE), (Baseline.PASSK, Scale.NONE)):
        sig = dict(
            merged_ptr=p64,
            mean_ptr=p64,
            std_ptr=p64,
            batch_ptr=p64,
            eps_ptr=p64,
            b_ptr=p64,
            f_ptr=p64,
            G="i32",
            passk_k="i32",
        )
        const = dict(BASELINE=int(baseline), SCALE=int(scale), EPS_IN_SQRT=False, SINGLETON_RAW=True, BLOCK=1024)
        yield f"_affine_kernel[baseline={int(baseline)},scale={int(scale)}]", k._affine_kernel, sig, const
    for passk in (False, True):
        sig = dict(
            scores_ptr=p32,
            group_ptr=pi64,
            ok_ptr=pi8,
            b_ptr=p64,
            f_ptr=p64,
            degenerate_ptr=pi8,
            adv_ptr=p64,
            keep_ptr=pi8,
            B="i32",
            G="i32",
        )
        const = dict(PASSK=passk, BLOCK=1024)
        yield f"_affine_sample_kernel[passk={passk}]", k._affine_sample_kernel, sig, const
