"""Fused GRPO-family policy loss in Triton (docs/token-shaping.md, docs/policy-loss.md): the CUDA backend of
``rlvr_kernels.ops.policy_loss`` (the kernel contract is that module's docstring and
:mod:`rlvr_kernels.contracts.policy_loss`; the exact math is
``rlvr_kernels.reference.policy_loss``).

Design:
- Work unit = one block of ``_TOKEN_BLOCK`` tokens of ONE sequence, so every
  per-sequence value (a [B] advantage, GSPO's log s_i, the sequence IS weight, A3PO
  thresholds, n_i) is a scalar load per program, and B = 64 × L = 8192 gives 512
  programs. Padded [B, L]: program p is block p % NBL of row p // NBL. Packed [T]: the
  launcher sanitises ``cu_seqlens`` (``_core.layout.sanitized_offsets``: in bounds, in order,
  disjoint whatever the input); the B sequences plus a head [0, cu[0]) and a tail [cu[B], T)
  segment (written as zeros) are cut into blocks by ``_block_offsets_kernel`` (a
  device-side cumsum of per-segment block counts, no host sync); the launch is the bound
  cdiv(T, BLOCK) + B + 2, which disjoint spans never exceed, and a program finds its
  segment by binary search (surplus programs are idle).
- ``_token_kernel``: the single pass of the common case (ppo + k3 + token_tis + token
  mean, [B] advantages): every input read once, the gradient written once, and one row
  of per-program partial sums. Options are constexpr, so unused features compile away.
  Its stages are inlined helpers that mirror the functions of the reference, one by one,
  under the same names with a leading underscore (the C++ kernel's helpers carry them too):
  the inputs (the rejection chain of ``RolloutCorrection`` removes tokens from the valid
  set: ``_rs_divergences`` → ``_token_keep``, and the sequence's keep_i from the stats
  pass) → ``_pg_term``: ``_log_ratio`` (``_gspo_ratio``) and ``_ppo_term`` | ``_gspo_term`` |
  ``_cispo_term`` | ``_sapo_term`` | ``_reinforce_term`` | ``_dppo_term`` |
  ``_geo_mean_term`` | ``_dro_term`` | ``_clip_cov_term`` | ``_kl_cov_term`` (ppo, gspo
  and clip_cov: ``_clipped_objective``, ppo and gspo then ``_dual_clip``; dppo_tv / dppo_kl:
  ``_dppo_keep``; geo_mean: ``_geo_mean_log_ratio`` in the per-sequence pass; clip_cov /
  kl_cov read the ``cov_selection`` input, computed outside the kernels by
  ``contracts.policy_loss.cov_selection``; ``_clip_sides``) → ``_shaping_weights`` →
  ``_is_weights`` (``_corrected_weight``; IcePop, mask, truncate, decoupled; OpenRLHF's
  clamp / gate: ``_gate_weight``, ``_gate_divergence``; over the batch mean with batch
  normalisation) → ``_kl_term`` (``_kl_estimate`` ×
  ``_importance_ratio``) → ``_token_loss`` → ``_aggregate`` → ``_partial_sums`` (the
  metrics' sums). The per-sequence values (a [B] advantage, log s_i, L_i / n_i, the
  sequence IS weight, keep_i, n_i) are loaded once, up front, so that no sequence address
  stays live through the token math (without that, geo_mean + seq_tis + k3 with [B]
  advantages spilled on sm_80). Names: ``adv`` is the advantage A, ``agg_w`` the
  aggregation weight (1/n_i for seq-mean-token-mean), m⁰ the valid flag before rejection.
- ``_seq_stats_kernel`` (one program per sequence, the C++ pre-pass), only when needed: the
  rejection chain (sums, means and maxima of k1 / k2 / k3 over m⁰: ``_seq_keep``; the
  token options per token; n_i and every sum below over the kept tokens), n_i
  (seq-mean-token-mean), Σ δ·m (GSPO), Σ δ_min·m and Σ A·m (geo_mean's share of the
  sequence loss), the sequence IS weight from Σ x·m⁰ (seq_tis / seq_mis / seq_icepop),
  Σ w·m⁰ (token-level batch normalisation), n⁰_i, the sequence-level gate's flag (the
  mean of its statistic over m⁰), and the A3PO
  selection (``_a3po_select``): the k-th highest / lowest metric by bisection on an
  order-preserving int64 image of the fp64 metric (≤ 64 passes, both knobs in lockstep),
  then one running-cumsum pass over the candidates equal to the threshold for the tie cut
  (lower index first). The token kernel recomputes the metric bitwise identically
  (``_a3po_candidates``) and selects ``key > K or (key == K and t < cut)``. Given the
  group's sequence statistics (``seq_stats``, contracts SeqStat; ``cp_group``) it reads
  their sums instead of its tokens (GIVEN: no token loop), as the C++ pre-pass does.
- ``_is_batch_norm_kernel`` (one program, only with ``is_batch_normalize``): the mean of the
  IS weights over m⁰ (token level) or over the sequences with a valid token (sequence
  level), in sequence order, for the token kernel to divide by.
- ``_finalize_kernel``: one program sums the partial rows in a fixed order in fp64
  (no atomics: bitwise reproducible), counts the sequences with n_i > 0 and forms the
  rejection's counts (NTOK_RAW, RS_REJECT, RS_SEQ_REJECT from n⁰_i and n_i) and IS_NORM.
Numerics follow the reference: compute in fp64 for fp64 inputs, else fp32; shaping
weights in fp64, rounded once; torch's derivative conventions (clamp passes the gradient
on the closed interval; maximum / minimum split it in half on ties). Hyper-parameters are
fp64 kernel arguments rounded in-kernel to the compute dtype, as torch rounds a Python
scalar to the tensor's dtype. Every load and store is masked, so no input makes a kernel
leave its buffers; the launcher checks the shapes the kernels rely on.
Cost outside the common case: the per-sequence pass is one program per sequence, and an
A3PO sequence takes up to ~67 passes over its tokens (the bisection); a3po is a rarely
used option, so this favours exactness and simplicity over speed.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .._core.layout import sanitized_offsets
from ..contracts.policy_loss import (
    NUM_SEQ_STATS,
    NUM_SUMS,
    A3poMetric,
    IsGate,
    KlClamp,
    KlEstimator,
    LossType,
    PolicyLossParams,
    PolicyLossSum,
    RolloutCorrectionCode,
    SeqStat,
    TokenOut,
)

# The branch codes as constexprs the kernels compare against (contracts.policy_loss);
# Triton kernels may only read module globals that are constexpr.
PPO = tl.constexpr(int(LossType.PPO))
GSPO = tl.constexpr(int(LossType.GSPO))
CISPO = tl.constexpr(int(LossType.CISPO))
SAPO = tl.constexpr(int(LossType.SAPO))
REINFORCE = tl.constexpr(int(LossType.REINFORCE))
DPPO_TV = tl.constexpr(int(LossType.DPPO_TV))
DPPO_KL = tl.constexpr(int(LossType.DPPO_KL))
GEO_MEAN = tl.constexpr(int(LossType.GEO_MEAN))
DRO = tl.constexpr(int(LossType.DRO))
CLIP_COV = tl.constexpr(int(LossType.CLIP_COV))
KL_COV = tl.constexpr(int(LossType.KL_COV))
KL_NONE = tl.constexpr(int(KlEstimator.NONE))
K1 = tl.constexpr(int(KlEstimator.K1))
K2 = tl.constexpr(int(KlEstimator.K2))
K3 = tl.constexpr(int(KlEstimator.K3))
K3_PLUS = tl.constexpr(int(KlEstimator.K3_PLUS))
KL_CLAMP_NONE = tl.constexpr(int(KlClamp.NONE))
KL_CLAMP_ALL = tl.constexpr(int(KlClamp.ALL))
RC_NONE = tl.constexpr(int(RolloutCorrectionCode.NONE))
TOKEN_TIS = tl.constexpr(int(RolloutCorrectionCode.TOKEN_TIS))
SEQ_TIS = tl.constexpr(int(RolloutCorrectionCode.SEQ_TIS))
TOKEN_MIS = tl.constexpr(int(RolloutCorrectionCode.TOKEN_MIS))
SEQ_MIS = tl.constexpr(int(RolloutCorrectionCode.SEQ_MIS))
DECOUPLED = tl.constexpr(int(RolloutCorrectionCode.DECOUPLED))
TOKEN_ICEPOP = tl.constexpr(int(RolloutCorrectionCode.TOKEN_ICEPOP))
SEQ_ICEPOP = tl.constexpr(int(RolloutCorrectionCode.SEQ_ICEPOP))
GATE = tl.constexpr(int(RolloutCorrectionCode.GATE))
GATE_CLAMP = tl.constexpr(int(IsGate.CLAMP))
GATE_RATIO = tl.constexpr(int(IsGate.RATIO))
GATE_TV = tl.constexpr(int(IsGate.TV))
TOKEN_OUT_LOSS = tl.constexpr(int(TokenOut.LOSS))
TOKEN_OUT_SHAPED = tl.constexpr(int(TokenOut.SHAPED_ADVANTAGES))
TOKEN_OUT_IS_WEIGHTS = tl.constexpr(int(TokenOut.IS_WEIGHTS))
TOKEN_OUT_KEEP = tl.constexpr(int(TokenOut.KEEP))
# Columns of a partial-sums row (PolicyLossSum), padded to a power of two.
_NP = tl.constexpr(32)
_C_TOTAL = tl.constexpr(int(PolicyLossSum.TOTAL))
_C_PG = tl.constexpr(int(PolicyLossSum.PG))
_C_KL = tl.constexpr(int(PolicyLossSum.KL))
_C_NTOK = tl.constexpr(int(PolicyLossSum.NTOK))
_C_NSEQ = tl.constexpr(int(PolicyLossSum.NSEQ))
_C_CLIP = tl.constexpr(int(PolicyLossSum.CLIP))
_C_CLIP_LOWER = tl.constexpr(int(PolicyLossSum.CLIP_LOWER))
_C_NEG_DELTA = tl.constexpr(int(PolicyLossSum.NEG_DELTA))
_C_KL_RAW = tl.constexpr(int(PolicyLossSum.KL_RAW))
_C_IS = tl.constexpr(int(PolicyLossSum.IS))
_C_IS_MAX = tl.constexpr(int(PolicyLossSum.IS_MAX))
_C_REJECT = tl.constexpr(int(PolicyLossSum.REJECT))
_C_SHAPED = tl.constexpr(int(PolicyLossSum.SHAPED))
_C_ENT = tl.constexpr(int(PolicyLossSum.ENT))
_C_NONFINITE = tl.constexpr(int(PolicyLossSum.NONFINITE))
_C_CLIP_LOW = tl.constexpr(int(PolicyLossSum.CLIP_LOW))
_C_CLIP_HIGH = tl.constexpr(int(PolicyLossSum.CLIP_HIGH))
_C_SEQ_CLIP_LOW = tl.constexpr(int(PolicyLossSum.SEQ_CLIP_LOW))
_C_SEQ_CLIP_HIGH = tl.constexpr(int(PolicyLossSum.SEQ_CLIP_HIGH))
_C_SEQ_CLIP_LOW_MIN = tl.constexpr(int(PolicyLossSum.SEQ_CLIP_LOW_MIN))
_C_SEQ_CLIP_HIGH_MAX = tl.constexpr(int(PolicyLossSum.SEQ_CLIP_HIGH_MAX))
_C_NTOK_RAW = tl.constexpr(int(PolicyLossSum.NTOK_RAW))
_C_RS_REJECT = tl.constexpr(int(PolicyLossSum.RS_REJECT))
_C_RS_SEQ_REJECT = tl.constexpr(int(PolicyLossSum.RS_SEQ_REJECT))
_C_IS_NORM = tl.constexpr(int(PolicyLossSum.IS_NORM))
_C_NUM_SUMS = tl.constexpr(NUM_SUMS)
assert NUM_SUMS <= 32
# Per-sequence stats row (_seq_stats_kernel): n_i (the kept valid tokens), log s_i (gspo),
# the IS weight (sequence level: w_i, the token kernel's weight; token level: Σ w·m⁰, the
# batch normalisation's), the share L_i / n_i (geo_mean), keep_i (1: the rejection's sequence
# options pass), n⁰_i (the valid tokens before rejection), w_i's rejected flag, unused. Row B
# holds the batch's values: column 0 the IS batch-normalisation mean (_is_batch_norm_kernel).
_NSTAT = tl.constexpr(8)
_S_N = tl.constexpr(0)
_S_LOG_S = tl.constexpr(1)
_S_IS_W = tl.constexpr(2)
_S_GEO = tl.constexpr(3)
_S_KEEP = tl.constexpr(4)
_S_N_RAW = tl.constexpr(5)
_S_SEQ_REJ = tl.constexpr(6)
# Columns of the given sequence statistics (contracts SeqStat; cp_group).
_NUM_SEQ_STATS = tl.constexpr(NUM_SEQ_STATS)
_SS_N = tl.constexpr(int(SeqStat.N))
_SS_N_RAW = tl.constexpr(int(SeqStat.N_RAW))
_SS_DELTA = tl.constexpr(int(SeqStat.DELTA))
_SS_DMIN = tl.constexpr(int(SeqStat.DMIN))
_SS_ADV = tl.constexpr(int(SeqStat.ADV))
_SS_LOGW = tl.constexpr(int(SeqStat.LOGW))
_SS_IS_W = tl.constexpr(int(SeqStat.IS_W))
_SS_GATE = tl.constexpr(int(SeqStat.GATE))
_NA3 = tl.constexpr(5)  # per-sequence A3PO row: polarity, K_high, cut_high, K_low, cut_low
_I64_MAX = tl.constexpr(0x7FFFFFFFFFFFFFFF)
_I64_MIN = tl.constexpr(-0x7FFFFFFFFFFFFFFF - 1)


# ------------------------------------------------------------------ small helpers
@triton.jit
def _param(x, DT: tl.constexpr):
    # x is an fp64 kernel argument (a Python float under the interpreter); one rounding
    # to DT, as torch rounds a Python scalar to a tensor's dtype.
    return (tl.zeros([], tl.float64) + x).to(DT)


@triton.jit
def _segment(cu_ptr, seg, B, T, ok):
    """[begin, end) of packed segment ``seg`` over the sanitised offsets: 0 = head [0, cu[0]),
    1..B = sequence seg − 1, B + 1 = tail [cu[B], T). The clamps are a no-op on sanitised
    offsets; they keep the helper in bounds on its own (and without them the A3PO stats
    kernel spills a register on sm_80)."""
    lo = tl.load(cu_ptr + tl.minimum(tl.maximum(seg - 1, 0), B), mask=ok, other=0)
    hi = tl.load(cu_ptr + tl.minimum(tl.maximum(seg, 0), B), mask=ok, other=0)
    begin = tl.where(seg == 0, 0, tl.minimum(tl.maximum(lo, 0), T))
    end = tl.where(seg == B + 1, T, tl.minimum(tl.maximum(hi, begin), T))
    return begin, end


@triton.jit
def _token_valid(mask_ptr, t, inside, HAS_MASK: tl.constexpr):
    valid = inside
    if HAS_MASK:
        valid = valid & tl.load(mask_ptr + t, mask=inside, other=0).to(tl.int1)
    return valid


@triton.jit
def _order_key(x):
    # int64 with the order of the fp64 values (negative floats: flip the magnitude bits).
    bits = x.to(tl.int64, bitcast=True)
    return bits ^ ((bits >> 63) & _I64_MAX)


@triton.jit
def _a3po_candidates(old, ent, valid, A3PO_ENT: tl.constexpr):
    """Mirrors the candidates of reference a3po_scales: valid tokens whose metric is ≠ 0, and
    the order key of the metric. The reference ranks exp(old) (or the entropy) in fp64: same
    rounding, same ties."""
    if A3PO_ENT:
        metric = ent.to(tl.float64)
    else:
        metric = tl.exp(old.to(tl.float64))
    return valid & (metric != 0.0), _order_key(metric)


@triton.jit
def _load_a3po_candidates(
    mask_ptr, old_ptr, ent_ptr, t, end, CDT: tl.constexpr, HAS_MASK: tl.constexpr, A3PO_ENT: tl.constexpr
):
    """The A3PO candidates and keys of token slots t (< end) of one sequence, from memory."""
    inside = t < end
    valid = _token_valid(mask_ptr, t, inside, HAS_MASK)
    old = tl.load(old_ptr + t, mask=inside, other=0.0).to(CDT)
    ent = old
    if A3PO_ENT:
        ent = tl.load(ent_ptr + t, mask=inside, other=0.0).to(CDT)
    return _a3po_candidates(old, ent, valid, A3PO_ENT)


# ------------------------------------------------------------------ packed layout: program offsets
@triton.jit
def _block_offsets_kernel(
    cu_ptr,  # [B + 1] int64, sanitised
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


# ------------------------------------------------------------------ per-sequence statistics
@triton.jit
def _a3po_select(
    mask_ptr,
    old_ptr,
    ent_ptr,
    begin,
    end,
    pol,  # Σ_t A·m of the sequence, fp64
    ncand,  # candidates (valid, metric ≠ 0)
    key_lo,  # smallest / largest candidate key
    key_hi,
    r_pos_high,
    s_pos_high,
    r_pos_low,
    s_pos_low,
    r_neg_high,
    s_neg_high,
    r_neg_low,
    s_neg_low,
    CDT: tl.constexpr,
    HAS_MASK: tl.constexpr,
    A3PO_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Mirrors reference a3po_scales for one sequence: the threshold key K and the tie cut of
    the high and the low knob of its polarity (a knob that is off never selects). Returns the
    sequence's A3PO row (polarity, K_high, cut_high, K_low, cut_low) in the first _NA3 lanes."""
    lanes = tl.arange(0, BLOCK)
    pos = pol > 0.0
    neg = pol < 0.0
    r_h = tl.where(pos, _param(r_pos_high, tl.float64), _param(r_neg_high, tl.float64))
    s_h = tl.where(pos, _param(s_pos_high, tl.float64), _param(s_neg_high, tl.float64))
    r_l = tl.where(pos, _param(r_pos_low, tl.float64), _param(r_neg_low, tl.float64))
    s_l = tl.where(pos, _param(s_pos_low, tl.float64), _param(s_neg_low, tl.float64))
    has = (pos | neg) & (ncand > 0)
    on_h = has & (r_h > 0.0) & (s_h != 1.0)
    on_l = has & (r_l > 0.0) & (s_l != 1.0)
    nc64 = ncand.to(tl.float64)
    k_h = tl.maximum((nc64 * r_h).to(tl.int64), 1)  # max(1, ⌊n·ratio⌋), Python's int()
    k_l = tl.maximum((nc64 * r_l).to(tl.int64), 1)
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
            cand, key = _load_a3po_candidates(mask_ptr, old_ptr, ent_ptr, start + lanes, end, CDT, HAS_MASK, A3PO_ENT)
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
        cand, key = _load_a3po_candidates(mask_ptr, old_ptr, ent_ptr, start + lanes, end, CDT, HAS_MASK, A3PO_ENT)
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
        cand, key = _load_a3po_candidates(mask_ptr, old_ptr, ent_ptr, t, end, CDT, HAS_MASK, A3PO_ENT)
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
    return row


