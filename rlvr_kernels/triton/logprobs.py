"""``linear_logprobs`` and ``logprobs_from_logits`` in Triton (docs/logprobs.md): the CUDA backend of
``rlvr_kernels.ops.logprobs``, whose module docstring is the kernel contract (z, the
per-row statistics, the CSR of targets, dz); the scalar parameters and the stats columns
are ``rlvr_kernels.contracts.logprobs``. The exact math is ``rlvr_kernels.reference.logprobs``.
The launchers (``linear_logprobs_stats``, ``linear_logprobs_bwd``,
``logprobs_from_logits_stats``, ``logprobs_from_logits_bwd``) carry the names and take the
arguments of the C++ kernels (``csrc/ops.cpp``), parameter lists included.

Design:
- Linear forward (``_linear_fwd_kernel``): one program per block of ``BLOCK_N`` rows. It
  walks the whole vocabulary in a fixed order, one ``BLOCK_V`` tile at a time; each tile of
  z is a ``tl.dot`` GEMM over H in ``BLOCK_H`` chunks (bf16/fp16 operands: HGMMA on sm_90,
  HMMA on sm_80; fp32 operands: IEEE fp32 FMA; fp64: DMMA), biased and scaled by 1/T in
  the epilogue, which folds it into the online per-row statistics (max, Σexp,
  Σexp·(z − max)). Logits never reach memory. A row's result depends only on its own
  data and on the tiling (a function of the dtype and the GPU arch, never of N): bitwise
  batch-invariant and deterministic.
- Target logits come from the same z tile (same rounding as the statistics): for
  k < (largest target count of the block's rows), the k-th target of every row is turned
  into an int32 column index local to the tile (−1 when it is not in the tile, including
  every id outside [0, V)) and compared with the tile's column lanes; a tile holding none
  of those targets skips the compare (a scalar runtime branch). Targets are compared,
  never used as addresses; ``target_logits`` starts zeroed, so an unmatched target (−1,
  another shard's id) reads 0.
- Linear backward, no atomics, everything summed in a fixed order:
  ``_linear_bwd_hidden_kernel`` (a program per row block; walks the vocabulary tiles,
  recomputes z, forms dz, adds dz·W[tile] into its own rows of grad_hidden) and
  ``_linear_bwd_weight_kernel`` (a program per vocabulary tile; walks the row blocks,
  recomputes z, forms dz, adds dzᵀ·hidden[block] into its own rows of grad_weight and
  Σ_rows dz into grad_bias, in registers). The [rows, H] / [vocab, H] accumulators do not
  fit in registers, so each program read-modify-writes its own rows of a compute-dtype
  buffer in ``BLOCK_HG`` chunks (``_rmw_product``: the first pass writes, a CTA barrier
  after each pass);
  for 16-bit inputs that buffer is an fp32 scratch cast to the input dtype at the end
  (transient memory: 4 bytes × (N + V) × H). dz is rounded to the operand dtype
  (bf16/fp16) for the tensor-core dot, as a cuBLAS backward on bf16 logits would be.
  Cost: 5 GEMM-sized passes of N·V·H (forward, two recomputes of z, dz·W, dzᵀ·hidden)
  against the 3 of an unfused implementation, plus an fp32 round trip of the
  accumulator per tile. Faster structures (not done): form dz once per (row block,
  vocab tile) and reduce both products deterministically through per-split partial
  buffers summed in a fixed order; and, for the forward, a split-V grid (a fixed number
  of vocabulary splits, so still batch-invariant) with a combine step, since one program
  per 128 rows leaves an H100 underfilled below N ≈ 17k rows.
- Logits forward (``_logits_fwd_kernel``): one program per row, one pass over V in
  ``BLOCK`` tiles with the online statistics (one exp per element: the tile's max is
  reduced first); the target logit is one masked load, index clamped into [0, V).
  Backward (``_logits_bwd_kernel``): a (row, tile) grid writing grad_logits once. Any row
  stride (stride(1) == 1), 0 included (an expanded view: rows are only read).
- Soft-cap (``HAS_CAP``, tanh_scale ≠ 0): z = tanh(a·y)·inv_T with a read from a
  one-element compute-dtype tensor (a Python float would reach the kernel as fp32, too
  coarse for the fp64 path); the backward multiplies dz by a·(1 − t²). The optional
  statistics (Σ exp², Σ z, the first argmax) are constexpr flags of the forward: the
  default launch compiles the same kernel as before they existed.
- Sampling support (the ``SUPPORT`` constexpr, a ``SupportMode``; NONE compiles the kernels
  as before it): ``_kept_tile`` / ``_kept_row`` say which columns of a tile are kept (MASK:
  a bit of the row's int32 bitmap, gathered per column; THRESHOLD: z >= the row's
  threshold, on the z the kernel itself formed). The forwards set the others to z = −inf
  right after the tile is formed, so the target logits and every statistic follow, and
  select (never multiply) exp(z − max) and z − max to 0 there, so an empty row ends at
  max −inf and zero sums without a NaN; the backwards select dz = 0 there.
- Threshold kernels: ``logprobs_from_logits_threshold`` runs ``_threshold_kernel`` (one
  program per row) on the logits themselves (z = logits · inv_T, the forward's product);
  ``linear_logprobs_threshold`` first writes z for a chunk of rows into an [R, V] scratch
  (``_linear_z_kernel``: the forward's ``_z_tile`` at the forward's tiles, R·V within
  ``THRESHOLD_SCRATCH_BYTES``), then runs it on the chunk. The selection makes passes over
  the row: max and Σe, t_min, then t_k and t_p by bisection on the order-preserving integer
  key of z (int32 for fp32, int64 for fp64; one pass per halving, 32 / 64 of them per
  filter), the largest value below t and the midpoint of the contract. Cost: up to ~70
  passes over the row (fp32, top-k and top-p both on), memory-bound; a radix select with
  16-way splits per pass would need a quarter of them (not done).
Numerics: compute dtype fp64 for fp64 inputs, else fp32; every load and store is masked,
offsets are int64 (column ids in the tile's layout are int32: int64 ones cost ~64
registers there), CSR ranges are clamped into [0, M], no host syncs (the loop bounds
that depend on the data are read in-kernel).

Interpreter: under ``TRITON_INTERPRET=1`` ``tl.dot`` on bf16 operands returns garbage, so
16-bit operands are upcast to fp32 there (``_INTERPRET``, read when this module is
imported); the bf16 path is covered by the ahead-of-time compile
(``python -m rlvr_kernels.triton.aot``: sm_80/sm_90, registers, spills, HGMMA) and by the
GPU run.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._core import layout
from ..contracts.logprobs import (
    NUM_STATS,
    LinearLogprobsBwdParams,
    LinearLogprobsStatsParams,
    LinearLogprobsThresholdParams,
    LogitsPrecision,
    LogprobsBwdParams,
    LogprobsStat,
    LogprobsStatsParams,
    LogprobsThresholdParams,
    SamplingConvention,
    SupportMode,
)

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# fp32 operands: IEEE fp32 (the default TF32 would lose ~3 digits against the fp32
# reference); "tf32x3" / "bf16x6" would run on tensor cores at near-fp32 accuracy.
_FP32_PRECISION = tl.constexpr("ieee")
_NEG_INF = tl.constexpr(float("-inf"))
_POS_INF = tl.constexpr(float("inf"))
# Logits precision (contracts.logprobs.LogitsPrecision; docs/logprobs.md). TF32: the operands are
# rounded to tf32 in registers first (to nearest, ties away: the C++ kernel's and the reference's
# rounding, so the tensor core's own truncation of the low bits finds them zero), then a TF32 dot.
# BF16: the operands cast to bf16 (to nearest even) for a bf16 dot with fp32 accumulation, y = acc + b
# rounded to bf16. The interpreter runs both as IEEE fp32 dots of the rounded (exact-product) operands,
# and rounds to bf16 with integer ops (its own fp32 -> bf16 cast truncates).
_PREC_TF32 = tl.constexpr(int(LogitsPrecision.TF32))
_PREC_BF16 = tl.constexpr(int(LogitsPrecision.BF16))
_TF32_PRECISION = tl.constexpr("ieee" if _INTERPRET else "tf32")
_BF16_DOT = tl.constexpr(not _INTERPRET)
# The stats output [N, _NUM_STATS] and its columns (contracts.logprobs.LogprobsStat).
_NUM_STATS = tl.constexpr(NUM_STATS)
_STAT_MAX = tl.constexpr(int(LogprobsStat.MAX))
_STAT_SUM_EXP = tl.constexpr(int(LogprobsStat.SUM_EXP))
_STAT_SUM_EXP_SHIFT = tl.constexpr(int(LogprobsStat.SUM_EXP_SHIFT))
_STAT_SUM_EXP_SQ = tl.constexpr(int(LogprobsStat.SUM_EXP_SQ))
_STAT_SUM_Z = tl.constexpr(int(LogprobsStat.SUM_Z))
_STAT_ARGMAX = tl.constexpr(int(LogprobsStat.ARGMAX))
# Sampling support (contracts.logprobs.SupportMode; ops/logprobs.py, "Sampling support"): the SUPPORT
# constexpr of the forward and backward kernels. NONE compiles the kernels as they were before it.
_SUP_NONE = tl.constexpr(int(SupportMode.NONE))
_SUP_MASK = tl.constexpr(int(SupportMode.MASK))
_SUP_THRESHOLD = tl.constexpr(int(SupportMode.THRESHOLD))
_CONV_VLLM = tl.constexpr(int(SamplingConvention.VLLM))
_I32_MAX = tl.constexpr(2**31 - 1)
_I64_MAX = tl.constexpr(2**63 - 1)
# The linear head's threshold kernel holds z for R rows at a time in an [R, V] scratch of at most
# this many bytes (one row if a row alone is larger): threshold_chunk_rows.
THRESHOLD_SCRATCH_BYTES = 64 << 20
# Smallest logits tile (a power of two): tl.arange needs at least 16 lanes.
_MIN_LOGITS_BLOCK = 16

# Untuned defaults (no GPU yet), per kernel family, operand width and (for sm_90) arch.
# The tiles depend on the dtype and the device only, never on N, so a row's result does
# not depend on the batch. Register budgets (python -m rlvr_kernels.triton.aot, no
# spills): the 16-bit forward runs a 128×128 tile on sm_90 (two warpgroups of m64n128
# wgmma, 248-255 registers) but 128×64 on sm_80, where mma.sync's layout spills the
# 128×128 epilogue. fp32 operands use the FMA dot (IEEE), which holds the K slices of both
# operands in registers: BLOCK_H = 16. fp64 (DMMA) holds twice the accumulator bytes.
# Tests shrink the tiles to exercise the multi-tile paths.
_CONFIGS = {
    ("linear_fwd", 16): dict(BLOCK_N=128, BLOCK_V=64, BLOCK_H=64, num_warps=8, num_stages=3),
    ("linear_fwd", 32): dict(BLOCK_N=64, BLOCK_V=64, BLOCK_H=16, num_warps=8, num_stages=2),
    ("linear_fwd", 64): dict(BLOCK_N=32, BLOCK_V=64, BLOCK_H=32, num_warps=4, num_stages=2),
    # The forward with a soft-cap or optional statistics: the same tiles, but no sm_90 128×128
    # override (its epilogue spills with the extra accumulators).
    ("linear_fwd_extra", 16): dict(BLOCK_N=128, BLOCK_V=64, BLOCK_H=64, num_warps=8, num_stages=3),
    ("linear_fwd_extra", 32): dict(BLOCK_N=64, BLOCK_V=64, BLOCK_H=16, num_warps=8, num_stages=2),
    ("linear_fwd_extra", 64): dict(BLOCK_N=32, BLOCK_V=64, BLOCK_H=32, num_warps=4, num_stages=2),
    ("linear_bwd", 16): dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=64, BLOCK_HG=64, num_warps=8, num_stages=2),
    ("linear_bwd", 32): dict(BLOCK_N=64, BLOCK_V=64, BLOCK_H=16, BLOCK_HG=16, num_warps=8, num_stages=2),
    ("linear_bwd", 64): dict(BLOCK_N=32, BLOCK_V=32, BLOCK_H=32, BLOCK_HG=32, num_warps=4, num_stages=2),
    # fp32 inputs with logits_precision="tf32": 8 warps spill in sm_80's weight-gradient kernel.
    ("linear_bwd_tf32", 32): dict(BLOCK_N=64, BLOCK_V=64, BLOCK_H=16, BLOCK_HG=16, num_warps=4, num_stages=2),
    ("logits_fwd", 16): dict(BLOCK=4096, num_warps=8),
    ("logits_fwd", 32): dict(BLOCK=4096, num_warps=8),
    ("logits_fwd", 64): dict(BLOCK=2048, num_warps=8),
    ("logits_bwd", 16): dict(BLOCK=2048, num_warps=4),
    ("logits_bwd", 32): dict(BLOCK=2048, num_warps=4),
    ("logits_bwd", 64): dict(BLOCK=1024, num_warps=4),
    # A MASK support gathers a bitmap word per tile element (a [BLOCK_N, BLOCK_V] tile of
    # addresses): smaller tiles, so that neither the forward nor the backward spills.
    ("linear_fwd_mask", 16): dict(BLOCK_N=64, BLOCK_V=64, BLOCK_H=64, num_warps=8, num_stages=3),
    ("linear_fwd_mask", 32): dict(BLOCK_N=64, BLOCK_V=64, BLOCK_H=16, num_warps=8, num_stages=2),
    ("linear_fwd_mask", 64): dict(BLOCK_N=32, BLOCK_V=32, BLOCK_H=32, num_warps=4, num_stages=2),
    ("linear_bwd_mask", 16): dict(BLOCK_N=64, BLOCK_V=64, BLOCK_H=64, BLOCK_HG=64, num_warps=8, num_stages=2),
    ("linear_bwd_mask", 32): dict(BLOCK_N=32, BLOCK_V=64, BLOCK_H=16, BLOCK_HG=16, num_warps=4, num_stages=2),
    ("linear_bwd_mask", 64): dict(BLOCK_N=32, BLOCK_V=32, BLOCK_H=32, BLOCK_HG=32, num_warps=4, num_stages=2),
    # The threshold kernels' per-row selection (one program per row, ~70 passes over its z). 2048
    # lanes over 8 warps spill on sm_90 (ptxas holds that loop nest to 32 registers).
    ("threshold_select", 16): dict(BLOCK=4096, num_warps=8),
    ("threshold_select", 32): dict(BLOCK=4096, num_warps=8),
    ("threshold_select", 64): dict(BLOCK=1024, num_warps=4),
}
_SM90_CONFIGS = {
    ("linear_fwd", 16): dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, num_warps=8, num_stages=3),
}


def _width(dtype: torch.dtype) -> int:
    return 64 if dtype == torch.float64 else 32 if dtype == torch.float32 else 16


def config(kind: str, dtype: torch.dtype, arch=None) -> dict:
    """Launch parameters (BLOCK_* constexprs, num_warps, num_stages, enable_fp_fusion) of a kernel family for
    an input dtype on a device of compute capability ``arch`` (80, 90, ...; None: CPU)."""
    key = (kind, _width(dtype))
    cfg = dict(_SM90_CONFIGS[key] if arch == 90 and key in _SM90_CONFIGS else _CONFIGS[key])
    # No FMA contraction: the backward recomputes z and must round it exactly as the
    # forward did. Contracting (acc + b)·inv_T − lse into one FMA in one kernel but not in
    # the other leaves an ulp of |z| in z_t − lse, i.e. all of 1 − p_t on a peaked row
    # (the C++ kernel has the same guard). The dots themselves are unaffected.
    cfg["enable_fp_fusion"] = False
    return cfg


def device_arch(device: torch.device):
    """Compute capability as 80, 90, ... (None off CUDA); cached by torch, no sync."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def compute_dtype(dtype: torch.dtype):
    """(torch, triton) compute dtype: fp64 for fp64 inputs, else fp32 (``layout.compute_dtype``)."""
    dt = layout.compute_dtype(dtype)
    return dt, (tl.float64 if dt == torch.float64 else tl.float32)


