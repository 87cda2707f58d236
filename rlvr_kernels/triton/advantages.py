"""Masked group advantages in Triton (SPEC §1): the CUDA backend.

Design:
- Group membership comes from a stable sort of the per-sample keys (the group id, or
  ``num_groups`` for excluded samples) and ``searchsorted`` offsets: no atomics, so the
  statistics are bitwise reproducible.
- ``_group_stats_kernel``: one program per group walks its segment twice (mean, then
  Σ(r − μ)², min/max and the OPO / pass@k extras) in fp32 — never Σr² − (Σr)²/n.
- ``_moments_kernel``: one program, fixed-order blocked sums of weighted moments over B
  (batch σ, GPG's α, the whitening mean/variance).
- ``_sample_kernel`` forms A_i, ``_whiten_kernel`` whitens it, and
  ``_padded_tokens_kernel`` / ``_packed_tokens_kernel`` write A_i · m_{i,t}; the packed
  kernel finds each token's sequence by a binary search in ``cu_seqlens``.
All pointer arithmetic is int64; every load and store is masked, and indices that could
come from unvalidated input (group ids, offsets) are clamped before they address memory.
"""

from __future__ import annotations

import math
import sys

import torch
import triton
import triton.language as tl

# Must match rlvr_kernels/ops/advantages.py (BASELINE, SCALE, WHITEN).
NONE, MEAN, RLOO, OPO, GPG, PASSK = 0, 1, 2, 3, 4, 5
SCALE_NONE, SCALE_GROUP, SCALE_BATCH = 0, 1, 2
WHITEN_OFF, WHITEN_TOKENS, WHITEN_SAMPLES = 0, 1, 2


@triton.jit
def _divide(x, sigma, eps, EPS_IN_SQRT: tl.constexpr):
    # A zero divisor only happens with eps = 0 and all scores equal (x = 0 too): give 0.
    if EPS_IN_SQRT:
        d = tl.sqrt(sigma * sigma + eps)
    else:
        d = sigma + eps
    return tl.where(d > 0.0, x / tl.where(d > 0.0, d, 1.0), 0.0)