@triton.jit
def _corrected_weight(raw, rc_low, rc_high, CDT: tl.constexpr, RC: tl.constexpr):
    """Mirrors reference corrected_weight (the C++ corrected_weight), for token lanes and a
    sequence's scalar alike: the IS weight from the raw weight and the flag of a weight a bound
    zeroed. TIS caps at C; decoupled drops weights above C; IcePop keeps the raw weight inside
    [low, C]; MIS keeps 1 inside [low, C]; 0 (rejected) outside."""
    cap = _param(rc_high, CDT)
    if (RC == TOKEN_TIS) or (RC == SEQ_TIS):
        rejected = tl.zeros(raw.shape, tl.int1)
        is_w = tl.minimum(raw, cap)
    elif RC == DECOUPLED:  # drop tokens whose behaviour weight exceeds the cap
        rejected = raw > cap
        is_w = tl.where(rejected, 0.0, raw)
    elif (RC == TOKEN_ICEPOP) or (RC == SEQ_ICEPOP):
        rejected = (raw < _param(rc_low, CDT)) | (raw > cap)
        is_w = tl.where(rejected, 0.0, raw)
    else:  # MIS: 1 inside [low, C], rejected outside
        rejected = (raw < _param(rc_low, CDT)) | (raw > cap)
        is_w = tl.where(rejected, 0.0, 1.0).to(CDT)
    return is_w, rejected


@triton.jit
def _gate_divergence(base, roll, CDT: tl.constexpr, IS_GATE: tl.constexpr):
    """Mirrors reference gate_statistic per token (the C++ gate_divergence): OpenRLHF's
    binary KL (or TV, IS_GATE) of p = exp(rollout), q = exp(base), both clamped to
    [1e-6, 1 − 1e-6]."""
    # 1e-6 rounded once to the compute dtype, as torch rounds the Python scalar (a float
    # literal is an fp32 constant even in fp64 code; 1e6 is exact in both, the division
    # correctly rounded, and 1 − it is 1 − 1e-6 rounded, in fp32 and fp64 alike)
    lo = 1.0 / tl.full([], 1e6, CDT)
    hi = 1.0 - lo
    p = tl.minimum(tl.maximum(tl.exp(roll), lo), hi)
    q = tl.minimum(tl.maximum(tl.exp(base), lo), hi)
    if IS_GATE == GATE_TV:
        stat = tl.abs(p - q)
    else:
        stat = p * tl.log(p / q) + (1.0 - p) * tl.log((1.0 - p) / (1.0 - q))
    return stat


@triton.jit
def _gate_weight(
    base, roll, raw, seq_rej, rc_low, rc_high, CDT: tl.constexpr, IS_GATE: tl.constexpr, GATE_SEQ: tl.constexpr
):
    """Mirrors reference is_weights for rollout_correction GATE (the C++ gate_weight): the
    token weight raw clamped into [low, C] (CLAMP, the tokens outside flagged), or kept where
    the gate's statistic (the token's; GATE_SEQ: the sequence's flag from the stats pass) lies
    in [low, C], else 0; the token stays counted either way."""
    low = _param(rc_low, CDT)
    cap = _param(rc_high, CDT)
    if IS_GATE == GATE_CLAMP:
        rejected = (raw < low) | (raw > cap)
        is_w = tl.minimum(tl.maximum(raw, low), cap)
    else:
        if GATE_SEQ:
            rejected = seq_rej
        else:
            stat = raw
            if IS_GATE != GATE_RATIO:
                stat = _gate_divergence(base, roll, CDT, IS_GATE)
            rejected = (stat < low) | (stat > cap)
        is_w = tl.where(rejected, 0.0, raw)
    return is_w, rejected


@triton.jit
def _rs_divergences(x):
    """Mirrors reference rs_statistics, per token: x clamped to ±20, k1 = −x, k2 = x²/2,
    k3 = eˣ − 1 − x."""
    xs = tl.minimum(tl.maximum(x, -20.0), 20.0)
    return -xs, 0.5 * (xs * xs), (tl.exp(xs) - 1.0) - xs


@triton.jit
def _within(v, lo, hi, ok, CDT: tl.constexpr, ON: tl.constexpr):
    # a k1 option: lo <= v <= hi (log space; bounds rounded to the compute dtype, as torch
    # compares a tensor with a Python scalar)
    if ON:
        ok = ok & (v >= _param(lo, CDT)) & (v <= _param(hi, CDT))
    return ok


@triton.jit
def _below(v, hi, ok, CDT: tl.constexpr, ON: tl.constexpr):
    # a k2 / k3 option: v <= hi
    if ON:
        ok = ok & (v <= _param(hi, CDT))
    return ok


@triton.jit
def _token_keep(k1, k2, k3, k1_low, k1_high, k2_max, k3_max, CDT: tl.constexpr, RS_TOK: tl.constexpr):
    """Mirrors reference rejection_keep, its token options (RS_TOK: bits 0..2 of rs_options) on
    the token's _rs_divergences."""
    keep = tl.full(k1.shape, 1, tl.int1)
    keep = _within(k1, k1_low, k1_high, keep, CDT, (RS_TOK & 1) != 0)
    keep = _below(k2, k2_max, keep, CDT, (RS_TOK & 2) != 0)
    keep = _below(k3, k3_max, keep, CDT, (RS_TOK & 4) != 0)
    return keep


@triton.jit
def _seq_keep(
    s1,  # Σ k1, Σ k2, Σ k3 over the sequence's valid tokens (compute dtype)
    s2,
    s3,
    m1,  # their means
    m2,
    m3,
    x2,  # max k2, max k3
    x3,
    sum_k1_low,
    sum_k1_high,
    sum_k2,
    sum_k3,
    mean_k1_low,
    mean_k1_high,
    mean_k2,
    mean_k3,
    max_k2,
    max_k3,
    CDT: tl.constexpr,
    RS: tl.constexpr,
):
    """Mirrors reference rejection_keep, its sequence options (bits 3..10 of rs_options)."""
    ok = tl.full([], 1, tl.int1)
    ok = _within(s1, sum_k1_low, sum_k1_high, ok, CDT, (RS & 8) != 0)
    ok = _below(s2, sum_k2, ok, CDT, (RS & 16) != 0)
    ok = _below(s3, sum_k3, ok, CDT, (RS & 32) != 0)
    ok = _within(m1, mean_k1_low, mean_k1_high, ok, CDT, (RS & 64) != 0)
    ok = _below(m2, mean_k2, ok, CDT, (RS & 128) != 0)
    ok = _below(m3, mean_k3, ok, CDT, (RS & 256) != 0)
    ok = _below(x2, max_k2, ok, CDT, (RS & 512) != 0)
    ok = _below(x3, max_k3, ok, CDT, (RS & 1024) != 0)
    return ok


