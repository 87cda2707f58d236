"""Fused GRPO-family policy loss in Triton (SPEC §2, §4): the CUDA backend of
``rlvr_kernels.ops.policy_loss`` (the kernel contract is that module's docstring; the
exact math is ``rlvr_kernels.reference.policy_loss``).

Design:
- Work unit = one block of ``_TOKEN_BLOCK`` tokens of ONE sequence, so every
  per-sequence value (a [B] advantage, GSPO's log s_i, the sequence IS weight, A3PO
  thresholds, n_i) is a scalar load per program, and B = 64 × L = 8192 gives 512
  programs. Padded [B, L]: program p is block p % NBL of row p // NBL. Packed [T]: the
  B sequences plus a head [0, cu[0]) and a tail [cu[B], T) segment (written as zeros) are
  cut into blocks by ``_block_offsets_kernel`` (a device-side cumsum of per-segment block
  counts, no host sync); the launch is the upper bound cdiv(T, BLOCK) + B + 2 and a
  program finds its segment by binary search (surplus programs are idle). Valid
  ``cu_seqlens`` cover each token exactly once.
- ``_token_kernel``: the single pass of the common case (ppo + k3 + token_tis + token
  mean, [B] advantages): every input read once, the gradient written once, and one row
  of per-program partial sums. Options are constexpr, so unused features compile away.
- ``_seq_stats_kernel`` (one program per sequence), only when needed: n_i
  (seq-mean-token-mean), Σ δ·m (GSPO), Σ log w·m (seq_tis / seq_mis) and the A3PO
  selection: the k-th highest / lowest metric by bisection on an order-preserving int64
  image of the fp64 metric (≤ 64 passes, both knobs in lockstep), then one running-cumsum
  pass over the candidates equal to the threshold for the tie cut (lower index first).
  The token kernel recomputes the metric bitwise identically and selects
  ``key > K or (key == K and t < cut)``.
- ``_finalize_kernel``: one program sums the partial rows in a fixed order in fp64
  (no atomics: bitwise reproducible) and counts the sequences with n_i > 0.
Numerics follow the reference: compute in fp64 for fp64 inputs, else fp32; shaping
weights in fp64, rounded once; torch's derivative conventions (clamp passes the gradient
on the closed interval; maximum / minimum split it in half on ties). Hyper-parameters are
fp64 kernel arguments rounded in-kernel to the compute dtype, as torch rounds a Python
scalar to the tensor's dtype. Every load and store is masked and cu_seqlens offsets are
clamped to [0, T], so no input makes a kernel leave its buffers. (Overlapping sequences —
an invalid cu_seqlens that validation rejects — may hold more blocks than the launch
bound; those tokens' outputs are then left unwritten.)
Cost outside the common case: the per-sequence pass is one program per sequence, and an
A3PO sequence takes up to ~67 passes over its tokens (the bisection); a3po is a rarely
used option, so this favours exactness and simplicity over speed.
"""

from __future__ import annotations

import math
import sys

import torch
import triton
import triton.language as tl

from ..ops.policy_loss import (
    F_A3PO,
    F_CLIP_C,
    F_CLIP_HI,
    F_CLIP_LO,
    F_ENT_COEF,
    F_GSPO_CLAMP,
    F_KL_COEF,
    F_LOG_RATIO_CLAMP,
    F_PROB_LAMBDA,
    F_RC_HIGH,
    F_RC_LOW,
    F_TAU_NEG,
    F_TAU_POS,
    F_W_NEG,
    F_W_POS,
    I_A3PO_METRIC,
    I_A3PO_ON,
    I_ENT_QUANTILE,
    I_KL,
    I_KL_CLAMP,
    I_LOSS_TYPE,
    I_RC,
    I_SEQ_ADV,
    I_SEQ_MEAN,
    I_TOKEN_OUT,
    NUM_SUMS,
    S_CLIP,
    S_CLIP_LOWER,
    S_ENT,
    S_IS,
    S_IS_MAX,
    S_KL,
    S_KL_RAW,
    S_NEG_DELTA,
    S_NONFINITE,
    S_NSEQ,
    S_NTOK,
    S_PG,
    S_REJECT,
    S_SHAPED,
    S_TOTAL,
)

# Loss / KL / rollout-correction codes (rlvr_kernels/ops/policy_loss.py LOSS_CODES, ...).
PPO, GSPO, CISPO, SAPO, REINFORCE = 0, 1, 2, 3, 4
K1, K2, K3, K3PLUS = 1, 2, 3, 4
TOKEN_TIS, SEQ_TIS, TOKEN_MIS, SEQ_MIS, DECOUPLED = 1, 2, 3, 4, 5

# Triton kernels may only read module globals that are constexpr.
_NP = tl.constexpr(16)  # columns of a partial-sums row (NUM_SUMS = 15, padded)
_C_TOTAL = tl.constexpr(S_TOTAL)
_C_PG = tl.constexpr(S_PG)
_C_KL = tl.constexpr(S_KL)
_C_NTOK = tl.constexpr(S_NTOK)
_C_NSEQ = tl.constexpr(S_NSEQ)
_C_CLIP = tl.constexpr(S_CLIP)
_C_CLIP_LOWER = tl.constexpr(S_CLIP_LOWER)
_C_NEG_DELTA = tl.constexpr(S_NEG_DELTA)
_C_KL_RAW = tl.constexpr(S_KL_RAW)
_C_IS = tl.constexpr(S_IS)
_C_IS_MAX = tl.constexpr(S_IS_MAX)
_C_REJECT = tl.constexpr(S_REJECT)
_C_SHAPED = tl.constexpr(S_SHAPED)
_C_ENT = tl.constexpr(S_ENT)
_C_NONFINITE = tl.constexpr(S_NONFINITE)
_C_NUM_SUMS = tl.constexpr(NUM_SUMS)
_NSTAT = tl.constexpr(4)  # per-sequence stats row: n_i, log s_i (gspo), Σ log w·m (seq IS), unused
_NA3 = tl.constexpr(5)  # per-sequence A3PO row: polarity, K_high, cut_high, K_low, cut_low
_I64_MAX = tl.constexpr(0x7FFFFFFFFFFFFFFF)
_I64_MIN = tl.constexpr(-0x7FFFFFFFFFFFFFFF - 1)


@triton.jit
def _param(x, DT: tl.constexpr):
    # x is an fp64 kernel argument (a Python float under the interpreter); one rounding
    # to DT, as torch rounds a Python scalar to a tensor's dtype.
    return (tl.zeros([], tl.float64) + x).to(DT)