def operand_dtype(dtype: torch.dtype, interpret: bool = _INTERPRET):
    """The ``tl.dot`` operand dtype: the input's own (fp32 for 16-bit under the interpreter)."""
    if dtype == torch.float64:
        return tl.float64
    if dtype == torch.float32 or interpret:
        return tl.float32
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def kernel_precision(logits_precision: int, dtype: torch.dtype) -> int:
    """The PREC constexpr: TF32 rounds nothing in 16-bit inputs (their mantissa fits), so they
    keep the FP32 kernel and its 16-bit tensor-core dot."""
    prec = LogitsPrecision(logits_precision)
    if prec == LogitsPrecision.TF32 and _width(dtype) == 16:
        return int(LogitsPrecision.FP32)
    return int(prec)


def _fwd_kind(extra: bool, support: int) -> str:
    """The linear forward's configuration family: ``extra`` (a soft-cap or optional statistics)
    and a THRESHOLD support take the "extra" tiles, a MASK support its own (smaller) ones."""
    if support == SupportMode.MASK:
        return "linear_fwd_mask"
    return "linear_fwd_extra" if extra or support == SupportMode.THRESHOLD else "linear_fwd"


def _bwd_kind(prec: int, dtype: torch.dtype, support: int = SupportMode.NONE) -> str:
    """The backward's configuration family: its own for fp32 inputs on TF32 tensor cores, and
    for a MASK support."""
    if support == SupportMode.MASK:
        return "linear_bwd_mask"
    return "linear_bwd_tf32" if prec == LogitsPrecision.TF32 and _width(dtype) == 32 else "linear_bwd"


# ---------------------------------------------------------------------------------------
# shared pieces


@triton.jit
def _mma(a, b, acc, OP: tl.constexpr):
    """acc + a·b with a, b cast to the operand dtype OP (acc: compute dtype)."""
    a = a.to(OP)
    b = b.to(OP)
    if OP == tl.float32:
        acc = tl.dot(a, b, acc, input_precision=_FP32_PRECISION)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _round_tf32(x):
    """x (any float dtype) as fp32 rounded to tf32: to nearest, ties away from zero (±inf, NaN kept)."""
    f = x.to(tl.float32)
    bits = (f.to(tl.int32, bitcast=True) + 0x1000) & -8192  # sign-magnitude: the carry rounds |x| up
    return tl.where(tl.abs(f) < _POS_INF, bits.to(tl.float32, bitcast=True), f)


@triton.jit
def _round_bf16(x):
    """x (fp32 or narrower) as fp32 rounded to bf16: to nearest, ties to even (±inf, NaN kept)."""
    f = x.to(tl.float32)
    if _BF16_DOT:
        r = f.to(tl.bfloat16).to(tl.float32)  # cvt.rn.bf16.f32
    else:
        bits = f.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        r = tl.where(f == f, bits.to(tl.float32, bitcast=True), f)
    return r


@triton.jit
def _z_mma(x, w, acc, CDT: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr):
    """acc + x·w as the logits precision PREC forms it (the GEMM of z only; the backward's
    products keep OP)."""
    if PREC == _PREC_BF16:
        xb = _round_bf16(x)
        wb = _round_bf16(w)
        if CDT == tl.float64:
            acc = _mma(xb, wb, acc, OP)
        elif _BF16_DOT:
            acc = tl.dot(xb.to(tl.bfloat16), wb.to(tl.bfloat16), acc)
        else:
            acc = _mma(xb, wb, acc, tl.float32)
    elif PREC == _PREC_TF32:
        xr = _round_tf32(x)
        wr = _round_tf32(w)
        if CDT == tl.float64:
            acc = _mma(xr, wr, acc, OP)
        else:
            acc = tl.dot(xr, wr, acc, input_precision=_TF32_PRECISION)
    else:
        acc = _mma(x, w, acc, OP)
    return acc


@triton.jit
def _csr(rowptr_ptr, rows, row_ok, M):
    """(begin, count) of each row's targets: row_ptr clamped into [0, M], a decreasing
    pair is empty, a row past N has none."""
    lo = tl.load(rowptr_ptr + rows, mask=row_ok, other=0)
    hi = tl.load(rowptr_ptr + rows + 1, mask=row_ok, other=0)
    beg = tl.minimum(tl.maximum(lo, 0), M)
    end = tl.minimum(tl.maximum(hi, beg), M)
    return beg, end - beg