@triton.jit
def _seq_stats_kernel(
    logp_ptr,
    old_ptr,  # token-shaped, input dtype
    adv_ptr,  # [B] or token-shaped, compute dtype
    mask_ptr,  # token-shaped bool (HAS_MASK)
    roll_ptr,
    ent_ptr,  # token-shaped, input dtype (NEED_ROLL / A3PO entropy metric)
    cu_ptr,  # [B + 1] int64, sanitised (PACKED)
    seqf_ptr,  # [B + 1, _NSTAT] compute dtype output: the per-sequence stats row (_NSTAT)
    a3po_ptr,  # [B, 5] int64 output (A3PO): polarity, K_high, cut_high, K_low, cut_low
    given_ptr,  # [B, NUM_SEQ_STATS] fp64 (GIVEN): the group's sequence statistics (contracts SeqStat)
    B,
    L,
    T,
    clip_lo: tl.float64,  # geo_mean: ε_low, ε_high
    clip_hi: tl.float64,
    rc_low: tl.float64,
    rc_high: tl.float64,
    r_pos_high: tl.float64,
    s_pos_high: tl.float64,
    r_pos_low: tl.float64,
    s_pos_low: tl.float64,
    r_neg_high: tl.float64,
    s_neg_high: tl.float64,
    r_neg_low: tl.float64,
    s_neg_low: tl.float64,
    rs_token_k1_low: tl.float64,  # the rejection bounds (PolicyLossParams rs_*, in order)
    rs_token_k1_high: tl.float64,
    rs_token_k2: tl.float64,
    rs_token_k3: tl.float64,
    rs_seq_sum_k1_low: tl.float64,
    rs_seq_sum_k1_high: tl.float64,
    rs_seq_sum_k2: tl.float64,
    rs_seq_sum_k3: tl.float64,
    rs_seq_mean_k1_low: tl.float64,
    rs_seq_mean_k1_high: tl.float64,
    rs_seq_mean_k2: tl.float64,
    rs_seq_mean_k3: tl.float64,
    rs_seq_max_k2: tl.float64,
    rs_seq_max_k3: tl.float64,
    CDT: tl.constexpr,
    PACKED: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SEQ_ADV: tl.constexpr,
    NEED_DELTA: tl.constexpr,
    NEED_LOGW: tl.constexpr,
    NEED_GEO: tl.constexpr,
    A3PO: tl.constexpr,
    A3PO_ENT: tl.constexpr,
    RC: tl.constexpr,  # the rollout-correction code (NORM_TOK's corrected weights)
    RS: tl.constexpr,  # rs_options (0: no rejection)
    RC_CURRENT: tl.constexpr,  # x = logprobs − rollout, else old − rollout
    NORM_TOK: tl.constexpr,  # token-level batch normalisation: Σ w·m⁰
    IS_GATE: tl.constexpr,  # GATE_SEQ: what the gate reads (IsGate)
    GATE_SEQ: tl.constexpr,  # the sequence-level gate: its flag from the mean statistic over m⁰
    GIVEN: tl.constexpr,  # the sums of given_ptr (cp_group) replace this call's (the C++ prepass's c.stats)
    BLOCK: tl.constexpr,
):
    """One program per sequence (the C++ prepass): the rejection chain (reference
    rejection_keep: the token options per token, the sequence options on the sums, means and
    maxima of _rs_divergences over the valid tokens m⁰; n_i and every sum below over the kept
    tokens m, n_i = 0 for a rejected sequence), n_i, GSPO's log s_i = Σ δ·m / max(n, 1)
    (reference gspo_term), geo_mean's share L_i / n_i = −Ā_i·r_i / n_i with
    r_i = exp(Σ δ_min·m / n_i), Ā_i = Σ A·m / n_i, n_i floored at 1 (reference geo_mean_term;
    the sums in fp64), the sequence IS log-weight Σ x·m⁰ (reference is_weights), the
    sequence-level gate's flag from the mean over m⁰ of its statistic (reference
    gate_statistic), the batch-norm weight (reference is_batch_norm) and the A3PO row
    (_a3po_select).
    (Long for its signature and the argument lists of the stage helpers.)"""
    i = tl.program_id(0).to(tl.int64)
    if PACKED:
        begin, end = _segment(cu_ptr, i + 1, B, T, True)
    else:
        begin = i * L
        end = begin + L
    lanes = tl.arange(0, BLOCK)
    NEED_ROLL: tl.constexpr = NEED_LOGW or (RS != 0) or NORM_TOK or GATE_SEQ
    COUNT_RAW: tl.constexpr = (RS != 0) or GATE_SEQ  # n⁰_i differs from n_i, or is read
    NEED_LP: tl.constexpr = NEED_DELTA or NEED_GEO or (RC_CURRENT and NEED_ROLL)

    acc_n = tl.zeros([BLOCK], tl.int32)
    acc_n0 = tl.zeros([BLOCK], tl.int32)
    acc_d = tl.zeros([BLOCK], CDT)
    acc_w = tl.zeros([BLOCK], CDT)
    acc_a = tl.zeros([BLOCK], tl.float64)
    acc_c = tl.zeros([BLOCK], tl.int32)
    acc_g = tl.zeros([BLOCK], tl.float64)  # geo_mean: Σ δ_min·m
    acc_k1 = tl.zeros([BLOCK], tl.float64)  # rejection: Σ k1·m⁰, Σ k2·m⁰, Σ k3·m⁰
    acc_k2 = tl.zeros([BLOCK], tl.float64)
    acc_k3 = tl.zeros([BLOCK], tl.float64)
    max_k2 = tl.full([BLOCK], float("-inf"), CDT)
    max_k3 = tl.full([BLOCK], float("-inf"), CDT)
    acc_nw = tl.zeros([BLOCK], tl.float64)  # token-level batch norm: Σ w·m⁰
    acc_gate = tl.zeros([BLOCK], tl.float64)  # the sequence-level gate: Σ stat·m⁰ (ratio: Σ x·m⁰)
    kmin = tl.full([BLOCK], _I64_MAX, tl.int64)
    kmax = tl.full([BLOCK], _I64_MIN, tl.int64)
    stop = end
    if GIVEN:  # (every sum is given)
        stop = begin
    for start in range(begin, stop, BLOCK):
        t = start + lanes
        inside = t < end
        valid0 = _token_valid(mask_ptr, t, inside, HAS_MASK)
        old = tl.load(old_ptr + t, mask=inside, other=0.0).to(CDT)
        lp = old
        if NEED_LP:
            lp = tl.load(logp_ptr + t, mask=inside, other=0.0).to(CDT)
        valid = valid0
        if NEED_ROLL:
            roll = tl.load(roll_ptr + t, mask=inside, other=0.0).to(CDT)
            if RC_CURRENT:
                x = lp - roll
            else:
                x = old - roll
            if NEED_LOGW:
                acc_w += tl.where(valid0, x, 0.0)
            if COUNT_RAW:
                acc_n0 += valid0.to(tl.int32)
            if GATE_SEQ:
                g = x
                if IS_GATE != GATE_RATIO:
                    base = old
                    if RC_CURRENT:
                        base = lp
                    g = _gate_divergence(base, roll, CDT, IS_GATE)
                acc_gate += tl.where(valid0, g.to(tl.float64), 0.0)
            if RS != 0:
                k1, k2, k3 = _rs_divergences(x)
                acc_k1 += tl.where(valid0, k1.to(tl.float64), 0.0)
                acc_k2 += tl.where(valid0, k2.to(tl.float64), 0.0)
                acc_k3 += tl.where(valid0, k3.to(tl.float64), 0.0)
                max_k2 = tl.maximum(max_k2, tl.where(valid0, k2, float("-inf")))
                max_k3 = tl.maximum(max_k3, tl.where(valid0, k3, float("-inf")))
                keep = _token_keep(k1, k2, k3, rs_token_k1_low, rs_token_k1_high, rs_token_k2, rs_token_k3, CDT, RS & 7)
                valid = valid0 & keep
            if NORM_TOK:
                w, _ = _corrected_weight(tl.exp(tl.minimum(tl.maximum(x, -20.0), 20.0)), rc_low, rc_high, CDT, RC)
                acc_nw += tl.where(valid0, w.to(tl.float64), 0.0)
        acc_n += valid.to(tl.int32)
        if NEED_DELTA:  # GSPO: the sequence mean of the unclamped δ
            acc_d += tl.where(valid, lp - old, 0.0)
        if (A3PO or NEED_GEO) and (not SEQ_ADV):  # Σ A·m in fp64: A3PO's polarity, geo_mean's Ā_i
            adv = tl.load(adv_ptr + t, mask=inside, other=0.0)
            acc_a += tl.where(valid, adv.to(tl.float64), 0.0)
        if NEED_GEO:
            if SEQ_ADV:
                adv = tl.load(adv_ptr + i) + tl.zeros([BLOCK], CDT)
            d_min = _geo_mean_log_ratio(lp - old, adv, _param(clip_lo, CDT), _param(clip_hi, CDT))
            acc_g += tl.where(valid, d_min.to(tl.float64), 0.0)
        if A3PO:
            ent = old
            if A3PO_ENT:
                ent = tl.load(ent_ptr + t, mask=inside, other=0.0).to(CDT)
            cand, key = _a3po_candidates(old, ent, valid, A3PO_ENT)
            acc_c += cand.to(tl.int32)
            kmin = tl.minimum(kmin, tl.where(cand, key, _I64_MAX))
            kmax = tl.maximum(kmax, tl.where(cand, key, _I64_MIN))
    row = seqf_ptr + i * _NSTAT
    n = tl.sum(acc_n, 0)
    n_raw = n
    if COUNT_RAW:
        n_raw = tl.sum(acc_n0, 0)
    sum_d = tl.sum(acc_d, 0).to(tl.float64)
    sum_g = tl.sum(acc_g, 0)
    sum_w = tl.sum(acc_w, 0)
    sum_nw = tl.sum(acc_nw, 0)
    sum_gate = tl.sum(acc_gate, 0)
    if GIVEN:  # the group's sums over the whole sequence replace this slice's (N = 0: rejected)
        given = given_ptr + i * _NUM_SEQ_STATS
        n = tl.load(given + _SS_N).to(tl.int32)
        n_raw = tl.load(given + _SS_N_RAW).to(tl.int32)
        sum_d = tl.load(given + _SS_DELTA)
        sum_g = tl.load(given + _SS_DMIN)
        sum_w = tl.load(given + _SS_LOGW).to(CDT)
        sum_nw = tl.load(given + _SS_IS_W)
        sum_gate = tl.load(given + _SS_GATE)
    if RS != 0:  # the sequence options, on the statistics over m⁰
        if GIVEN:  # (applied to the group's statistics already: N = 0)
            seq_ok = n > 0
        else:
            has = n_raw > 0
            nr = tl.maximum(n_raw, 1).to(CDT)
            s1 = tl.sum(acc_k1, 0).to(CDT)
            s2 = tl.sum(acc_k2, 0).to(CDT)
            s3 = tl.sum(acc_k3, 0).to(CDT)
            seq_ok = _seq_keep(
                s1,
                s2,
                s3,
                tl.where(has, s1 / nr, 0.0),
                tl.where(has, s2 / nr, 0.0),
                tl.where(has, s3 / nr, 0.0),
                tl.where(has, tl.max(max_k2, 0), 0.0),
                tl.where(has, tl.max(max_k3, 0), 0.0),
                rs_seq_sum_k1_low,
                rs_seq_sum_k1_high,
                rs_seq_sum_k2,
                rs_seq_sum_k3,
                rs_seq_mean_k1_low,
                rs_seq_mean_k1_high,
                rs_seq_mean_k2,
                rs_seq_mean_k3,
                rs_seq_max_k2,
                rs_seq_max_k3,
                CDT,
                RS,
            )
        n = tl.where(seq_ok, n, 0)
        tl.store(row + _S_KEEP, tl.where(seq_ok, 1.0, 0.0).to(CDT))
    nf = n.to(CDT)
    tl.store(row + _S_N, nf)
    tl.store(row + _S_N_RAW, n_raw.to(CDT))
    if NEED_DELTA:
        if GIVEN:  # (the division in fp64, as the reference and the C++ form it from the sums)
            tl.store(row + _S_LOG_S, (sum_d / tl.maximum(n, 1).to(tl.float64)).to(CDT))
        else:
            tl.store(row + _S_LOG_S, sum_d.to(CDT) / tl.maximum(nf, 1.0))
    if NEED_LOGW:  # the sequence IS weight (reference is_weights): once per sequence, here
        logw = tl.minimum(tl.maximum(sum_w, -20.0), 20.0)
        seq_w, seq_rej = _corrected_weight(tl.exp(logw), rc_low, rc_high, CDT, RC)
        tl.store(row + _S_IS_W, seq_w)
        tl.store(row + _S_SEQ_REJ, tl.where(seq_rej, 1.0, 0.0).to(CDT))
    if GATE_SEQ:  # reference gate_statistic: the mean over the valid tokens before rejection
        stat = tl.where(n_raw > 0, sum_gate.to(CDT) / tl.maximum(n_raw, 1).to(CDT), 0.0)
        if IS_GATE == GATE_RATIO:
            stat = tl.exp(tl.minimum(tl.maximum(stat, -20.0), 20.0))
        gate_rej = (stat < _param(rc_low, CDT)) | (stat > _param(rc_high, CDT))
        tl.store(row + _S_SEQ_REJ, tl.where(gate_rej, 1.0, 0.0).to(CDT))
    if NORM_TOK:
        tl.store(row + _S_IS_W, sum_nw.to(CDT))
    if NEED_GEO:
        nn = tl.maximum(n, 1).to(tl.float64)
        if GIVEN:
            sum_adv = tl.load(given_ptr + i * _NUM_SEQ_STATS + _SS_ADV)
        elif SEQ_ADV:  # Σ A·m = A_i · n_i
            sum_adv = tl.load(adv_ptr + i).to(tl.float64) * n.to(tl.float64)
        else:
            sum_adv = tl.sum(acc_a, 0)
        r = tl.exp((sum_g / nn).to(CDT))
        adv_mean = (sum_adv / nn).to(CDT)
        tl.store(row + _S_GEO, -adv_mean * r / nn.to(CDT))

    if A3PO:
        # Polarity = sign of Σ_t A·m in fp64 (a [B] advantage: A_i · n_i).
        if SEQ_ADV:
            pol = tl.load(adv_ptr + i).to(tl.float64) * n.to(tl.float64)
        else:
            pol = tl.sum(acc_a, 0)
        a3 = _a3po_select(
            mask_ptr,
            old_ptr,
            ent_ptr,
            begin,
            end,
            pol,
            tl.sum(acc_c, 0),
            tl.min(kmin, 0),
            tl.max(kmax, 0),
            r_pos_high,
            s_pos_high,
            r_pos_low,
            s_pos_low,
            r_neg_high,
            s_neg_high,
            r_neg_low,
            s_neg_low,
            CDT,
            HAS_MASK,
            A3PO_ENT,
            BLOCK,
        )
        cols = tl.arange(0, 8)
        tl.store(a3po_ptr + i * _NA3 + cols, a3, mask=cols < _NA3)


@triton.jit
def _is_batch_norm_kernel(
    seqf_ptr,  # [B + 1, _NSTAT]: reads the rows 0..B-1, writes the mean to row B, column 0
    B,
    CDT: tl.constexpr,
    SEQ_LEVEL: tl.constexpr,
    SEQS: tl.constexpr,
):
    """Mirrors reference is_batch_norm (the C++ forward's batch mean), one program, in sequence
    order: the mean of the IS weights over the valid tokens m⁰ (token level: Σ_i Σ w·m⁰ / Σ_i
    n⁰_i) or over the sequences with a valid token (sequence level); 1 when it is <= 1e-8."""
    lanes = tl.arange(0, SEQS).to(tl.int64)
    num = tl.zeros([SEQS], tl.float64)
    den = tl.zeros([SEQS], tl.float64)
    for start in range(0, B, SEQS):
        s = start + lanes
        ok = s < B
        w = tl.load(seqf_ptr + s * _NSTAT + _S_IS_W, mask=ok, other=0.0).to(tl.float64)
        n0 = tl.load(seqf_ptr + s * _NSTAT + _S_N_RAW, mask=ok, other=0.0).to(tl.float64)
        if SEQ_LEVEL:
            num += tl.where(n0 > 0.0, w, 0.0)
            den += tl.where(n0 > 0.0, 1.0, 0.0)
        else:
            num += w
            den += n0
    num_t = tl.sum(num, 0)
    den_t = tl.sum(den, 0)
    mu = tl.where(den_t > 0.0, num_t.to(CDT) / tl.maximum(den_t, 1.0).to(CDT), 0.0)
    # 1e-8 rounded once to the compute dtype (a float literal is an fp32 constant even in
    # fp64 code; 1e8 is exact in both, the division correctly rounded)
    eps = 1.0 / tl.full([], 1e8, CDT)
    tl.store(seqf_ptr + B * _NSTAT, tl.where(mu > eps, mu, 1.0).to(CDT))


# ------------------------------------------------------------------ token stages
@triton.jit
def _program_span(
    p, cu_ptr, boff_ptr, B, L, T, NBL, PACKED: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr
):
    """The token slots [begin, end) of program p, the row of its sequence, whether it is a
    sequence (not a packed head / tail or an idle program) and the sequence length."""
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
    return row, begin, end, is_seq, seq_len