@triton.jit
def _segment(cu_ptr, seg, B, T, ok):
    """[begin, end) of packed segment ``seg``: 0 = head [0, cu[0]), 1..B = sequence seg − 1,
    B + 1 = tail [cu[B], T); offsets clamped to [0, T], a decreasing pair is empty."""
    lo_raw = tl.load(cu_ptr + tl.minimum(tl.maximum(seg - 1, 0), B), mask=ok, other=0)
    hi_raw = tl.load(cu_ptr + tl.minimum(tl.maximum(seg, 0), B), mask=ok, other=0)
    begin = tl.where(seg == 0, 0, tl.minimum(tl.maximum(lo_raw, 0), T))
    end = tl.where(seg == B + 1, T, tl.minimum(tl.maximum(hi_raw, begin), T))
    return begin, end


@triton.jit
def _a3po_metric(old, ent, METRIC_ENT: tl.constexpr):
    # The reference ranks exp(old) (or the entropy) in fp64: same rounding, same ties.
    if METRIC_ENT:
        m = ent.to(tl.float64)
    else:
        m = tl.exp(old.to(tl.float64))
    return m


@triton.jit
def _order_key(x):
    # int64 with the order of the fp64 values (negative floats: flip the magnitude bits).
    bits = x.to(tl.int64, bitcast=True)
    return bits ^ ((bits >> 63) & _I64_MAX)