@triton.jit
def _group_stats_kernel(
    scores_ptr,  # [B] float, any float dtype
    order_ptr,  # [B] int64: samples sorted by group, excluded ones last
    offsets_ptr,  # [G + 1] int64: group g owns order[offsets[g]:offsets[g + 1]]
    weight_ptr,  # [B] fp32 token weights (OPO), read only if HAS_WEIGHT
    mean_ptr,
    std_ptr,
    ext_a_ptr,
    ext_b_ptr,  # [G] fp32 outputs
    count_ptr,  # [G] int64 output
    degenerate_ptr,  # [G] int8 output
    passk_k,
    eps,
    STD_UNBIASED: tl.constexpr,
    EPS_IN_SQRT: tl.constexpr,
    BASELINE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
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
    shift = tl.load(scores_ptr + first, mask=n > 0, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(begin, end, BLOCK):
        j = start + lanes
        inside = j < end
        idx = tl.load(order_ptr + j, mask=inside, other=0)
        x = tl.load(scores_ptr + idx, mask=inside, other=0.0).to(tl.float32)
        acc += tl.where(inside, x - shift, 0.0)
    nf = n.to(tl.float32)
    mu = shift + tl.sum(acc, axis=0) / tl.maximum(nf, 1.0)

    m2 = tl.zeros([BLOCK], dtype=tl.float32)
    lo = tl.full([BLOCK], float("inf"), tl.float32)
    hi = tl.full([BLOCK], float("-inf"), tl.float32)
    wr = tl.zeros([BLOCK], dtype=tl.float32)
    ws = tl.zeros([BLOCK], dtype=tl.float32)
    neg = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(begin, end, BLOCK):
        j = start + lanes
        inside = j < end
        idx = tl.load(order_ptr + j, mask=inside, other=0)
        x = tl.load(scores_ptr + idx, mask=inside, other=0.0).to(tl.float32)
        d = tl.where(inside, x - mu, 0.0)
        m2 += d * d
        lo = tl.minimum(lo, tl.where(inside, x, float("inf")))
        hi = tl.maximum(hi, tl.where(inside, x, float("-inf")))
        if BASELINE == 3:  # OPO: length-weighted baseline
            if HAS_WEIGHT:
                w = tl.load(weight_ptr + idx, mask=inside, other=0.0)
            else:
                w = tl.where(inside, 1.0, 0.0)
            wr += w * x
            ws += w
        if BASELINE == 5:  # pass@k: count incorrect samples (r <= 0)
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

    if BASELINE == 3:
        sw = tl.sum(ws, axis=0)
        tl.store(ext_a_ptr + g, tl.where(sw > 0.0, tl.sum(wr, axis=0) / tl.where(sw > 0.0, sw, 1.0), mu))
    if BASELINE == 5:
        # In float64 (a handful of scalar flops per group): R̄ close to 1 would otherwise
        # lose the small 1 − R̄ to cancellation. Written with a = 1 − R̄ = C(n_neg, k)/C(n, k).
        n_neg = tl.sum(neg, axis=0).to(tl.float64)
        nd = nf.to(tl.float64)
        # C(n_neg, k)/C(n, k) = Π_{j<k} (n_neg − j)/(n − j); C(a, b) = 0 when a < b.
        all_neg = nd * 0.0 + 1.0
        drop = tl.where(n_neg >= 1.0, 1.0, 0.0).to(tl.float64)  # C(n_neg − 1, k − 1)/C(n − 1, k − 1)
        for jj in range(0, passk_k):
            jf = jj * 1.0
            all_neg = all_neg * tl.maximum(n_neg - jf, 0.0) / tl.maximum(nd - jf, 1.0)
            if jj < passk_k - 1:
                drop = drop * tl.maximum(n_neg - 1.0 - jf, 0.0) / tl.maximum(nd - 1.0 - jf, 1.0)
        s = tl.sqrt(all_neg * (1.0 - all_neg))
        enough = nf >= passk_k
        eps64 = nd * 0.0 + eps
        pos = _divide(all_neg, s, eps64, EPS_IN_SQRT).to(tl.float32)
        negv = _divide(all_neg - drop, s, eps64, EPS_IN_SQRT).to(tl.float32)
        tl.store(ext_a_ptr + g, tl.where(enough, pos, 0.0))
        tl.store(ext_b_ptr + g, tl.where(enough, negv, 0.0))


@triton.jit
def _moments_kernel(
    values_ptr,  # [B] float
    weight_ptr,  # [B] fp32 weights (0 = excluded)
    out_ptr,  # [4] fp32: Σw, weighted mean, Σw(x − mean)², Σw·[x ≠ 0]
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
        x = tl.load(values_ptr + i, mask=inside, other=0.0).to(tl.float64)
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
        x = tl.load(values_ptr + i, mask=inside, other=0.0).to(tl.float64)
        m2 += w * (x - mean) * (x - mean)
    tl.store(out_ptr + 0, W.to(tl.float32))
    tl.store(out_ptr + 1, mean.to(tl.float32))
    tl.store(out_ptr + 2, tl.sum(m2, axis=0).to(tl.float32))
    tl.store(out_ptr + 3, tl.sum(nz, axis=0).to(tl.float32))


@triton.jit
def _sample_kernel(
    scores_ptr,  # [B] float
    group_ptr,  # [B] int64 group ids
    ok_ptr,  # [B] int8: valid, finite and in range
    mean_ptr,
    std_ptr,
    ext_a_ptr,
    ext_b_ptr,  # [G] fp32 group statistics
    count_ptr,  # [G] int64
    degenerate_ptr,  # [G] int8
    moments_ptr,  # [4] fp32 from _moments_kernel over the valid scores (batch σ, GPG α)
    adv_ptr,  # [B] fp32 output
    keep_ptr,  # [B] int8 output
    B,
    G,
    eps,
    BASELINE: tl.constexpr,
    SCALE: tl.constexpr,
    STD_UNBIASED: tl.constexpr,
    EPS_IN_SQRT: tl.constexpr,
    SINGLETON_RAW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < B
    ok = tl.load(ok_ptr + i, mask=inside, other=0) != 0
    g = tl.load(group_ptr + i, mask=inside, other=0)
    g = tl.minimum(tl.maximum(g, 0), tl.maximum(G - 1, 0))  # never address outside [0, G)
    x = tl.load(scores_ptr + i, mask=ok, other=0.0).to(tl.float32)
    n = tl.load(count_ptr + g, mask=ok, other=0).to(tl.float32)
    mu = tl.load(mean_ptr + g, mask=ok, other=0.0)
    sd = tl.load(std_ptr + g, mask=ok, other=0.0)
    deg = tl.load(degenerate_ptr + g, mask=ok, other=1) != 0

    if BASELINE == 0:
        a = x
    elif BASELINE == 5:
        a = tl.where(x > 0.0, tl.load(ext_a_ptr + g, mask=ok, other=0.0), tl.load(ext_b_ptr + g, mask=ok, other=0.0))
    else:
        W = tl.load(moments_ptr + 0)
        if BASELINE == 1:
            if SCALE == 1:
                a = _divide(x - mu, sd, eps, EPS_IN_SQRT)
            elif SCALE == 2:
                m2 = tl.load(moments_ptr + 2)
                if STD_UNBIASED:
                    denom = W - 1.0
                else:
                    denom = W
                batch_sd = tl.where(denom > 0.0, tl.sqrt(m2 / tl.maximum(denom, 1e-30)), 0.0)
                a = _divide(x - mu, batch_sd, eps, EPS_IN_SQRT)
            else:
                a = x - mu
            if SCALE == 0:
                lone = x
            else:
                lone = _divide(x, 1.0, eps, EPS_IN_SQRT)  # verl's loop rule: mean 0, std 1
        elif BASELINE == 2:
            a = n / tl.maximum(n - 1.0, 1.0) * (x - mu)
            lone = x
        elif BASELINE == 3:
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
    tl.store(adv_ptr + i, a, mask=inside)
    tl.store(keep_ptr + i, (ok & ~deg).to(tl.int8), mask=inside)


@triton.jit
def _whiten_kernel(
    adv_ptr,  # [B] fp32, whitened in place
    weight_ptr,  # [B] fp32 whitening weights
    moments_ptr,  # [4] fp32 from _moments_kernel over adv
    B,
    eps,
    EPS_IN_SQRT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < B
    W = tl.load(moments_ptr + 0)
    mean = tl.load(moments_ptr + 1)
    var = tl.where(W > 1.0, tl.load(moments_ptr + 2) / tl.maximum(W - 1.0, 1e-30), 0.0)
    x = tl.load(adv_ptr + i, mask=inside, other=0.0)
    w = tl.load(weight_ptr + i, mask=inside, other=0.0)
    y = _divide(x - mean, tl.sqrt(var), eps, EPS_IN_SQRT)
    tl.store(adv_ptr + i, tl.where(w > 0.0, y, 0.0), mask=inside)


@triton.jit
def _row_sum_kernel(
    mask_ptr,  # [B, L] padded or [T] packed mask, any dtype
    cu_ptr,  # [B + 1] offsets (PACKED only)
    out_ptr,  # [B] fp32 token counts
    B,
    L,
    T,
    PACKED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if PACKED:
        begin = tl.minimum(tl.maximum(tl.load(cu_ptr + row).to(tl.int64), 0), T)
        end = tl.minimum(tl.maximum(tl.load(cu_ptr + row + 1).to(tl.int64), begin), T)
    else:
        begin = row * L
        end = begin + L
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(begin, end, BLOCK):
        t = start + tl.arange(0, BLOCK)
        acc += tl.load(mask_ptr + t, mask=t < end, other=0).to(tl.float32)
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


@triton.jit
def _padded_tokens_kernel(
    adv_ptr,  # [B] fp32
    mask_ptr,  # [B, L] contiguous, any dtype
    out_ptr,  # [B, L] contiguous, out dtype
    B,
    L,
    BLOCK_B: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
    a = tl.load(adv_ptr + rows, mask=rows < B, other=0.0)
    inside = (rows[:, None] < B) & (cols[None, :] < L)
    offs = rows[:, None] * L + cols[None, :]
    m = tl.load(mask_ptr + offs, mask=inside, other=0).to(tl.float32)
    tl.store(out_ptr + offs, a[:, None] * m, mask=inside)


@triton.jit
def _packed_tokens_kernel(
    adv_ptr,  # [B] fp32
    cu_ptr,  # [B + 1] int32/int64 offsets
    mask_ptr,  # [T] mask, read only if HAS_MASK
    out_ptr,  # [T] out dtype
    B,
    T,
    HAS_MASK: tl.constexpr,
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
    a = tl.load(adv_ptr + lo, mask=covered, other=0.0)
    if HAS_MASK:
        a = a * tl.load(mask_ptr + t, mask=covered, other=0).to(tl.float32)
    tl.store(out_ptr + t, a, mask=inside)


_BLOCK = 1024


def group_advantages_triton(
    scores,
    group_index,
    num_groups,
    group_size,
    valid,
    lengths,
    response_mask,
    cu_seqlens,
    num_tokens,
    baseline,
    scale,
    std_unbiased,
    eps,
    eps_in_sqrt,
    singleton_raw,
    passk_k,
    whiten,
    whiten_eps,
    whiten_eps_in_sqrt,
    out_dtype,
):
    """Same contract as the C++ kernel ``rlvr_kernels_C::group_advantages``."""
    dev = scores.device
    B, G = scores.shape[0], num_groups
    f32 = dict(dtype=torch.float32, device=dev)
    packed = cu_seqlens is not None
    has_layout = packed or response_mask is not None
    if packed:
        T = response_mask.shape[0] if response_mask is not None else max(num_tokens, 0)
        token_adv = torch.empty(T, dtype=out_dtype, device=dev)
    elif response_mask is not None:
        token_adv = torch.empty(response_mask.shape, dtype=out_dtype, device=dev)
    else:
        token_adv = torch.empty(0, dtype=out_dtype, device=dev)

    scores = scores.contiguous()
    if group_size > 0:  # contiguous groups: ids are cheap to make on the device
        group_index = torch.arange(B, device=dev) // group_size
    group_index = group_index.contiguous()
    in_range = (group_index >= 0) & (group_index < G)
    ok = torch.isfinite(scores) & in_range
    if valid is not None:
        ok &= valid
    ok8 = ok.to(torch.int8)

    # Token weights w_i: needed by OPO and token whitening.
    weights = None
    if baseline == OPO or whiten == WHITEN_TOKENS:
        if lengths is not None:
            weights = lengths.to(torch.float32).contiguous()
        elif packed and response_mask is None:
            cu = cu_seqlens.long().clamp(0, token_adv.shape[0])
            weights = (cu[1:] - torch.minimum(cu[:-1], cu[1:])).to(torch.float32)
        elif has_layout and B > 0:
            weights = torch.empty(B, **f32)
            m = response_mask.contiguous()
            L = 1 if packed else m.shape[1]
            cu = cu_seqlens.contiguous() if packed else weights  # unused when not packed
            _row_sum_kernel[(B,)](
                m, cu, weights, B, L, token_adv.shape[0] if packed else 0, PACKED=packed, BLOCK=_BLOCK
            )

    # Segments: a stable sort keeps each group's samples in sample order.
    key = torch.where(ok, group_index, torch.full_like(group_index, G))
    sorted_key, order = torch.sort(key, stable=True)
    offsets = torch.searchsorted(sorted_key, torch.arange(G + 1, device=dev, dtype=sorted_key.dtype))

    mean = torch.zeros(G, **f32)
    sd = torch.zeros(G, **f32)
    ext_a = torch.zeros(G, **f32)
    ext_b = torch.zeros(G, **f32)
    count = torch.zeros(G, dtype=torch.int64, device=dev)
    degenerate = torch.ones(G, dtype=torch.int8, device=dev)
    if G > 0:
        _group_stats_kernel[(G,)](
            scores,
            order,
            offsets,
            weights if weights is not None else mean,
            mean,
            sd,
            ext_a,
            ext_b,
            count,
            degenerate,
            int(passk_k),
            float(eps),
            STD_UNBIASED=bool(std_unbiased),
            EPS_IN_SQRT=bool(eps_in_sqrt),
            BASELINE=int(baseline),
            HAS_WEIGHT=weights is not None,
            BLOCK=64,
        )

    moments = torch.zeros(4, **f32)
    adv = torch.zeros(B, **f32)
    keep8 = torch.zeros(B, dtype=torch.int8, device=dev)
    if B > 0:
        ok_f = ok.to(torch.float32)
        if (baseline == MEAN and scale == SCALE_BATCH) or baseline == GPG:
            _moments_kernel[(1,)](scores, ok_f, moments, B, BLOCK=_BLOCK)
        _sample_kernel[(triton.cdiv(B, _BLOCK),)](
            scores,
            group_index,
            ok8,
            mean,
            sd,
            ext_a,
            ext_b,
            count,
            degenerate,
            moments,
            adv,
            keep8,
            B,
            G,
            float(eps),
            BASELINE=int(baseline),
            SCALE=int(scale),
            STD_UNBIASED=bool(std_unbiased),
            EPS_IN_SQRT=bool(eps_in_sqrt),
            SINGLETON_RAW=bool(singleton_raw),
            BLOCK=_BLOCK,
        )
        if whiten != WHITEN_OFF:
            wts = ok_f * weights if (whiten == WHITEN_TOKENS and weights is not None) else ok_f
            wmom = torch.zeros(4, **f32)
            _moments_kernel[(1,)](adv, wts, wmom, B, BLOCK=_BLOCK)
            _whiten_kernel[(triton.cdiv(B, _BLOCK),)](
                adv, wts, wmom, B, float(whiten_eps), EPS_IN_SQRT=bool(whiten_eps_in_sqrt), BLOCK=_BLOCK
            )

    if has_layout and token_adv.numel() > 0:
        if packed:
            T = token_adv.shape[0]
            steps = max(1, math.ceil(math.log2(B + 1)) + 1)
            m = response_mask.contiguous() if response_mask is not None else token_adv
            _packed_tokens_kernel[(triton.cdiv(T, _BLOCK),)](
                adv,
                cu_seqlens.contiguous(),
                m,
                token_adv,
                B,
                T,
                HAS_MASK=response_mask is not None,
                SEARCH_STEPS=steps,
                BLOCK=_BLOCK,
            )
        else:
            L = response_mask.shape[1]
            block_l = min(1024, max(16, triton.next_power_of_2(L)))
            block_b = max(1, 2048 // block_l)
            grid = (triton.cdiv(B, block_b), triton.cdiv(L, block_l))
            _padded_tokens_kernel[grid](
                adv, response_mask.contiguous(), token_adv, B, L, BLOCK_B=block_b, BLOCK_L=block_l
            )

    return (
        adv.to(out_dtype),
        token_adv,
        mean.to(out_dtype),
        sd.to(out_dtype),
        count,
        degenerate.bool(),
        keep8.bool(),
    )


def aot_specs():
    """Variants compiled ahead of time by ``python -m rlvr_kernels.triton.aot`` (see there for the
    spec format): every statistics plan, the per-sample, whitening and token kernels."""
    k = sys.modules[__name__]

    p32, pi64, pi8 = "*fp32", "*i64", "*i8"
    for baseline in (k.MEAN, k.OPO, k.PASSK):
        sig = dict(
            scores_ptr="*bf16",
            order_ptr=pi64,
            offsets_ptr=pi64,
            weight_ptr=p32,
            mean_ptr=p32,
            std_ptr=p32,
            ext_a_ptr=p32,
            ext_b_ptr=p32,
            count_ptr=pi64,
            degenerate_ptr=pi8,
            passk_k="i32",
            eps="fp32",
        )
        const = dict(STD_UNBIASED=True, EPS_IN_SQRT=False, BASELINE=baseline, HAS_WEIGHT=baseline == k.OPO, BLOCK=64)
        yield f"_group_stats_kernel[baseline={baseline}]", k._group_stats_kernel, sig, const
    yield (
        "_moments_kernel",
        k._moments_kernel,
        dict(values_ptr=p32, weight_ptr=p32, out_ptr=p32, B="i32"),
        dict(BLOCK=1024),
    )
    for baseline, scale in ((k.MEAN, k.SCALE_GROUP), (k.MEAN, k.SCALE_BATCH), (k.GPG, k.SCALE_NONE), (k.PASSK, 0)):
        sig = dict(
            scores_ptr=p32,
            group_ptr=pi64,
            ok_ptr=pi8,
            mean_ptr=p32,
            std_ptr=p32,
            ext_a_ptr=p32,
            ext_b_ptr=p32,
            count_ptr=pi64,
            degenerate_ptr=pi8,
            moments_ptr=p32,
            adv_ptr=p32,
            keep_ptr=pi8,
            B="i32",
            G="i32",
            eps="fp32",
        )
        const = dict(
            BASELINE=baseline, SCALE=scale, STD_UNBIASED=True, EPS_IN_SQRT=False, SINGLETON_RAW=True, BLOCK=1024
        )
        yield f"_sample_kernel[baseline={baseline},scale={scale}]", k._sample_kernel, sig, const
    yield (
        "_whiten_kernel",
        k._whiten_kernel,
        dict(adv_ptr=p32, weight_ptr=p32, moments_ptr=p32, B="i32", eps="fp32"),
        dict(EPS_IN_SQRT=True, BLOCK=1024),
    )
    for packed in (False, True):
        sig = dict(mask_ptr=p32, cu_ptr=pi64, out_ptr=p32, B="i32", L="i32", T="i64")
        yield f"_row_sum_kernel[packed={packed}]", k._row_sum_kernel, sig, dict(PACKED=packed, BLOCK=1024)
    for mask in ("*fp32", "*i1"):
        sig = dict(adv_ptr=p32, mask_ptr=mask, out_ptr=p32, B="i32", L="i32")
        yield f"_padded_tokens_kernel[mask={mask}]", k._padded_tokens_kernel, sig, dict(BLOCK_B=2, BLOCK_L=1024)
    sig = dict(adv_ptr=p32, cu_ptr="*i32", mask_ptr="*i1", out_ptr="*bf16", B="i32", T="i64")
    yield "_packed_tokens_kernel", k._packed_tokens_kernel, sig, dict(HAS_MASK=True, SEARCH_STEPS=14, BLOCK=1024)