@triton.jit
def _log_ratio(lp, old, lr_clamp, CDT: tl.constexpr, LR_CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    """Mirrors reference log_ratio: δ = logp − old, clamped to ±lr_clamp (LR_CLAMP), and
    ∂δ/∂logp (torch.clamp passes the gradient on the closed interval)."""
    delta_raw = lp - old
    if LR_CLAMP:
        c = _param(lr_clamp, CDT)
        delta = tl.minimum(tl.maximum(delta_raw, -c), c)
        d_delta = tl.where((delta_raw >= -c) & (delta_raw <= c), 1.0, 0.0).to(CDT)
    else:
        delta = delta_raw
        d_delta = tl.full([BLOCK], 1.0, CDT)
    return delta, d_delta


@triton.jit
def _clipped_objective(adv, x, dl1, lo, hi):
    """Mirrors reference clipped_objective: max(l1, l2) with l1 = −A·x, l2 = −A·clamp(x, lo,
    hi), its derivative from dl1 = ∂l1/∂logp (torch.maximum: the larger branch's gradient, half
    to each on a tie; clamp passes [lo, hi]), and the clip flag."""
    l1 = -adv * x
    l2 = -adv * tl.minimum(tl.maximum(x, lo), hi)
    pg = tl.maximum(l1, l2)
    dl2 = tl.where((x >= lo) & (x <= hi), dl1, 0.0)
    dpg = tl.where(l1 > l2, dl1, tl.where(l2 > l1, dl2, 0.5 * (dl1 + dl2)))
    return pg, dpg, l2 > l1


@triton.jit
def _clip_sides(x, adv, valid, lo, hi):
    """Mirrors reference clip_sides: the clip sides of the ratio x (PolicyLossSum.CLIP_LOW /
    CLIP_HIGH): below lo with A < 0, above hi with A > 0, on valid tokens."""
    return valid & (x < lo) & (adv < 0.0), valid & (x > hi) & (adv > 0.0)


@triton.jit
def _dual_clip(pg, dpg, adv, clip_c, CDT: tl.constexpr):
    """Mirrors reference dual_clip: for A < 0, min(pg, −A·c) (torch.minimum passes half the
    gradient on a tie); returns (pg, ∂pg/∂logp, clip_lower), clip_lower the A < 0 tokens it
    bounds. Shared by _ppo_term and _gspo_term (gspo_dual_clip)."""
    l3 = -adv * _param(clip_c, CDT)
    neg = adv < 0.0
    clip_lower = neg & (pg > l3)
    dpg = tl.where(neg, tl.where(pg < l3, dpg, tl.where(pg == l3, 0.5 * dpg, 0.0)), dpg)
    pg = tl.where(neg, tl.minimum(pg, l3), pg)
    return pg, dpg, clip_lower


@triton.jit
def _gspo_ratio(log_s, gspo_clamp, CDT: tl.constexpr):
    """Mirrors reference gspo_ratio: s = exp(min(log s_i, clamp)) from the stats pass, and
    ∂s_{i,t}/∂logp_t = s while log s_i is under the clamp (else 0)."""
    g = _param(gspo_clamp, CDT)
    s = tl.exp(tl.minimum(log_s, g))
    return s, tl.where(log_s <= g, s, 0.0)


@triton.jit
def _ppo_term(
    lp,
    old,
    adv,
    valid,
    lo,
    hi,
    clip_c,
    lr_clamp,
    CDT: tl.constexpr,
    LR_CLAMP: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Mirrors reference ppo_term: _clipped_objective of exp(δ), then _dual_clip; returns
    (pg, ∂pg/∂logp, clipped, clip_lower, δ, low, high)."""
    delta, d_delta = _log_ratio(lp, old, lr_clamp, CDT, LR_CLAMP, BLOCK)
    ratio = tl.exp(delta)
    pg, dpg, clipped = _clipped_objective(adv, ratio, -adv * ratio * d_delta, lo, hi)
    clip_lower = valid & False
    if DUAL_CLIP:
        pg, dpg, clip_lower = _dual_clip(pg, dpg, adv, clip_c, CDT)
    low, high = _clip_sides(ratio, adv, valid, lo, hi)
    return pg, dpg, clipped, clip_lower, delta, low, high


@triton.jit
def _gspo_term(lp, old, adv, valid, log_s, lo, hi, clip_c, gspo_clamp, CDT: tl.constexpr, DUAL_CLIP: tl.constexpr):
    """Mirrors reference gspo_term: _clipped_objective of _gspo_ratio, then _dual_clip
    (gspo_dual_clip)."""
    s, ds = _gspo_ratio(log_s, gspo_clamp, CDT)
    pg, dpg, clipped = _clipped_objective(adv, s, -adv * ds, lo, hi)
    clip_lower = valid & False
    if DUAL_CLIP:
        pg, dpg, clip_lower = _dual_clip(pg, dpg, adv, clip_c, CDT)
    low, high = _clip_sides(s, adv, valid, lo, hi)
    return pg, dpg, clipped, clip_lower, lp - old, low, high


@triton.jit
def _cispo_term(lp, old, adv, valid, lo, hi, lr_clamp, CDT: tl.constexpr, LR_CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    """Mirrors reference cispo_term: −sg(clamp(ratio))·A·logp (the clipped ratio is a constant)."""
    delta, _ = _log_ratio(lp, old, lr_clamp, CDT, LR_CLAMP, BLOCK)
    ratio = tl.exp(delta)
    cr = tl.minimum(tl.maximum(ratio, lo), hi)
    dpg = -cr * adv
    low, high = _clip_sides(ratio, adv, valid, lo, hi)
    return dpg * lp, dpg, ratio != cr, valid & False, delta, low, high


@triton.jit
def _sapo_term(
    lp, old, adv, valid, tau_pos, tau_neg, lr_clamp, CDT: tl.constexpr, LR_CLAMP: tl.constexpr, BLOCK: tl.constexpr
):
    """Mirrors reference sapo_term: −σ(τ·(ratio − 1))·(4/τ)·A."""
    delta, d_delta = _log_ratio(lp, old, lr_clamp, CDT, LR_CLAMP, BLOCK)
    ratio = tl.exp(delta)
    tau = tl.where(adv > 0.0, _param(tau_pos, CDT), _param(tau_neg, CDT))
    sig = tl.sigmoid(tau * (ratio - 1.0))
    k = 4.0 / tau
    pg = -(sig * k) * adv
    dpg = (-adv * k) * ((1.0 - sig) * sig) * tau * ratio * d_delta
    return pg, dpg, valid & False, valid & False, delta, valid & False, valid & False


@triton.jit
def _reinforce_term(lp, old, adv, valid):
    """Mirrors reference reinforce_term: −A·logp."""
    return -adv * lp, -adv, valid & False, valid & False, lp - old, valid & False, valid & False


@triton.jit
def _dppo_keep(lp, old, adv, lo, hi, CDT: tl.constexpr, LOSS: tl.constexpr, BLOCK: tl.constexpr):
    """Mirrors reference dppo_keep: the trust-region mask (lo, hi: the thresholds δ_low,
    δ_high). DPPO_TV: p − p_old <= δ_high for A > 0, >= −δ_low otherwise. DPPO_KL: kl =
    p_old·(old − logp) + (1 − p_old)·log((1 − p_old + 1e-8) / (1 − p + 1e-8)), kl <= δ_high
    or p <= p_old for A > 0, kl <= δ_low or p >= p_old otherwise."""
    p = tl.exp(lp)
    p_old = tl.exp(old)
    if LOSS == DPPO_TV:
        d = p - p_old
        keep = tl.where(adv > 0.0, d <= hi, d >= -lo)
    else:
        # 1e-8 rounded once to the compute dtype, as torch rounds the Python scalar (a float
        # literal is an fp32 constant even in fp64 code; 1e8 is exact in both, the division
        # correctly rounded)
        eps = 1.0 / tl.full([BLOCK], 1e8, CDT)
        kl = p_old * (old - lp) + (1.0 - p_old) * tl.log((1.0 - p_old + eps) / (1.0 - p + eps))
        keep = tl.where(adv > 0.0, (kl <= hi) | (p <= p_old), (kl <= lo) | (p >= p_old))
    return keep


@triton.jit
def _dppo_term(
    lp,
    old,
    adv,
    valid,
    lo,
    hi,
    clip_c,
    lr_clamp,
    CDT: tl.constexpr,
    LOSS: tl.constexpr,
    LR_CLAMP: tl.constexpr,
    CAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Mirrors reference dppo_term (with dppo_ratio): −A·sg(min(ρ, c))·logp·keep, the truncated
    ratio and keep = _dppo_keep constants (CAP: the cap c is on); clipped = outside the
    region, clip_lower = kept with ρ > c."""
    delta, _ = _log_ratio(lp, old, lr_clamp, CDT, LR_CLAMP, BLOCK)
    ratio = tl.exp(delta)
    capped = valid & False
    trunc = ratio
    if CAP:
        c = _param(clip_c, CDT)
        capped = ratio > c  # torch.clamp(max=c): NaN stays NaN
        trunc = tl.where(capped, c, ratio)
    keep = _dppo_keep(lp, old, adv, lo, hi, CDT, LOSS, BLOCK)
    coef = -adv * trunc
    dpg = tl.where(keep, coef, 0.0)
    pg = tl.where(keep, coef * lp, 0.0)
    return pg, dpg, ~keep, keep & capped, delta, valid & False, valid & False


@triton.jit
def _geo_mean_log_ratio(delta, adv, eps_low, eps_high):
    """Mirrors reference geo_mean_log_ratio (in the per-sequence pass): δ clipped above at
    ε_high for A > 0, below at −ε_low for A < 0, 0 for A = 0."""
    pos = tl.where(delta > eps_high, eps_high, delta)
    neg = tl.where(delta < -eps_low, -eps_low, delta)
    return tl.where(adv > 0.0, pos, tl.where(adv < 0.0, neg, 0.0))


@triton.jit
def _geo_mean_term(lp, old, adv, valid, share, lo, hi):
    """Mirrors reference geo_mean_term: every valid token carries its sequence's share
    L_i / n_i (the stats pass) and the derivative share·∂δ_min/∂δ: the share, except 0 where
    the clip binds (A > 0 and δ > ε_high, A < 0 and δ < −ε_low; the bounds themselves pass, as
    torch.minimum's halves of a tie add up to 1) and for A = 0 (lo, hi: ε_low, ε_high).
    clipped = δ outside [−ε_low, ε_high] with A > 0, clip_lower the same with A < 0."""
    delta = lp - old
    pos = adv > 0.0
    neg = adv < 0.0
    above = delta > hi
    below = delta < -lo
    outside = above | below
    dpg = tl.where((pos & ~above) | (neg & ~below), share, 0.0)
    return share, dpg, outside & pos, outside & neg, delta, valid & False, valid & False


@triton.jit
def _dro_term(lp, old, adv, valid, half_dro_beta, CDT: tl.constexpr):
    """Mirrors reference dro_term: −(logp·A − ½β·δ²), δ = logp − old unclamped, so
    ∂pg/∂logp = ½β·2δ − A (half_dro_beta: Python's 0.5·β, rounded to the compute dtype)."""
    hb = _param(half_dro_beta, CDT)
    delta = lp - old
    pg = -(lp * adv - hb * (delta * delta))
    dpg = hb * (delta + delta) - adv
    return pg, dpg, valid & False, valid & False, delta, valid & False, valid & False


@triton.jit
def _clip_cov_term(
    lp, old, adv, valid, sel, lo, hi, lr_clamp, CDT: tl.constexpr, LR_CLAMP: tl.constexpr, BLOCK: tl.constexpr
):
    """Mirrors reference clip_cov_term: ppo's _clipped_objective of exp(δ) without the dual
    clip, 0 (value and gradient) on the covariance-selected tokens ``sel``; clipped = sel (the
    CLIP count is the selected valid tokens), the clip sides are ppo's."""
    delta, d_delta = _log_ratio(lp, old, lr_clamp, CDT, LR_CLAMP, BLOCK)
    ratio = tl.exp(delta)
    pg, dpg, _ = _clipped_objective(adv, ratio, -adv * ratio * d_delta, lo, hi)
    low, high = _clip_sides(ratio, adv, valid, lo, hi)
    return tl.where(sel, 0.0, pg), tl.where(sel, 0.0, dpg), sel, valid & False, delta, low, high


@triton.jit
def _kl_cov_term(
    lp, old, adv, valid, sel, kl_cov_coef, lr_clamp, CDT: tl.constexpr, LR_CLAMP: tl.constexpr, BLOCK: tl.constexpr
):
    """Mirrors reference kl_cov_term: −A·ρ + kl_cov_coef·|δ| on the selected tokens (∂|δ|/∂δ =
    sign(δ), 0 at δ = 0, as torch.abs); clipped = sel; the δ slot holds −|δ| (NEG_DELTA: Σ m·|δ|)."""
    delta, d_delta = _log_ratio(lp, old, lr_clamp, CDT, LR_CLAMP, BLOCK)
    ratio = tl.exp(delta)
    coef = _param(kl_cov_coef, CDT)
    abs_delta = tl.where(delta < 0.0, -delta, delta)
    sign = tl.where(delta > 0.0, 1.0, tl.where(delta < 0.0, -1.0, 0.0)).to(CDT)
    pg = -adv * ratio + tl.where(sel, coef * abs_delta, 0.0)
    dpg = (-adv * ratio + tl.where(sel, coef * sign, 0.0)) * d_delta
    return pg, dpg, sel, valid & False, -abs_delta, valid & False, valid & False


@triton.jit
def _pg_term(
    lp,
    old,
    adv,
    valid,
    log_s,  # GSPO: log s_i of the program's sequence
    geo_share,  # geo_mean: L_i / n_i of the program's sequence
    clip_lo,
    clip_hi,
    clip_c,
    lr_clamp,
    gspo_clamp,
    tau_pos,
    tau_neg,
    half_dro_beta,
    sel,  # clip_cov / kl_cov: the covariance selection
    kl_cov_coef,
    CDT: tl.constexpr,
    LOSS: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    LR_CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Mirrors reference pg_term: (pg, ∂pg/∂logp, clipped, clip_lower, δ for ppo_kl) and the
    clip sides (low, high) of reference clip_sides."""
    lo = _param(clip_lo, CDT)
    hi = _param(clip_hi, CDT)
    if LOSS == CLIP_COV:
        return _clip_cov_term(lp, old, adv, valid, sel, lo, hi, lr_clamp, CDT, LR_CLAMP, BLOCK)
    elif LOSS == KL_COV:
        return _kl_cov_term(lp, old, adv, valid, sel, kl_cov_coef, lr_clamp, CDT, LR_CLAMP, BLOCK)
    elif LOSS == PPO:
        return _ppo_term(lp, old, adv, valid, lo, hi, clip_c, lr_clamp, CDT, LR_CLAMP, DUAL_CLIP, BLOCK)
    elif LOSS == GSPO:
        return _gspo_term(lp, old, adv, valid, log_s, lo, hi, clip_c, gspo_clamp, CDT, DUAL_CLIP)
    elif LOSS == CISPO:
        return _cispo_term(lp, old, adv, valid, lo, hi, lr_clamp, CDT, LR_CLAMP, BLOCK)
    elif LOSS == SAPO:
        return _sapo_term(lp, old, adv, valid, tau_pos, tau_neg, lr_clamp, CDT, LR_CLAMP, BLOCK)
    elif (LOSS == DPPO_TV) or (LOSS == DPPO_KL):  # (DUAL_CLIP: the truncation cap is on)
        return _dppo_term(lp, old, adv, valid, lo, hi, clip_c, lr_clamp, CDT, LOSS, LR_CLAMP, DUAL_CLIP, BLOCK)
    elif LOSS == GEO_MEAN:  # (no log_ratio_clamp, as verl)
        return _geo_mean_term(lp, old, adv, valid, geo_share, lo, hi)
    elif LOSS == DRO:
        return _dro_term(lp, old, adv, valid, half_dro_beta, CDT)
    else:  # REINFORCE
        return _reinforce_term(lp, old, adv, valid)


@triton.jit
def _a3po_scale(cand, key, t, pol, k_h, cut_h, k_l, cut_l, s_pos_high, s_pos_low, s_neg_high, s_neg_low):
    """Mirrors reference a3po_scales (token side): the scales of the knobs whose threshold
    (from the stats pass) selects the token."""
    sel_h = cand & ((key > k_h) | ((key == k_h) & (t < cut_h)))
    sel_l = cand & ((key < k_l) | ((key == k_l) & (t < cut_l)))
    sc_h = tl.where(pol > 0, _param(s_pos_high, tl.float64), _param(s_neg_high, tl.float64))
    sc_l = tl.where(pol > 0, _param(s_pos_low, tl.float64), _param(s_neg_low, tl.float64))
    return tl.where(sel_h, sc_h, 1.0) * tl.where(sel_l, sc_l, 1.0)


@triton.jit
def _shaping_weights(
    adv,
    old,
    ent,
    valid,
    t,
    row,
    is_seq,
    a3po_ptr,
    thr_ptr,
    w_pos,
    w_neg,
    prob_lambda,
    s_pos_high,
    s_pos_low,
    s_neg_high,
    s_neg_low,
    SHAPE_POL: tl.constexpr,
    SHAPE_PROB: tl.constexpr,
    A3PO: tl.constexpr,
    A3PO_ENT: tl.constexpr,
    ENT_Q: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Mirrors reference shaping_weights: w = polarity × probability × A3PO scales × entropy
    keep, in fp64 like the reference (a constant). Returns (A in fp64, w in fp64)."""
    adv64 = adv.to(tl.float64)
    w64 = tl.full([BLOCK], 1.0, tl.float64)
    if SHAPE_POL:  # polarity_weights
        w64 = tl.where(adv64 > 0.0, _param(w_pos, tl.float64), tl.where(adv64 < 0.0, _param(w_neg, tl.float64), 1.0))
    if SHAPE_PROB:  # probability_weights
        pr = tl.exp(old.to(tl.float64))
        wp = tl.where(adv64 > 0.0, 1.0 - pr, tl.where(adv64 < 0.0, pr, 0.0))
        lam = _param(prob_lambda, tl.float64)
        w64 = w64 * ((1.0 - lam) + lam * wp)
    if A3PO:
        cand, key = _a3po_candidates(old, ent, valid, A3PO_ENT)
        a3 = a3po_ptr + row * _NA3
        pol = tl.load(a3 + 0, mask=is_seq, other=0)
        k_h = tl.load(a3 + 1, mask=is_seq, other=_I64_MAX)
        cut_h = tl.load(a3 + 2, mask=is_seq, other=-1)
        k_l = tl.load(a3 + 3, mask=is_seq, other=_I64_MIN)
        cut_l = tl.load(a3 + 4, mask=is_seq, other=-1)
        w64 = w64 * _a3po_scale(cand, key, t, pol, k_h, cut_h, k_l, cut_l, s_pos_high, s_pos_low, s_neg_high, s_neg_low)
    if ENT_Q:  # entropy_keep
        keep = ent.to(tl.float32) >= tl.load(thr_ptr)
        w64 = w64 * tl.where(keep, 1.0, 0.0)
    return adv64, w64


@triton.jit
def _is_weights(
    base,
    roll,
    seq_w,
    seq_rej,
    is_mu,
    rc_low,
    rc_high,
    CDT: tl.constexpr,
    RC: tl.constexpr,
    SEQ_RC: tl.constexpr,
    IS_NORM: tl.constexpr,
    IS_GATE: tl.constexpr,
    GATE_SEQ: tl.constexpr,
):
    """Mirrors reference is_weights (and is_batch_norm's division): the detached
    rollout-correction weight and the rejected flag. Token level: _corrected_weight of
    exp(clamp(x, ±20)), x = base − rollout (base: old, or logprobs with rc_current); sequence
    level (SEQ_RC): the sequence's weight and flag from the stats pass (the same
    _corrected_weight of exp(clamp(Σ x·m⁰, ±20))); GATE: _gate_weight of the token's
    exp(clamp(x, ±20)) (GATE_SEQ: with the sequence's flag seq_rej); over the batch mean
    is_mu with IS_NORM."""
    if SEQ_RC:
        is_w = seq_w
        rejected = seq_rej
    else:
        raw = tl.exp(tl.minimum(tl.maximum(base - roll, -20.0), 20.0))
        if RC == GATE:
            is_w, rejected = _gate_weight(base, roll, raw, seq_rej, rc_low, rc_high, CDT, IS_GATE, GATE_SEQ)
        else:
            is_w, rejected = _corrected_weight(raw, rc_low, rc_high, CDT, RC)
    if IS_NORM:
        is_w = is_w / is_mu
    return is_w, rejected


@triton.jit
def _kl_quadratic(
    x,
    K1_EST: tl.constexpr,
    KL_CLAMP: tl.constexpr,
    KL_IN: tl.constexpr,
    KL_OUT: tl.constexpr,
    CDT: tl.constexpr,
):
    """k1 / k2 (reference kl_estimate's first branch) with the clamps of kl_clamp = ALL: the
    estimate, its ∂/∂logp and live (no clamp active)."""
    live = x == x
    if KL_IN > 0 and KL_CLAMP == KL_CLAMP_ALL:
        live = (x >= -KL_IN) & (x <= KL_IN)
        x = tl.minimum(tl.maximum(x, -KL_IN), KL_IN)
    if K1_EST:
        v = x
        d = tl.full(x.shape, 1.0, CDT)
    else:
        v = 0.5 * (x * x)
        d = x
    if KL_OUT > 0 and KL_CLAMP == KL_CLAMP_ALL:
        live = live & (v >= -KL_OUT) & (v <= KL_OUT)
        v = tl.minimum(tl.maximum(v, -KL_OUT), KL_OUT)
    if (KL_IN > 0 or KL_OUT > 0) and KL_CLAMP == KL_CLAMP_ALL:
        d = tl.where(live, d, 0.0)
    return v, d, live


@triton.jit
def _kl_estimate(
    lp,
    ref,
    KL: tl.constexpr,
    KL_CLAMP: tl.constexpr,
    KL_IN: tl.constexpr,
    KL_OUT: tl.constexpr,
    CDT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Mirrors reference kl_estimate, the one home of the KL estimators: the estimate, its
    ∂/∂logp and live (no clamp active: reference kl_clamped; k3+: the value of k3, the
    gradient of k2, each clamped as on its own). KL_CLAMP: the KlClamp scope of the KL_IN /
    KL_OUT clamps (constexpr bounds, 0 = off: folded like literals)."""
    x = lp - ref
    if KL == K1:
        kl, dkl, live = _kl_quadratic(x, True, KL_CLAMP, KL_IN, KL_OUT, CDT)
    elif KL == K2:
        kl, dkl, live = _kl_quadratic(x, False, KL_CLAMP, KL_IN, KL_OUT, CDT)
    else:
        y = ref - lp
        d3 = tl.full([BLOCK], 1.0, CDT)
        if KL_IN > 0 and KL_CLAMP != KL_CLAMP_NONE:
            d3 = tl.where((y >= -KL_IN) & (y <= KL_IN), d3, 0.0)
            y = tl.minimum(tl.maximum(y, -KL_IN), KL_IN)
        ey = tl.exp(y)
        kl = ey - y - 1.0
        if KL_OUT > 0 and KL_CLAMP != KL_CLAMP_NONE:
            d3 = tl.where((kl >= -KL_OUT) & (kl <= KL_OUT), d3, 0.0)
            kl = tl.minimum(tl.maximum(kl, -KL_OUT), KL_OUT)
        if KL == K3:
            dkl = (1.0 - ey) * d3
            live = d3 != 0.0
        else:  # K3_PLUS
            _, dkl, live = _kl_quadratic(x, False, KL_CLAMP, KL_IN, KL_OUT, CDT)
    return kl, dkl, live


@triton.jit
def _importance_ratio(
    lp,
    old,
    log_s,
    lr_clamp,
    gspo_clamp,
    CDT: tl.constexpr,
    LOSS: tl.constexpr,
    LR_CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Mirrors reference importance_ratio: the ratio r the loss type is built on and its
    own-token derivative dr: exp(δ) through _log_ratio, GSPO's _gspo_ratio."""
    if LOSS == GSPO:
        r, dr = _gspo_ratio(log_s, gspo_clamp, CDT)
    else:
        delta, d_delta = _log_ratio(lp, old, lr_clamp, CDT, LR_CLAMP, BLOCK)
        r = tl.exp(delta)
        dr = r * d_delta
    return r, dr


@triton.jit
def _kl_term(
    lp,
    old,
    ref,
    log_s,
    lr_clamp,
    gspo_clamp,
    CDT: tl.constexpr,
    LOSS: tl.constexpr,
    KL: tl.constexpr,
    KL_CLAMP: tl.constexpr,
    KL_IN: tl.constexpr,
    KL_OUT: tl.constexpr,
    KL_RATIO: tl.constexpr,
    KL_SCORE: tl.constexpr,
    LR_CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Mirrors reference kl_term: _kl_estimate, times _importance_ratio with KL_RATIO
    (kl_ratio_correction: d(kl·r) = dkl·r + kl·dr); KL_SCORE (kl_score_grad) adds kl to the
    derivative where the estimate is live."""
    kl, dkl, live = _kl_estimate(lp, ref, KL, KL_CLAMP, KL_IN, KL_OUT, CDT, BLOCK)
    if KL_RATIO:
        r, dr = _importance_ratio(lp, old, log_s, lr_clamp, gspo_clamp, CDT, LOSS, LR_CLAMP, BLOCK)
        dkl = dkl * r + kl * dr
        kl = kl * r
    if KL_SCORE:
        dkl = dkl + tl.where(live, kl, 0.0)
    return kl, dkl


@triton.jit
def _token_loss(
    pg,
    dpg,
    w,
    is_w,
    kl,
    dkl,
    ent,
    beta,
    ec,
    SHAPING: tl.constexpr,
    RC: tl.constexpr,
    KL: tl.constexpr,
    ENT_TERM: tl.constexpr,
):
    """Mirrors reference token_loss: ℓ = pg·w·is_w + β·kl − c_H·H, pg·w·is_w, and ∂ℓ/∂logp."""
    pgw = pg
    dlp = dpg
    if SHAPING:
        pgw = pgw * w
        dlp = dlp * w
    if RC != RC_NONE:
        pgw = pgw * is_w
        dlp = dlp * is_w
    ell = pgw
    if KL != KL_NONE:
        ell = ell + beta * kl
        dlp = dlp + beta * dkl
    if ENT_TERM:
        ell = ell - ec * ent
    return ell, pgw, dlp


@triton.jit
def _aggregate(
    ell,
    pgw,
    kl,
    dlp,
    ec,
    n_i,
    SEQ_MEAN: tl.constexpr,
):
    """Mirrors reference aggregate, the kernel's share of it: ℓ, pg·w·is_w, kl, ∂ℓ/∂logp and
    ∂ℓ/∂H = −c_H times the aggregation weight agg_w (1/n_i for seq-mean-token-mean, else 1;
    the valid selection is _partial_sums' and the stores'). The scalar normalisation (1/N_tok,
    1/N_seq, dp_size, loss_scale_factor) is the op layer's _aggregate."""
    if SEQ_MEAN:
        agg_w = 1.0 / tl.maximum(n_i, 1.0)
        ell = ell * agg_w
        pgw = pgw * agg_w
        kl = kl * agg_w
        dlp = dlp * agg_w
        grad_ent = -ec * agg_w
    else:
        grad_ent = -ec
    return ell, pgw, kl, dlp, grad_ent


@triton.jit
def _partial_sums(
    valid,
    ell_a,  # agg_w·ℓ
    pgw_a,  # agg_w·pg·w·is_w
    kl,
    kl_a,  # agg_w·kl
    clipped,
    clip_lower,
    low,
    high,
    delta,
    is_w,
    rejected,
    w,
    ent,
    nonfinite,  # a token with a non-finite input (NaN lanes)
    CDT: tl.constexpr,
    LOSS: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    KL: tl.constexpr,
    RC: tl.constexpr,
    SHAPING: tl.constexpr,
    HAS_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The sums of _aggregate's outputs and of the metrics: one row of the program's partial
    sums (PolicyLossSum columns; fixed-order tree sums inside the block)."""
    zero = tl.zeros([BLOCK], CDT)
    one = tl.full([BLOCK], 1.0, CDT)
    cols = tl.arange(0, _NP)
    part = tl.zeros([_NP], CDT)
    part = tl.where(cols == _C_TOTAL, tl.sum(tl.where(valid, ell_a, zero), 0), part)
    part = tl.where(cols == _C_PG, tl.sum(tl.where(valid, pgw_a, zero), 0), part)
    ntok = tl.sum(tl.where(valid, one, zero), 0)
    part = tl.where(cols == _C_NTOK, ntok, part)
    CLIPS: tl.constexpr = (LOSS == PPO) or (LOSS == GSPO) or (LOSS == CISPO) or (LOSS == DPPO_TV) or (LOSS == DPPO_KL)
    COV: tl.constexpr = (LOSS == CLIP_COV) or (LOSS == KL_COV)  # (CLIP: the selected tokens)
    if CLIPS or COV or (LOSS == GEO_MEAN):  # these clip
        part = tl.where(cols == _C_CLIP, tl.sum(tl.where(valid & clipped, one, zero), 0), part)
        part = tl.where(cols == _C_CLIP_LOW, tl.sum(tl.where(low, one, zero), 0), part)
        part = tl.where(cols == _C_CLIP_HIGH, tl.sum(tl.where(high, one, zero), 0), part)
    if DUAL_CLIP or (LOSS == GEO_MEAN):  # (geo_mean: δ outside the bounds with A < 0)
        part = tl.where(cols == _C_CLIP_LOWER, tl.sum(tl.where(valid & clip_lower, one, zero), 0), part)
    part = tl.where(cols == _C_NEG_DELTA, tl.sum(tl.where(valid, -delta, zero), 0), part)
    if RC != RC_NONE:
        part = tl.where(cols == _C_IS, tl.sum(tl.where(valid, is_w, zero), 0), part)
        part = tl.where(cols == _C_IS_MAX, tl.max(tl.where(valid, is_w, zero), 0), part)
    else:  # is_w = 1
        part = tl.where(cols == _C_IS, ntok, part)
        part = tl.where(cols == _C_IS_MAX, tl.minimum(ntok, 1.0), part)
    if KL != KL_NONE:
        part = tl.where(cols == _C_KL, tl.sum(tl.where(valid, kl_a, zero), 0), part)
        part = tl.where(cols == _C_KL_RAW, tl.sum(tl.where(valid, kl, zero), 0), part)
    REJECTS: tl.constexpr = (RC == TOKEN_MIS) or (RC == SEQ_MIS) or (RC == DECOUPLED) or (RC == GATE)
    if REJECTS or (RC == TOKEN_ICEPOP) or (RC == SEQ_ICEPOP):  # these reject (GATE CLAMP: outside its bounds)
        part = tl.where(cols == _C_REJECT, tl.sum(tl.where(valid & rejected, one, zero), 0), part)
    if SHAPING:
        part = tl.where(cols == _C_SHAPED, tl.sum(tl.where(valid & (w != 1.0), one, zero), 0), part)
    if HAS_ENT:
        part = tl.where(cols == _C_ENT, tl.sum(tl.where(valid, ent, zero), 0), part)
    part = tl.where(cols == _C_NONFINITE, tl.sum(tl.where(valid & nonfinite, one, zero), 0), part)
    return part


# ------------------------------------------------------------------ the token kernel
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
    cov_ptr,  # token-shaped bool: the covariance selection (clip_cov / kl_cov)
    cu_ptr,  # [B + 1] int64, sanitised (PACKED)
    boff_ptr,  # [B + 3] int64 program offsets of the packed segments (PACKED)
    seqf_ptr,  # [B + 1, _NSTAT] compute dtype, from _seq_stats_kernel (and _is_batch_norm_kernel)
    a3po_ptr,  # [B, 5] int64, from _seq_stats_kernel (A3PO)
    grad_ptr,  # token-shaped compute dtype: agg_w · ∂ℓ/∂logp
    gent_ptr,  # token-shaped compute dtype: agg_w · ∂ℓ/∂entropy (ENT_GRAD)
    tok_ptr,  # token-shaped compute dtype: the TOKEN_OUT output (TokenOut)
    part_ptr,  # [programs, 32] compute dtype: per-program partial sums (PolicyLossSum columns)
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
    half_dro_beta: tl.float64,
    kl_cov_coef: tl.float64,
    rs_token_k1_low: tl.float64,  # the rejection's token bounds (PolicyLossParams rs_token_*)
    rs_token_k1_high: tl.float64,
    rs_token_k2: tl.float64,
    rs_token_k3: tl.float64,
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
    KL_RATIO: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
    KL_IN: tl.constexpr,
    KL_OUT: tl.constexpr,
    KL_SCORE: tl.constexpr,
    RS_TOK: tl.constexpr,  # the rejection's token options (bits 0..2 of rs_options)
    RS_SEQ: tl.constexpr,  # a sequence option of the rejection is on (keep_i from the stats pass)
    RC_CURRENT: tl.constexpr,  # the rollout log-ratio from logprobs, else from old_logprobs
    IS_NORM: tl.constexpr,  # the IS weights over their batch mean (seqf row B)
    IS_GATE: tl.constexpr,  # rollout_correction GATE: what the gate reads (IsGate)
    GATE_SEQ: tl.constexpr,  # ... the sequence's statistic (its flag from the stats pass)
):
    """One block of one sequence through every stage: inputs (the rejection's keep:
    _rs_divergences → _token_keep, with the sequence's keep_i) → _pg_term → _shaping_weights →
    _is_weights → _kl_term → _token_loss → _aggregate → the token outputs and _partial_sums.
    (Long for its signature — every pointer, hyper-parameter and constexpr of the fused pass —
    and the argument lists of the stage calls; the body is the stage sequence.)"""
    p = tl.program_id(0).to(tl.int64)
    row, begin, end, is_seq, seq_len = _program_span(p, cu_ptr, boff_ptr, B, L, T, NBL, PACKED, SEARCH_STEPS, BLOCK)
    t = begin + tl.arange(0, BLOCK)
    inside = t < end
    valid = _token_valid(mask_ptr, t, inside, HAS_MASK) & is_seq

    # ---- the sequence's values: one scalar load each per program, up front (so that the row's
    # address is not live through the token math), splat (the interpreter mishandles scalar &
    # vector bools)
    zero = tl.zeros([BLOCK], CDT)
    stats = seqf_ptr + row * _NSTAT
    if SEQ_ADV:
        adv = tl.load(adv_ptr + row, mask=is_seq, other=0.0).to(CDT) + zero
    log_s = zero
    if LOSS == GSPO:
        log_s = tl.load(stats + _S_LOG_S, mask=is_seq, other=0.0) + zero
    geo_share = zero
    if LOSS == GEO_MEAN:
        geo_share = tl.load(stats + _S_GEO, mask=is_seq, other=0.0) + zero
    SEQ_RC: tl.constexpr = (RC == SEQ_TIS) or (RC == SEQ_MIS) or (RC == SEQ_ICEPOP)
    seq_w = zero
    seq_rej = valid & False
    if SEQ_RC:
        seq_w = tl.load(stats + _S_IS_W, mask=is_seq, other=0.0) + zero
    if SEQ_RC or GATE_SEQ:
        seq_rej = (tl.load(stats + _S_SEQ_REJ, mask=is_seq, other=0.0) + zero) != 0.0
    keep_i = valid | True
    if RS_SEQ:
        keep_i = (tl.load(stats + _S_KEEP, mask=is_seq, other=0.0) + zero) != 0.0
    n_i = seq_len.to(CDT)  # seq-mean-token-mean's n_i (packed without a mask: every token is valid)
    if SEQ_MEAN and N_FROM_STATS:
        n_i = tl.load(stats + _S_N, mask=is_seq, other=0.0)

    # ---- inputs in the compute dtype
    lp = tl.load(logp_ptr + t, mask=inside, other=0.0).to(CDT)
    old = tl.load(old_ptr + t, mask=inside, other=0.0).to(CDT)
    if not SEQ_ADV:
        adv = tl.load(adv_ptr + t, mask=inside, other=0.0).to(CDT)
    ent = tl.zeros([BLOCK], CDT)
    if HAS_ENT:
        ent = tl.load(ent_ptr + t, mask=inside, other=0.0).to(CDT)
    ref = tl.zeros([BLOCK], CDT)
    if KL != KL_NONE:
        ref = tl.load(ref_ptr + t, mask=inside, other=0.0).to(CDT)
    roll = tl.zeros([BLOCK], CDT)
    NEED_ROLL: tl.constexpr = (RC != RC_NONE) or (RS_TOK != 0) or RS_SEQ
    if NEED_ROLL:  # (the sequence-level weights use it in the stats pass; read here for the value check)
        roll = tl.load(roll_ptr + t, mask=inside, other=0.0).to(CDT)
    base = old  # the rollout log-ratio x = base − rollout
    if RC_CURRENT:
        base = lp
    valid0 = valid  # before the rejection (TokenOut.IS_WEIGHTS)
    if RS_TOK != 0:  # verl's rejection modifies the mask (reference rejection_keep)
        k1, k2, k3 = _rs_divergences(base - roll)
        valid = valid & _token_keep(
            k1, k2, k3, rs_token_k1_low, rs_token_k1_high, rs_token_k2, rs_token_k3, CDT, RS_TOK
        )
    if RS_SEQ:
        valid = valid & keep_i
    sel = valid & False
    if (LOSS == CLIP_COV) or (LOSS == KL_COV):
        sel = tl.load(cov_ptr + t, mask=inside, other=0).to(tl.int1)

    # ---- the stages
    pg, dpg, clipped, clip_lower, delta, low, high = _pg_term(
        lp,
        old,
        adv,
        valid,
        log_s,
        geo_share,
        clip_lo,
        clip_hi,
        clip_c,
        lr_clamp,
        gspo_clamp,
        tau_pos,
        tau_neg,
        half_dro_beta,
        sel,
        kl_cov_coef,
        CDT,
        LOSS,
        DUAL_CLIP,
        LR_CLAMP,
        BLOCK,
    )
    SHAPING: tl.constexpr = SHAPE_POL or SHAPE_PROB or A3PO or ENT_Q
    adv64, w64 = _shaping_weights(
        adv,
        old,
        ent,
        valid,
        t,
        row,
        is_seq,
        a3po_ptr,
        thr_ptr,
        w_pos,
        w_neg,
        prob_lambda,
        s_pos_high,
        s_pos_low,
        s_neg_high,
        s_neg_low,
        SHAPE_POL,
        SHAPE_PROB,
        A3PO,
        A3PO_ENT,
        ENT_Q,
        BLOCK,
    )
    w = w64.to(CDT)
    is_w = tl.full([BLOCK], 1.0, CDT)
    rejected = valid & False
    if RC != RC_NONE:
        is_mu = 1.0
        if IS_NORM:
            is_mu = tl.load(seqf_ptr + B * _NSTAT)
        is_w, rejected = _is_weights(
            base, roll, seq_w, seq_rej, is_mu, rc_low, rc_high, CDT, RC, SEQ_RC, IS_NORM, IS_GATE, GATE_SEQ
        )
    kl = tl.zeros([BLOCK], CDT)
    dkl = tl.zeros([BLOCK], CDT)
    if KL != KL_NONE:
        kl, dkl = _kl_term(
            lp,
            old,
            ref,
            log_s,
            lr_clamp,
            gspo_clamp,
            CDT,
            LOSS,
            KL,
            KL_CLAMP,
            KL_IN,
            KL_OUT,
            KL_RATIO,
            KL_SCORE,
            LR_CLAMP,
            BLOCK,
        )
    ec = _param(ent_coef, CDT)
    ell, pgw, dlp = _token_loss(pg, dpg, w, is_w, kl, dkl, ent, _param(kl_coef, CDT), ec, SHAPING, RC, KL, ENT_TERM)

    ell_a, pgw_a, kl_a, dlp, grad_ent = _aggregate(ell, pgw, kl, dlp, ec, n_i, SEQ_MEAN)

    # ---- the outputs
    tl.store(grad_ptr + t, tl.where(valid, dlp, zero), mask=inside)
    if ENT_GRAD:
        tl.store(gent_ptr + t, tl.where(valid, grad_ent + zero, zero), mask=inside)
    if TOKEN_OUT == TOKEN_OUT_LOSS:
        tl.store(tok_ptr + t, tl.where(valid, ell, zero), mask=inside)
    elif TOKEN_OUT == TOKEN_OUT_SHAPED:  # the shaped advantage A·w, formed in fp64 as the reference
        tl.store(tok_ptr + t, tl.where(valid, (adv64 * w64).to(CDT), zero), mask=inside)
    elif TOKEN_OUT == TOKEN_OUT_IS_WEIGHTS:  # (is_w = 1 without a correction weight; rejected tokens too)
        tl.store(tok_ptr + t, tl.where(valid0, is_w, zero), mask=inside)
    elif TOKEN_OUT == TOKEN_OUT_KEEP:  # the valid tokens the rejection keeps
        tl.store(tok_ptr + t, tl.where(valid, 1.0, zero), mask=inside)

    # The value check: x − x is NaN iff x is NaN or ±inf, so one sum over the inputs flags a
    # valid token with any non-finite input (the op layer raises on a count > 0).
    chk = (lp - lp) + (old - old) + (adv - adv)
    if HAS_ENT:
        chk += ent - ent
    if KL != KL_NONE:
        chk += ref - ref
    if NEED_ROLL:
        chk += roll - roll
    part = _partial_sums(
        valid,
        ell_a,
        pgw_a,
        kl,
        kl_a,
        clipped,
        clip_lower,
        low,
        high,
        delta,
        is_w,
        rejected,
        w,
        ent,
        chk != chk,
        CDT,
        LOSS,
        DUAL_CLIP,
        KL,
        RC,
        SHAPING,
        HAS_ENT,
        BLOCK,
    )
    tl.store(part_ptr + p * _NP + tl.arange(0, _NP), part)


@triton.jit
def _finalize_kernel(
    part_ptr,  # [P, 32] compute dtype partial sums
    seqf_ptr,  # [B + 1, _NSTAT] per-sequence stats (HAS_STATS: n_i, n⁰_i; row B: the IS_NORM mean)
    boff_ptr,  # [B + 3] int64 program offsets (PACKED)
    sums_ptr,  # [NUM_SUMS] compute dtype output
    P,
    B,
    NBL,
    CDT: tl.constexpr,
    PACKED: tl.constexpr,
    HAS_STATS: tl.constexpr,
    RS: tl.constexpr,  # the rejection is on: NTOK_RAW, RS_REJECT, RS_SEQ_REJECT from n⁰_i and n_i
    IS_NORM: tl.constexpr,
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

    # Per sequence: n_i (from the stats pass, else the per-program counts) and the clip-side
    # counts (per-program counts, summed over the sequence's programs in order).
    lanes = tl.arange(0, SEQS).to(tl.int64)
    nseq = tl.zeros([SEQS], tl.int32)
    f_lo_sum = tl.zeros([SEQS], tl.float64)
    f_hi_sum = tl.zeros([SEQS], tl.float64)
    f_lo_min = tl.full([SEQS], float("inf"), tl.float64)
    f_hi_max = tl.zeros([SEQS], tl.float64)
    n_raw_sum = tl.zeros([SEQS], tl.float64)
    rs_rej = tl.zeros([SEQS], tl.float64)
    rs_seq_rej = tl.zeros([SEQS], tl.float64)
    for start in range(0, B, SEQS):
        s = start + lanes
        ok = s < B
        if PACKED:
            b0 = tl.load(boff_ptr + s + 1, mask=ok, other=0)
            nb = tl.where(ok, tl.load(boff_ptr + s + 2, mask=ok, other=0) - b0, 0)
        else:
            b0 = s * NBL
            nb = tl.where(ok, NBL, 0).to(tl.int64)
        n = tl.zeros([SEQS], CDT)
        c_lo = tl.zeros([SEQS], CDT)
        c_hi = tl.zeros([SEQS], CDT)
        for j in range(0, tl.max(nb, 0)):
            # (b0 + j < P always holds for sanitised spans; the mask keeps every read in bounds)
            rmask = (j < nb) & (b0 + j < P)
            rp = part_ptr + (b0 + j) * _NP
            n += tl.load(rp + _C_NTOK, mask=rmask, other=0.0)
            c_lo += tl.load(rp + _C_CLIP_LOW, mask=rmask, other=0.0)
            c_hi += tl.load(rp + _C_CLIP_HIGH, mask=rmask, other=0.0)
        if HAS_STATS:
            n = tl.load(seqf_ptr + s * _NSTAT + _S_N, mask=ok, other=0.0)
        if RS:
            n0 = tl.load(seqf_ptr + s * _NSTAT + _S_N_RAW, mask=ok, other=0.0).to(tl.float64)
            n_raw_sum += n0
            rs_rej += n0 - n.to(tl.float64)
            rs_seq_rej += tl.where(n0 > n.to(tl.float64), 1.0, 0.0)
        has = ok & (n > 0.0)
        nseq += has.to(tl.int32)
        n64 = tl.maximum(n.to(tl.float64), 1.0)
        f_lo = c_lo.to(tl.float64) / n64
        f_hi = c_hi.to(tl.float64) / n64
        f_lo_sum += tl.where(has, f_lo, 0.0)
        f_hi_sum += tl.where(has, f_hi, 0.0)
        f_lo_min = tl.minimum(f_lo_min, tl.where(has, f_lo, float("inf")))
        f_hi_max = tl.maximum(f_hi_max, tl.where(has, f_hi, 0.0))
    n_all = tl.sum(nseq, 0)
    out = tl.where(cols == _C_NSEQ, n_all.to(tl.float64), out)
    out = tl.where(cols == _C_SEQ_CLIP_LOW, tl.sum(f_lo_sum, 0), out)
    out = tl.where(cols == _C_SEQ_CLIP_HIGH, tl.sum(f_hi_sum, 0), out)
    out = tl.where(cols == _C_SEQ_CLIP_LOW_MIN, tl.where(n_all > 0, tl.min(f_lo_min, 0), 0.0), out)
    out = tl.where(cols == _C_SEQ_CLIP_HIGH_MAX, tl.max(f_hi_max, 0), out)
    # The rejection's counts (without it every valid token is kept: NTOK_RAW = NTOK, the
    # others 0) and the batch-normalisation mean (0 when off).
    if RS:
        out = tl.where(cols == _C_NTOK_RAW, tl.sum(n_raw_sum, 0), out)
        out = tl.where(cols == _C_RS_REJECT, tl.sum(rs_rej, 0), out)
        out = tl.where(cols == _C_RS_SEQ_REJECT, tl.sum(rs_seq_rej, 0), out)
    else:
        out = tl.where(cols == _C_NTOK_RAW, tl.sum(tl.where(cols == _C_NTOK, acc, 0.0), 0), out)
    if IS_NORM:
        out = tl.where(cols == _C_IS_NORM, tl.load(seqf_ptr + B * _NSTAT).to(tl.float64), out)
    tl.store(sums_ptr + cols, out.to(CDT), mask=cols < _C_NUM_SUMS)


# ------------------------------------------------------------------ launchers
# Tokens per program of the token kernel / lanes of the per-sequence kernel (tests shrink
# them to exercise multi-block sequences under the interpreter). fp64 and the fp64
# shaping math (probability, A3PO) hold twice the registers per token: half the block
# keeps them spill-free at 4 warps (python -m rlvr_kernels.triton.aot); so do the rejection's
# statistics (five more accumulators per lane) in the per-sequence pass.
_TOKEN_BLOCK = 1024
_SEQ_BLOCK = 1024
_WARPS = 4


def token_block(fp64: bool, heavy: bool) -> int:
    return max(16, _TOKEN_BLOCK // 2) if (fp64 or heavy) else _TOKEN_BLOCK


def seq_block(fp64: bool, heavy: bool) -> int:
    return max(16, _SEQ_BLOCK // 2) if (fp64 or heavy) else _SEQ_BLOCK


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check(ok: bool, *message) -> None:
    # The C++ kernel's TORCH_CHECK, for the same contract: a RuntimeError naming the argument.
    if not ok:
        raise RuntimeError("policy_loss_fwd: " + "".join(str(m) for m in message))


class _Inputs(NamedTuple):
    """The tensor arguments of ``policy_loss_fwd``, contiguous, advantages in the compute dtype."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: Optional[torch.Tensor]
    ref_logprobs: Optional[torch.Tensor]
    rollout_logprobs: Optional[torch.Tensor]
    entropy: Optional[torch.Tensor]
    cu_seqlens: Optional[torch.Tensor]
    entropy_threshold: Optional[torch.Tensor]
    cov_selection: Optional[torch.Tensor]


def _check_inputs(x: _Inputs, p: PolicyLossParams, need_entropy_grad: bool) -> int:
    """Every shape relation the kernels rely on (no host sync), as the C++ entry point checks
    them; returns B."""
    lp, packed = x.logprobs, x.cu_seqlens is not None
    shape = tuple(lp.shape)
    _check(lp.dtype in _FLOAT_DTYPES, "logprobs must be float16, bfloat16, float32 or float64, got ", lp.dtype)
    layout = "[T] with cu_seqlens" if packed else "[B, L] without cu_seqlens"
    _check(lp.dim() == (1 if packed else 2), "logprobs must be ", layout, ", got shape ", shape)
    _check(packed or x.mask is not None, "the padded layout needs a mask")
    cov = p.loss_type in (LossType.CLIP_COV, LossType.KL_COV)
    _check(
        (x.cov_selection is not None) == cov,
        "cov_selection is ",
        "required by" if cov else "only read by",
        " the clip_cov / kl_cov loss types",
    )
    needs_entropy = p.entropy_quantile or (p.a3po and p.a3po_metric == A3poMetric.ENTROPY) or need_entropy_grad
    for name, t, needed, dtype in (
        ("old_logprobs", x.old_logprobs, True, lp.dtype),
        ("ref_logprobs", x.ref_logprobs, p.kl != KlEstimator.NONE, lp.dtype),
        ("rollout_logprobs", x.rollout_logprobs, _needs_rollout(p), lp.dtype),
        ("entropy", x.entropy, needs_entropy, lp.dtype),
        ("mask", x.mask, False, torch.bool),
        ("cov_selection", x.cov_selection, cov, torch.bool),
        ("advantages", x.advantages if not p.seq_adv else None, False, None),
    ):
        _check(t is not None or not needed, "these options need ", name)
        if t is not None:
            _check(t.device == lp.device, name, " must be on ", lp.device, ", got ", t.device)
            _check(tuple(t.shape) == shape, name, " must have shape ", shape, ", got ", tuple(t.shape))
            _check(dtype is None or t.dtype == dtype, name, " must have dtype ", dtype, ", got ", t.dtype)
    if packed:
        cu = x.cu_seqlens
        _check(
            cu.dim() == 1 and cu.numel() >= 1 and not cu.is_floating_point() and cu.device == lp.device,
            "cu_seqlens must be a 1-D integer tensor of B + 1 >= 1 offsets on ",
            lp.device,
            ", got shape ",
            tuple(cu.shape),
        )
    B = x.cu_seqlens.shape[0] - 1 if packed else shape[0]
    if p.seq_adv:
        _check(x.advantages.device == lp.device, "advantages must be on ", lp.device)
        _check(tuple(x.advantages.shape) == (B,), "advantages must be [B = ", B, "], got ", tuple(x.advantages.shape))
    if p.entropy_quantile:
        thr = x.entropy_threshold
        _check(
            thr is not None and thr.numel() == 1 and thr.dtype == torch.float32 and thr.device == lp.device,
            "the entropy quantile needs a 1-element fp32 entropy_threshold",
        )
    return B


def policy_loss_fwd(
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
    cov_selection=None,
    seq_stats=None,
):
    """The Triton kernels under the contract of ``rlvr_kernels_C::policy_loss_fwd``: returns
    ``(sums, grad_logprobs, grad_entropy, token_out)``. ``seq_stats`` (contracts SeqStat, the
    whole sequences' statistics under cp_group) replaces ``_seq_stats_kernel``'s rows."""
    p = PolicyLossParams.unpack(fparams, iparams)
    # (the bits above the 11 options are ignored, as the C++ kernel does)
    p = dataclasses.replace(p, rs_options=int(p.rs_options) & 0x7FF)
    gate = p.rollout_correction == RolloutCorrectionCode.GATE
    # (the C++ entry point's checks of the same contract)
    _check(not (_gate_seq(p) and p.is_gate == IsGate.CLAMP), "is_gate CLAMP is token level")
    _check(not (gate and p.is_batch_normalize), "is_batch_normalize is not supported with rollout_correction GATE")
    # The kernels index flat, contiguous buffers (a no-op for what the op layer passes).
    x = _Inputs(
        *(
            None if t is None else t.contiguous()
            for t in (logprobs, old_logprobs, advantages, mask, ref_logprobs, rollout_logprobs, entropy)
        ),
        cu_seqlens,
        entropy_threshold,
        None if cov_selection is None else cov_selection.contiguous(),
    )
    fp64 = x.logprobs.dtype == torch.float64
    cdt = torch.float64 if fp64 else torch.float32
    x = x._replace(advantages=x.advantages.to(cdt))
    B = _check_inputs(x, p, need_entropy_grad)
    dev, shape = x.logprobs.device, tuple(x.logprobs.shape)
    k = dict(
        CDT=tl.float64 if fp64 else tl.float32,
        PACKED=x.cu_seqlens is not None,
        HAS_MASK=x.mask is not None,
        SEQ_ADV=bool(p.seq_adv),
        A3PO=bool(p.a3po),
        A3PO_ENT=p.a3po_metric == A3poMetric.ENTROPY,
    )
    grad = torch.empty(shape, dtype=cdt, device=dev)
    gent = torch.empty(shape if need_entropy_grad else (0,), dtype=cdt, device=dev)
    tok = torch.empty(shape if p.token_out != TokenOut.NONE else (0,), dtype=cdt, device=dev)
    sums = torch.empty(NUM_SUMS, dtype=cdt, device=dev)

    tb = token_block(fp64, p.a3po or p.probability != 0)
    if k["PACKED"]:
        T, L, NBL = shape[0], 0, 0
        cu = sanitized_offsets(x.cu_seqlens, T).contiguous()  # in bounds and disjoint, whatever the input
        P = triton.cdiv(T, tb) + B + 2
        boff = torch.empty(B + 3, dtype=torch.int64, device=dev)
        _block_offsets_kernel[(1,)](cu, boff, B, T, TOKEN_BLOCK=tb, BLOCK=1024)
    else:
        L = shape[1]
        T, NBL = B * L, triton.cdiv(L, tb)
        P = B * NBL
        cu = boff = grad  # unused
    given = seq_stats is not None
    if given:  # (the C++ entry point's checks)
        _check(
            seq_stats.dtype == torch.float64
            and seq_stats.dim() == 2
            and tuple(seq_stats.shape) == (B, NUM_SEQ_STATS)
            and seq_stats.device == dev,
            f"seq_stats must be float64 [B = {B}, {NUM_SEQ_STATS}] on {dev}, got {seq_stats.dtype} ",
            tuple(seq_stats.shape),
        )
        _check(not k["A3PO"], "seq_stats does not carry the A3PO selection")
        seq_stats = seq_stats.contiguous()
    rs = p.rs_options != 0
    # (with rejection n_i is the kept count: from the stats pass in every layout; given
    # statistics: the whole sequence's)
    n_from_stats = bool(p.seq_mean) and (k["HAS_MASK"] or not k["PACKED"] or rs or given)
    seq_pass = n_from_stats or p.loss_type in (LossType.GSPO, LossType.GEO_MEAN) or _seq_rc(p) or k["A3PO"]
    # (given statistics: every sequence-level quantity from them, as the C++ prepass does)
    stats = (seq_pass or rs or _is_norm(p) or _gate_seq(p) or given) and B > 0
    seqf, a3po_rows = grad, grad
    if stats:
        seqf = torch.empty((B + 1) * int(_NSTAT), dtype=cdt, device=dev)
        if k["A3PO"]:
            a3po_rows = torch.empty(B * 5, dtype=torch.int64, device=dev)
        _launch_seq_stats(p, k, x, cu, seqf, a3po_rows, seq_stats, B, L, T)
        if _is_norm(p):
            _is_batch_norm_kernel[(1,)](seqf, B, CDT=k["CDT"], SEQ_LEVEL=_seq_rc(p), SEQS=128)
    part = torch.empty(max(P, 1) * 32, dtype=cdt, device=dev)
    if P > 0:
        _token_kernel[(P,)](
            *_token_pointers(p, x, grad),
            cu,
            boff,
            seqf,
            a3po_rows,
            grad,
            gent if need_entropy_grad else grad,
            tok if p.token_out != TokenOut.NONE else grad,
            part,
            B,
            L,
            T,
            NBL,
            *_token_floats(p),
            **_token_constexprs(p, k, x.entropy is not None, need_entropy_grad, n_from_stats, B),
            BLOCK=tb,
            num_warps=_WARPS,
        )
    c = dict(
        CDT=k["CDT"],
        PACKED=k["PACKED"],
        HAS_STATS=stats,
        RS=rs and stats,
        IS_NORM=_is_norm(p) and stats,
        ROWS=32,
        SEQS=128,
    )
    _finalize_kernel[(1,)](part, seqf, boff, sums, P, B, NBL, **c)
    return sums, grad, gent, tok


def _seq_rc(p: PolicyLossParams) -> bool:
    seq = (RolloutCorrectionCode.SEQ_TIS, RolloutCorrectionCode.SEQ_MIS, RolloutCorrectionCode.SEQ_ICEPOP)
    return p.rollout_correction in seq


def _gate_seq(p: PolicyLossParams) -> bool:
    return p.rollout_correction == RolloutCorrectionCode.GATE and bool(p.is_gate_seq)


def _is_norm(p: PolicyLossParams) -> bool:
    return bool(p.is_batch_normalize) and p.rollout_correction != RolloutCorrectionCode.NONE


def _needs_rollout(p: PolicyLossParams) -> bool:
    return p.rollout_correction != RolloutCorrectionCode.NONE or p.rs_options != 0


# The rejection bounds: the PolicyLossParams fields rs_* (the kernels' argument names), in order.
_RS_BOUNDS = tuple(
    f.name for f in dataclasses.fields(PolicyLossParams) if f.name.startswith("rs_") and f.name != "rs_options"
)


def _rs_bounds(p: PolicyLossParams):
    return tuple(getattr(p, name) for name in _RS_BOUNDS)


def _a3po_knobs(p: PolicyLossParams):
    return (
        p.a3po_pos_high_ratio,
        p.a3po_pos_high_scale,
        p.a3po_pos_low_ratio,
        p.a3po_pos_low_scale,
        p.a3po_neg_high_ratio,
        p.a3po_neg_high_scale,
        p.a3po_neg_low_ratio,
        p.a3po_neg_low_scale,
    )


def _launch_seq_stats(p: PolicyLossParams, k, x: _Inputs, cu, seqf, a3po_rows, given, B, L, T):
    dummy = seqf  # (pointers the options do not read)
    _seq_stats_kernel[(B,)](
        x.logprobs,
        x.old_logprobs,
        x.advantages,
        dummy if x.mask is None else x.mask,
        x.rollout_logprobs if _needs_rollout(p) else dummy,
        dummy if x.entropy is None else x.entropy,
        cu,
        seqf,
        a3po_rows if k["A3PO"] else dummy,
        dummy if given is None else given,
        B,
        L,
        T,
        p.ratio_low,
        p.ratio_high,
        p.rc_low,
        p.rc_high,
        *_a3po_knobs(p),
        *_rs_bounds(p),
        NEED_DELTA=p.loss_type == LossType.GSPO,
        NEED_LOGW=_seq_rc(p),
        NEED_GEO=p.loss_type == LossType.GEO_MEAN,
        RC=int(p.rollout_correction),
        RS=int(p.rs_options),
        RC_CURRENT=bool(p.rc_current),
        NORM_TOK=_is_norm(p) and not _seq_rc(p),
        IS_GATE=int(p.is_gate),
        GATE_SEQ=_gate_seq(p),
        GIVEN=given is not None,
        BLOCK=seq_block(k["CDT"] is tl.float64, k["A3PO"] or p.rs_options != 0),
        num_warps=_WARPS,
        **k,
    )


def _token_pointers(p: PolicyLossParams, x: _Inputs, dummy):
    """The token kernel's input pointers, ``dummy`` where the options do not read one."""
    return (
        x.logprobs,
        x.old_logprobs,
        x.advantages,
        dummy if x.mask is None else x.mask,
        x.ref_logprobs if p.kl != KlEstimator.NONE else dummy,
        x.rollout_logprobs if _needs_rollout(p) else dummy,
        dummy if x.entropy is None else x.entropy,
        x.entropy_threshold if p.entropy_quantile else dummy,
        x.cov_selection if x.cov_selection is not None else dummy,
    )


def _token_floats(p: PolicyLossParams):
    """The token kernel's fp64 arguments, in its order."""
    return (
        p.ratio_low,
        p.ratio_high,
        p.clip_ratio_c,
        p.log_ratio_clamp,
        p.gspo_log_clamp,
        p.tau_pos,
        p.tau_neg,
        p.kl_coef,
        p.rc_low,
        p.rc_high,
        p.entropy_coef,
        p.w_pos,
        p.w_neg,
        p.probability,
        p.a3po_pos_high_scale,
        p.a3po_pos_low_scale,
        p.a3po_neg_high_scale,
        p.a3po_neg_low_scale,
        0.5 * p.dro_beta,  # (Python's 0.5·β, as the reference forms it)
        p.kl_cov_coef,
        *_rs_bounds(p)[:4],  # the token options' bounds
    )


def _token_constexprs(p: PolicyLossParams, k, has_entropy: bool, need_entropy_grad: bool, n_from_stats: bool, B: int):
    return dict(
        k,
        LOSS=int(p.loss_type),
        # (dppo: the truncation cap; its CLIP_LOWER is the kept tokens above the cap)
        DUAL_CLIP=p.loss_type in (LossType.PPO, LossType.GSPO, LossType.DPPO_TV, LossType.DPPO_KL)
        and p.clip_ratio_c > 0,
        LR_CLAMP=p.log_ratio_clamp > 0,
        KL=int(p.kl),
        KL_CLAMP=int(p.kl_clamp),
        KL_IN=float(p.kl_clamp_input),
        KL_OUT=float(p.kl_clamp_output),
        KL_SCORE=p.kl != KlEstimator.NONE and bool(p.kl_score_grad),
        RC=int(p.rollout_correction),
        SEQ_MEAN=bool(p.seq_mean),
        N_FROM_STATS=n_from_stats,
        TOKEN_OUT=int(p.token_out),
        HAS_ENT=has_entropy,
        ENT_TERM=has_entropy and p.entropy_coef != 0,
        ENT_GRAD=bool(need_entropy_grad),
        SHAPE_POL=p.w_pos != 1.0 or p.w_neg != 1.0,
        SHAPE_PROB=p.probability != 0,
        ENT_Q=bool(p.entropy_quantile),
        KL_RATIO=p.kl != KlEstimator.NONE and bool(p.kl_ratio_correction),
        SEARCH_STEPS=max(1, math.ceil(math.log2(B + 2)) + 1) if k["PACKED"] else 1,
        RS_TOK=int(p.rs_options) & 7,
        RS_SEQ=(int(p.rs_options) >> 3) != 0,
        RC_CURRENT=bool(p.rc_current),
        IS_NORM=_is_norm(p) and B > 0,  # (B = 0: no stats pass, no valid token)
        IS_GATE=int(p.is_gate),
        GATE_SEQ=_gate_seq(p),
    )


def policy_loss_grad(coef, up, dtype):
    """The backward of ``policy_loss_fwd`` on CUDA: ``(coef · up).to(dtype)``. torch's own
    elementwise kernels are bandwidth-bound already (one read of coef, one write), so a
    Triton kernel would add nothing."""
    return (coef * up).to(dtype)


# ------------------------------------------------------------------ ahead-of-time compile specs
def aot_specs():
    """The policy_loss kernels for ``python -m rlvr_kernels.triton.aot``: the common single
    pass, each loss type and feature family, the fp64 variants, and the per-sequence (GSPO /
    seq IS / A3PO) pre-pass."""
    k = sys.modules[__name__]
    yield (
        "_block_offsets_kernel",
        k._block_offsets_kernel,
        dict(cu_ptr="*i64", boff_ptr="*i64", B="i32", T="i32"),
        dict(TOKEN_BLOCK=k._TOKEN_BLOCK, BLOCK=1024),
    )
    yield from _aot_seq_stats_specs()
    yield from _aot_token_specs()
    for name, cdt, packed, stats in (
        ("padded", tl.float32, False, False),
        ("packed", tl.float32, True, False),
        ("stats,fp64", tl.float64, False, True),
    ):
        c = "*fp64" if cdt is tl.float64 else "*fp32"
        sig = dict(part_ptr=c, seqf_ptr=c, boff_ptr="*i64", sums_ptr=c, P="i32", B="i32", NBL="i32")
        yield (
            f"_finalize_kernel[{name}]",
            k._finalize_kernel,
            sig,
            dict(CDT=cdt, PACKED=packed, HAS_STATS=stats, RS=stats, IS_NORM=stats, ROWS=32, SEQS=128),
        )
    for name, cdt, seq_level in (("token", tl.float32, False), ("sequence,fp64", tl.float64, True)):
        c = "*fp64" if cdt is tl.float64 else "*fp32"
        yield (
            f"_is_batch_norm_kernel[{name}]",
            k._is_batch_norm_kernel,
            dict(seqf_ptr=c, B="i32"),
            dict(CDT=cdt, SEQ_LEVEL=seq_level, SEQS=128),
        )


def _aot_spec(kernel, pointers, floats, defaults, block, name, inp, cdt, const):
    """One AOT spec of ``kernel``: its signature (``pointers``: name -> "inp" (the input
    dtype), "c" (the compute dtype) or a fixed type; then the i32 sizes and the fp64
    ``floats``), the constexprs ``defaults`` updated by ``const`` and BLOCK = ``block(fp64,
    constexprs)``."""
    c = "*fp64" if cdt is tl.float64 else "*fp32"
    sig = {n: {"inp": inp, "c": c}.get(t, t) for n, t in pointers.items()}
    sig.update(B="i32", L="i32", T="i32")
    if kernel is _token_kernel:
        sig.update(NBL="i32")
    sig.update({n: "fp64" for n in floats})
    full = dict(defaults, CDT=cdt, **const)
    full["BLOCK"] = block(cdt is tl.float64, full)
    return f"{kernel.__name__}[{name}]", kernel, sig, full


_AOT_SEQ_STATS_POINTERS = dict(
    logp_ptr="inp",
    old_ptr="inp",
    adv_ptr="c",
    mask_ptr="*i1",
    roll_ptr="inp",
    ent_ptr="inp",
    cu_ptr="*i64",
    seqf_ptr="c",
    a3po_ptr="*i64",
    given_ptr="*fp64",
)
_AOT_SEQ_STATS_DEFAULTS = dict(
    PACKED=False,
    HAS_MASK=True,
    SEQ_ADV=True,
    NEED_DELTA=False,
    NEED_LOGW=False,
    NEED_GEO=False,
    A3PO=False,
    A3PO_ENT=False,
    RC=int(RolloutCorrectionCode.NONE),
    RS=0,
    RC_CURRENT=False,
    NORM_TOK=False,
    IS_GATE=int(IsGate.CLAMP),
    GATE_SEQ=False,
    GIVEN=False,
)


def _aot_seq_stats_spec(name, inp, cdt, **const):
    floats = ("clip_lo", "clip_hi", "rc_low", "rc_high")
    floats += tuple(f"{rs}_{knob}" for knob in ("pos_high", "pos_low", "neg_high", "neg_low") for rs in "rs")
    return _aot_spec(
        _seq_stats_kernel,
        _AOT_SEQ_STATS_POINTERS,
        floats + _RS_BOUNDS,
        _AOT_SEQ_STATS_DEFAULTS,
        lambda fp64, k: seq_block(fp64, k["A3PO"] or k["RS"] != 0),
        name,
        inp,
        cdt,
        const,
    )


def _aot_seq_stats_specs():
    spec = _aot_seq_stats_spec
    yield spec("seq_mean,packed", "*bf16", tl.float32, PACKED=True)
    yield spec("gspo,seq_tis", "*bf16", tl.float32, NEED_DELTA=True, NEED_LOGW=True)
    yield spec("a3po_prob,token_adv", "*bf16", tl.float32, A3PO=True, SEQ_ADV=False)
    yield spec("a3po_entropy,packed", "*fp32", tl.float32, A3PO=True, A3PO_ENT=True, PACKED=True)
    yield spec("fp64,all", "*fp64", tl.float64, NEED_DELTA=True, NEED_LOGW=True, A3PO=True)
    yield spec("geo_mean,token_adv", "*bf16", tl.float32, NEED_GEO=True, SEQ_ADV=False)
    yield spec("geo_mean,a3po,fp64", "*fp64", tl.float64, NEED_GEO=True, A3PO=True, SEQ_ADV=False)
    # RolloutCorrection: every rejection option, with the IS weights' batch normalisation
    seq_icepop = int(RolloutCorrectionCode.SEQ_ICEPOP)
    yield spec("rs_all,seq_icepop,norm", "*bf16", tl.float32, RS=_RS_ALL, RC=seq_icepop, NEED_LOGW=True)
    yield spec(
        "rs_all,token_icepop,norm_tok,current,gspo,packed",
        "*bf16",
        tl.float32,
        RS=_RS_ALL,
        RC=int(RolloutCorrectionCode.TOKEN_ICEPOP),
        NORM_TOK=True,
        RC_CURRENT=True,
        NEED_DELTA=True,
        PACKED=True,
    )
    yield spec("rs_seq,geo_mean,fp64", "*fp64", tl.float64, RS=_RS_ALL & ~7, NEED_GEO=True, SEQ_ADV=False)
    # OpenRLHF's sequence-level gate (the mean divergence / log-ratio over m⁰)
    gate = int(RolloutCorrectionCode.GATE)
    yield spec("gate_seq,binary_kl", "*bf16", tl.float32, RC=gate, IS_GATE=int(IsGate.BINARY_KL), GATE_SEQ=True)
    yield spec(
        "gate_seq,tv,rs_all,current,packed",
        "*bf16",
        tl.float32,
        RC=gate,
        IS_GATE=int(IsGate.TV),
        GATE_SEQ=True,
        RS=_RS_ALL,
        RC_CURRENT=True,
        PACKED=True,
    )
    yield spec("gate_seq,ratio,fp64", "*fp64", tl.float64, RC=gate, IS_GATE=int(IsGate.RATIO), GATE_SEQ=True)
    # cp_group: the given statistics (no token loop)
    yield spec(
        "given,gspo,rs_all,gate_seq,tv",
        "*bf16",
        tl.float32,
        GIVEN=True,
        NEED_DELTA=True,
        RS=_RS_ALL,
        RC=gate,
        IS_GATE=int(IsGate.TV),
        GATE_SEQ=True,
    )
    yield spec(
        "given,geo_mean,seq_tis,fp64",
        "*fp64",
        tl.float64,
        GIVEN=True,
        NEED_GEO=True,
        NEED_LOGW=True,
        RC=int(RolloutCorrectionCode.SEQ_TIS),
        SEQ_ADV=False,
    )


_RS_ALL = (1 << 11) - 1  # every rejection option (options.RS_OPTIONS)
_AOT_TOKEN_FLOATS = (
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
    "half_dro_beta",
    "kl_cov_coef",
    "rs_token_k1_low",
    "rs_token_k1_high",
    "rs_token_k2",
    "rs_token_k3",
)


_AOT_TOKEN_POINTERS = dict(
    logp_ptr="inp",
    old_ptr="inp",
    adv_ptr="c",
    mask_ptr="*i1",
    ref_ptr="inp",
    roll_ptr="inp",
    ent_ptr="inp",
    thr_ptr="*fp32",
    cov_ptr="*i1",
    cu_ptr="*i64",
    boff_ptr="*i64",
    seqf_ptr="c",
    a3po_ptr="*i64",
    grad_ptr="c",
    gent_ptr="c",
    tok_ptr="c",
    part_ptr="c",
)
_AOT_TOKEN_DEFAULTS = dict(
    PACKED=False,
    HAS_MASK=True,
    SEQ_ADV=True,
    LOSS=int(LossType.PPO),
    DUAL_CLIP=False,
    LR_CLAMP=True,
    KL=int(KlEstimator.NONE),
    KL_CLAMP=int(KlClamp.K3),
    RC=int(RolloutCorrectionCode.NONE),
    SEQ_MEAN=False,
    N_FROM_STATS=False,
    TOKEN_OUT=int(TokenOut.NONE),
    HAS_ENT=False,
    ENT_TERM=False,
    ENT_GRAD=False,
    SHAPE_POL=False,
    SHAPE_PROB=False,
    A3PO=False,
    A3PO_ENT=False,
    ENT_Q=False,
    KL_RATIO=False,
    SEARCH_STEPS=1,
    KL_IN=20.0,
    KL_OUT=10.0,
    KL_SCORE=False,
    RS_TOK=0,
    RS_SEQ=False,
    RC_CURRENT=False,
    IS_NORM=False,
    IS_GATE=int(IsGate.CLAMP),
    GATE_SEQ=False,
)


def _aot_token_spec(name, inp, cdt, **const):
    return _aot_spec(
        _token_kernel,
        _AOT_TOKEN_POINTERS,
        _AOT_TOKEN_FLOATS,
        _AOT_TOKEN_DEFAULTS,
        lambda fp64, k: token_block(fp64, k["A3PO"] or k["SHAPE_PROB"]),
        name,
        inp,
        cdt,
        const,
    )


def _aot_token_specs():
    spec = _aot_token_spec
    common = dict(KL=int(KlEstimator.K3), RC=int(RolloutCorrectionCode.TOKEN_TIS))
    yield spec("ppo,k3,token_tis", "*bf16", tl.float32, **common)
    yield spec("ppo,k3,token_tis,packed", "*bf16", tl.float32, PACKED=True, HAS_MASK=False, SEARCH_STEPS=8, **common)
    yield spec("ppo,fp32,dual_clip,k1", "*fp32", tl.float32, DUAL_CLIP=True, KL=int(KlEstimator.K1), SEQ_ADV=False)
    yield spec(
        "gspo,seq_tis,seq_mean",
        "*bf16",
        tl.float32,
        LOSS=int(LossType.GSPO),
        RC=int(RolloutCorrectionCode.SEQ_TIS),
        SEQ_MEAN=True,
        N_FROM_STATS=True,
    )
    yield spec(
        "cispo,k2,token_mis",
        "*fp16",
        tl.float32,
        LOSS=int(LossType.CISPO),
        KL=int(KlEstimator.K2),
        RC=int(RolloutCorrectionCode.TOKEN_MIS),
    )
    yield spec(
        "sapo,seq_mis,entropy",
        "*bf16",
        tl.float32,
        LOSS=int(LossType.SAPO),
        RC=int(RolloutCorrectionCode.SEQ_MIS),
        HAS_ENT=True,
        ENT_TERM=True,
        ENT_GRAD=True,
    )
    yield spec(
        "reinforce,shaping,token_out=2",
        "*fp32",
        tl.float32,
        LOSS=int(LossType.REINFORCE),
        SHAPE_POL=True,
        SHAPE_PROB=True,
        A3PO=True,
        HAS_ENT=True,
        ENT_Q=True,
        TOKEN_OUT=int(TokenOut.SHAPED_ADVANTAGES),
        SEQ_ADV=False,
    )
    # verl's DPPO: the truncation cap on (DUAL_CLIP), as the drop-ins call it
    yield spec("dppo_tv,cap", "*bf16", tl.float32, LOSS=int(LossType.DPPO_TV), DUAL_CLIP=True, SEQ_ADV=False)
    yield spec("dppo_kl,cap", "*fp32", tl.float32, LOSS=int(LossType.DPPO_KL), DUAL_CLIP=True, SEQ_ADV=False)
    # verl's GMPO and DRO drop-ins: token advantages, no log-ratio clamp (geo_mean: the IS
    # weights folded into A; dro: token_tis)
    yield spec("geo_mean", "*bf16", tl.float32, LOSS=int(LossType.GEO_MEAN), LR_CLAMP=False, SEQ_ADV=False)
    yield spec(
        "geo_mean,seq_tis,k3",
        "*bf16",
        tl.float32,
        LOSS=int(LossType.GEO_MEAN),
        RC=int(RolloutCorrectionCode.SEQ_TIS),
        KL=int(KlEstimator.K3),
        LR_CLAMP=False,
        SEQ_ADV=False,
    )
    geo_seq_tis_k3 = dict(
        LOSS=int(LossType.GEO_MEAN), RC=int(RolloutCorrectionCode.SEQ_TIS), KL=int(KlEstimator.K3), LR_CLAMP=False
    )
    yield spec("geo_mean,seq_tis,k3,seq_adv", "*bf16", tl.float32, **geo_seq_tis_k3)
    yield spec(
        "geo_mean,fp64,seq_mean", "*fp64", tl.float64, LOSS=int(LossType.GEO_MEAN), SEQ_MEAN=True, N_FROM_STATS=True
    )
    # verl's Clip-Cov / KL-Cov drop-ins: token advantages, no log-ratio clamp
    yield spec("clip_cov", "*bf16", tl.float32, LOSS=int(LossType.CLIP_COV), LR_CLAMP=False, SEQ_ADV=False)
    yield spec(
        "kl_cov,k3,seq_mean",
        "*bf16",
        tl.float32,
        LOSS=int(LossType.KL_COV),
        KL=int(KlEstimator.K3),
        SEQ_MEAN=True,
        N_FROM_STATS=True,
        SEQ_ADV=False,
    )
    yield spec("clip_cov,fp64,packed", "*fp64", tl.float64, LOSS=int(LossType.CLIP_COV), PACKED=True, SEARCH_STEPS=8)
    # RolloutCorrection: the rejection chain (token and sequence options), IcePop, the batch
    # normalisation, log_ratio="current", and the token outputs of verl's bypass (weights, keep)
    rejection = dict(RS_TOK=7, RS_SEQ=True, IS_NORM=True)
    yield spec(
        "ppo,k3,token_icepop,rs,norm,current,token_out=3",
        "*bf16",
        tl.float32,
        KL=int(KlEstimator.K3),
        RC=int(RolloutCorrectionCode.TOKEN_ICEPOP),
        RC_CURRENT=True,
        TOKEN_OUT=int(TokenOut.IS_WEIGHTS),
        **rejection,
    )
    yield spec(
        "gspo,seq_icepop,rs,norm,seq_mean,packed,token_out=4",
        "*bf16",
        tl.float32,
        LOSS=int(LossType.GSPO),
        RC=int(RolloutCorrectionCode.SEQ_ICEPOP),
        SEQ_MEAN=True,
        N_FROM_STATS=True,
        PACKED=True,
        SEARCH_STEPS=8,
        TOKEN_OUT=int(TokenOut.KEEP),
        **rejection,
    )
    yield spec("ppo,rs_only", "*bf16", tl.float32, RS_TOK=2, RS_SEQ=True, DUAL_CLIP=True)
    yield spec(
        "geo_mean,seq_tis,k3,rs,norm,fp64",
        "*fp64",
        tl.float64,
        SEQ_ADV=False,
        **dict(geo_seq_tis_k3, **rejection),
    )
    yield spec(
        "dro,token_tis",
        "*bf16",
        tl.float32,
        LOSS=int(LossType.DRO),
        RC=int(RolloutCorrectionCode.TOKEN_TIS),
        LR_CLAMP=False,
        SEQ_ADV=False,
    )
    everything = dict(
        DUAL_CLIP=True,
        KL=int(KlEstimator.K3_PLUS),
        RC=int(RolloutCorrectionCode.DECOUPLED),
        SEQ_MEAN=True,
        N_FROM_STATS=True,
        TOKEN_OUT=int(TokenOut.LOSS),
        HAS_ENT=True,
        ENT_TERM=True,
        ENT_GRAD=True,
        SHAPE_POL=True,
        SHAPE_PROB=True,
        A3PO=True,
        A3PO_ENT=True,
        ENT_Q=True,
    )
    yield spec("everything,packed", "*bf16", tl.float32, PACKED=True, SEARCH_STEPS=8, **everything)
    yield spec("fp64,everything", "*fp64", tl.float64, **everything)
    yield spec("fp64,gspo", "*fp64", tl.float64, LOSS=int(LossType.GSPO), KL=int(KlEstimator.K3))
    # The peers' KL clamps: every estimator clamped with the score gradient (nemo_rl), only
    # k3's value clamped (slime's low_var_kl)
    yield spec(
        "ppo,k3,clamp_all,score_grad",
        "*bf16",
        tl.float32,
        KL=int(KlEstimator.K3),
        KL_CLAMP=int(KlClamp.ALL),
        KL_SCORE=True,
        LR_CLAMP=False,
    )
    yield spec("ppo,k1,clamp_all", "*bf16", tl.float32, KL=int(KlEstimator.K1), KL_CLAMP=int(KlClamp.ALL), KL_IN=0.0)
    yield spec("gspo,k3,output_clamp", "*bf16", tl.float32, LOSS=int(LossType.GSPO), KL=int(KlEstimator.K3), KL_IN=0.0)
    # TRL's defaults with beta > 0: k3 times the ratio (use_bias_correction_kl)
    yield spec("ppo,k3,kl_ratio", "*bf16", tl.float32, LOSS=int(LossType.PPO), KL=int(KlEstimator.K3), KL_RATIO=True)
    yield spec(
        "gspo,k3,kl_ratio,seq_mean",
        "*bf16",
        tl.float32,
        LOSS=int(LossType.GSPO),
        KL=int(KlEstimator.K3),
        KL_RATIO=True,
        SEQ_MEAN=True,
        N_FROM_STATS=True,
    )
    # OpenRLHF's is_mode clamp / gate (token level; the sequence level: the stats pass's flag)
    gate = int(RolloutCorrectionCode.GATE)
    yield spec("ppo,k3,gate_clamp", "*bf16", tl.float32, KL=int(KlEstimator.K3), RC=gate, IS_GATE=int(IsGate.CLAMP))
    yield spec(
        "ppo,gate,binary_kl,current,token_out=3",
        "*bf16",
        tl.float32,
        RC=gate,
        IS_GATE=int(IsGate.BINARY_KL),
        RC_CURRENT=True,
        TOKEN_OUT=int(TokenOut.IS_WEIGHTS),
    )
    yield spec("ppo,gate,tv,rs", "*fp16", tl.float32, RC=gate, IS_GATE=int(IsGate.TV), RS_TOK=7, RS_SEQ=True)
    yield spec(
        "gspo,gate_seq,ratio,seq_mean",
        "*bf16",
        tl.float32,
        LOSS=int(LossType.GSPO),
        RC=gate,
        IS_GATE=int(IsGate.RATIO),
        GATE_SEQ=True,
        SEQ_MEAN=True,
        N_FROM_STATS=True,
    )
    yield spec(
        "fp64,gate,binary_kl", "*fp64", tl.float64, KL=int(KlEstimator.K3), RC=gate, IS_GATE=int(IsGate.BINARY_KL)
    )