@triton.jit
def _tanh(x, CDT: tl.constexpr):
    """tanh: (1 − e)/(1 + e) with e = exp(−2|x|) (absolute error a few ulp of 1, exact limits);
    in fp32 the odd Taylor series through x⁹ below |x| = 1/8 (relative accuracy near 0; its
    remainder is below 1e-11 relative, too coarse for fp64, where the quotient's absolute
    error of ~1e-16 is what the fp64 checks need). The C++ kernel: the same for fp32, libm for fp64."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    q = (1.0 - e) / (1.0 + e)
    q = tl.where(x < 0, -q, q)
    if CDT == tl.float32:
        x2 = x * x
        p = x2 * (62.0 / 2835.0) - 17.0 / 315.0
        p = p * x2 + 2.0 / 15.0
        p = p * x2 - 1.0 / 3.0
        q = tl.where(ax < 0.125, x + x * x2 * p, q)
    return q


@triton.jit
def _z_tile(
    x_ptr,
    w_ptr,
    b_ptr,
    rows,
    cols,
    row_ok,
    col_ok,
    inv_t,
    tanh_scale,
    H,
    HAS_BIAS: tl.constexpr,
    HAS_CAP: tl.constexpr,
    CDT: tl.constexpr,
    OP: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """(z, t): z[rows, cols] = y · inv_t[rows], y = hidden[rows]·W[cols]ᵀ + b[cols], in the
    compute dtype, or with HAS_CAP z = t · inv_t, t = tanh(tanh_scale · y) (t is z without
    a cap; masked rows / columns compute from zeros; the caller masks them). y as the logits
    precision PREC forms it (``_z_mma``; BF16 rounds b and y to bf16)."""
    ks = tl.arange(0, BLOCK_H)
    x_ptrs = x_ptr + rows[:, None] * H + ks[None, :]  # [BLOCK_N, BLOCK_H]
    w_ptrs = w_ptr + cols[None, :] * H + ks[:, None]  # [BLOCK_H, BLOCK_V] = W[cols]ᵀ
    acc = tl.zeros([BLOCK_N, BLOCK_V], CDT)
    for h0 in range(0, H, BLOCK_H):
        k_ok = ks < H - h0
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _z_mma(x, w, acc, CDT, OP, PREC)
        x_ptrs += BLOCK_H
        w_ptrs += BLOCK_H
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=col_ok, other=0.0)
        if PREC == _PREC_BF16:
            b = _round_bf16(b)
        acc = acc + b.to(CDT)[None, :]
    if PREC == _PREC_BF16:
        acc = _round_bf16(acc).to(CDT)
    if HAS_CAP:
        acc = _tanh(acc * tanh_scale, CDT)
    return acc * inv_t[:, None], acc


@triton.jit
def _tile_local(t, ok, v0, V, BLOCK_V: tl.constexpr):
    """Target ids as int32 column indices local to the tile [v0, v0 + BLOCK_V), −1 where
    the id is not a valid column of the tile (or ``ok`` is False). Compare with
    ``tl.arange(0, BLOCK_V)``: int32, so no int64 column ids live in the tile's layout."""
    in_tile = ok & (t >= v0) & (t < v0 + BLOCK_V) & (t < V)
    return tl.where(in_tile, t - v0, -1).to(tl.int32)


@triton.jit
def _kept_tile(z, sup_ptr, rows, row_ok, c32, col_ok, V, SUPPORT: tl.constexpr):
    """Which entries of the tile z [rows, cols] the sampling support keeps (False outside the
    valid rows / columns); ``c32``: the tile's columns as int32 ids. MASK: bit c % 32 of word
    c // 32 of the row's bitmap (int32 [N, ceil(V / 32)]); THRESHOLD: z >= the row's threshold
    (a NaN threshold keeps nothing). SUPPORT is MASK or THRESHOLD."""
    ok = row_ok[:, None] & col_ok[None, :]
    if SUPPORT == _SUP_MASK:
        words_per_row = (V + 31) // 32
        w = tl.load(sup_ptr + rows[:, None] * words_per_row + (c32 >> 5)[None, :], mask=ok, other=0)
        kept = ((w >> (c32 & 31)[None, :]) & 1) != 0
    else:
        thr = tl.load(sup_ptr + rows, mask=row_ok, other=0.0).to(z.dtype)
        kept = z >= thr[:, None]
    return kept & ok


