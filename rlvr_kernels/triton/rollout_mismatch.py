"""Train–rollout log-prob mismatch metrics in Triton (docs/rollout-mismatch.md): the CUDA backend
of ``rollout_mismatch`` (contract: :mod:`rlvr_kernels.ops.rollout_mismatch`; parameters:
:class:`rlvr_kernels.contracts.RolloutMismatchParams`; stages: the reference's).

Design:
- ``_sequence_kernel``: one program per sequence walks its tokens in blocks of ``BLOCK``,
  accumulating lane-wise, then reduces the lanes in a fixed tree: the sequence's sums,
  extrema and ratio counts go to a ``[B, NUM_ACC]`` scratch table (plus ``[B, 3]`` int64
  counts), its ``[B, 3]`` output columns are written directly.
- ``_batch_kernel``: one program walks the table in blocks of sequences (fixed order) and
  writes the batch vector and the valid-token count.
No atomics: the same bits on every run. Compute dtype ``CDT``: float64 when an input is
float64, float32 otherwise. Only valid tokens are read (padding may hold NaN); pointer
arithmetic is int64; packed offsets are sanitised (``_core.layout``) before they address memory.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from .._core.layout import compute_dtype, sanitized_offsets
from ..contracts.rollout_mismatch import (
    NUM_MISMATCH_OUT,
    NUM_MISMATCH_SEQ,
    MismatchOut,
    MismatchSeq,
    RolloutMismatchParams,
)

# Columns of the per-sequence scratch table (floating) and of the int64 counts.
_SUM_D, _SUM_ABS, _MAX_ABS, _SUM_K2, _SUM_K3, _SUM_RATIO, _MIN_D, _MAX_D, _SUM_CHI2, _SUM_TRAIN, _SUM_ROLLOUT = range(
    11
)
NUM_ACC = 11
_N, _N_LOW, _N_HIGH = range(3)

# The output indices as constexprs (contracts.rollout_mismatch).
OUT_ABS_DIFF_MEAN = tl.constexpr(int(MismatchOut.ABS_DIFF_MEAN))
OUT_ABS_DIFF_MAX = tl.constexpr(int(MismatchOut.ABS_DIFF_MAX))
OUT_K1 = tl.constexpr(int(MismatchOut.K1))
OUT_K2 = tl.constexpr(int(MismatchOut.K2))
OUT_K3 = tl.constexpr(int(MismatchOut.K3))
OUT_RATIO_MEAN = tl.constexpr(int(MismatchOut.RATIO_MEAN))
OUT_RATIO_MIN = tl.constexpr(int(MismatchOut.RATIO_MIN))
OUT_RATIO_MAX = tl.constexpr(int(MismatchOut.RATIO_MAX))
OUT_RATIO_FRAC_LOW = tl.constexpr(int(MismatchOut.RATIO_FRAC_LOW))
OUT_RATIO_FRAC_HIGH = tl.constexpr(int(MismatchOut.RATIO_FRAC_HIGH))
OUT_RATIO_FRAC_OUTSIDE = tl.constexpr(int(MismatchOut.RATIO_FRAC_OUTSIDE))
OUT_CHI2_TOKEN = tl.constexpr(int(MismatchOut.CHI2_TOKEN))
OUT_SEQ_ABS_DIFF_MEAN = tl.constexpr(int(MismatchOut.SEQ_ABS_DIFF_MEAN))
OUT_LOG_PPL_DIFF = tl.constexpr(int(MismatchOut.LOG_PPL_DIFF))
OUT_LOG_PPL_ABS_DIFF = tl.constexpr(int(MismatchOut.LOG_PPL_ABS_DIFF))
OUT_LOG_PPL_DIFF_MAX = tl.constexpr(int(MismatchOut.LOG_PPL_DIFF_MAX))
OUT_LOG_PPL_DIFF_MIN = tl.constexpr(int(MismatchOut.LOG_PPL_DIFF_MIN))
OUT_PPL_RATIO = tl.constexpr(int(MismatchOut.PPL_RATIO))
OUT_CHI2_SEQ = tl.constexpr(int(MismatchOut.CHI2_SEQ))
OUT_TRAINING_PPL = tl.constexpr(int(MismatchOut.TRAINING_PPL))
OUT_TRAINING_LOG_PPL = tl.constexpr(int(MismatchOut.TRAINING_LOG_PPL))
OUT_ROLLOUT_PPL = tl.constexpr(int(MismatchOut.ROLLOUT_PPL))
OUT_ROLLOUT_LOG_PPL = tl.constexpr(int(MismatchOut.ROLLOUT_LOG_PPL))
OUT_SEQ_RATIO_MEAN = tl.constexpr(int(MismatchOut.SEQ_RATIO_MEAN))
OUT_SEQ_RATIO_MIN = tl.constexpr(int(MismatchOut.SEQ_RATIO_MIN))
OUT_SEQ_RATIO_MAX = tl.constexpr(int(MismatchOut.SEQ_RATIO_MAX))
SEQ_ABS_DIFF_MEAN = tl.constexpr(int(MismatchSeq.ABS_DIFF_MEAN))
SEQ_ABS_DIFF_MAX = tl.constexpr(int(MismatchSeq.ABS_DIFF_MAX))
SEQ_LOG_RATIO = tl.constexpr(int(MismatchSeq.LOG_RATIO))
NSEQ = tl.constexpr(NUM_MISMATCH_SEQ)
NACC = tl.constexpr(NUM_ACC)

_BLOCK = 1024
_BLOCK_B = 256


@triton.jit
def _sequence_kernel(
    train_ptr,
    rollout_ptr,
    mask_ptr,
    cu_ptr,
    acc_ptr,
    cnt_ptr,
    seq_ptr,
    L,
    ratio_low,
    ratio_high,
    bound,
    PACKED: tl.constexpr,
    HAS_MASK: tl.constexpr,
    CDT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    if PACKED:
        start = tl.load(cu_ptr + b)
        end = tl.load(cu_ptr + b + 1)
    else:
        start = b * L
        end = start + L
    lanes = tl.arange(0, BLOCK)
    zero = tl.zeros((BLOCK,), CDT)
    n = tl.zeros((BLOCK,), tl.int32)
    n_low = tl.zeros((BLOCK,), tl.int32)
    n_high = tl.zeros((BLOCK,), tl.int32)
    s_d = zero
    s_abs = zero
    m_abs = zero
    s_k2 = zero
    s_k3 = zero
    s_ratio = zero
    s_chi2 = zero
    s_tr = zero
    s_ro = zero
    min_d = tl.full((BLOCK,), float("inf"), CDT)
    max_d = tl.full((BLOCK,), float("-inf"), CDT)
    for off in range(start, end, BLOCK):
        idx = off + lanes
        valid = idx < end
        if HAS_MASK:
            valid = valid & (tl.load(mask_ptr + idx, mask=valid, other=0) != 0)
        tr = tl.load(train_ptr + idx, mask=valid, other=0.0).to(CDT)
        ro = tl.load(rollout_ptr + idx, mask=valid, other=0.0).to(CDT)
        d = tl.where(valid, tr - ro, 0.0)
        e = tl.exp(d)
        ad = tl.abs(d)
        n += valid.to(tl.int32)
        s_d += d
        s_abs += ad
        m_abs = tl.maximum(m_abs, ad)
        s_k2 += tl.where(valid, 0.5 * d * d, 0.0)
        s_k3 += tl.where(valid, e - d - 1.0, 0.0)
        s_ratio += tl.where(valid, e, 0.0)
        min_d = tl.where(valid, tl.minimum(min_d, d), min_d)
        max_d = tl.where(valid, tl.maximum(max_d, d), max_d)
        n_low += (valid & (e < ratio_low)).to(tl.int32)
        n_high += (valid & (e > ratio_high)).to(tl.int32)
        ec = tl.exp(tl.minimum(tl.maximum(d, -bound), bound))
        s_chi2 += tl.where(valid, ec * ec, 0.0)
        s_tr += tl.where(valid, tr, 0.0)
        s_ro += tl.where(valid, ro, 0.0)
    count = tl.sum(n, axis=0)
    sum_d = tl.sum(s_d, axis=0)
    sum_abs = tl.sum(s_abs, axis=0)
    max_abs = tl.max(m_abs, axis=0)
    row = acc_ptr + b * NACC
    tl.store(row + 0, sum_d)
    tl.store(row + 1, sum_abs)
    tl.store(row + 2, max_abs)
    tl.store(row + 3, tl.sum(s_k2, axis=0))
    tl.store(row + 4, tl.sum(s_k3, axis=0))
    tl.store(row + 5, tl.sum(s_ratio, axis=0))
    tl.store(row + 6, tl.min(min_d, axis=0))
    tl.store(row + 7, tl.max(max_d, axis=0))
    tl.store(row + 8, tl.sum(s_chi2, axis=0))
    tl.store(row + 9, tl.sum(s_tr, axis=0))
    tl.store(row + 10, tl.sum(s_ro, axis=0))
    crow = cnt_ptr + b * 3
    tl.store(crow + 0, count.to(tl.int64))
    tl.store(crow + 1, tl.sum(n_low, axis=0).to(tl.int64))
    tl.store(crow + 2, tl.sum(n_high, axis=0).to(tl.int64))
    srow = seq_ptr + b * NSEQ
    mean_abs = tl.where(count > 0, sum_abs / tl.maximum(count, 1).to(CDT), 0.0)
    tl.store(srow + SEQ_ABS_DIFF_MEAN, mean_abs)
    tl.store(srow + SEQ_ABS_DIFF_MAX, max_abs)
    tl.store(srow + SEQ_LOG_RATIO, sum_d)


@triton.jit
def _batch_kernel(acc_ptr, cnt_ptr, out_ptr, ntok_ptr, B, bound, CDT: tl.constexpr, BLOCK_B: tl.constexpr):
    lanes = tl.arange(0, BLOCK_B)
    zero = tl.zeros((BLOCK_B,), CDT)
    n_tok = tl.zeros((BLOCK_B,), tl.int64)
    n_low = tl.zeros((BLOCK_B,), tl.int64)
    n_high = tl.zeros((BLOCK_B,), tl.int64)
    s_d = zero
    s_abs = zero
    m_abs = zero
    s_k2 = zero
    s_k3 = zero
    s_ratio = zero
    s_chi2 = zero
    min_d = tl.full((BLOCK_B,), float("inf"), CDT)
    max_d = tl.full((BLOCK_B,), float("-inf"), CDT)
    q_abs = zero
    q_lpd = zero
    q_lpd_abs = zero
    q_ppl_ratio = zero
    q_chi2 = zero
    q_tppl = zero
    q_tlog = zero
    q_rppl = zero
    q_rlog = zero
    q_sr = zero
    lpd_max = tl.full((BLOCK_B,), float("-inf"), CDT)
    lpd_min = tl.full((BLOCK_B,), float("inf"), CDT)
    sr_min = tl.full((BLOCK_B,), float("inf"), CDT)
    sr_max = zero
    for off in range(0, B, BLOCK_B):
        b = (off + lanes).to(tl.int64)
        inb = b < B
        row = acc_ptr + b * NACC
        crow = cnt_ptr + b * 3
        n = tl.load(crow + 0, mask=inb, other=0)
        a_d = tl.load(row + 0, mask=inb, other=0.0)
        a_abs = tl.load(row + 1, mask=inb, other=0.0)
        n_tok += n
        n_low += tl.load(crow + 1, mask=inb, other=0)
        n_high += tl.load(crow + 2, mask=inb, other=0)
        s_d += a_d
        s_abs += a_abs
        m_abs = tl.maximum(m_abs, tl.load(row + 2, mask=inb, other=0.0))
        s_k2 += tl.load(row + 3, mask=inb, other=0.0)
        s_k3 += tl.load(row + 4, mask=inb, other=0.0)
        s_ratio += tl.load(row + 5, mask=inb, other=0.0)
        min_d = tl.minimum(min_d, tl.load(row + 6, mask=inb, other=float("inf")))
        max_d = tl.maximum(max_d, tl.load(row + 7, mask=inb, other=float("-inf")))
        s_chi2 += tl.load(row + 8, mask=inb, other=0.0)
        # Sequence metrics over every sequence; an empty one has mean 0, as in verl.
        inv = tl.where(n > 0, 1.0 / tl.maximum(n, 1).to(CDT), 0.0)
        d = -a_d * inv
        tlp = -tl.load(row + 9, mask=inb, other=0.0) * inv
        rlp = -tl.load(row + 10, mask=inb, other=0.0) * inv
        sr = tl.exp(a_d)
        q_abs += a_abs * inv
        q_lpd += d
        q_lpd_abs += tl.abs(d)
        lpd_max = tl.where(inb, tl.maximum(lpd_max, d), lpd_max)
        lpd_min = tl.where(inb, tl.minimum(lpd_min, d), lpd_min)
        q_ppl_ratio += tl.where(inb, tl.exp(d), 0.0)
        q_chi2 += tl.where(inb, tl.exp(2.0 * tl.minimum(tl.maximum(a_d, -bound), bound)), 0.0)
        q_tppl += tl.where(inb, tl.exp(tlp), 0.0)
        q_tlog += tlp
        q_rppl += tl.where(inb, tl.exp(rlp), 0.0)
        q_rlog += rlp
        q_sr += tl.where(inb, sr, 0.0)
        sr_min = tl.where(inb, tl.minimum(sr_min, sr), sr_min)
        sr_max = tl.where(inb, tl.maximum(sr_max, sr), sr_max)
    N = tl.sum(n_tok, axis=0)
    tl.store(ntok_ptr, N)
    some = N > 0  # no valid token: every metric is 0
    Nf = tl.maximum(N, 1).to(CDT)
    Bf = tl.maximum(B, 1).to(CDT)
    tl.store(out_ptr + OUT_ABS_DIFF_MEAN, tl.where(some, tl.sum(s_abs, axis=0) / Nf, 0.0))
    tl.store(out_ptr + OUT_ABS_DIFF_MAX, tl.where(some, tl.max(m_abs, axis=0), 0.0))
    tl.store(out_ptr + OUT_K1, tl.where(some, -tl.sum(s_d, axis=0) / Nf, 0.0))
    tl.store(out_ptr + OUT_K2, tl.where(some, tl.sum(s_k2, axis=0) / Nf, 0.0))
    tl.store(out_ptr + OUT_K3, tl.where(some, tl.sum(s_k3, axis=0) / Nf, 0.0))
    tl.store(out_ptr + OUT_RATIO_MEAN, tl.where(some, tl.sum(s_ratio, axis=0) / Nf, 0.0))
    tl.store(out_ptr + OUT_RATIO_MIN, tl.where(some, tl.exp(tl.min(min_d, axis=0)), 0.0))
    tl.store(out_ptr + OUT_RATIO_MAX, tl.where(some, tl.exp(tl.max(max_d, axis=0)), 0.0))
    low = tl.sum(n_low, axis=0)
    high = tl.sum(n_high, axis=0)
    tl.store(out_ptr + OUT_RATIO_FRAC_LOW, tl.where(some, low.to(CDT) / Nf, 0.0))
    tl.store(out_ptr + OUT_RATIO_FRAC_HIGH, tl.where(some, high.to(CDT) / Nf, 0.0))
    tl.store(out_ptr + OUT_RATIO_FRAC_OUTSIDE, tl.where(some, (low + high).to(CDT) / Nf, 0.0))
    tl.store(out_ptr + OUT_CHI2_TOKEN, tl.where(some, tl.sum(s_chi2, axis=0) / Nf - 1.0, 0.0))
    tl.store(out_ptr + OUT_SEQ_ABS_DIFF_MEAN, tl.where(some, tl.sum(q_abs, axis=0) / Bf, 0.0))
    tl.store(out_ptr + OUT_LOG_PPL_DIFF, tl.where(some, tl.sum(q_lpd, axis=0) / Bf, 0.0))
    tl.store(out_ptr + OUT_LOG_PPL_ABS_DIFF, tl.where(some, tl.sum(q_lpd_abs, axis=0) / Bf, 0.0))
    tl.store(out_ptr + OUT_LOG_PPL_DIFF_MAX, tl.where(some, tl.max(lpd_max, axis=0), 0.0))
    tl.store(out_ptr + OUT_LOG_PPL_DIFF_MIN, tl.where(some, tl.min(lpd_min, axis=0), 0.0))
    tl.store(out_ptr + OUT_PPL_RATIO, tl.where(some, tl.sum(q_ppl_ratio, axis=0) / Bf, 0.0))
    tl.store(out_ptr + OUT_CHI2_SEQ, tl.where(some, tl.sum(q_chi2, axis=0) / Bf - 1.0, 0.0))
    tl.store(out_ptr + OUT_TRAINING_PPL, tl.where(some, tl.sum(q_tppl, axis=0) / Bf, 0.0))
    tl.store(out_ptr + OUT_TRAINING_LOG_PPL, tl.where(some, tl.sum(q_tlog, axis=0) / Bf, 0.0))
    tl.store(out_ptr + OUT_ROLLOUT_PPL, tl.where(some, tl.sum(q_rppl, axis=0) / Bf, 0.0))
    tl.store(out_ptr + OUT_ROLLOUT_LOG_PPL, tl.where(some, tl.sum(q_rlog, axis=0) / Bf, 0.0))
    tl.store(out_ptr + OUT_SEQ_RATIO_MEAN, tl.where(some, tl.sum(q_sr, axis=0) / Bf, 0.0))
    tl.store(out_ptr + OUT_SEQ_RATIO_MIN, tl.where(some, tl.min(sr_min, axis=0), 0.0))
    tl.store(out_ptr + OUT_SEQ_RATIO_MAX, tl.where(some, tl.max(sr_max, axis=0), 0.0))


_TL_DTYPE = {torch.float32: tl.float32, torch.float64: tl.float64}


def rollout_mismatch_stats(train_logprobs, rollout_logprobs, response_mask, cu_seqlens, fparams, iparams):
    """The launcher of the kernel contract (same arguments and outputs as the C++ op)."""
    p = RolloutMismatchParams.unpack(fparams, iparams)
    packed = cu_seqlens is not None
    if train_logprobs.dim() != (1 if packed else 2) or rollout_logprobs.shape != train_logprobs.shape:
        raise ValueError(
            "rollout_mismatch_stats: train_logprobs and rollout_logprobs must be [T] with cu_seqlens or "
            f"[B, L] without, of one shape; got {tuple(train_logprobs.shape)} and {tuple(rollout_logprobs.shape)}"
        )
    if response_mask is not None and response_mask.shape != train_logprobs.shape:
        raise ValueError(
            f"rollout_mismatch_stats: response_mask must have shape {tuple(train_logprobs.shape)}, "
            f"got {tuple(response_mask.shape)}"
        )
    device = train_logprobs.device
    cdt = compute_dtype(torch.promote_types(train_logprobs.dtype, rollout_logprobs.dtype))
    train, rollout = train_logprobs.contiguous(), rollout_logprobs.contiguous()
    if packed:
        cu = sanitized_offsets(cu_seqlens, train.shape[0]).contiguous()
        B, L = cu.numel() - 1, 0
    else:
        cu = train  # not read
        B, L = train.shape
    mask = response_mask
    if mask is not None:
        mask = mask.contiguous()
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8)
    acc = torch.empty((B, NUM_ACC), dtype=cdt, device=device)
    cnt = torch.empty((B, 3), dtype=torch.int64, device=device)
    seq = torch.empty((B, NUM_MISMATCH_SEQ), dtype=cdt, device=device)
    out = torch.empty((NUM_MISMATCH_OUT,), dtype=cdt, device=device)
    num_tokens = torch.empty((), dtype=torch.int64, device=device)
    if B > 0:
        _sequence_kernel[(B,)](
            train,
            rollout,
            mask if mask is not None else train,
            cu,
            acc,
            cnt,
            seq,
            L,
            p.ratio_low,
            p.ratio_high,
            p.log_ratio_bound,
            PACKED=packed,
            HAS_MASK=mask is not None,
            CDT=_TL_DTYPE[cdt],
            BLOCK=_BLOCK if (L or train.shape[0]) >= _BLOCK else 128,
        )
    _batch_kernel[(1,)](acc, cnt, out, num_tokens, B, p.log_ratio_bound, CDT=_TL_DTYPE[cdt], BLOCK_B=_BLOCK_B)
    return out, seq, num_tokens


def aot_specs():
    """Variants compiled ahead of time by ``python -m rlvr_kernels.triton.aot`` (see there for the
    spec format): the sequence kernel padded and packed on bf16 and fp32 inputs with a mask, and
    the batch kernel, in fp32 compute."""
    k = sys.modules[__name__]
    for dtype in ("bf16", "fp32"):
        for packed in (False, True):
            sig = dict(
                train_ptr=f"*{dtype}",
                rollout_ptr=f"*{dtype}",
                mask_ptr="*u8",
                cu_ptr="*i64",
                acc_ptr="*fp32",
                cnt_ptr="*i64",
                seq_ptr="*fp32",
                L="i64",
                ratio_low="fp32",
                ratio_high="fp32",
                bound="fp32",
            )
            const = dict(PACKED=packed, HAS_MASK=True, CDT=tl.float32, BLOCK=_BLOCK)
            yield f"_sequence_kernel[{dtype},{'packed' if packed else 'padded'}]", k._sequence_kernel, sig, const
    sig = dict(acc_ptr="*fp32", cnt_ptr="*i64", out_ptr="*fp32", ntok_ptr="*i64", B="i64", bound="fp32")
    yield "_batch_kernel", k._batch_kernel, sig, dict(CDT=tl.float32, BLOCK_B=_BLOCK_B)