@triton.jit
def _block_offsets_kernel(
    cu_ptr,  # [B + 1] int64
    boff_ptr,  # [B + 3] int64 output: segment s owns programs [boff[s], boff[s + 1])
    B,
    T,
    TOKEN_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    nseg = B + 2
    tl.store(boff_ptr + lanes, tl.zeros([BLOCK], tl.int64), mask=lanes == 0)
    carry = tl.zeros([], tl.int64)
    for start in range(0, nseg, BLOCK):
        seg = start + lanes
        inside = seg < nseg
        begin, end = _segment(cu_ptr, seg, B, T, inside)
        nb = tl.where(inside, (end - begin + TOKEN_BLOCK - 1) // TOKEN_BLOCK, 0)
        tl.store(boff_ptr + 1 + seg, carry + tl.cumsum(nb, 0), mask=inside)
        carry += tl.sum(nb, 0)


@triton.jit
def _seq_stats_kernel(
    logp_ptr,
    old_ptr,  # token-shaped, input dtype
    adv_ptr,  # [B] or token-shaped, compute dtype
    mask_ptr,  # token-shaped bool (HAS_MASK)
    roll_ptr,
    ent_ptr,  # token-shaped, input dtype (NEED_LOGW / A3PO entropy metric)
    cu_ptr,  # [B + 1] int64 (PACKED)
    seqf_ptr,  # [B, 4] compute dtype output: n_i, log s_i, Σ log w·m
    a3po_ptr,  # [B, 5] int64 output (A3PO): polarity, K_high, cut_high, K_low, cut_low
    B,
    L,
    T,
    r_pos_high: tl.float64,
    s_pos_high: tl.float64,
    r_pos_low: tl.float64,
    s_pos_low: tl.float64,
    r_neg_high: tl.float64,
    s_neg_high: tl.float64,
    r_neg_low: tl.float64,
    s_neg_low: tl.float64,
    CDT: tl.constexpr,
    PACKED: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SEQ_ADV: tl.constexpr,
    NEED_DELTA: tl.constexpr,
    NEED_LOGW: tl.constexpr,
    A3PO: tl.constexpr,
    A3PO_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    if PACKED:
        begin, end = _segment(cu_ptr, i + 1, B, T, True)
    else:
        begin = i * L
        end = begin + L
    lanes = tl.arange(0, BLOCK)

    acc_n = tl.zeros([BLOCK], tl.int32)
    acc_d = tl.zeros([BLOCK], CDT)
    acc_w = tl.zeros([BLOCK], CDT)
    acc_a = tl.zeros([BLOCK], tl.float64)
    acc_c = tl.zeros([BLOCK], tl.int32)
    kmin = tl.full([BLOCK], _I64_MAX, tl.int64)
    kmax = tl.full([BLOCK], _I64_MIN, tl.int64)
    for start in range(begin, end, BLOCK):
        t = start + lanes
        inside = t < end
        valid = inside
        if HAS_MASK:
            valid = valid & tl.load(mask_ptr + t, mask=inside, other=0).to(tl.int1)
        acc_n += valid.to(tl.int32)
        old = tl.load(old_ptr + t, mask=inside, other=0.0).to(CDT)
        if NEED_DELTA:  # GSPO: the sequence mean of the unclamped δ
            lp = tl.load(logp_ptr + t, mask=inside, other=0.0).to(CDT)
            acc_d += tl.where(valid, lp - old, 0.0)
        if NEED_LOGW:
            roll = tl.load(roll_ptr + t, mask=inside, other=0.0).to(CDT)
            acc_w += tl.where(valid, old - roll, 0.0)
        if A3PO:
            if not SEQ_ADV:
                adv = tl.load(adv_ptr + t, mask=inside, other=0.0).to(tl.float64)
                acc_a += tl.where(valid, adv, 0.0)
            ent = old
            if A3PO_ENT:
                ent = tl.load(ent_ptr + t, mask=inside, other=0.0).to(CDT)
            metric = _a3po_metric(old, ent, A3PO_ENT)
            cand = valid & (metric != 0.0)
            key = _order_key(metric)
            acc_c += cand.to(tl.int32)
            kmin = tl.minimum(kmin, tl.where(cand, key, _I64_MAX))
            kmax = tl.maximum(kmax, tl.where(cand, key, _I64_MIN))
    n = tl.sum(acc_n, 0)
    nf = n.to(CDT)
    tl.store(seqf_ptr + i * _NSTAT + 0, nf)
    if NEED_DELTA:
        tl.store(seqf_ptr + i * _NSTAT + 1, tl.sum(acc_d, 0) / tl.maximum(nf, 1.0))
    if NEED_LOGW:
        tl.store(seqf_ptr + i * _NSTAT + 2, tl.sum(acc_w, 0))

    if A3PO:
        # Polarity = sign of Σ_t A·m in fp64 (a [B] advantage: A_i · n_i).
        if SEQ_ADV:
            pol = tl.load(adv_ptr + i).to(tl.float64) * n.to(tl.float64)
        else:
            pol = tl.sum(acc_a, 0)
        pos = pol > 0.0
        neg = pol < 0.0
        r_h = tl.where(pos, _param(r_pos_high, tl.float64), _param(r_neg_high, tl.float64))
        s_h = tl.where(pos, _param(s_pos_high, tl.float64), _param(s_neg_high, tl.float64))
        r_l = tl.where(pos, _param(r_pos_low, tl.float64), _param(r_neg_low, tl.float64))
        s_l = tl.where(pos, _param(s_pos_low, tl.float64), _param(s_neg_low, tl.float64))
        ncand = tl.sum(acc_c, 0)
        has = (pos | neg) & (ncand > 0)
        on_h = has & (r_h > 0.0) & (s_h != 1.0)
        on_l = has & (r_l > 0.0) & (s_l != 1.0)
        nc64 = ncand.to(tl.float64)
        k_h = tl.maximum((nc64 * r_h).to(tl.int64), 1)  # max(1, ⌊n·ratio⌋), Python's int()
        k_l = tl.maximum((nc64 * r_l).to(tl.int64), 1)
        key_lo = tl.min(kmin, 0)
        key_hi = tl.max(kmax, 0)
        # high: K_h = max{K : #(key ≥ K) ≥ k_h}; low: K_l = min{K : #(key ≤ K) ≥ k_l}.
        lo_h = key_lo
        hi_h = tl.where(on_h, key_hi, key_lo)
        lo_l = tl.where(on_l, key_lo, key_hi)
        hi_l = key_hi
        while (lo_h < hi_h) | (lo_l < hi_l):
            mid_h = (lo_h | hi_h) - ((lo_h ^ hi_h) >> 1)  # ⌈(lo + hi)/2⌉ without overflow
            mid_l = (lo_l & hi_l) + ((lo_l ^ hi_l) >> 1)  # ⌊(lo + hi)/2⌋
            c_h = tl.zeros([BLOCK], tl.int32)
            c_l = tl.zeros([BLOCK], tl.int32)
            for start in range(begin, end, BLOCK):
                t = start + lanes
                inside = t < end
                valid = inside
                if HAS_MASK:
                    valid = valid & tl.load(mask_ptr + t, mask=inside, other=0).to(tl.int1)
                old = tl.load(old_ptr + t, mask=inside, other=0.0).to(CDT)
                ent = old
                if A3PO_ENT:
                    ent = tl.load(ent_ptr + t, mask=inside, other=0.0).to(CDT)
                metric = _a3po_metric(old, ent, A3PO_ENT)
                cand = valid & (metric != 0.0)
                key = _order_key(metric)
                c_h += (cand & (key >= mid_h)).to(tl.int32)
                c_l += (cand & (key <= mid_l)).to(tl.int32)
            ok_h = tl.sum(c_h, 0) >= k_h
            ok_l = tl.sum(c_l, 0) >= k_l
            run_h = lo_h < hi_h
            run_l = lo_l < hi_l
            lo_h = tl.where(run_h & ok_h, mid_h, lo_h)
            hi_h = tl.where(run_h & ~ok_h, mid_h - 1, hi_h)
            hi_l = tl.where(run_l & ok_l, mid_l, hi_l)
            lo_l = tl.where(run_l & ~ok_l, mid_l + 1, lo_l)
        # Ties at the threshold: the r = k − #(strictly beyond) lowest-index ones.
        g_h = tl.zeros([BLOCK], tl.int32)
        g_l = tl.zeros([BLOCK], tl.int32)
        for start in range(begin, end, BLOCK):
            t = start + lanes
            inside = t < end
            valid = inside
            if HAS_MASK:
                valid = valid & tl.load(mask_ptr + t, mask=inside, other=0).to(tl.int1)
            old = tl.load(old_ptr + t, mask=inside, other=0.0).to(CDT)
            ent = old
            if A3PO_ENT:
                ent = tl.load(ent_ptr + t, mask=inside, other=0.0).to(CDT)
            metric = _a3po_metric(old, ent, A3PO_ENT)
            cand = valid & (metric != 0.0)
            key = _order_key(metric)
            g_h += (cand & (key > lo_h)).to(tl.int32)
            g_l += (cand & (key < lo_l)).to(tl.int32)
        need_h = k_h - tl.sum(g_h, 0)
        need_l = k_l - tl.sum(g_l, 0)
        seen_h = tl.zeros([], tl.int64)
        seen_l = tl.zeros([], tl.int64)
        cut_h = tl.full([], -1, tl.int64)
        cut_l = tl.full([], -1, tl.int64)
        for start in range(begin, end, BLOCK):
            t = start + lanes
            inside = t < end
            valid = inside
            if HAS_MASK:
                valid = valid & tl.load(mask_ptr + t, mask=inside, other=0).to(tl.int1)
            old = tl.load(old_ptr + t, mask=inside, other=0.0).to(CDT)
            ent = old
            if A3PO_ENT:
                ent = tl.load(ent_ptr + t, mask=inside, other=0.0).to(CDT)
            metric = _a3po_metric(old, ent, A3PO_ENT)
            cand = valid & (metric != 0.0)
            key = _order_key(metric)
            eq_h = (cand & (key == lo_h)).to(tl.int32)
            eq_l = (cand & (key == lo_l)).to(tl.int32)
            hit_h = (eq_h != 0) & ((seen_h + tl.cumsum(eq_h, 0)) == need_h)
            hit_l = (eq_l != 0) & ((seen_l + tl.cumsum(eq_l, 0)) == need_l)
            cut_h = tl.maximum(cut_h, tl.max(tl.where(hit_h, t + 1, -1), 0))
            cut_l = tl.maximum(cut_l, tl.max(tl.where(hit_l, t + 1, -1), 0))
            seen_h += tl.sum(eq_h, 0)
            seen_l += tl.sum(eq_l, 0)
        cols = tl.arange(0, 8)
        row = tl.where(cols == 0, tl.where(pos, 1, tl.where(neg, -1, 0)).to(tl.int64), 0)
        row = tl.where(cols == 1, tl.where(on_h, lo_h, _I64_MAX), row)  # off: never selected
        row = tl.where(cols == 2, tl.where(on_h, cut_h, -1), row)
        row = tl.where(cols == 3, tl.where(on_l, lo_l, _I64_MIN), row)
        row = tl.where(cols == 4, tl.where(on_l, cut_l, -1), row)
        tl.store(a3po_ptr + i * _NA3 + cols, row, mask=cols < _NA3)


@triton.jit
def _token_kernel(
    logp_ptr,
    old_ptr,  # token-shaped, input dtype
    adv_ptr,  # [B] (SEQ_ADV) or token-shaped, compute dtype
    mask_ptr,  # token-shaped bool (HAS_MASK)
    ref_ptr,
    roll_ptr,
    ent_ptr,  # token-shaped, input dtype (KL / RC / HAS_ENT)
    thr_ptr,  # 0-d fp32 entropy threshold (ENT_Q)
    cu_ptr,  # [B + 1] int64 (PACKED)
    boff_ptr,  # [B + 3] int64 program offsets of the packed segments (PACKED)
    seqf_ptr,  # [B, 4] compute dtype, from _seq_stats_kernel
    a3po_ptr,  # [B, 5] int64, from _seq_stats_kernel (A3PO)
    grad_ptr,  # token-shaped compute dtype: a_t · ∂ℓ_t/∂logp_t
    gent_ptr,  # token-shaped compute dtype: a_t · ∂ℓ_t/∂entropy_t (ENT_GRAD)
    tok_ptr,  # token-shaped compute dtype: ℓ·m (TOKEN_OUT = 1) or A·w·m (TOKEN_OUT = 2)
    part_ptr,  # [programs, 16] compute dtype: per-program partial sums (S_* columns)
    B,
    L,
    T,
    NBL,
    clip_lo: tl.float64,
    clip_hi: tl.float64,
    clip_c: tl.float64,
    lr_clamp: tl.float64,
    gspo_clamp: tl.float64,
    tau_pos: tl.float64,
    tau_neg: tl.float64,
    kl_coef: tl.float64,
    rc_low: tl.float64,
    rc_high: tl.float64,
    ent_coef: tl.float64,
    w_pos: tl.float64,
    w_neg: tl.float64,
    prob_lambda: tl.float64,
    s_pos_high: tl.float64,
    s_pos_low: tl.float64,
    s_neg_high: tl.float64,
    s_neg_low: tl.float64,
    CDT: tl.constexpr,
    PACKED: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SEQ_ADV: tl.constexpr,
    LOSS: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    LR_CLAMP: tl.constexpr,
    KL: tl.constexpr,
    KL_CLAMP: tl.constexpr,
    RC: tl.constexpr,
    SEQ_MEAN: tl.constexpr,
    N_FROM_STATS: tl.constexpr,
    TOKEN_OUT: tl.constexpr,
    HAS_ENT: tl.constexpr,
    ENT_TERM: tl.constexpr,
    ENT_GRAD: tl.constexpr,
    SHAPE_POL: tl.constexpr,
    SHAPE_PROB: tl.constexpr,
    A3PO: tl.constexpr,
    A3PO_ENT: tl.constexpr,
    ENT_Q: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    if PACKED:
        # Largest segment s with boff[s] <= p (empty segments share their offset).
        nseg = B + 2
        s_lo = tl.zeros([], tl.int64)
        s_hi = s_lo + nseg - 1
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (s_lo + s_hi + 1) // 2
            go = tl.load(boff_ptr + mid) <= p
            s_lo = tl.where(go, mid, s_lo)
            s_hi = tl.where(go, s_hi, mid - 1)
        seg = s_lo
        busy = p < tl.load(boff_ptr + nseg)
        seg_begin, seg_end = _segment(cu_ptr, seg, B, T, True)
        begin = seg_begin + (p - tl.load(boff_ptr + seg)) * BLOCK
        end = tl.where(busy, tl.minimum(begin + BLOCK, seg_end), begin)
        is_seq = busy & (seg >= 1) & (seg <= B)
        row = tl.minimum(tl.maximum(seg - 1, 0), tl.maximum(B - 1, 0))
        seq_len = seg_end - seg_begin
    else:
        row = p // NBL
        begin = row * L + (p - row * NBL) * BLOCK
        end = tl.minimum(begin + BLOCK, row * L + L)
        is_seq = row < B
        seq_len = L
    t = begin + lanes
    inside = t < end
    valid = inside & is_seq
    if HAS_MASK:
        valid = valid & tl.load(mask_ptr + t, mask=inside, other=0).to(tl.int1)

    lp = tl.load(logp_ptr + t, mask=inside, other=0.0).to(CDT)
    old = tl.load(old_ptr + t, mask=inside, other=0.0).to(CDT)
    if SEQ_ADV:  # one load per program, splat (the interpreter mishandles scalar & vector bools)
        a = tl.load(adv_ptr + row, mask=is_seq, other=0.0).to(CDT) + tl.zeros([BLOCK], CDT)
    else:
        a = tl.load(adv_ptr + t, mask=inside, other=0.0).to(CDT)
    ent = tl.zeros([BLOCK], CDT)
    if HAS_ENT:
        ent = tl.load(ent_ptr + t, mask=inside, other=0.0).to(CDT)
    if SEQ_MEAN:
        if N_FROM_STATS:
            n_i = tl.load(seqf_ptr + row * _NSTAT, mask=is_seq, other=0.0)
        else:  # packed without a mask: every token of the sequence is valid
            n_i = seq_len.to(CDT)
        inv_n = 1.0 / tl.maximum(n_i, 1.0)

    lo = _param(clip_lo, CDT)
    hi = _param(clip_hi, CDT)
    delta_raw = lp - old
    if LR_CLAMP:
        c = _param(lr_clamp, CDT)
        delta = tl.minimum(tl.maximum(delta_raw, -c), c)
        d_delta = tl.where((delta_raw >= -c) & (delta_raw <= c), 1.0, 0.0).to(CDT)
    else:
        delta = delta_raw
        d_delta = tl.full([BLOCK], 1.0, CDT)

    # ---- policy-gradient term pg, its derivative dpg, the clip flags, δ for ppo_kl
    clipped = valid & False
    clip_lower = valid & False
    if LOSS == 0:  # ppo
        ratio = tl.exp(delta)
        l1 = -a * ratio
        l2 = -a * tl.minimum(tl.maximum(ratio, lo), hi)
        pg = tl.maximum(l1, l2)
        clipped = l2 > l1
        dl1 = -a * ratio * d_delta
        dl2 = tl.where((ratio >= lo) & (ratio <= hi), dl1, 0.0)
        # torch.maximum: the larger branch's gradient, half to each on a tie.
        dpg = tl.where(l1 > l2, dl1, tl.where(l2 > l1, dl2, 0.5 * (dl1 + dl2)))
        if DUAL_CLIP:
            l3 = -a * _param(clip_c, CDT)
            neg = a < 0.0
            clip_lower = neg & (pg > l3)
            dpg = tl.where(neg, tl.where(pg < l3, dpg, tl.where(pg == l3, 0.5 * dpg, 0.0)), dpg)
            pg = tl.where(neg, tl.minimum(pg, l3), pg)
        delta_m = delta
    elif LOSS == 1:  # gspo: s = exp(min(log s_i, clamp)), ∂ log s_i,t / ∂logp_t = 1
        log_s = tl.load(seqf_ptr + row * _NSTAT + 1, mask=is_seq, other=0.0) + tl.zeros([BLOCK], CDT)
        g = _param(gspo_clamp, CDT)
        s = tl.exp(tl.minimum(log_s, g))
        ds = tl.where(log_s <= g, s, 0.0)
        l1 = -a * s
        l2 = -a * tl.minimum(tl.maximum(s, lo), hi)
        pg = tl.maximum(l1, l2)
        clipped = l2 > l1
        dl1 = -a * ds
        dl2 = tl.where((s >= lo) & (s <= hi), dl1, 0.0)
        dpg = tl.where(l1 > l2, dl1, tl.where(l2 > l1, dl2, 0.5 * (dl1 + dl2)))
        delta_m = delta_raw
    elif LOSS == 2:  # cispo: the clipped ratio is a constant
        ratio = tl.exp(delta)
        cr = tl.minimum(tl.maximum(ratio, lo), hi)
        dpg = -cr * a
        pg = dpg * lp
        clipped = ratio != cr
        delta_m = delta
    elif LOSS == 3:  # sapo
        ratio = tl.exp(delta)
        tau = tl.where(a > 0.0, _param(tau_pos, CDT), _param(tau_neg, CDT))
        sig = tl.sigmoid(tau * (ratio - 1.0))
        k = 4.0 / tau
        pg = -(sig * k) * a
        dpg = (-a * k) * ((1.0 - sig) * sig) * tau * ratio * d_delta
        delta_m = delta
    else:  # reinforce / gpg
        pg = -a * lp
        dpg = -a
        delta_m = delta_raw

    # ---- shaping weight w (constant), in fp64 like the reference, rounded once
    SHAPING: tl.constexpr = SHAPE_POL or SHAPE_PROB or A3PO or ENT_Q
    a64 = a.to(tl.float64)
    w64 = tl.full([BLOCK], 1.0, tl.float64)
    if SHAPE_POL:
        w64 = tl.where(a64 > 0.0, _param(w_pos, tl.float64), tl.where(a64 < 0.0, _param(w_neg, tl.float64), 1.0))
    if SHAPE_PROB:
        pr = tl.exp(old.to(tl.float64))
        wp = tl.where(a64 > 0.0, 1.0 - pr, tl.where(a64 < 0.0, pr, 0.0))
        lam = _param(prob_lambda, tl.float64)
        w64 = w64 * ((1.0 - lam) + lam * wp)
    if A3PO:
        metric = _a3po_metric(old, ent, A3PO_ENT)
        cand = valid & (metric != 0.0)
        key = _order_key(metric)
        a3 = a3po_ptr + row * _NA3
        pol = tl.load(a3 + 0, mask=is_seq, other=0)
        k_h = tl.load(a3 + 1, mask=is_seq, other=_I64_MAX)
        cut_h = tl.load(a3 + 2, mask=is_seq, other=-1)
        k_l = tl.load(a3 + 3, mask=is_seq, other=_I64_MIN)
        cut_l = tl.load(a3 + 4, mask=is_seq, other=-1)
        sel_h = cand & ((key > k_h) | ((key == k_h) & (t < cut_h)))
        sel_l = cand & ((key < k_l) | ((key == k_l) & (t < cut_l)))
        sc_h = tl.where(pol > 0, _param(s_pos_high, tl.float64), _param(s_neg_high, tl.float64))
        sc_l = tl.where(pol > 0, _param(s_pos_low, tl.float64), _param(s_neg_low, tl.float64))
        w64 = w64 * (tl.where(sel_h, sc_h, 1.0) * tl.where(sel_l, sc_l, 1.0))
    if ENT_Q:
        keep = ent.to(tl.float32) >= tl.load(thr_ptr)
        w64 = w64 * tl.where(keep, 1.0, 0.0)
    w = w64.to(CDT)

    # ---- rollout-correction weight (constant) and rejections
    is_w = tl.full([BLOCK], 1.0, CDT)
    rejected = valid & False
    if RC != 0:
        cap = _param(rc_high, CDT)
        if (RC == 2) or (RC == 4):  # sequence level: the masked sum of log w, clamped
            slw = tl.load(seqf_ptr + row * _NSTAT + 2, mask=is_seq, other=0.0)
            raw = tl.exp(tl.minimum(tl.maximum(slw, -20.0), 20.0)) + tl.zeros([BLOCK], CDT)
        else:
            roll = tl.load(roll_ptr + t, mask=inside, other=0.0).to(CDT)
            raw = tl.exp(tl.minimum(tl.maximum(old - roll, -20.0), 20.0))
        if (RC == 1) or (RC == 2):  # TIS
            is_w = tl.minimum(raw, cap)
        elif RC == 5:  # decoupled: drop tokens whose behaviour weight exceeds the cap
            rejected = raw > cap
            is_w = tl.where(rejected, 0.0, raw)
        else:  # MIS: 1 inside [low, C], rejected outside
            rejected = (raw < _param(rc_low, CDT)) | (raw > cap)
            is_w = tl.where(rejected, 0.0, 1.0).to(CDT)

    # ---- KL to the reference
    kl = tl.zeros([BLOCK], CDT)
    dkl = tl.zeros([BLOCK], CDT)
    if KL != 0:
        ref = tl.load(ref_ptr + t, mask=inside, other=0.0).to(CDT)
        x = lp - ref
        if KL == 1:
            kl = x
            dkl = tl.full([BLOCK], 1.0, CDT)
        elif KL == 2:
            kl = 0.5 * (x * x)
            dkl = x
        else:
            y = ref - lp
            d3 = tl.full([BLOCK], 1.0, CDT)
            if KL_CLAMP:
                d3 = tl.where((y >= -20.0) & (y <= 20.0), d3, 0.0)
                y = tl.minimum(tl.maximum(y, -20.0), 20.0)
            ey = tl.exp(y)
            kl = ey - y - 1.0
            if KL_CLAMP:
                d3 = tl.where((kl >= -10.0) & (kl <= 10.0), d3, 0.0)
                kl = tl.minimum(tl.maximum(kl, -10.0), 10.0)
            if KL == 3:
                dkl = (1.0 - ey) * d3
            else:  # k3+: the value of k3, the gradient of k2
                dkl = x
        beta = _param(kl_coef, CDT)

    # ---- per-token loss ℓ and its derivative
    pgw = pg
    dlp = dpg
    if SHAPING:
        pgw = pgw * w
        dlp = dlp * w
    if RC != 0:
        pgw = pgw * is_w
        dlp = dlp * is_w
    ell = pgw
    if KL != 0:
        ell = ell + beta * kl
        dlp = dlp + beta * dkl
    ec = _param(ent_coef, CDT)
    if ENT_TERM:
        ell = ell - ec * ent
    if SEQ_MEAN:  # a_t = m_t / n_i
        ell_a = ell * inv_n
        pgw_a = pgw * inv_n
        kl_a = kl * inv_n
        dlp = dlp * inv_n
    else:
        ell_a = ell
        pgw_a = pgw
        kl_a = kl

    zero = tl.zeros([BLOCK], CDT)
    tl.store(grad_ptr + t, tl.where(valid, dlp, zero), mask=inside)
    if ENT_GRAD:
        if SEQ_MEAN:
            ge = -ec * inv_n + zero
        else:
            ge = -ec + zero
        tl.store(gent_ptr + t, tl.where(valid, ge, zero), mask=inside)
    if TOKEN_OUT == 1:
        tl.store(tok_ptr + t, tl.where(valid, ell, zero), mask=inside)
    elif TOKEN_OUT == 2:  # the shaped advantage A·w, formed in fp64 as the reference
        tl.store(tok_ptr + t, tl.where(valid, (a64 * w64).to(CDT), zero), mask=inside)

    # ---- one row of partial sums (fixed-order tree sums inside the block)
    one = tl.full([BLOCK], 1.0, CDT)
    cols = tl.arange(0, _NP)
    part = tl.zeros([_NP], CDT)
    part = tl.where(cols == _C_TOTAL, tl.sum(tl.where(valid, ell_a, zero), 0), part)
    part = tl.where(cols == _C_PG, tl.sum(tl.where(valid, pgw_a, zero), 0), part)
    ntok = tl.sum(tl.where(valid, one, zero), 0)
    part = tl.where(cols == _C_NTOK, ntok, part)
    if LOSS <= 2:  # only ppo, gspo and cispo clip
        part = tl.where(cols == _C_CLIP, tl.sum(tl.where(valid & clipped, one, zero), 0), part)
    if DUAL_CLIP:
        part = tl.where(cols == _C_CLIP_LOWER, tl.sum(tl.where(valid & clip_lower, one, zero), 0), part)
    part = tl.where(cols == _C_NEG_DELTA, tl.sum(tl.where(valid, -delta_m, zero), 0), part)
    if RC != 0:
        part = tl.where(cols == _C_IS, tl.sum(tl.where(valid, is_w, zero), 0), part)
        part = tl.where(cols == _C_IS_MAX, tl.max(tl.where(valid, is_w, zero), 0), part)
    else:  # is_w = 1
        part = tl.where(cols == _C_IS, ntok, part)
        part = tl.where(cols == _C_IS_MAX, tl.minimum(ntok, 1.0), part)
    if KL != 0:
        part = tl.where(cols == _C_KL, tl.sum(tl.where(valid, kl_a, zero), 0), part)
        part = tl.where(cols == _C_KL_RAW, tl.sum(tl.where(valid, kl, zero), 0), part)
    if RC >= 3:  # MIS and decoupled reject
        part = tl.where(cols == _C_REJECT, tl.sum(tl.where(valid & rejected, one, zero), 0), part)
    if SHAPING:
        part = tl.where(cols == _C_SHAPED, tl.sum(tl.where(valid & (w != 1.0), one, zero), 0), part)
    if HAS_ENT:
        part = tl.where(cols == _C_ENT, tl.sum(tl.where(valid, ent, zero), 0), part)
    # The value check: x − x is NaN iff x is NaN or ±inf, so one sum over the inputs
    # flags a valid token with any non-finite input (the wrapper raises on a count > 0).
    chk = (lp - lp) + (old - old) + (a - a)
    if HAS_ENT:
        chk += ent - ent
    if KL != 0:
        chk += ref - ref
    if (RC == 2) or (RC == 4):  # (the sequence-level weights read it in the stats pass only)
        roll = tl.load(roll_ptr + t, mask=inside, other=0.0).to(CDT)
    if RC != 0:
        chk += roll - roll
    part = tl.where(cols == _C_NONFINITE, tl.sum(tl.where(valid & (chk != chk), one, zero), 0), part)
    tl.store(part_ptr + p * _NP + cols, part)


@triton.jit
def _finalize_kernel(
    part_ptr,  # [P, 16] compute dtype partial sums
    seqf_ptr,  # [B, 4] per-sequence stats (HAS_STATS: column 0 is n_i)
    boff_ptr,  # [B + 3] int64 program offsets (PACKED)
    sums_ptr,  # [NUM_SUMS] compute dtype output
    P,
    B,
    NBL,
    CDT: tl.constexpr,
    PACKED: tl.constexpr,
    HAS_STATS: tl.constexpr,
    ROWS: tl.constexpr,
    SEQS: tl.constexpr,
):
    cols = tl.arange(0, _NP)
    acc = tl.zeros([_NP], tl.float64)
    mx = tl.zeros([_NP], tl.float64)
    for start in range(0, P, ROWS):
        r = start + tl.arange(0, ROWS).to(tl.int64)
        tile = tl.load(part_ptr + r[:, None] * _NP + cols[None, :], mask=(r < P)[:, None], other=0.0)
        tile = tile.to(tl.float64)
        acc += tl.sum(tile, 0)
        mx = tl.maximum(mx, tl.max(tile, 0))
    out = tl.where(cols == _C_IS_MAX, mx, acc)

    # Sequences with n_i > 0: from the stats pass, else from the per-program counts.
    lanes = tl.arange(0, SEQS).to(tl.int64)
    nseq = tl.zeros([SEQS], tl.int32)
    for start in range(0, B, SEQS):
        s = start + lanes
        ok = s < B
        if HAS_STATS:
            n = tl.load(seqf_ptr + s * _NSTAT, mask=ok, other=0.0)
        else:
            if PACKED:
                b0 = tl.load(boff_ptr + s + 1, mask=ok, other=0)
                nb = tl.where(ok, tl.load(boff_ptr + s + 2, mask=ok, other=0) - b0, 0)
            else:
                b0 = s * NBL
                nb = tl.where(ok, NBL, 0).to(tl.int64)
            n = tl.zeros([SEQS], CDT)
            for j in range(0, tl.max(nb, 0)):
                # (b0 + j < P: overlapping, i.e. invalid, cu_seqlens may count more blocks than ran)
                n += tl.load(part_ptr + (b0 + j) * _NP + _C_NTOK, mask=(j < nb) & (b0 + j < P), other=0.0)
        nseq += (ok & (n > 0.0)).to(tl.int32)
    out = tl.where(cols == _C_NSEQ, tl.sum(nseq, 0).to(tl.float64), out)
    tl.store(sums_ptr + cols, out.to(CDT), mask=cols < _C_NUM_SUMS)


# Tokens per program of the token kernel / lanes of the per-sequence kernel (tests shrink
# them to exercise multi-block sequences under the interpreter). fp64 and the fp64
# shaping math (probability, A3PO) hold twice the registers per token: half the block
# keeps them spill-free at 4 warps (python -m rlvr_kernels.triton.aot).
_TOKEN_BLOCK = 1024
_SEQ_BLOCK = 1024
_WARPS = 4


def token_block(fp64: bool, heavy: bool) -> int:
    return max(16, _TOKEN_BLOCK // 2) if (fp64 or heavy) else _TOKEN_BLOCK


def seq_block(fp64: bool, a3po: bool) -> int:
    return max(16, _SEQ_BLOCK // 2) if (fp64 or a3po) else _SEQ_BLOCK


def policy_loss_triton(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    ref_logprobs,
    rollout_logprobs,
    entropy,
    cu_seqlens,
    entropy_threshold,
    fparams,
    iparams,
    need_entropy_grad,
):
    """Same contract as the C++ kernel ``rlvr_kernels_C::policy_loss_fwd``: returns
    ``(sums, grad_logprobs, grad_entropy, token_out)``."""
    dev = logprobs.device
    fp64 = logprobs.dtype == torch.float64
    cdt = torch.float64 if fp64 else torch.float32
    CDT = tl.float64 if fp64 else tl.float32
    shape = tuple(logprobs.shape)
    packed = cu_seqlens is not None
    f = [float(v) for v in fparams]
    loss, kl, rc = int(iparams[I_LOSS_TYPE]), int(iparams[I_KL]), int(iparams[I_RC])
    seq_mean, token_out = bool(iparams[I_SEQ_MEAN]), int(iparams[I_TOKEN_OUT])
    a3po, a3po_ent = bool(iparams[I_A3PO_ON]), bool(iparams[I_A3PO_METRIC])
    ent_q, seq_adv = bool(iparams[I_ENT_QUANTILE]), bool(iparams[I_SEQ_ADV])
    has_mask, has_ent = mask is not None, entropy is not None
    w_pos, w_neg, tau_pos, tau_neg = f[F_W_POS], f[F_W_NEG], f[F_TAU_POS], f[F_TAU_NEG]
    a3 = f[F_A3PO : F_A3PO + 8]

    grad = torch.empty(shape, dtype=cdt, device=dev)
    gent = torch.empty(shape if need_entropy_grad else (0,), dtype=cdt, device=dev)
    tok = torch.empty(shape if token_out else (0,), dtype=cdt, device=dev)
    sums = torch.empty(NUM_SUMS, dtype=cdt, device=dev)

    shape_prob = f[F_PROB_LAMBDA] != 0
    tb = token_block(fp64, a3po or shape_prob)
    if packed:
        T = shape[0]
        B = cu_seqlens.shape[0] - 1
        L, NBL = 0, 0
        cu = cu_seqlens.contiguous()
        P = triton.cdiv(T, tb) + B + 2
        boff = torch.empty(B + 3, dtype=torch.int64, device=dev)
        _block_offsets_kernel[(1,)](cu, boff, B, T, TOKEN_BLOCK=tb, BLOCK=1024)
    else:
        B, L = shape
        T = B * L
        NBL = triton.cdiv(L, tb)
        P = B * NBL
        cu = boff = grad  # unused

    dummy = grad
    n_from_stats = seq_mean and (has_mask or not packed)
    need_delta = loss == GSPO
    need_logw = rc in (SEQ_TIS, SEQ_MIS)
    stats = n_from_stats or need_delta or need_logw or a3po
    seqf = dummy
    a3po_rows = torch.empty(0, dtype=torch.int64, device=dev)
    if stats and B > 0:
        seqf = torch.empty(B * 4, dtype=cdt, device=dev)
        if a3po:
            a3po_rows = torch.empty(B * 5, dtype=torch.int64, device=dev)
        _seq_stats_kernel[(B,)](
            logprobs,
            old_logprobs,
            advantages,
            mask if has_mask else dummy,
            rollout_logprobs if need_logw else dummy,
            entropy if has_ent else dummy,
            cu,
            seqf,
            a3po_rows if a3po else dummy,
            B,
            L,
            T,
            *a3,
            CDT=CDT,
            PACKED=packed,
            HAS_MASK=has_mask,
            SEQ_ADV=seq_adv,
            NEED_DELTA=need_delta,
            NEED_LOGW=need_logw,
            A3PO=a3po,
            A3PO_ENT=a3po_ent,
            BLOCK=seq_block(fp64, a3po),
            num_warps=_WARPS,
        )

    part = torch.empty(max(P, 1) * 16, dtype=cdt, device=dev)
    if P > 0:
        _token_kernel[(P,)](
            logprobs,
            old_logprobs,
            advantages,
            mask if has_mask else dummy,
            ref_logprobs if kl else dummy,
            rollout_logprobs if rc else dummy,
            entropy if has_ent else dummy,
            entropy_threshold if ent_q else dummy,
            cu,
            boff,
            seqf,
            a3po_rows if a3po else dummy,
            grad,
            gent if need_entropy_grad else dummy,
            tok if token_out else dummy,
            part,
            B,
            L,
            T,
            NBL,
            f[F_CLIP_LO],
            f[F_CLIP_HI],
            f[F_CLIP_C],
            f[F_LOG_RATIO_CLAMP],
            f[F_GSPO_CLAMP],
            tau_pos,
            tau_neg,
            f[F_KL_COEF],
            f[F_RC_LOW],
            f[F_RC_HIGH],
            f[F_ENT_COEF],
            w_pos,
            w_neg,
            f[F_PROB_LAMBDA],
            a3[1],
            a3[3],
            a3[5],
            a3[7],
            CDT=CDT,
            PACKED=packed,
            HAS_MASK=has_mask,
            SEQ_ADV=seq_adv,
            LOSS=loss,
            DUAL_CLIP=loss == PPO and f[F_CLIP_C] > 0,
            LR_CLAMP=f[F_LOG_RATIO_CLAMP] > 0,
            KL=kl,
            KL_CLAMP=bool(iparams[I_KL_CLAMP]),
            RC=rc,
            SEQ_MEAN=seq_mean,
            N_FROM_STATS=n_from_stats,
            TOKEN_OUT=token_out,
            HAS_ENT=has_ent,
            ENT_TERM=has_ent and f[F_ENT_COEF] != 0,
            ENT_GRAD=bool(need_entropy_grad),
            SHAPE_POL=w_pos != 1.0 or w_neg != 1.0,
            SHAPE_PROB=shape_prob,
            A3PO=a3po,
            A3PO_ENT=a3po_ent,
            ENT_Q=ent_q,
            SEARCH_STEPS=max(1, math.ceil(math.log2(B + 2)) + 1) if packed else 1,
            BLOCK=tb,
            num_warps=_WARPS,
        )
    _finalize_kernel[(1,)](
        part, seqf, boff, sums, P, B, NBL, CDT=CDT, PACKED=packed, HAS_STATS=bool(stats and B > 0), ROWS=64, SEQS=256
    )
    return sums, grad, gent, tok


def aot_specs():
    """The policy_loss kernels: the common single pass, each loss type and feature family,
    the fp64 variants, and the per-sequence (GSPO / seq IS / A3PO) pre-pass."""
    import triton.language as tl

    k = sys.modules[__name__]

    pi64 = "*i64"
    yield (
        "_block_offsets_kernel",
        k._block_offsets_kernel,
        dict(cu_ptr=pi64, boff_ptr=pi64, B="i32", T="i32"),
        dict(TOKEN_BLOCK=k._TOKEN_BLOCK, BLOCK=1024),
    )

    def seq_stats(name, inp, cdt, **const):
        c = "*fp64" if cdt is tl.float64 else "*fp32"
        sig = dict(
            logp_ptr=inp,
            old_ptr=inp,
            adv_ptr=c,
            mask_ptr="*i1",
            roll_ptr=inp,
            ent_ptr=inp,
            cu_ptr=pi64,
            seqf_ptr=c,
            a3po_ptr=pi64,
            B="i32",
            L="i32",
            T="i32",
        )
        sig.update(
            {
                n: "fp64"
                for n in (
                    "r_pos_high",
                    "s_pos_high",
                    "r_pos_low",
                    "s_pos_low",
                    "r_neg_high",
                    "s_neg_high",
                    "r_neg_low",
                    "s_neg_low",
                )
            }
        )
        full = dict(
            CDT=cdt,
            PACKED=False,
            HAS_MASK=True,
            SEQ_ADV=True,
            NEED_DELTA=False,
            NEED_LOGW=False,
            A3PO=False,
            A3PO_ENT=False,
        )
        full.update(const)
        full["BLOCK"] = k.seq_block(cdt is tl.float64, full["A3PO"])
        return f"_seq_stats_kernel[{name}]", k._seq_stats_kernel, sig, full

    yield seq_stats("seq_mean,packed", "*bf16", tl.float32, PACKED=True)
    yield seq_stats("gspo,seq_tis", "*bf16", tl.float32, NEED_DELTA=True, NEED_LOGW=True)
    yield seq_stats("a3po_prob,token_adv", "*bf16", tl.float32, A3PO=True, SEQ_ADV=False)
    yield seq_stats("a3po_entropy,packed", "*fp32", tl.float32, A3PO=True, A3PO_ENT=True, PACKED=True)
    yield seq_stats("fp64,all", "*fp64", tl.float64, NEED_DELTA=True, NEED_LOGW=True, A3PO=True)

    floats = (
        "clip_lo",
        "clip_hi",
        "clip_c",
        "lr_clamp",
        "gspo_clamp",
        "tau_pos",
        "tau_neg",
        "kl_coef",
        "rc_low",
        "rc_high",
        "ent_coef",
        "w_pos",
        "w_neg",
        "prob_lambda",
        "s_pos_high",
        "s_pos_low",
        "s_neg_high",
        "s_neg_low",
    )

    def token(name, inp, cdt, **const):
        c = "*fp64" if cdt is tl.float64 else "*fp32"
        sig = dict(
            logp_ptr=inp,
            old_ptr=inp,
            adv_ptr=c,
            mask_ptr="*i1",
            ref_ptr=inp,
            roll_ptr=inp,
            ent_ptr=inp,
            thr_ptr="*fp32",
            cu_ptr=pi64,
            boff_ptr=pi64,
            seqf_ptr=c,
            a3po_ptr=pi64,
            grad_ptr=c,
            gent_ptr=c,
            tok_ptr=c,
            part_ptr=c,
            B="i32",
            L="i32",
            T="i32",
            NBL="i32",
        )
        sig.update({n: "fp64" for n in floats})
        full = dict(
            CDT=cdt,
            PACKED=False,
            HAS_MASK=True,
            SEQ_ADV=True,
            LOSS=k.PPO,
            DUAL_CLIP=False,
            LR_CLAMP=True,
            KL=0,
            KL_CLAMP=True,
            RC=0,
            SEQ_MEAN=False,
            N_FROM_STATS=False,
            TOKEN_OUT=0,
            HAS_ENT=False,
            ENT_TERM=False,
            ENT_GRAD=False,
            SHAPE_POL=False,
            SHAPE_PROB=False,
            A3PO=False,
            A3PO_ENT=False,
            ENT_Q=False,
            SEARCH_STEPS=1,
        )
        full.update(const)
        full["BLOCK"] = k.token_block(cdt is tl.float64, full["A3PO"] or full["SHAPE_PROB"])
        return f"_token_kernel[{name}]", k._token_kernel, sig, full

    common = dict(KL=k.K3, RC=k.TOKEN_TIS)
    yield token("ppo,k3,token_tis", "*bf16", tl.float32, **common)
    yield token("ppo,k3,token_tis,packed", "*bf16", tl.float32, PACKED=True, HAS_MASK=False, SEARCH_STEPS=8, **common)
    yield token("ppo,fp32,dual_clip,k1", "*fp32", tl.float32, DUAL_CLIP=True, KL=k.K1, SEQ_ADV=False)
    yield token(
        "gspo,seq_tis,seq_mean", "*bf16", tl.float32, LOSS=k.GSPO, RC=k.SEQ_TIS, SEQ_MEAN=True, N_FROM_STATS=True
    )
    yield token("cispo,k2,token_mis", "*fp16", tl.float32, LOSS=k.CISPO, KL=k.K2, RC=k.TOKEN_MIS)
    yield token(
        "sapo,seq_mis,entropy",
        "*bf16",
        tl.float32,
        LOSS=k.SAPO,
        RC=k.SEQ_MIS,
        HAS_ENT=True,
        ENT_TERM=True,
        ENT_GRAD=True,
    )
    yield token(
        "reinforce,shaping,token_out=2",
        "*fp32",
        tl.float32,
        LOSS=k.REINFORCE,
        SHAPE_POL=True,
        SHAPE_PROB=True,
        A3PO=True,
        HAS_ENT=True,
        ENT_Q=True,
        TOKEN_OUT=2,
        SEQ_ADV=False,
    )
    everything = dict(
        DUAL_CLIP=True,
        KL=k.K3PLUS,
        RC=k.DECOUPLED,
        SEQ_MEAN=True,
        N_FROM_STATS=True,
        TOKEN_OUT=1,
        HAS_ENT=True,
        ENT_TERM=True,
        ENT_GRAD=True,
        SHAPE_POL=True,
        SHAPE_PROB=True,
        A3PO=True,
        A3PO_ENT=True,
        ENT_Q=True,
    )
    yield token("everything,packed", "*bf16", tl.float32, PACKED=True, SEARCH_STEPS=8, **everything)
    yield token("fp64,everything", "*fp64", tl.float64, **everything)
    yield token("fp64,gspo", "*fp64", tl.float64, LOSS=k.GSPO, KL=k.K3)

    for name, cdt, packed, stats in (
        ("padded", tl.float32, False, False),
        ("packed", tl.float32, True, False),
        ("stats,fp64", tl.float64, False, True),
    ):
        c = "*fp64" if cdt is tl.float64 else "*fp32"
        sig = dict(part_ptr=c, seqf_ptr=c, boff_ptr=pi64, sums_ptr=c, P="i32", B="i32", NBL="i32")
        yield (
            f"_finalize_kernel[{name}]",
            k._finalize_kernel,
            sig,
            dict(CDT=cdt, PACKED=packed, HAS_STATS=stats, ROWS=64, SEQS=256),
        )