@triton.jit
def _kept_row(z, sup_ptr, n, c32, ok, V, SUPPORT: tl.constexpr):
    """``_kept_tile`` for one row n: z and the int32 column ids c32 are 1-D (or scalars)."""
    if SUPPORT == _SUP_MASK:
        w = tl.load(sup_ptr + n * ((V + 31) // 32) + (c32 >> 5), mask=ok, other=0)
        kept = ((w >> (c32 & 31)) & 1) != 0
    else:
        kept = z >= tl.load(sup_ptr + n).to(z.dtype)
    return kept & ok


@triton.jit
def _row_grad_stats(
    g_ptr,
    lse_ptr,
    ent_ptr,
    gent_ptr,
    rows,
    row_ok,
    beg,
    cnt,
    kmax,
    HAS_GENT: tl.constexpr,
    CDT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Per-row lse, entropy, h = grad_entropy (0 without) and G = Σ of the row's g."""
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0).to(CDT)
    ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0).to(CDT)
    if HAS_GENT:
        hg = tl.load(gent_ptr + rows, mask=row_ok, other=0.0).to(CDT)
    else:
        hg = tl.zeros([BLOCK_N], CDT)
    G = tl.zeros([BLOCK_N], CDT)
    for k in range(kmax):
        G += tl.load(g_ptr + beg + k, mask=k < cnt, other=0.0).to(CDT)
    return lse, ent, hg, G


@triton.jit
def _dz_tile(
    z,
    tgt_ptr,
    g_ptr,
    beg,
    cnt,
    kmax,
    vl,
    v0,
    V,
    inv_t,
    lse,
    ent,
    hg,
    G,
    rows,
    row_ok,
    col_ok,
    sup_ptr,
    HAS_GENT: tl.constexpr,
    CDT: tl.constexpr,
    SUPPORT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """dz = inv_T · (S − G·p − h·p·(z − lse + entropy)) on the tile, 0 outside the valid
    rows / columns and (SUPPORT) on the columns the support does not keep, selected: there
    p may be inf or NaN (an empty row's lse is −inf). S[n, v] = Σ_{k in row n, t_k = v} g_k
    (an id outside [0, V) never matches). S is added into the tile in z's own (MMA) layout: a separate
    zero-initialised accumulator would get a blocked layout that replicates the per-row
    vectors across a warp's lanes (int64 CSR offsets and pointers, ~150 registers)."""
    d = z - lse[:, None]
    p = tl.exp(d)
    inner = -(G[:, None] * p)
    if HAS_GENT:
        inner -= hg[:, None] * p * (d + ent[:, None])
    for k in range(kmax):
        k_ok = k < cnt
        loc = _tile_local(tl.load(tgt_ptr + beg + k, mask=k_ok, other=-1), k_ok, v0, V, BLOCK_V)
        if tl.max(loc, 0) >= 0:  # some row's k-th target is in this tile
            g = tl.load(g_ptr + beg + k, mask=loc >= 0, other=0.0).to(CDT)
            inner += tl.where(vl[None, :] == loc[:, None], g[:, None], 0.0)
    dz = inner * inv_t[:, None]
    if SUPPORT == _SUP_NONE:
        ok = row_ok[:, None] & col_ok[None, :]
    else:
        ok = _kept_tile(z, sup_ptr, rows, row_ok, v0 + vl, col_ok, V, SUPPORT)
    return tl.where(ok, dz, 0.0)


@triton.jit
def _rmw_product(
    a,
    b_ptr,
    b_rows,
    b_row_ok,
    o_ptr,
    o_rows,
    o_row_ok,
    pos,
    H,
    OP: tl.constexpr,
    BLOCK_HG: tl.constexpr,
):
    """o[o_rows] (+)= a · b[b_rows] over the H columns of the row-major [*, H] matrices b and
    o (compute dtype), with a [len(o_rows), len(b_rows)] in registers (operand dtype OP). The
    [rows, H] accumulator does not fit in registers, so it is read, added to and written back
    in BLOCK_HG-column chunks; the program's first pass (``pos`` == 0: its first vocabulary
    tile or row block) writes without reading. A CTA barrier at the end: this pass's stores
    are visible to the whole CTA before the next pass reads them."""
    hl = tl.arange(0, BLOCK_HG)
    not_first = (tl.zeros([BLOCK_HG], tl.int32) + pos) > 0
    b_ptrs = b_ptr + b_rows[:, None] * H + hl[None, :]
    o_ptrs = o_ptr + o_rows[:, None] * H + hl[None, :]
    for h0 in range(0, H, BLOCK_HG):
        h_ok = hl < H - h0
        b = tl.load(b_ptrs, mask=b_row_ok[:, None] & h_ok[None, :], other=0.0)
        o_mask = o_row_ok[:, None] & h_ok[None, :]
        prev = tl.load(o_ptrs, mask=o_mask & not_first[None, :], other=0.0)
        tl.store(o_ptrs, _mma(a, b, prev, OP), mask=o_mask)
        b_ptrs += BLOCK_HG
        o_ptrs += BLOCK_HG
    tl.debug_barrier()


# ---------------------------------------------------------------------------------------
# linear_logprobs


@triton.jit
def _linear_fwd_kernel(
    x_ptr,  # [N, H] hidden, input dtype
    w_ptr,  # [V, H] weight, input dtype
    b_ptr,  # [V] bias, input dtype (HAS_BIAS)
    invt_ptr,  # [N] inverse temperature, compute dtype
    rowptr_ptr,  # [N + 1] int64 CSR of the targets
    tgt_ptr,  # [M] int64 local vocabulary ids (compared only)
    sup_ptr,  # the sampling support (SUPPORT): int32 [N, ceil(V / 32)] bitmap or [N] compute-dtype threshold
    stats_ptr,  # [N, _NUM_STATS] compute dtype output: max z, Σexp(z − max), Σexp(z − max)·(z − max), ...
    tlog_ptr,  # [M] compute dtype output, zeroed by the launcher: z of each matching target
    tscale_ptr,  # [1] compute dtype: tanh_scale (HAS_CAP)
    N,
    V,
    H,
    M,
    HAS_BIAS: tl.constexpr,
    NEED_ENTROPY: tl.constexpr,
    HAS_CAP: tl.constexpr,
    NEED_SUM_SQ: tl.constexpr,
    NEED_SUM_Z: tl.constexpr,
    NEED_ARGMAX: tl.constexpr,
    CDT: tl.constexpr,
    OP: tl.constexpr,
    PREC: tl.constexpr,
    SUPPORT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    row_ok = rows < N
    inv_t = tl.load(invt_ptr + rows, mask=row_ok, other=0.0).to(CDT)
    beg, cnt = _csr(rowptr_ptr, rows, row_ok, M)
    kmax = tl.max(cnt, 0)
    vl = tl.arange(0, BLOCK_V)
    tanh_scale = tl.zeros([], CDT)
    if HAS_CAP:
        tanh_scale = tl.load(tscale_ptr).to(CDT)

    m = tl.full([BLOCK_N], _NEG_INF, CDT)
    s = tl.zeros([BLOCK_N], CDT)
    t = tl.zeros([BLOCK_N], CDT)
    q = tl.zeros([BLOCK_N], CDT)
    zs = tl.zeros([BLOCK_N], CDT)
    am = tl.zeros([BLOCK_N], tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + vl.to(tl.int64)  # addresses only; the tile compares int32 local ids
        col_ok = vl < V - v0
        z, _ = _z_tile(
            x_ptr,
            w_ptr,
            b_ptr,
            rows,
            cols,
            row_ok,
            col_ok,
            inv_t,
            tanh_scale,
            H,
            HAS_BIAS,
            HAS_CAP,
            CDT,
            OP,
            PREC,
            BLOCK_N,
            BLOCK_V,
            BLOCK_H,
        )
        if SUPPORT != _SUP_NONE:
            # A column the support does not keep is z = −inf from here on (its target logit too).
            kept = _kept_tile(z, sup_ptr, rows, row_ok, v0 + vl, col_ok, V, SUPPORT)
            z = tl.where(kept, z, _NEG_INF)
        # Target logits straight from the tile.
        for k in range(kmax):
            k_ok = k < cnt
            loc = _tile_local(tl.load(tgt_ptr + beg + k, mask=k_ok, other=-1), k_ok, v0, V, BLOCK_V)
            if tl.max(loc, 0) >= 0:  # some row's k-th target is in this tile
                val = tl.sum(tl.where(vl[None, :] == loc[:, None], z, 0.0), 1)
                tl.store(tlog_ptr + beg + k, val, mask=loc >= 0)
        # Online statistics (every tile holds ≥ 1 valid column, so m_new is finite
        # unless z itself is ±inf / NaN).
        m_new = tl.maximum(m, tl.max(tl.where(col_ok[None, :], z, _NEG_INF), 1))
        if NEED_ARGMAX:
            # The tile's first max column replaces the argmax only when it is strictly larger
            # (ties keep the earlier column, as torch.argmax).
            zm = tl.where(col_ok[None, :], z, _NEG_INF)
            tile_max = tl.max(zm, 1)
            tile_arg = tl.min(tl.where(zm == tile_max[:, None], vl[None, :], BLOCK_V), 1)
            am = tl.where(tile_max > m, v0 + tile_arg, am)
        if SUPPORT == _SUP_NONE:
            if NEED_SUM_Z:
                zs += tl.sum(tl.where(col_ok[None, :], z, 0.0), 1)
        elif NEED_SUM_Z:
            zs += tl.sum(tl.where(kept, z, 0.0), 1)
        seen = m > _NEG_INF
        shift = tl.where(seen, m - m_new, 0.0)
        alpha = tl.where(seen, tl.exp(shift), 0.0)
        if SUPPORT == _SUP_NONE:
            d = z - m_new[:, None]
            e = tl.where(col_ok[None, :], tl.exp(d), 0.0)
        else:
            # Selected, not masked by a product: z − m_new is −inf or NaN off the support.
            d = tl.where(kept, z - m_new[:, None], 0.0)
            e = tl.where(kept, tl.exp(d), 0.0)
        if NEED_ENTROPY:
            t = alpha * (t + shift * s) + tl.sum(e * d, 1)
        if NEED_SUM_SQ:
            q = alpha * alpha * q + tl.sum(e * e, 1)
        s = alpha * s + tl.sum(e, 1)
        m = m_new
    tl.store(stats_ptr + rows * _NUM_STATS + _STAT_MAX, m, mask=row_ok)
    tl.store(stats_ptr + rows * _NUM_STATS + _STAT_SUM_EXP, s, mask=row_ok)
    tl.store(stats_ptr + rows * _NUM_STATS + _STAT_SUM_EXP_SHIFT, t, mask=row_ok)
    tl.store(stats_ptr + rows * _NUM_STATS + _STAT_SUM_EXP_SQ, q, mask=row_ok)
    tl.store(stats_ptr + rows * _NUM_STATS + _STAT_SUM_Z, zs, mask=row_ok)
    tl.store(stats_ptr + rows * _NUM_STATS + _STAT_ARGMAX, am.to(CDT), mask=row_ok)


@triton.jit
def _linear_bwd_hidden_kernel(
    x_ptr,
    w_ptr,
    b_ptr,  # hidden [N, H], weight [V, H], bias [V] (HAS_BIAS): input dtype
    invt_ptr,  # [N] compute dtype
    rowptr_ptr,
    tgt_ptr,  # [N + 1], [M] int64 CSR of the targets
    g_ptr,  # [M] compute dtype: gradient of each target's log-prob
    lse_ptr,
    ent_ptr,  # [N] compute dtype: global logsumexp and entropy
    gent_ptr,  # [N] compute dtype: gradient of the entropy (HAS_GENT)
    sup_ptr,  # the forward's sampling support (SUPPORT)
    gh_ptr,  # [N, H] compute dtype output (accumulated in place): dz·W
    tscale_ptr,  # [1] compute dtype: tanh_scale (HAS_CAP)
    N,
    V,
    H,
    M,
    HAS_BIAS: tl.constexpr,
    HAS_GENT: tl.constexpr,
    HAS_CAP: tl.constexpr,
    CDT: tl.constexpr,
    OP: tl.constexpr,
    PREC: tl.constexpr,
    SUPPORT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HG: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    row_ok = rows < N
    inv_t = tl.load(invt_ptr + rows, mask=row_ok, other=0.0).to(CDT)
    beg, cnt = _csr(rowptr_ptr, rows, row_ok, M)
    kmax = tl.max(cnt, 0)
    lse, ent, hg, G = _row_grad_stats(
        g_ptr, lse_ptr, ent_ptr, gent_ptr, rows, row_ok, beg, cnt, kmax, HAS_GENT, CDT, BLOCK_N
    )
    vl = tl.arange(0, BLOCK_V)
    tanh_scale = tl.zeros([], CDT)
    if HAS_CAP:
        tanh_scale = tl.load(tscale_ptr).to(CDT)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + vl.to(tl.int64)  # addresses only; the tile compares int32 local ids
        col_ok = vl < V - v0
        z, tt = _z_tile(
            x_ptr,
            w_ptr,
            b_ptr,
            rows,
            cols,
            row_ok,
            col_ok,
            inv_t,
            tanh_scale,
            H,
            HAS_BIAS,
            HAS_CAP,
            CDT,
            OP,
            PREC,
            BLOCK_N,
            BLOCK_V,
            BLOCK_H,
        )
        dz = _dz_tile(
            z,
            tgt_ptr,
            g_ptr,
            beg,
            cnt,
            kmax,
            vl,
            v0,
            V,
            inv_t,
            lse,
            ent,
            hg,
            G,
            rows,
            row_ok,
            col_ok,
            sup_ptr,
            HAS_GENT,
            CDT,
            SUPPORT,
            BLOCK_V,
        )
        if HAS_CAP:
            dz = dz * (tanh_scale * (1.0 - tt * tt))
        dz = dz.to(OP)
        # grad_hidden[rows] (+)= dz · W[cols]: the first tile writes, later ones add.
        _rmw_product(dz, w_ptr, cols, col_ok, gh_ptr, rows, row_ok, v0, H, OP, BLOCK_HG)


@triton.jit
def _linear_bwd_weight_kernel(
    x_ptr,
    w_ptr,
    b_ptr,  # hidden [N, H], weight [V, H], bias [V] (HAS_BIAS): input dtype
    invt_ptr,  # [N] compute dtype
    rowptr_ptr,
    tgt_ptr,  # [N + 1], [M] int64 CSR of the targets
    g_ptr,  # [M] compute dtype: gradient of each target's log-prob
    lse_ptr,
    ent_ptr,  # [N] compute dtype: global logsumexp and entropy
    gent_ptr,  # [N] compute dtype: gradient of the entropy (HAS_GENT)
    sup_ptr,  # the forward's sampling support (SUPPORT)
    gw_ptr,  # [V, H] compute dtype output (accumulated in place): dzᵀ·hidden (NEED_W)
    gb_ptr,  # [V] bias-dtype output: Σ_rows dz (NEED_B)
    tscale_ptr,  # [1] compute dtype: tanh_scale (HAS_CAP)
    N,
    V,
    H,
    M,
    HAS_BIAS: tl.constexpr,
    HAS_GENT: tl.constexpr,
    HAS_CAP: tl.constexpr,
    NEED_W: tl.constexpr,
    NEED_B: tl.constexpr,
    CDT: tl.constexpr,
    OP: tl.constexpr,
    PREC: tl.constexpr,
    SUPPORT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HG: tl.constexpr,
):
    v0 = tl.program_id(0) * BLOCK_V
    vl = tl.arange(0, BLOCK_V)
    cols = v0 + vl.to(tl.int64)  # addresses only; the tile compares int32 local ids
    col_ok = vl < V - v0
    nl = tl.arange(0, BLOCK_N).to(tl.int64)
    gb = tl.zeros([BLOCK_V], CDT)
    tanh_scale = tl.zeros([], CDT)
    if HAS_CAP:
        tanh_scale = tl.load(tscale_ptr).to(CDT)
    for n0 in range(0, N, BLOCK_N):
        rows = n0 + nl
        row_ok = rows < N
        inv_t = tl.load(invt_ptr + rows, mask=row_ok, other=0.0).to(CDT)
        beg, cnt = _csr(rowptr_ptr, rows, row_ok, M)
        kmax = tl.max(cnt, 0)
        lse, ent, hg, G = _row_grad_stats(
            g_ptr, lse_ptr, ent_ptr, gent_ptr, rows, row_ok, beg, cnt, kmax, HAS_GENT, CDT, BLOCK_N
        )
        z, tt = _z_tile(
            x_ptr,
            w_ptr,
            b_ptr,
            rows,
            cols,
            row_ok,
            col_ok,
            inv_t,
            tanh_scale,
            H,
            HAS_BIAS,
            HAS_CAP,
            CDT,
            OP,
            PREC,
            BLOCK_N,
            BLOCK_V,
            BLOCK_H,
        )
        dz = _dz_tile(
            z,
            tgt_ptr,
            g_ptr,
            beg,
            cnt,
            kmax,
            vl,
            v0,
            V,
            inv_t,
            lse,
            ent,
            hg,
            G,
            rows,
            row_ok,
            col_ok,
            sup_ptr,
            HAS_GENT,
            CDT,
            SUPPORT,
            BLOCK_V,
        )
        if HAS_CAP:
            dz = dz * (tanh_scale * (1.0 - tt * tt))
        if NEED_B:
            gb += tl.sum(dz, 0)
        if NEED_W:
            # grad_weight[cols] (+)= dzᵀ · hidden[rows]: the first row block writes.
            dzt = tl.trans(dz.to(OP))  # [BLOCK_V, BLOCK_N]
            _rmw_product(dzt, x_ptr, rows, row_ok, gw_ptr, cols, col_ok, n0, H, OP, BLOCK_HG)
    if NEED_B:
        tl.store(gb_ptr + cols, gb.to(gb_ptr.dtype.element_ty), mask=col_ok)


# ---------------------------------------------------------------------------------------
# logprobs_from_logits


@triton.jit
def _logits_fwd_kernel(
    l_ptr,  # [N, V] logits, any float dtype, row stride `stride` (may be 0), unit column stride
    tgt_ptr,  # [N] int64 local vocabulary ids (an address only when in [0, V))
    invt_ptr,  # [N] compute dtype
    sup_ptr,  # the sampling support (SUPPORT): int32 [N, ceil(V / 32)] bitmap or [N] compute-dtype threshold
    stats_ptr,  # [N, _NUM_STATS] compute dtype output: max z, Σexp(z − max), Σexp(z − max)·(z − max)
    tlog_ptr,  # [N] compute dtype output: z of the target (−inf off the support), 0 when it is outside [0, V)
    V,
    stride,
    NEED_ENTROPY: tl.constexpr,
    CDT: tl.constexpr,
    SUPPORT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    base = l_ptr + n * stride
    inv_t = tl.load(invt_ptr + n).to(CDT)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    m = tl.full([], _NEG_INF, CDT)
    s = tl.zeros([], CDT)
    t = tl.zeros([], CDT)
    for v0 in range(0, V, BLOCK):
        cols = v0 + lanes
        ok = cols < V
        z = tl.load(base + cols, mask=ok, other=0.0).to(CDT) * inv_t
        if SUPPORT != _SUP_NONE:
            kept = _kept_row(z, sup_ptr, n, v0 + tl.arange(0, BLOCK), ok, V, SUPPORT)
            z = tl.where(kept, z, _NEG_INF)
        m_new = tl.maximum(m, tl.max(tl.where(ok, z, _NEG_INF), 0))
        seen = m > _NEG_INF
        shift = tl.where(seen, m - m_new, 0.0)
        alpha = tl.where(seen, tl.exp(shift), 0.0)
        if SUPPORT == _SUP_NONE:
            d = z - m_new
            e = tl.where(ok, tl.exp(d), 0.0)
        else:
            # Selected, not masked by a product: z − m_new is −inf or NaN off the support.
            d = tl.where(kept, z - m_new, 0.0)
            e = tl.where(kept, tl.exp(d), 0.0)
        if NEED_ENTROPY:
            t = alpha * (t + shift * s) + tl.sum(e * d, 0)
        s = alpha * s + tl.sum(e, 0)
        m = m_new
    tg = tl.load(tgt_ptr + n)
    t_ok = (tg >= 0) & (tg < V)
    tc = tl.where(t_ok, tg, 0)
    zt = tl.load(base + tc, mask=t_ok, other=0.0).to(CDT) * inv_t
    if SUPPORT != _SUP_NONE:
        zt = tl.where(_kept_row(zt, sup_ptr, n, tc.to(tl.int32), t_ok, V, SUPPORT), zt, _NEG_INF)
    tl.store(tlog_ptr + n, tl.where(t_ok, zt, 0.0))
    tl.store(stats_ptr + n * _NUM_STATS + _STAT_MAX, m)
    tl.store(stats_ptr + n * _NUM_STATS + _STAT_SUM_EXP, s)
    tl.store(stats_ptr + n * _NUM_STATS + _STAT_SUM_EXP_SHIFT, t)
    zero = tl.zeros([], CDT)  # the linear head's optional columns
    tl.store(stats_ptr + n * _NUM_STATS + _STAT_SUM_EXP_SQ, zero)
    tl.store(stats_ptr + n * _NUM_STATS + _STAT_SUM_Z, zero)
    tl.store(stats_ptr + n * _NUM_STATS + _STAT_ARGMAX, zero)


@triton.jit
def _logits_bwd_kernel(
    l_ptr,  # [N, V] logits, row stride `stride` (may be 0), unit column stride
    tgt_ptr,  # [N] int64 local vocabulary ids (compared only)
    invt_ptr,
    g_ptr,
    lse_ptr,
    ent_ptr,  # [N] compute dtype: inv T, grad of log p, lse, entropy
    gent_ptr,  # [N] compute dtype: gradient of the entropy (HAS_GENT)
    sup_ptr,  # the forward's sampling support (SUPPORT)
    out_ptr,  # [N, V] contiguous, logits' dtype: dz
    V,
    stride,
    HAS_GENT: tl.constexpr,
    CDT: tl.constexpr,
    SUPPORT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    ok = cols < V
    inv_t = tl.load(invt_ptr + n).to(CDT)
    g = tl.load(g_ptr + n).to(CDT)
    lse = tl.load(lse_ptr + n).to(CDT)
    tg = tl.load(tgt_ptr + n)
    z = tl.load(l_ptr + n * stride + cols, mask=ok, other=0.0).to(CDT) * inv_t
    d = z - lse
    p = tl.exp(d)
    inner = tl.where(cols == tg, g, 0.0) - g * p
    if HAS_GENT:
        h = tl.load(gent_ptr + n).to(CDT)
        ent = tl.load(ent_ptr + n).to(CDT)
        inner -= h * p * (d + ent)
    dz = inner * inv_t
    if SUPPORT != _SUP_NONE:
        # Selected: off the support p may be inf or NaN (an empty row's lse is −inf).
        dz = tl.where(_kept_row(z, sup_ptr, n, tl.program_id(1) * BLOCK + tl.arange(0, BLOCK), ok, V, SUPPORT), dz, 0.0)
    tl.store(out_ptr + n * V + cols, dz.to(out_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------
# sampling thresholds (linear_logprobs_threshold, logprobs_from_logits_threshold)


@triton.jit
def _linear_z_kernel(
    x_ptr,
    w_ptr,
    b_ptr,  # hidden [N, H], weight [V, H], bias [V] (HAS_BIAS): input dtype
    invt_ptr,  # [N] compute dtype
    z_ptr,  # [R, V] compute dtype output: z of rows row0 .. row_end − 1 (scratch row r = row row0 + r)
    tscale_ptr,  # [1] compute dtype: tanh_scale (HAS_CAP)
    row0,
    row_end,
    V,
    H,
    HAS_BIAS: tl.constexpr,
    HAS_CAP: tl.constexpr,
    CDT: tl.constexpr,
    OP: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One (row block, vocabulary tile) of z, by the forward's own tile code (``_z_tile``) at the
    forward's tiles (row0 is a multiple of BLOCK_N, so the row blocks are the forward's)."""
    rows = row0 + tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    row_ok = rows < row_end
    v0 = tl.program_id(1) * BLOCK_V
    vl = tl.arange(0, BLOCK_V)
    cols = v0 + vl.to(tl.int64)
    col_ok = vl < V - v0
    inv_t = tl.load(invt_ptr + rows, mask=row_ok, other=0.0).to(CDT)
    tanh_scale = tl.zeros([], CDT)
    if HAS_CAP:
        tanh_scale = tl.load(tscale_ptr).to(CDT)
    z, _ = _z_tile(
        x_ptr,
        w_ptr,
        b_ptr,
        rows,
        cols,
        row_ok,
        col_ok,
        inv_t,
        tanh_scale,
        H,
        HAS_BIAS,
        HAS_CAP,
        CDT,
        OP,
        PREC,
        BLOCK_N,
        BLOCK_V,
        BLOCK_H,
    )
    tl.store(z_ptr + (rows - row0)[:, None] * V + cols[None, :], z, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _order_key(z, KEY: tl.constexpr):
    """The integer key of a float that orders as the float does (−0 and +0 one key): the bits,
    with the magnitude bits of a negative value flipped. Its own inverse on the bits."""
    b = tl.where(z == 0, 0.0, z).to(KEY, bitcast=True)
    if KEY == tl.int64:
        flip = b ^ _I64_MAX
    else:
        flip = b ^ _I32_MAX
    return tl.where(b >= 0, b, flip)


@triton.jit
def _key_value(key, CDT: tl.constexpr, KEY: tl.constexpr):
    """The float whose ``_order_key`` is ``key``."""
    if KEY == tl.int64:
        flip = key ^ _I64_MAX
    else:
        flip = key ^ _I32_MAX
    return tl.where(key >= 0, key, flip).to(CDT, bitcast=True)


@triton.jit
def _key_min(KEY: tl.constexpr):
    """The least key (−2^31 or −2^63)."""
    if KEY == tl.int64:
        lo = tl.full([], -_I64_MAX - 1, tl.int64)
    else:
        lo = tl.full([], -_I32_MAX - 1, tl.int32)
    return lo


@triton.jit
def _row_z(base, v0, lanes, V, inv_t, HAS_INVT: tl.constexpr, CDT: tl.constexpr):
    """(z, ok) of the columns v0 + lanes of a row: the logits forward's z (logits · inv_T) with
    HAS_INVT, else z as stored (the linear head's scratch); −inf on the lanes past V."""
    cols = v0 + lanes
    ok = cols < V
    x = tl.load(base + cols, mask=ok, other=0.0).to(CDT)
    if HAS_INVT:
        x = x * inv_t
    return tl.where(ok, x, _NEG_INF), ok


@triton.jit
def _threshold_kernel(
    z_ptr,  # row r of the chunk at z_ptr + r·stride: the linear head's z scratch, or the logits
    stride,
    invt_ptr,  # [N] compute dtype (HAS_INVT: z = logits · inv_T)
    topk_ptr,  # [N] int64: top-k (<= 0 or >= V: off)
    topp_ptr,  # [N] compute dtype: top-p (>= 1: off; > 0)
    minp_ptr,  # [N] compute dtype: min-p (<= 0: off; <= 1)
    out_ptr,  # [N] compute dtype output: the THRESHOLD support
    row0,  # the chunk's first row
    V,
    HAS_INVT: tl.constexpr,
    CONV: tl.constexpr,
    CDT: tl.constexpr,
    KEY: tl.constexpr,
    NBITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row's threshold (ops/logprobs.py, "Sampling support"), by passes over its z: m and
    Σe, t_min, t_k by bisection on the order key (the largest key T with count(key >= T) >= k),
    Σ_U e, t_p by bisection on the key (the least T with B(T) = Σ_{z in U, key > T} e below P:
    B only falls as T grows, in floating point too, since fl(a + b) is monotone), then the
    largest value below t and the midpoint. NBITS halvings close the key range; no sort."""
    r = tl.program_id(0).to(tl.int64)
    n = row0 + r
    base = z_ptr + r * stride
    inv_t = tl.zeros([], CDT)
    if HAS_INVT:
        inv_t = tl.load(invt_ptr + n).to(CDT)
    k = tl.load(topk_ptr + n)
    top_p = tl.load(topp_ptr + n).to(CDT)
    min_p = tl.load(minp_ptr + n).to(CDT)
    lanes = tl.arange(0, BLOCK)

    m = tl.full([], _NEG_INF, CDT)
    for v0 in range(0, V, BLOCK):
        z, ok = _row_z(base, v0, lanes, V, inv_t, HAS_INVT, CDT)
        m = tl.maximum(m, tl.max(z, 0))
    total = tl.zeros([], CDT)
    t_min = tl.full([], _POS_INF, CDT)
    for v0 in range(0, V, BLOCK):
        z, ok = _row_z(base, v0, lanes, V, inv_t, HAS_INVT, CDT)
        e = tl.where(ok, tl.exp(z - m), 0.0)
        total += tl.sum(e, 0)
        t_min = tl.minimum(t_min, tl.min(tl.where(ok & (e >= min_p), z, _POS_INF), 0))
    t1 = tl.where(min_p > 0, t_min, _NEG_INF)

    if (k > 0) & (k < V):
        # lo: count(key >= lo) >= k holds (every column); hi = key(m) + 1: it does not.
        lo = _key_min(KEY)
        hi = _order_key(m, KEY) + 1
        for _ in range(NBITS):
            mid = (lo & hi) + ((lo ^ hi) >> 1)  # floor((lo + hi) / 2), no overflow
            cnt = tl.zeros([], tl.int64)
            for v0 in range(0, V, BLOCK):
                z, ok = _row_z(base, v0, lanes, V, inv_t, HAS_INVT, CDT)
                cnt += tl.sum((ok & (_order_key(z, KEY) >= mid)).to(tl.int64), 0)
            enough = cnt >= k
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid)
        t1 = tl.maximum(t1, _key_value(lo, CDT, KEY))

    t = t1
    if top_p < 1:
        mass_u = tl.zeros([], CDT)
        for v0 in range(0, V, BLOCK):
            z, ok = _row_z(base, v0, lanes, V, inv_t, HAS_INVT, CDT)
            mass_u += tl.sum(tl.where(ok & (z >= t1), tl.exp(z - m), 0.0), 0)
        if CONV == _CONV_VLLM:
            p_mass = top_p * mass_u
        else:
            p_mass = top_p * total
        # lo: every key above it is counted (taken as failing; if it holds, the least column of
        # U is the answer, which the bisection then finds); hi = key(m): B = 0, which holds.
        lo = _key_min(KEY)
        hi = _order_key(m, KEY)
        for _ in range(NBITS):
            mid = (lo & hi) + ((lo ^ hi) >> 1)
            above = tl.zeros([], CDT)
            for v0 in range(0, V, BLOCK):
                z, ok = _row_z(base, v0, lanes, V, inv_t, HAS_INVT, CDT)
                sel = ok & (z >= t1) & (_order_key(z, KEY) > mid)
                above += tl.sum(tl.where(sel, tl.exp(z - m), 0.0), 0)
            if CONV == _CONV_VLLM:
                holds = above < p_mass
            else:
                holds = above <= p_mass
            hi = tl.where(holds, mid, hi)
            lo = tl.where(holds, lo, mid)
        # t_p: the least column of U whose key is at least hi.
        t_p = tl.full([], _POS_INF, CDT)
        for v0 in range(0, V, BLOCK):
            z, ok = _row_z(base, v0, lanes, V, inv_t, HAS_INVT, CDT)
            sel = ok & (z >= t1) & (_order_key(z, KEY) >= hi)
            t_p = tl.minimum(t_p, tl.min(tl.where(sel, z, _POS_INF), 0))
        t = tl.maximum(t1, t_p)

    # The largest value below t, and a number strictly between them (t when the midpoint
    # rounds onto either end, or when nothing lies below t).
    below = tl.full([], _NEG_INF, CDT)
    for v0 in range(0, V, BLOCK):
        z, ok = _row_z(base, v0, lanes, V, inv_t, HAS_INVT, CDT)
        below = tl.maximum(below, tl.max(tl.where(ok & (z < t), z, _NEG_INF), 0))
    mid_v = below + (t - below) / 2
    tl.store(out_ptr + n, tl.where((mid_v > below) & (mid_v < t), mid_v, t))


# ---------------------------------------------------------------------------------------
# launchers (contract: rlvr_kernels/ops/logprobs.py; parameters: rlvr_kernels/contracts/logprobs.py)


def _support_arg(support, mode: SupportMode, like: torch.Tensor) -> torch.Tensor:
    """The support tensor a kernel reads under ``mode``, or an unread placeholder for NONE."""
    if mode == SupportMode.NONE:
        return like
    if support is None:
        raise ValueError(f"support: a tensor is required with support_mode {mode.name}")
    return support


def linear_logprobs_stats(hidden, weight, bias, inv_temperature, row_ptr, sorted_targets, support, fparams, iparams):
    """-> (stats [N, NUM_STATS], target_logits [M]), compute dtype."""
    p = LinearLogprobsStatsParams.unpack(fparams, iparams)
    N, H = hidden.shape
    V = weight.shape[0]
    M = sorted_targets.shape[0]
    cdt, CDT = compute_dtype(hidden.dtype)
    dev = hidden.device
    stats = torch.empty((N, NUM_STATS), dtype=cdt, device=dev)
    target_logits = torch.zeros(M, dtype=cdt, device=dev)
    if N == 0:
        return stats, target_logits
    extra = p.tanh_scale != 0.0 or p.need_sum_sq or p.need_sum_z or p.need_argmax
    cfg = config(_fwd_kind(extra, p.support_mode), hidden.dtype, device_arch(dev))
    grid = (triton.cdiv(N, cfg["BLOCK_N"]),)
    _linear_fwd_kernel[grid](
        hidden,
        weight,
        bias if bias is not None else hidden,
        inv_temperature,
        row_ptr,
        sorted_targets,
        _support_arg(support, p.support_mode, inv_temperature),
        stats,
        target_logits,
        _tanh_scale_arg(p.tanh_scale, cdt, inv_temperature),
        N,
        V,
        H,
        M,
        HAS_BIAS=bias is not None,
        NEED_ENTROPY=p.need_entropy,
        HAS_CAP=p.tanh_scale != 0.0,
        NEED_SUM_SQ=p.need_sum_sq,
        NEED_SUM_Z=p.need_sum_z,
        NEED_ARGMAX=p.need_argmax,
        CDT=CDT,
        OP=operand_dtype(hidden.dtype),
        PREC=kernel_precision(p.logits_precision, hidden.dtype),
        SUPPORT=int(p.support_mode),
        **cfg,
    )
    return stats, target_logits


def linear_logprobs_bwd(
    hidden,
    weight,
    bias,
    inv_temperature,
    row_ptr,
    sorted_targets,
    sorted_grad,
    lse,
    entropy,
    grad_entropy,
    support,
    fparams,
    iparams,
):
    """-> (grad_hidden [N, H], grad_weight [V, H], grad_bias [V]) in the inputs' dtypes; an
    output not needed is an empty [0] tensor."""
    p = LinearLogprobsBwdParams.unpack(fparams, iparams)
    N, H = hidden.shape
    V = weight.shape[0]
    M = sorted_targets.shape[0]
    cdt, CDT = compute_dtype(hidden.dtype)
    dev = hidden.device
    need_hidden, need_weight = p.need_hidden, p.need_weight
    need_bias = p.need_bias and bias is not None
    empty = torch.empty(0, dtype=hidden.dtype, device=dev)
    prec = kernel_precision(p.logits_precision, hidden.dtype)
    cfg = config(_bwd_kind(prec, hidden.dtype, p.support_mode), hidden.dtype, device_arch(dev))
    common = dict(
        HAS_BIAS=bias is not None,
        HAS_GENT=grad_entropy is not None,
        HAS_CAP=p.tanh_scale != 0.0,
        CDT=CDT,
        OP=operand_dtype(hidden.dtype),
        PREC=prec,
        SUPPORT=int(p.support_mode),
        **cfg,
    )
    tscale = _tanh_scale_arg(p.tanh_scale, cdt, inv_temperature)
    args = (
        hidden,
        weight,
        bias if bias is not None else hidden,
        inv_temperature,
        row_ptr,
        sorted_targets,
        sorted_grad,
        lse,
        entropy,
        grad_entropy if grad_entropy is not None else lse,
        _support_arg(support, p.support_mode, lse),
    )

    grad_hidden = empty
    if need_hidden:
        # The kernel accumulates in the compute dtype: in place for fp32 / fp64 inputs.
        gh = torch.empty((N, H), dtype=cdt, device=dev)
        if N > 0 and H > 0:
            _linear_bwd_hidden_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](*args, gh, tscale, N, V, H, M, **common)
        grad_hidden = gh.to(hidden.dtype)

    grad_weight, grad_bias = empty, torch.empty(0, dtype=bias.dtype if bias is not None else hidden.dtype, device=dev)
    if need_weight or need_bias:
        gw = torch.empty((V, H) if need_weight else (0,), dtype=cdt, device=dev)
        gb = torch.empty(V if need_bias else 0, dtype=bias.dtype if need_bias else cdt, device=dev)
        if N == 0:  # a sum over no rows
            gw.zero_()
            gb.zero_()
        elif (need_weight and H > 0) or need_bias:
            _linear_bwd_weight_kernel[(triton.cdiv(V, cfg["BLOCK_V"]),)](
                *args,
                gw if need_weight else lse,
                gb if need_bias else lse,
                tscale,
                N,
                V,
                H,
                M,
                NEED_W=need_weight and H > 0,
                NEED_B=need_bias,
                **common,
            )
        if need_weight:
            grad_weight = gw.to(weight.dtype)
        if need_bias:
            grad_bias = gb
    return grad_hidden, grad_weight, grad_bias


def _tanh_scale_arg(tanh_scale: float, cdt: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """The soft-cap's tanh_scale as a one-element compute-dtype tensor (exact in fp64), or any
    compute-dtype tensor as an unread placeholder without a cap."""
    if tanh_scale == 0.0:
        return like
    return torch.full((1,), tanh_scale, dtype=cdt, device=like.device)


def _logits_block(kind: str, dtype: torch.dtype, device: torch.device, V: int) -> dict:
    """The launch configuration of a logits kernel, its tile shrunk to the vocabulary."""
    cfg = config(kind, dtype, device_arch(device))
    cfg["BLOCK"] = min(cfg["BLOCK"], max(_MIN_LOGITS_BLOCK, triton.next_power_of_2(V)))
    return cfg


def logprobs_from_logits_stats(logits, targets, inv_temperature, support, fparams, iparams):
    """-> (stats [N, NUM_STATS], target_logits [N]), compute dtype. Any row stride (0 too)."""
    p = LogprobsStatsParams.unpack(fparams, iparams)
    N, V = logits.shape
    cdt, CDT = compute_dtype(logits.dtype)
    stats = torch.empty((N, NUM_STATS), dtype=cdt, device=logits.device)
    target_logits = torch.empty(N, dtype=cdt, device=logits.device)
    if N == 0:
        return stats, target_logits
    _logits_fwd_kernel[(N,)](
        logits,
        targets,
        inv_temperature,
        _support_arg(support, p.support_mode, inv_temperature),
        stats,
        target_logits,
        V,
        logits.stride(0),
        NEED_ENTROPY=p.need_entropy,
        CDT=CDT,
        SUPPORT=int(p.support_mode),
        **_logits_block("logits_fwd", logits.dtype, logits.device, V),
    )
    return stats, target_logits


def logprobs_from_logits_bwd(
    logits, targets, inv_temperature, grad_logp, lse, entropy, grad_entropy, support, fparams, iparams
):
    """-> grad_logits [N, V], logits' dtype, contiguous (whatever the logits' row stride)."""
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    _logits_bwd_into(
        out, logits, targets, inv_temperature, grad_logp, lse, entropy, grad_entropy, support, fparams, iparams
    )
    return out


def logprobs_from_logits_bwd_(
    logits, targets, inv_temperature, grad_logp, lse, entropy, grad_entropy, support, fparams, iparams
):
    """The same gradient written over the logits (contiguous): a program loads its tile once, the
    support test included, before it stores the tile's gradient."""
    if not logits.is_contiguous():
        raise ValueError("logprobs_from_logits_bwd_: logits must be contiguous (their gradient is written over them)")
    if LogprobsBwdParams.unpack(fparams, iparams).support_mode == SupportMode.THRESHOLD:
        raise ValueError("logprobs_from_logits_bwd_: a THRESHOLD support is not supported in place")
    _logits_bwd_into(
        logits, logits, targets, inv_temperature, grad_logp, lse, entropy, grad_entropy, support, fparams, iparams
    )


def _logits_bwd_into(
    out, logits, targets, inv_temperature, grad_logp, lse, entropy, grad_entropy, support, fparams, iparams
):
    p = LogprobsBwdParams.unpack(fparams, iparams)
    N, V = logits.shape
    _, CDT = compute_dtype(logits.dtype)
    if N == 0:
        return
    cfg = _logits_block("logits_bwd", logits.dtype, logits.device, V)
    grid = (N, triton.cdiv(V, cfg["BLOCK"]))
    _logits_bwd_kernel[grid](
        logits,
        targets,
        inv_temperature,
        grad_logp,
        lse,
        entropy,
        grad_entropy if grad_entropy is not None else lse,
        _support_arg(support, p.support_mode, lse),
        out,
        V,
        logits.stride(0),
        HAS_GENT=grad_entropy is not None,
        CDT=CDT,
        SUPPORT=int(p.support_mode),
        **cfg,
    )


def _threshold_launch(dtype: torch.dtype, device: torch.device, V: int) -> dict:
    """The selection kernel's launch configuration (its tile shrunk to the vocabulary) and its
    key: int32 keys and 32 halvings for fp32 z, int64 and 64 for fp64."""
    cfg = config("threshold_select", dtype, device_arch(device))
    cfg["BLOCK"] = min(cfg["BLOCK"], max(_MIN_LOGITS_BLOCK, triton.next_power_of_2(V)))
    wide = layout.compute_dtype(dtype) == torch.float64
    return dict(KEY=tl.int64 if wide else tl.int32, NBITS=64 if wide else 32, **cfg)


def threshold_chunk_rows(N: int, V: int, block_n: int, itemsize: int) -> int:
    """Rows of z the linear head's threshold kernel holds at a time: within
    THRESHOLD_SCRATCH_BYTES (one row if a row is larger), a multiple of the forward's row block
    when at least one block fits (then every chunk's row blocks are the forward's), and no more
    than the batch needs."""
    fit = max(1, THRESHOLD_SCRATCH_BYTES // (V * itemsize))
    if fit >= block_n:
        fit = fit // block_n * block_n
    return min(fit, triton.cdiv(N, block_n) * block_n)


def linear_logprobs_threshold(hidden, weight, bias, inv_temperature, top_k, top_p, min_p, fparams, iparams):
    """-> threshold [N] (compute dtype): the THRESHOLD support of the rows' top-k / top-p / min-p.
    z is written a chunk of rows at a time into a bounded [R, V] scratch by the forward's tile
    code at the forward's tiles, then each row's threshold is selected from it."""
    p = LinearLogprobsThresholdParams.unpack(fparams, iparams)
    N, H = hidden.shape
    V = weight.shape[0]
    cdt, CDT = compute_dtype(hidden.dtype)
    dev = hidden.device
    out = torch.empty(N, dtype=cdt, device=dev)
    if N == 0:
        return out
    cap = p.tanh_scale != 0.0
    # The tiles of the THRESHOLD forward that follows (a row's z is then bitwise the stats
    # kernel's; in another tiling the midpoint rule keeps the kept set).
    cfg = config(_fwd_kind(cap, SupportMode.THRESHOLD), hidden.dtype, device_arch(dev))
    R = threshold_chunk_rows(N, V, cfg["BLOCK_N"], cdt.itemsize)
    scratch = torch.empty((R, V), dtype=cdt, device=dev)
    tscale = _tanh_scale_arg(p.tanh_scale, cdt, inv_temperature)
    sel = _threshold_launch(hidden.dtype, dev, V)
    for r0 in range(0, N, R):
        r1 = min(N, r0 + R)
        grid = (triton.cdiv(r1 - r0, cfg["BLOCK_N"]), triton.cdiv(V, cfg["BLOCK_V"]))
        _linear_z_kernel[grid](
            hidden,
            weight,
            bias if bias is not None else hidden,
            inv_temperature,
            scratch,
            tscale,
            r0,
            r1,
            V,
            H,
            HAS_BIAS=bias is not None,
            HAS_CAP=cap,
            CDT=CDT,
            OP=operand_dtype(hidden.dtype),
            PREC=kernel_precision(p.logits_precision, hidden.dtype),
            **cfg,
        )
        _threshold_kernel[(r1 - r0,)](
            scratch,
            V,
            inv_temperature,
            top_k,
            top_p,
            min_p,
            out,
            r0,
            V,
            HAS_INVT=False,
            CONV=int(p.convention),
            CDT=CDT,
            **sel,
        )
    return out


def logprobs_from_logits_threshold(logits, inv_temperature, top_k, top_p, min_p, fparams, iparams):
    """-> threshold [N] (compute dtype), selected straight from the logits (z = logits · inv_T, the
    forward's rounding); any row stride (0 too)."""
    p = LogprobsThresholdParams.unpack(fparams, iparams)
    N, V = logits.shape
    cdt, CDT = compute_dtype(logits.dtype)
    out = torch.empty(N, dtype=cdt, device=logits.device)
    if N == 0:
        return out
    _threshold_kernel[(N,)](
        logits,
        logits.stride(0),
        inv_temperature,
        top_k,
        top_p,
        min_p,
        out,
        0,
        V,
        HAS_INVT=True,
        CONV=int(p.convention),
        CDT=CDT,
        **_threshold_launch(logits.dtype, logits.device, V),
    )
    return out


# ---------------------------------------------------------------------------------------
# ahead-of-time compile specs (python -m rlvr_kernels.triton.aot)

_AOT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
_AOT_I64 = "*i64:16"


def _aot_setup(kind, dt, arch):
    """(input pointer type, compute-dtype pointer type, constexprs, options) of a kernel family
    at its launch configuration for ``arch``."""
    cfg = config(kind, _AOT_DTYPES[dt], arch)
    opts = {n: cfg.pop(n) for n in ("num_warps", "num_stages", "enable_fp_fusion") if n in cfg}
    opts["archs"] = (arch,)
    _, cdt = compute_dtype(_AOT_DTYPES[dt])
    c = "*fp64:16" if cdt is tl.float64 else "*fp32:16"
    const = dict(CDT=cdt, **cfg)
    if kind.startswith(("linear", "logits")):
        const["SUPPORT"] = int(SupportMode.NONE)
    if kind.startswith("linear"):
        const["OP"] = operand_dtype(_AOT_DTYPES[dt], interpret=False)
        const["PREC"] = int(LogitsPrecision.FP32)
    return f"*{dt}:16", c, const, opts


def _support_sig(support, c):
    """The support pointer's type (the bitmap's int32 or the threshold's compute dtype; NONE: an
    unread compute-dtype placeholder) and the spec name's suffix."""
    if support == SupportMode.NONE:
        return c, ""
    return ("*i32:16" if support == SupportMode.MASK else c), f",{support.name.lower()}"


def _aot_linear_fwd(dt, bias, entropy, arch, extra=False, prec=LogitsPrecision.FP32, support=SupportMode.NONE):
    """``extra``: the soft-cap and every optional statistic; ``prec``: the logits precision;
    ``support``: the sampling support's mode."""
    inp, c, const, opts = _aot_setup(_fwd_kind(extra, support), dt, arch)
    const["PREC"] = int(prec)
    const["SUPPORT"] = int(support)
    sup, sup_name = _support_sig(support, c)
    sig = dict(
        x_ptr=inp,
        w_ptr=inp,
        b_ptr=inp,
        invt_ptr=c,
        rowptr_ptr=_AOT_I64,
        tgt_ptr=_AOT_I64,
        sup_ptr=sup,
        stats_ptr=c,
        tlog_ptr=c,
        tscale_ptr=c,
        N="i32",
        V="i32",
        H="i32:16",
        M="i32",
    )
    const.update(
        HAS_BIAS=bias, NEED_ENTROPY=entropy, HAS_CAP=extra, NEED_SUM_SQ=extra, NEED_SUM_Z=extra, NEED_ARGMAX=extra
    )
    tail = (",cap,stats" if extra else "") + ("" if prec == LogitsPrecision.FP32 else f",{prec.name.lower()}")
    tail += sup_name
    name = f"_linear_fwd_kernel[{dt},bias={int(bias)},entropy={int(entropy)}{tail}]"
    return name, _linear_fwd_kernel, sig, const, opts


def _aot_linear_bwd(
    which,
    dt,
    bias,
    gent,
    arch,
    need_w=True,
    need_b=True,
    cap=False,
    prec=LogitsPrecision.FP32,
    support=SupportMode.NONE,
):
    inp, c, const, opts = _aot_setup(_bwd_kind(int(prec), _AOT_DTYPES[dt], support), dt, arch)
    const["PREC"] = int(prec)
    const["SUPPORT"] = int(support)
    sup, sup_name = _support_sig(support, c)
    sig = dict(
        x_ptr=inp,
        w_ptr=inp,
        b_ptr=inp,
        invt_ptr=c,
        rowptr_ptr=_AOT_I64,
        tgt_ptr=_AOT_I64,
        g_ptr=c,
        lse_ptr=c,
        ent_ptr=c,
        gent_ptr=c,
        sup_ptr=sup,
    )
    const.update(HAS_BIAS=bias, HAS_GENT=gent, HAS_CAP=cap)
    if which == "hidden":
        sig["gh_ptr"] = c
        kernel, extra = _linear_bwd_hidden_kernel, ""
    else:
        sig.update(gw_ptr=c, gb_ptr=inp)
        const.update(NEED_W=need_w, NEED_B=need_b and bias)
        kernel, extra = _linear_bwd_weight_kernel, f",need_w={int(need_w)},need_b={int(need_b and bias)}"
    if cap:
        extra += ",cap"
    if prec != LogitsPrecision.FP32:
        extra += f",{prec.name.lower()}"
    extra += sup_name
    sig.update(tscale_ptr=c, N="i32", V="i32", H="i32:16", M="i32")
    name = f"{kernel.__name__}[{dt},bias={int(bias)},grad_entropy={int(gent)}{extra}]"
    return name, kernel, sig, const, opts


def _aot_logits(dt, flag, arch, support=SupportMode.NONE):
    """The logits forward (entropy = flag) and backward (grad_entropy = flag)."""
    inp, c, const, opts = _aot_setup("logits_fwd", dt, arch)
    sup, sup_name = _support_sig(support, c)
    sig = dict(l_ptr=inp, tgt_ptr=_AOT_I64, invt_ptr=c, sup_ptr=sup, stats_ptr=c, tlog_ptr=c, V="i32", stride="i32:16")
    const.update(NEED_ENTROPY=flag, SUPPORT=int(support))
    yield f"_logits_fwd_kernel[{dt},entropy={int(flag)}{sup_name}]", _logits_fwd_kernel, sig, const, opts
    inp, c, const, opts = _aot_setup("logits_bwd", dt, arch)
    sig = dict(
        l_ptr=inp,
        tgt_ptr=_AOT_I64,
        invt_ptr=c,
        g_ptr=c,
        lse_ptr=c,
        ent_ptr=c,
        gent_ptr=c,
        sup_ptr=sup,
        out_ptr=inp,
        V="i32:16",
        stride="i32:16",
    )
    const.update(HAS_GENT=flag, SUPPORT=int(support))
    yield f"_logits_bwd_kernel[{dt},grad_entropy={int(flag)}{sup_name}]", _logits_bwd_kernel, sig, const, opts


def _aot_threshold(dt, arch, linear, convention=SamplingConvention.VLLM):
    """The threshold kernels: the linear head's z writer at the forward's tiles (``linear``) and
    the per-row selection, on the scratch (``linear``) or on the logits."""
    if linear:
        inp, c, const, opts = _aot_setup(_fwd_kind(False, SupportMode.THRESHOLD), dt, arch)
        del const["SUPPORT"]
        sig = dict(
            x_ptr=inp,
            w_ptr=inp,
            b_ptr=inp,
            invt_ptr=c,
            z_ptr=c,
            tscale_ptr=c,
            row0="i32",
            row_end="i32",
            V="i32",
            H="i32:16",
        )
        const.update(HAS_BIAS=True, HAS_CAP=False)
        yield f"_linear_z_kernel[{dt}]", _linear_z_kernel, sig, const, opts
    inp, c, const, opts = _aot_setup("threshold_select", dt, arch)
    wide = const["CDT"] is tl.float64
    sig = dict(
        z_ptr=c if linear else inp,
        stride="i32:16",
        invt_ptr=c,
        topk_ptr=_AOT_I64,
        topp_ptr=c,
        minp_ptr=c,
        out_ptr=c,
        row0="i32",
        V="i32",
    )
    const.update(
        HAS_INVT=not linear,
        CONV=int(convention),
        KEY=tl.int64 if wide else tl.int32,
        NBITS=64 if wide else 32,
    )
    name = f"_threshold_kernel[{dt},{'linear' if linear else 'logits'},{convention.name.lower()}]"
    yield name, _threshold_kernel, sig, const, opts


def aot_specs():
    """The logprobs kernels at each arch's launch configuration (``config``: sm_90 has its own
    16-bit forward tile): bf16 (tensor cores: HGMMA on sm_90, HMMA on sm_80), fp32 (IEEE FMA
    dot) and fp64 (DMMA), with / without bias, entropy and its gradient. H and the row
    strides carry the ``:16`` hint, as for real model sizes (another H runs unvectorised tile
    loads: correct, slower, not checked here)."""
    from . import AOT_ARCHS

    for arch in AOT_ARCHS:
        yield _aot_linear_fwd("bf16", True, True, arch)
        yield _aot_linear_fwd("bf16", False, False, arch)
        yield _aot_linear_fwd("fp32", True, True, arch)
        yield _aot_linear_fwd("fp64", True, True, arch)
        yield _aot_linear_fwd("bf16", True, True, arch, extra=True)
        yield _aot_linear_fwd("fp32", True, True, arch, extra=True)
        yield _aot_linear_bwd("hidden", "bf16", True, True, arch, cap=True)
        yield _aot_linear_bwd("weight", "bf16", True, True, arch, cap=True)
        yield _aot_linear_bwd("hidden", "bf16", True, True, arch)
        yield _aot_linear_bwd("hidden", "fp32", True, True, arch)
        yield _aot_linear_bwd("hidden", "fp64", True, True, arch)
        yield _aot_linear_bwd("weight", "bf16", True, True, arch)
        yield _aot_linear_bwd("weight", "bf16", False, False, arch)
        yield _aot_linear_bwd("weight", "fp32", True, True, arch)
        yield _aot_linear_bwd("weight", "fp64", True, True, arch)
        # Logits precision: fp32 inputs on bf16 / tf32 tensor cores, and bf16 inputs with the bf16 rounding of y.
        for prec in (LogitsPrecision.BF16, LogitsPrecision.TF32):
            yield _aot_linear_fwd("fp32", True, True, arch, prec=prec)
            yield _aot_linear_bwd("hidden", "fp32", True, True, arch, prec=prec)
            yield _aot_linear_bwd("weight", "fp32", True, True, arch, prec=prec)
        yield _aot_linear_fwd("bf16", True, True, arch, prec=LogitsPrecision.BF16)
        yield _aot_linear_bwd("weight", "bf16", True, True, arch, prec=LogitsPrecision.BF16)
        for dt, flag in (("bf16", True), ("fp32", False), ("fp64", True)):
            yield from _aot_logits(dt, flag, arch)
        # Sampling support: each mode in the 16-bit forward and backward (the plain forward tile,
        # sm_90's 128×128 included, and the extra statistics' one), fp32 / fp64 once; the threshold kernels.
        for support in (SupportMode.MASK, SupportMode.THRESHOLD):
            yield _aot_linear_fwd("bf16", True, True, arch, support=support)
            yield _aot_linear_fwd("bf16", True, True, arch, extra=True, support=support)
            yield _aot_linear_bwd("hidden", "bf16", True, True, arch, support=support)
            yield _aot_linear_bwd("weight", "bf16", True, True, arch, support=support)
            yield from _aot_logits("bf16", True, arch, support=support)
        yield _aot_linear_fwd("fp32", True, True, arch, support=SupportMode.THRESHOLD)
        yield _aot_linear_fwd("fp64", True, True, arch, support=SupportMode.MASK)
        yield _aot_linear_bwd("weight", "fp32", True, True, arch, support=SupportMode.MASK)
        yield _aot_linear_bwd("weight", "fp32", True, True, arch, prec=LogitsPrecision.TF32, support=SupportMode.MASK)
        yield _aot_linear_bwd("hidden", "fp64", True, True, arch, support=SupportMode.THRESHOLD)
        for dt in ("bf16", "fp32", "fp64"):
            yield from _aot_threshold(dt, arch, linear=True)
        yield from _aot_threshold("bf16", arch, linear=False, convention=SamplingConvention.SGLANG)
        yield from _aot_threshold("fp32", arch, linear=False)
