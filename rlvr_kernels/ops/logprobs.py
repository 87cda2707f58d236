"""``linear_logprobs`` and ``logprobs_from_logits`` (docs/logprobs.md): validation, the
``rlvr_kernels::linear_logprobs`` / ``rlvr_kernels::logprobs_from_logits`` custom ops with
their autograd, the vocab-parallel (``process_group``) path (the custom op
``rlvr_kernels::linear_logprobs_vocab_parallel``, sharing the forward and the autograd of
``rlvr_kernels::linear_logprobs``), and dispatch to the C++ (CPU) and Triton (CUDA)
kernels through the dispatch table (``_core/dispatch.py``).

Why the kernels return raw per-row statistics instead of log-probs: the vocab-parallel path
has to all-reduce them between the kernel and the final combine, and a shard only sees its
own slice of the vocabulary. So every kernel works on "local" columns and the combine
(lse, entropy, log-prob = target logit − lse) is a few O(N) torch ops here, shared by the
single-process op and the process-group path.

Kernel contract (both backends; C++ in csrc/logprobs.cpp, Triton in triton/logprobs.py,
each kernel under the same name; scalar parameters and stats columns in
``rlvr_kernels.contracts.logprobs``, passed as ``fparams, iparams`` = ``params.pack()``).
"Compute dtype" is fp64 for fp64 inputs, else fp32. With y = hidden·Wᵀ + b accumulated in
the compute dtype whatever the input dtype, z = y · inv_temperature (row-wise), or with a
soft-cap (tanh_scale ≠ 0) z = tanh(tanh_scale · y) · inv_temperature. The op folds the public
transform z = softcap·tanh(logit_scale·y/softcap)/T into these: inv_temperature = logit_scale/T
(no cap) or softcap/T, tanh_scale = logit_scale/softcap ("inv_temperature" is the per-row
factor after the transform, 1/T when nothing else is asked). ``logits_precision`` (a
``LogitsPrecision``) says how y is formed: FP32 as above; TF32 with hidden and W rounded to
tf32 (to nearest, ties away from zero) before the fp32 GEMM; BF16 with hidden, W and b rounded
to bf16 (to nearest even) and y = bf16(acc + b) (fp64 inputs: each rounding through fp32).

  linear_logprobs_stats(hidden [N,H], weight [V,H], bias [V] or None, inv_temperature [N],
                        row_ptr [N+1], sorted_targets [M],
                        LinearLogprobsStatsParams(tanh_scale, need_entropy, need_sum_sq,
                                                  need_sum_z, need_argmax, logits_precision))
      -> stats [N, NUM_STATS], target_logits [M]            (compute dtype)
    hidden, weight, bias: one float dtype, contiguous. inv_temperature: compute dtype.
    row_ptr: int64, non-decreasing, row_ptr[0] = 0, row_ptr[N] = M; the targets of row n
    are sorted_targets[row_ptr[n]:row_ptr[n+1]] (a CSR of the rows' targets).
    sorted_targets: int64 local vocabulary ids; a value outside [0, V) never matches any
    column (ignored targets are −1, another shard's targets are out of range) and is never
    used as an address.
    stats[n] = (MAX: max_v z, SUM_EXP: Σ_v exp(z − max), SUM_EXP_SHIFT: Σ_v exp(z − max)·(z − max),
    SUM_EXP_SQ: Σ_v exp(2(z − max)), SUM_Z: Σ_v z, ARGMAX: the first v with z_v = max, as a
    number) over the V local columns (columns named by ``LogprobsStat``); each optional
    column is 0 unless its flag (need_entropy, need_sum_sq, need_sum_z, need_argmax) is set,
    and computing it must not change the other columns. The logits kernels compute the first
    three columns and write 0 to the others.
    target_logits[k] = z[n, sorted_targets[k]] for k in row n if that id is in [0, V), else 0.
    The target logit must come from the same rounding of z as the statistics (take it
    from the tile, not from a separate dot product), so log p = z_t − lse ≤ 0 holds.

  linear_logprobs_bwd(hidden, weight, bias, inv_temperature, row_ptr, sorted_targets,
                      sorted_grad [M], lse [N], entropy [N], grad_entropy [N] or None,
                      LinearLogprobsBwdParams(tanh_scale, need_hidden, need_weight, need_bias,
                                              logits_precision))
      -> grad_hidden [N,H] (hidden's dtype), grad_weight [V,H] (weight's dtype),
         grad_bias [V] (bias' dtype); an output that is not needed is an empty [0] tensor.
    sorted_grad, lse, entropy, grad_entropy: compute dtype. lse and entropy are the global
    (all-shard) statistics. With p_v = exp(z_v − lse_n), G_n = Σ_{k in row n} g_k (all of
    the row's targets, matching or not — a target in another shard still pulls every
    column down) and h_n = grad_entropy[n] (0 if None):
        dz[n,v] = inv_T_n · ( Σ_{k in row n, t_k = v} g_k − G_n·p_v − h_n·p_v·(z_v − lse_n + entropy_n) )
    times tanh_scale·(1 − tanh²(tanh_scale·y_v)) with a soft-cap (dz is d/dy), and
        grad_hidden = dz·W,  grad_weight = dzᵀ·hidden,  grad_bias = Σ_n dz
    accumulated in the compute dtype, with z recomputed as the forward made it (its
    logits_precision) and W, hidden as given (the rounding is passed straight through).
    grad_weight and grad_bias are summed over rows in a fixed order (no atomics):
    bitwise-deterministic whatever the thread count.

  logprobs_from_logits_stats(logits [N,V], targets [N], inv_temperature [N],
                             LogprobsStatsParams(need_entropy))
      -> stats [N, NUM_STATS], target_logits [N]
    logits: any float dtype, rows contiguous (stride(1) == 1) at any row stride, 0 included
    (an expanded view: the kernels only read the logits). targets: int64 local ids,
    out-of-range ones never match (−1 = ignored). z = logits · inv_T.
  logprobs_from_logits_bwd(logits, targets, inv_temperature, grad_logp [N], lse [N],
                           entropy [N], grad_entropy [N] or None) -> grad_logits [N,V]
    (logits' dtype, a fresh contiguous tensor whatever the logits' strides), dz as above
    with one target per row (G_n = g_n). No scalar parameters.
  logprobs_from_logits_bwd_(logits, ... as logprobs_from_logits_bwd) -> ()
    the same dz written over the logits, which must be contiguous; support NONE or MASK
    (a THRESHOLD support keeps a target by its z, which the kernel has overwritten). For a
    caller whose logits are a scratch buffer: the gradient takes no memory of its own.

Sampling support (docs/logprobs.md, "Sampling support"): the four kernels above also take
``support`` (after ``sorted_targets`` / ``targets`` in the forward kernels, after
``grad_entropy`` in the backward ones) and ``support_mode`` (a ``SupportMode``, the last
int parameter of each; ``logprobs_from_logits_bwd`` takes ``LogprobsBwdParams`` for it):
    NONE: support is None, every column is kept (all of the above).
    MASK: support int32 [N, ceil(V / 32)] contiguous (V: the local vocabulary); column v of
      row n is kept iff bit (v % 32) of support[n, v // 32] is set (bits past V are ignored).
    THRESHOLD: support [N] in the compute dtype; column v of row n is kept iff
      z[n, v] >= support[n] (z as the kernel forms it; −inf keeps every column, NaN none).
    Every statistic is taken over the kept columns only (a column not kept counts as
    z = −inf); a row with no kept column gets MAX = −inf, SUM_EXP = 0, SUM_EXP_SHIFT = 0 and
    the optional columns 0. target_logits[k] = z if the target is in [0, V) and kept, −inf if
    it is in [0, V) and not kept, 0 if out of range. In the backward dz[n, v] = 0 for a column
    not kept (selected, never a product with exp(z − lse), so an empty row's lse = −inf makes
    no NaN) and the formula above for a kept one; the op passes g = 0 for a target outside the
    support, so G_n sums the kept targets' gradients only.

  linear_logprobs_threshold(hidden, weight, bias, inv_temperature, top_k [N] int64,
                            top_p [N], min_p [N],
                            LinearLogprobsThresholdParams(tanh_scale, logits_precision, convention))
  logprobs_from_logits_threshold(logits, inv_temperature, top_k, top_p, min_p,
                                 LogprobsThresholdParams(convention))
      -> threshold [N] (compute dtype): the THRESHOLD support of the engine's top-k / top-p /
         min-p filters (top_p, min_p in the compute dtype). With z the row as the stats kernel
         forms it, m = max z and e_v = exp(z_v − m):
    min-p (0 < min_p): t_min = the least z_v with e_v >= min_p; else −inf.
    top-k (0 < top_k < V): t_k = the top_k-th largest z_v (counted with multiplicity, so a tie
      with it is kept whole); else −inf.   t1 = max(t_min, t_k),  U = {v : z_v >= t1}.
    top-p (top_p < 1): with B(v) = Σ_{u in U, z_u > z_v} e_u and P = top_p · Σ_{u in U} e_u
      (VLLM) or P = top_p · Σ_u e_u (SGLANG), t_p = the least z_v in U with B(v) < P (VLLM) or
      B(v) <= P (SGLANG); else −inf. The max is always kept.
    t = max(t1, t_p) is a value of the row; the kernel returns a number strictly between t and
      the largest row value below it (−inf if there is none): lo + (t − lo)/2, or t when that
      rounds to lo. So recomputing z in another tiling cannot move a column across it.
    The filters read z in the compute dtype; the sums may be taken in any order (a column whose
    B(v) lies within the sums' rounding of P may go either way). Memory: a bounded buffer of
    rows at a time (never [N, V]); no sort.

Every kernel: N = 0 or M = 0 gives empty outputs; V >= 1 is guaranteed by validation, and
every C++ entry point checks the shape relations above (TORCH_CHECK) itself. A row's
forward result is bitwise independent of the other rows in the batch (fixed tiling, no
reduction across rows).
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Callable, NamedTuple, Optional, Sequence, Tuple, Union

import einops
import torch

from .._core import collectives
from .._core import dispatch as _dispatch
from .._core.layout import compute_dtype as _compute_dtype
from .._core.rounding import round_bf16, round_tf32
from .._core.validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    MAX_COUNT,
    MAX_LOGIT_FACTOR,
    MIN_LOGIT_FACTOR,
    check_int,
    check_number,
    check_temperature,
    check_tensor,
    checks_enabled,
)
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

_Triple = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_Four = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_Seven = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_INT64 = torch.iinfo(torch.int64)

# The optional statistics of ``linear_logprobs(outputs=...)``, in the order of :class:`LinearLogprobs`.
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# ``logits_precision`` values (docs/logprobs.md, "Logits precision") and their kernel codes.
LOGITS_PRECISIONS = {"fp32": LogitsPrecision.FP32, "tf32": LogitsPrecision.TF32, "bf16": LogitsPrecision.BF16}
# ``sampling_convention`` values (docs/logprobs.md, "Sampling support") and their kernel codes.
SAMPLING_CONVENTIONS = {"vllm": SamplingConvention.VLLM, "sglang": SamplingConvention.SGLANG}
# The ARGMAX stats column holds a column index in the compute dtype: exact up to 2^24 in fp32.
_MAX_TOP1_VOCAB = 2**24


class LinearLogprobs(NamedTuple):
    """What ``linear_logprobs`` returns, whatever is asked: None for an output not requested
    (``entropy`` is requested by ``return_entropy=True`` or ``outputs``). ``entropy``
    carries a gradient; the others do not."""

    logp: torch.Tensor  # [M]: log-prob of each target (0 for ignored ones)
    entropy: Optional[torch.Tensor]  # [N]: entropy of each row's distribution
    log_sum_sq_probs: Optional[torch.Tensor]  # [N]: log Σ_v p_v² (no gradient)
    mean_logits: Optional[torch.Tensor]  # [N]: mean over the vocabulary of z (no gradient)
    is_top1: Optional[torch.Tensor]  # [M] bool: the target is the row's first argmax (no gradient)

    @property
    def outside_support(self) -> torch.Tensor:
        """[M] bool: the target lies outside its row's sampling support (its log-prob is −inf);
        all False without a support."""
        return torch.isneginf(self.logp.detach())


class LogprobsFromLogits(NamedTuple):
    """What ``logprobs_from_logits`` returns, whatever is asked; both shaped like the targets."""

    logp: torch.Tensor  # log-prob of each target (0 for ignored ones)
    entropy: Optional[torch.Tensor]  # entropy of each row's distribution; None without return_entropy

    @property
    def outside_support(self) -> torch.Tensor:
        """Shaped like the targets: outside its row's sampling support (log-prob −inf)."""
        return torch.isneginf(self.logp.detach())


# ------------------------------------------------------------------ custom ops: the kernels
# Thin custom ops around the kernels, so torch.compile sees opaque nodes with fake kernels
# (and the process-group path, which all-reduces between kernel and combine, can reuse them).
@torch.library.custom_op("rlvr_kernels::linear_logprobs_stats", mutates_args=())
def _linear_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    inv_temperature: torch.Tensor,
    row_ptr: torch.Tensor,
    sorted_targets: torch.Tensor,
    support: Optional[torch.Tensor],
    tanh_scale: float,
    need_entropy: bool,
    need_sum_sq: bool,
    need_sum_z: bool,
    need_argmax: bool,
    logits_precision: int,
    support_mode: int,
    backend: str,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(stats [N, NUM_STATS], target_logits [M]) of the kernel contract."""
    params = LinearLogprobsStatsParams(
        tanh_scale=tanh_scale,
        need_entropy=need_entropy,
        need_sum_sq=need_sum_sq,
        need_sum_z=need_sum_z,
        need_argmax=need_argmax,
        logits_precision=LogitsPrecision(logits_precision),
        support_mode=SupportMode(support_mode),
    )
    args = (hidden, weight, bias, inv_temperature, row_ptr, sorted_targets, support, *params.pack())
    return _dispatch.run("linear_logprobs_stats", backend, hidden.device, *args)


@_linear_stats.register_fake
def _(
    hidden,
    weight,
    bias,
    inv_temperature,
    row_ptr,
    sorted_targets,
    support,
    tanh_scale,
    need_entropy,
    need_sum_sq,
    need_sum_z,
    need_argmax,
    logits_precision,
    support_mode,
    backend,
):
    dt = _compute_dtype(hidden.dtype)
    return hidden.new_empty((hidden.shape[0], NUM_STATS), dtype=dt), hidden.new_empty(sorted_targets.shape, dtype=dt)


@torch.library.custom_op("rlvr_kernels::linear_logprobs_bwd", mutates_args=())
def _linear_bwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    inv_temperature: torch.Tensor,
    row_ptr: torch.Tensor,
    sorted_targets: torch.Tensor,
    sorted_grad: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_entropy: Optional[torch.Tensor],
    support: Optional[torch.Tensor],
    tanh_scale: float,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    logits_precision: int,
    support_mode: int,
    backend: str,
) -> _Triple:
    """(grad_hidden, grad_weight, grad_bias) of the kernel contract."""
    params = LinearLogprobsBwdParams(
        tanh_scale=tanh_scale,
        need_hidden=need_hidden,
        need_weight=need_weight,
        need_bias=need_bias,
        logits_precision=LogitsPrecision(logits_precision),
        support_mode=SupportMode(support_mode),
    )
    args = (
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
    )
    return _dispatch.run("linear_logprobs_bwd", backend, hidden.device, *args, *params.pack())


@_linear_bwd.register_fake
def _(
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
    tanh_scale,
    need_hidden,
    need_weight,
    need_bias,
    logits_precision,
    support_mode,
    backend,
):
    empty = hidden.new_empty((0,))
    return (
        torch.empty_like(hidden) if need_hidden else empty,
        torch.empty_like(weight) if need_weight else weight.new_empty((0,)),
        torch.empty_like(bias) if need_bias and bias is not None else weight.new_empty((0,)),
    )


@torch.library.custom_op("rlvr_kernels::linear_logprobs_threshold", mutates_args=())
def _linear_threshold(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    inv_temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    tanh_scale: float,
    logits_precision: int,
    convention: int,
    backend: str,
) -> torch.Tensor:
    """threshold [N] of the kernel contract (the THRESHOLD support of top-k / top-p / min-p)."""
    params = LinearLogprobsThresholdParams(
        tanh_scale=tanh_scale,
        logits_precision=LogitsPrecision(logits_precision),
        convention=SamplingConvention(convention),
    )
    args = (hidden, weight, bias, inv_temperature, top_k, top_p, min_p, *params.pack())
    return _dispatch.run("linear_logprobs_threshold", backend, hidden.device, *args)


@_linear_threshold.register_fake
def _(hidden, weight, bias, inv_temperature, top_k, top_p, min_p, tanh_scale, logits_precision, convention, backend):
    return hidden.new_empty((hidden.shape[0],), dtype=_compute_dtype(hidden.dtype))


@torch.library.custom_op("rlvr_kernels::logprobs_from_logits_threshold", mutates_args=())
def _logits_threshold(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    convention: int,
    backend: str,
) -> torch.Tensor:
    """threshold [N] of the kernel contract, from logits [N, V] (rows contiguous)."""
    params = LogprobsThresholdParams(convention=SamplingConvention(convention))
    args = (logits, inv_temperature, top_k, top_p, min_p, *params.pack())
    return _dispatch.run("logprobs_from_logits_threshold", backend, logits.device, *args)


@_logits_threshold.register_fake
def _(logits, inv_temperature, top_k, top_p, min_p, convention, backend):
    return logits.new_empty((logits.shape[0],), dtype=_compute_dtype(logits.dtype))


# ------------------------------------------------------------------ custom ops: linear_logprobs
class _LinearArgs(NamedTuple):
    """The inputs of ``rlvr_kernels::linear_logprobs`` (and the first ones of
    ``rlvr_kernels::linear_logprobs_vocab_parallel``), in its schema's order (a test checks
    it): how their autograd reads them and returns their gradients, by name."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    targets: torch.Tensor  # int64 [M]
    row_index: Optional[torch.Tensor]  # int64 [M]
    row_ptr: torch.Tensor  # [N + 1]: the CSR of the targets by row (_csr)
    order: Optional[torch.Tensor]  # [M]: CSR position -> target position (None: the identity)
    inv_temperature: torch.Tensor  # [N], compute dtype: the factor after the transform (contract)
    ignore_index: int
    return_entropy: bool
    tanh_scale: float  # 0: no soft-cap (contract)
    need_sum_sq: bool  # log_sum_sq_probs
    need_sum_z: bool  # mean_logits
    need_top1: bool  # is_top1
    logits_precision: int  # a LogitsPrecision (contract)
    support: Optional[torch.Tensor]  # the kernels' sampling support (contract; None: every column)
    support_mode: int  # a SupportMode (contract)
    keep_targets: bool  # a target outside the support joins its row's support (_widen_support)
    backend: str


class _LinearSaved(NamedTuple):
    """What the backward of both linear ops keeps (``ctx.saved_tensors``)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    targets: torch.Tensor
    row_ptr: torch.Tensor
    order: Optional[torch.Tensor]
    inv_temperature: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor
    support: Optional[torch.Tensor]
    outside: Optional[torch.Tensor]  # [M] bool: the target is outside the support (None without one)
    widened: Optional[torch.Tensor]  # [M] CSR order: z of a target joined to its row's support, else −inf


class _VocabShard(NamedTuple):
    """The inputs that ``rlvr_kernels::linear_logprobs_vocab_parallel`` takes after those of
    :class:`_LinearArgs`, in its schema's order (a test checks it): this rank's part of the
    call."""

    group_name: str  # the process group, by the name it is registered under (collectives.group_name)
    vocab_start: int  # the first vocabulary id of this rank's weight shard
    vocab_size: int  # the whole vocabulary


def _linear_forward(a: _LinearArgs, shard: Optional[_VocabShard]) -> _Seven:
    """The forward of both linear ops (outputs as in ``_linear_logprobs``): the kernel on the
    local columns; with a shard, the all-reduce of the statistics before the combine."""
    vocab_start, vocab_size = (0, a.weight.shape[0]) if shard is None else (shard.vocab_start, shard.vocab_size)
    local = _local_sorted_targets(a.targets, a.order, a.ignore_index, vocab_start)
    stats, tlog = _linear_stats(
        a.hidden,
        a.weight,
        a.bias,
        a.inv_temperature,
        a.row_ptr,
        local,
        a.support,
        a.tanh_scale,
        a.return_entropy,
        a.need_sum_sq,
        a.need_sum_z,
        a.need_top1,
        a.logits_precision,
        a.support_mode,
        a.backend,
    )
    if shard is not None:
        group = collectives.resolve_group(shard.group_name)
        stats, tlog = _all_reduce_stats(stats, tlog, group, vocab_start, a.need_sum_sq, a.need_sum_z, a.need_top1)
    widened = a.hidden.new_empty((0,), dtype=tlog.dtype)
    if a.keep_targets and a.support is not None:
        rows = _csr_rows(a.row_ptr, a.hidden.shape[0])
        head = (a.hidden, a.weight, a.bias, a.inv_temperature, a.tanh_scale, a.logits_precision)
        widened = _outside_logits(tlog, local, rows, lambda r, c: _linear_logits(*head, r, c)[1])
        stats, tlog = _widen_support(stats, tlog, rows, local, widened, vocab_size)
    lse, entropy = _row_statistics(stats, vocab_size, a.return_entropy)
    logp = _target_logprobs(tlog, lse, a.row_index, a.order, a.targets == a.ignore_index)
    # (after the all-reduce ARGMAX is a global vocabulary id)
    extras = _optional_statistics(
        stats, vocab_size, a.targets, a.row_index, a.ignore_index, a.need_sum_sq, a.need_sum_z, a.need_top1
    )
    return (logp, entropy, lse, *extras, widened)


@torch.library.custom_op("rlvr_kernels::linear_logprobs", mutates_args=())
def _linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    row_index: Optional[torch.Tensor],
    row_ptr: torch.Tensor,
    order: Optional[torch.Tensor],
    inv_temperature: torch.Tensor,
    ignore_index: int,
    return_entropy: bool,
    tanh_scale: float,
    need_sum_sq: bool,
    need_sum_z: bool,
    need_top1: bool,
    logits_precision: int,
    support: Optional[torch.Tensor],
    support_mode: int,
    keep_targets: bool,
    backend: str,
) -> _Seven:
    """(logp [M], entropy [N], lse [N], log_sum_sq_probs [N], mean_logits [N], is_top1 [M] bool,
    widened) in the compute dtype; entropy is 0 unless ``return_entropy``, an optional output
    not requested is an empty [0] tensor. lse and widened (with ``keep_targets`` and a support:
    [M] in CSR order, the logit of each target that joined its row's support, −inf for the
    others; else [0]) are returned for the backward only."""
    return _linear_forward(_LinearArgs(**locals()), None)  # (locals(): the parameters, by name)


@torch.library.custom_op("rlvr_kernels::linear_logprobs_vocab_parallel", mutates_args=())
def _linear_logprobs_vocab_parallel(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    row_index: Optional[torch.Tensor],
    row_ptr: torch.Tensor,
    order: Optional[torch.Tensor],
    inv_temperature: torch.Tensor,
    ignore_index: int,
    return_entropy: bool,
    tanh_scale: float,
    need_sum_sq: bool,
    need_sum_z: bool,
    need_top1: bool,
    logits_precision: int,
    support: Optional[torch.Tensor],
    support_mode: int,
    keep_targets: bool,
    backend: str,
    group_name: str,
    vocab_start: int,
    vocab_size: int,
) -> _Seven:
    """``rlvr_kernels::linear_logprobs`` (same outputs, the unsharded op's) with the
    vocabulary sharded over the process group registered as ``group_name``: ``weight`` and
    ``bias`` hold the ids [vocab_start, vocab_start + weight.shape[0]) of a ``vocab_size``
    vocabulary, every rank passes the same other inputs. The per-row statistics are
    all-reduced between the kernel and the combine, the backward all-reduces grad hidden.
    Eager only: the collectives run inside (the caller checks, ``collectives.check_eager``)."""
    inputs = locals()  # the parameters, by name
    a = _LinearArgs(**{name: inputs[name] for name in _LinearArgs._fields})
    return _linear_forward(a, _VocabShard(**{name: inputs[name] for name in _VocabShard._fields}))


def _linear_fake(*inputs):
    """The fake kernel of both linear ops (the shard's inputs change no shape)."""
    a = _LinearArgs(*inputs[: len(_LinearArgs._fields)])
    dt = _compute_dtype(a.hidden.dtype)
    n = a.hidden.shape[0]
    return (
        a.hidden.new_empty(a.targets.shape, dtype=dt),
        a.hidden.new_empty((n,), dtype=dt),
        a.hidden.new_empty((n,), dtype=dt),
        a.hidden.new_empty((n if a.need_sum_sq else 0,), dtype=dt),
        a.hidden.new_empty((n if a.need_sum_z else 0,), dtype=dt),
        a.hidden.new_empty(a.targets.shape if a.need_top1 else (0,), dtype=torch.bool),
        a.hidden.new_empty(a.targets.shape if (a.keep_targets and a.support is not None) else (0,), dtype=dt),
    )


def _linear_setup_context(ctx, inputs, output):
    """Both linear ops: ``inputs`` are those of :class:`_LinearArgs`, then those of
    :class:`_VocabShard` for the vocab-parallel op (``ctx.shard``; None without)."""
    k = len(_LinearArgs._fields)
    a = _LinearArgs(*inputs[:k])
    ctx.shard = _VocabShard(*inputs[k:]) if len(inputs) > k else None
    logp, entropy, lse, log_sum_sq, mean_logits, _, widened = output
    ctx.mark_non_differentiable(lse, log_sum_sq, mean_logits, widened)
    saved = _LinearSaved(
        hidden=a.hidden,
        weight=a.weight,
        bias=a.bias,
        targets=a.targets,
        row_ptr=a.row_ptr,
        order=a.order,
        inv_temperature=a.inv_temperature,
        lse=lse,
        entropy=entropy,
        support=a.support,
        # A target outside the support has the constant log-prob −inf: no gradient, and its
        # upstream gradient must not pull its row's columns down (G_n of the contract).
        outside=None if a.support is None else torch.isneginf(logp),
        widened=widened if widened.numel() else None,
    )
    ctx.save_for_backward(*saved)
    ctx.ignore_index, ctx.return_entropy, ctx.backend = a.ignore_index, a.return_entropy, a.backend
    ctx.tanh_scale, ctx.logits_precision, ctx.support_mode = a.tanh_scale, a.logits_precision, a.support_mode


def _linear_backward(ctx, g_logp, g_entropy, *_no_grad):
    s = _LinearSaved(*ctx.saved_tensors)
    need = _LinearArgs(*ctx.needs_input_grad[: len(_LinearArgs._fields)])
    shard: Optional[_VocabShard] = ctx.shard
    no_grads = () if shard is None else _grads_by_name(_VocabShard)
    # With a shard every rank runs the backward's all-reduce, whatever its own inputs need.
    if shard is None and not (need.hidden or need.weight or need.bias):
        return _grads_by_name(_LinearArgs)
    g, grad_entropy = _upstream(ctx, g_logp, g_entropy, s.targets, s.order, s.lse, s.outside)
    local = _local_sorted_targets(s.targets, s.order, ctx.ignore_index, 0 if shard is None else shard.vocab_start)
    gh, gw, gb = _linear_bwd(
        s.hidden,
        s.weight,
        s.bias,
        s.inv_temperature,
        s.row_ptr,
        local,
        g,
        s.lse,
        s.entropy,
        grad_entropy,
        s.support,
        ctx.tanh_scale,
        need.hidden or shard is not None,
        need.weight,
        need.bias and s.bias is not None,
        ctx.logits_precision,
        ctx.support_mode,
        ctx.backend,
    )
    if s.widened is not None:
        _keep_targets_linear_bwd(
            s.hidden.detach(),
            s.weight.detach(),
            None if s.bias is None else s.bias.detach(),
            s.inv_temperature,
            s.row_ptr,
            local,
            g,
            s.lse,
            s.entropy,
            grad_entropy,
            s.widened,
            ctx.tanh_scale,
            ctx.logits_precision,
            gh if need.hidden else None,
            gw if need.weight else None,
            gb if (need.bias and s.bias is not None) else None,
        )
    if shard is not None:
        # Every rank holds the same hidden rows, so each rank's dz·W_shard is a partial sum
        # of d hidden over the vocabulary: the matching reduction is an all-reduce.
        collectives.all_reduce(gh, collectives.resolve_group(shard.group_name), "sum")
    grads = _grads_by_name(
        _LinearArgs,
        hidden=gh if need.hidden else None,
        weight=gw if need.weight else None,
        bias=gb if need.bias else None,
    )
    return grads + no_grads


_linear_logprobs.register_fake(_linear_fake)
_linear_logprobs.register_autograd(_linear_backward, setup_context=_linear_setup_context)
_linear_logprobs_vocab_parallel.register_fake(_linear_fake)
_linear_logprobs_vocab_parallel.register_autograd(_linear_backward, setup_context=_linear_setup_context)


# ------------------------------------------------------------------ custom ops: logprobs_from_logits
class _LogitsArgs(NamedTuple):
    """The inputs of ``rlvr_kernels::logprobs_from_logits``, in its schema's order (a test
    checks it)."""

    logits: torch.Tensor  # [N, V], unit column stride, any row stride (0 included)
    targets: torch.Tensor  # int64 [N]
    inv_temperature: torch.Tensor  # [N], compute dtype
    ignore_index: int
    return_entropy: bool
    support: Optional[torch.Tensor]  # the kernels' sampling support (contract; None: every column)
    support_mode: int  # a SupportMode (contract)
    keep_targets: bool  # a target outside the support joins its row's support (_widen_support)
    backend: str


class _LogitsSaved(NamedTuple):
    logits: torch.Tensor
    targets: torch.Tensor
    inv_temperature: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor
    support: Optional[torch.Tensor]
    outside: Optional[torch.Tensor]  # [N] bool: the target is outside the support (None without one)
    widened: Optional[torch.Tensor]  # [N]: z of a target joined to its row's support, else −inf


@torch.library.custom_op("rlvr_kernels::logprobs_from_logits", mutates_args=())
def _from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    inv_temperature: torch.Tensor,
    ignore_index: int,
    return_entropy: bool,
    support: Optional[torch.Tensor],
    support_mode: int,
    keep_targets: bool,
    backend: str,
) -> _Four:
    """(logp [N], entropy [N], lse [N], widened) from logits [N, V] (rows contiguous); widened
    as in ``rlvr_kernels::linear_logprobs`` ([N], or [0] without ``keep_targets`` and a support)."""
    ignored = targets == ignore_index
    local = torch.where(ignored, torch.full_like(targets, -1), targets)
    params = LogprobsStatsParams(need_entropy=return_entropy, support_mode=SupportMode(support_mode))
    args = (logits, local, inv_temperature, support, *params.pack())
    stats, tlog = _dispatch.run("logprobs_from_logits_stats", backend, logits.device, *args)
    widened = logits.new_empty((0,), dtype=tlog.dtype)
    if keep_targets and support is not None:
        rows = torch.arange(logits.shape[0], device=logits.device)

        def z_of(r, c):  # the kernels' z = x · (1 / T), exactly
            return logits[r, c].to(inv_temperature.dtype) * inv_temperature[r]

        widened = _outside_logits(tlog, local, rows, z_of)
        stats, tlog = _widen_support(stats, tlog, rows, local, widened, logits.shape[1])
    lse, entropy = _row_statistics(stats, logits.shape[1], return_entropy)
    return _target_logprobs(tlog, lse, None, None, ignored), entropy, lse, widened


@_from_logits.register_fake
def _(logits, targets, inv_temperature, ignore_index, return_entropy, support, support_mode, keep_targets, backend):
    dt = _compute_dtype(logits.dtype)
    n = logits.shape[0]
    return (
        logits.new_empty((n,), dtype=dt),
        logits.new_empty((n,), dtype=dt),
        logits.new_empty((n,), dtype=dt),
        logits.new_empty((n if (keep_targets and support is not None) else 0,), dtype=dt),
    )


@torch.library.custom_op("rlvr_kernels::logprobs_from_logits_bwd", mutates_args=())
def _from_logits_bwd(
    logits: torch.Tensor,
    targets: torch.Tensor,
    inv_temperature: torch.Tensor,
    grad_logp: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_entropy: Optional[torch.Tensor],
    support: Optional[torch.Tensor],
    support_mode: int,
    backend: str,
) -> torch.Tensor:
    """grad_logits [N, V] of the kernel contract: a fresh contiguous tensor (the gradient of
    an expanded view of the logits is summed by autograd, not here)."""
    args = (logits, targets, inv_temperature, grad_logp, lse, entropy, grad_entropy, support)
    return _dispatch.run("logprobs_from_logits_bwd", backend, logits.device, *args, *_bwd_params(support_mode))


def _bwd_params(support_mode: int) -> tuple:
    return LogprobsBwdParams(support_mode=SupportMode(support_mode)).pack()


@_from_logits_bwd.register_fake
def _(logits, targets, inv_temperature, grad_logp, lse, entropy, grad_entropy, support, support_mode, backend):
    return logits.new_empty(logits.shape)


@torch.library.custom_op("rlvr_kernels::logprobs_from_logits_bwd_", mutates_args=("logits",))
def _from_logits_bwd_inplace(
    logits: torch.Tensor,
    targets: torch.Tensor,
    inv_temperature: torch.Tensor,
    grad_logp: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_entropy: Optional[torch.Tensor],
    support: Optional[torch.Tensor],
    support_mode: int,
    backend: str,
) -> None:
    """``rlvr_kernels::logprobs_from_logits_bwd`` written over ``logits`` (kernel contract)."""
    if not logits.is_contiguous():
        raise ValueError("logits: expected a contiguous tensor (its gradient is written over it)")
    if SupportMode(support_mode) == SupportMode.THRESHOLD:
        raise ValueError("support_mode: a THRESHOLD support is not supported in place")
    args = (logits, targets, inv_temperature, grad_logp, lse, entropy, grad_entropy, support)
    _dispatch.run("logprobs_from_logits_bwd_", backend, logits.device, *args, *_bwd_params(support_mode))


@_from_logits_bwd_inplace.register_fake
def _(logits, targets, inv_temperature, grad_logp, lse, entropy, grad_entropy, support, support_mode, backend):
    return None


def _from_logits_setup_context(ctx, inputs, output):
    a = _LogitsArgs(*inputs)
    logp, entropy, lse, widened = output
    ctx.mark_non_differentiable(lse, widened)
    saved = _LogitsSaved(
        logits=a.logits,
        targets=a.targets,
        inv_temperature=a.inv_temperature,
        lse=lse,
        entropy=entropy,
        support=a.support,
        outside=None if a.support is None else torch.isneginf(logp),
        widened=widened if widened.numel() else None,
    )
    ctx.save_for_backward(*saved)
    ctx.ignore_index, ctx.return_entropy, ctx.backend = a.ignore_index, a.return_entropy, a.backend
    ctx.support_mode = a.support_mode


def _from_logits_backward(ctx, g_logp, g_entropy, g_lse, g_widened):
    s = _LogitsSaved(*ctx.saved_tensors)
    if not _LogitsArgs(*ctx.needs_input_grad).logits:
        return _grads_by_name(_LogitsArgs)
    g, grad_entropy = _upstream(ctx, g_logp, g_entropy, s.targets, None, s.lse, s.outside)
    local = _local_sorted_targets(s.targets, None, ctx.ignore_index, 0)
    grad = _from_logits_bwd(
        s.logits,
        local,
        s.inv_temperature,
        g,
        s.lse,
        s.entropy,
        grad_entropy,
        s.support,
        ctx.support_mode,
        ctx.backend,
    )
    if s.widened is not None:
        _keep_targets_logits_bwd(local, s.inv_temperature, g, s.lse, s.entropy, grad_entropy, s.widened, grad)
    return _grads_by_name(_LogitsArgs, logits=grad)


_from_logits.register_autograd(_from_logits_backward, setup_context=_from_logits_setup_context)


# ------------------------------------------------------------------ validation
@dataclasses.dataclass(frozen=True)
class _LinearInputs:
    """``linear_logprobs``' arguments after the static checks, as the kernels take them."""

    hidden: torch.Tensor  # [N, H], contiguous
    weight: torch.Tensor  # [V, H] (this rank's shard), contiguous
    bias: Optional[torch.Tensor]  # [V], contiguous
    targets: torch.Tensor  # [M] int64
    row_index: Optional[torch.Tensor]  # [M] int64
    temperature: Union[float, torch.Tensor]  # a float, or [N] (detached, maybe a broadcast view)
    num_rows: int  # N
    vocab: int  # V of this shard
    logit_scale: float
    softcap: Optional[float]
    outputs: frozenset  # of OPTIONAL_OUTPUTS names (return_entropy adds "entropy")
    logits_precision: str  # a LOGITS_PRECISIONS name


@dataclasses.dataclass(frozen=True)
class _LogitsInputs:
    """``logprobs_from_logits``' arguments after the static checks."""

    lead: Tuple[int, ...]  # logits.shape[:-1] == targets.shape
    num_rows: int  # N = prod(lead)
    vocab: int  # V
    temperature: Union[float, torch.Tensor]  # a float, or shaped ``lead`` (detached, maybe a broadcast view)


def _check_count(name: str, what: str, value: int) -> None:
    """A size the kernels index with (rows, targets, vocabulary, hidden width): at most
    :data:`MAX_COUNT`, so a garbage shape (an expanded or meta tensor of 2^40 rows) is
    refused here, not by an allocation inside a kernel."""
    if value > MAX_COUNT:
        raise ValueError(f"{name}: expected at most {MAX_COUNT} {what}, got {value}")


def _check_ignore_index(ignore_index) -> int:
    return check_int("ignore_index", ignore_index, minimum=_INT64.min, maximum=_INT64.max)


def _check_outputs(outputs) -> frozenset:
    if isinstance(outputs, str) or not isinstance(outputs, (tuple, list, set, frozenset)):
        raise TypeError(f"outputs: expected a tuple of names from {OPTIONAL_OUTPUTS}, got {outputs!r}")
    unknown = [o for o in outputs if o not in OPTIONAL_OUTPUTS]
    if unknown:
        raise ValueError(f"outputs: unknown output(s) {unknown}; expected names from {OPTIONAL_OUTPUTS}")
    return frozenset(outputs)


def _check_logits_precision(logits_precision, allowed: Sequence[str], why: str = "") -> str:
    if not isinstance(logits_precision, str) or logits_precision not in allowed:
        raise ValueError(f"logits_precision: expected one of {tuple(allowed)}{why}, got {logits_precision!r}")
    return logits_precision


def _check_logit_transform(logit_scale, softcap) -> Tuple[float, Optional[float]]:
    """logit_scale: 0 or a magnitude in [MIN_LOGIT_FACTOR, MAX_LOGIT_FACTOR]; softcap: None
    or in that range. The kernels' fp32 factors built from them and the temperature stay
    normal numbers there (``_core/validation.py``), so the tanh's scale logit_scale/softcap
    is never the kernels' "no soft-cap" 0 and no factor overflows."""
    logit_scale = check_number("logit_scale", logit_scale)
    if logit_scale != 0.0 and not MIN_LOGIT_FACTOR <= abs(logit_scale) <= MAX_LOGIT_FACTOR:
        raise ValueError(
            f"logit_scale: expected 0 or a magnitude in [{MIN_LOGIT_FACTOR}, {MAX_LOGIT_FACTOR}], got {logit_scale!r}"
        )
    if softcap is not None:
        softcap = check_number("softcap", softcap, minimum=MIN_LOGIT_FACTOR, maximum=MAX_LOGIT_FACTOR)
    return logit_scale, softcap


def _validate_linear(
    hidden,
    weight,
    targets,
    row_index,
    temperature,
    bias,
    ignore_index,
    validate,
    logit_scale=1.0,
    softcap=None,
    outputs=(),
    return_entropy=False,
    logits_precision="fp32",
) -> _LinearInputs:
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES, ndim=(2,))
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=(2,), like=hidden, like_name="hidden")
    n, h = hidden.shape
    v = weight.shape[0]
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: expected dtype {hidden.dtype} (like hidden), got {weight.dtype}; cast one of them")
    if weight.shape[1] != h:
        raise ValueError(f"weight: expected shape (V, {h}) (H = hidden.shape[1]), got {tuple(weight.shape)}")
    if v < 1:
        raise ValueError(f"weight: expected at least one vocabulary row, got shape {tuple(weight.shape)}")
    _check_count("hidden", "rows", n)
    _check_count("hidden", "columns", h)
    _check_count("weight", "vocabulary rows", v)
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, like=hidden, like_name="hidden")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias: expected dtype {weight.dtype} (like weight), got {bias.dtype}")
        if tuple(bias.shape) != (v,):
            raise ValueError(f"bias: expected shape ({v},) (V = weight.shape[0]), got {tuple(bias.shape)}")
    check_tensor("targets", targets, dtypes=INDEX_DTYPES, ndim=(1,), like=hidden, like_name="hidden")
    m = targets.shape[0]
    _check_count("targets", "targets", m)
    if row_index is None:
        if m != n:
            raise ValueError(
                f"targets: expected shape ({n},) (one per hidden row; pass row_index to predict "
                f"several targets from one row), got {tuple(targets.shape)}"
            )
    else:
        check_tensor("row_index", row_index, dtypes=INDEX_DTYPES, ndim=(1,), like=hidden, like_name="hidden")
        if row_index.shape[0] != m:
            raise ValueError(f"row_index: expected shape ({m},) (one per target), got {tuple(row_index.shape)}")
    _check_ignore_index(ignore_index)
    logit_scale, softcap = _check_logit_transform(logit_scale, softcap)
    wanted = _check_outputs(outputs) | ({"entropy"} if return_entropy else set())
    logits_precision = _check_logits_precision(logits_precision, tuple(LOGITS_PRECISIONS))
    temp = check_temperature(temperature, (n,), hidden, "hidden", validate)
    return _LinearInputs(
        hidden=hidden.contiguous(),
        weight=weight.contiguous(),
        bias=None if bias is None else bias.contiguous(),
        targets=targets.long(),
        row_index=None if row_index is None else row_index.long(),
        temperature=temp,
        num_rows=n,
        vocab=v,
        logit_scale=logit_scale,
        softcap=softcap,
        outputs=wanted,
        logits_precision=logits_precision,
    )


def _validate_from_logits(
    logits, targets, temperature, ignore_index, validate, logits_precision="fp32"
) -> _LogitsInputs:
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES)
    check_tensor("targets", targets, dtypes=INDEX_DTYPES, like=logits, like_name="logits")
    if logits.dim() < 1 or tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"targets: expected shape {tuple(logits.shape[:-1])} (logits.shape[:-1]), "
            f"got {tuple(targets.shape)} with logits {tuple(logits.shape)}"
        )
    v = logits.shape[-1]
    if v < 1:
        raise ValueError(
            f"logits: expected a vocabulary of at least 1 (last dimension), got shape {tuple(logits.shape)}"
        )
    _check_count("logits", "vocabulary entries (last dimension)", v)
    lead = tuple(targets.shape)
    n = math.prod(lead)
    _check_count("logits", "rows (the product of the leading dimensions)", n)
    _check_ignore_index(ignore_index)
    # tf32 is a rounding of GEMM operands: given logits have none.
    _check_logits_precision(logits_precision, ("fp32", "bf16"), " (tf32 rounds GEMM operands; given logits have none)")
    temp = check_temperature(temperature, lead, logits, "logits", validate)
    return _LogitsInputs(lead=lead, num_rows=n, vocab=v, temperature=temp)


def _check_values(targets, row_index, vocab_size: int, n: int, ignore_index: int, validate: bool):
    """Range checks that read the data (one host sync each on CUDA); skipped when
    ``validate`` is False, under torch.compile and on meta tensors. The temperatures'
    range is checked by ``check_temperature``."""
    if not checks_enabled(validate, targets, row_index):
        return
    if targets.numel():
        t = targets.long()
        bad = ((t < 0) | (t >= vocab_size)) & (t != ignore_index)
        if bool(bad.any()):
            k = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"targets: expected ids in [0, {vocab_size}) or ignore_index={ignore_index}, "
                f"got {int(t[k])} at position {k}"
            )
    if row_index is not None and row_index.numel():
        r = row_index.long()
        if bool(((r < 0) | (r >= n)).any()):
            raise ValueError(
                f"row_index: expected rows in [0, {n}) (N = hidden.shape[0]), got values in "
                f"[{int(r.min())}, {int(r.max())}]"
            )


# ------------------------------------------------------------------ sampling support
@dataclasses.dataclass(frozen=True)
class _Sampling:
    """A sampling support after the static checks: an explicit CSR, or the engine's filters
    (each a number, a tensor broadcast to the rows, or None when not given)."""

    ids: Optional[torch.Tensor]  # [nnz] int64
    offsets: Optional[torch.Tensor]  # [N + 1] int64
    top_k: Union[None, int, torch.Tensor]
    top_p: Union[None, float, torch.Tensor]
    min_p: Union[None, float, torch.Tensor]
    convention: str  # a SAMPLING_CONVENTIONS name
    keep_targets: bool  # a target outside joins its row's support


def _check_filter(name: str, value, rows_shape, like, like_name, validate, integer: bool, low: float, open_low: bool):
    """top_k (an int; <= 0 keeps every column), top_p (in (0, 1]) or min_p (in [0, 1]): a number
    or a tensor broadcastable to the rows; the tensor's values are checked with ``validate``."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        dtypes = INDEX_DTYPES if integer else FLOAT_DTYPES
        check_tensor(name, value, dtypes=dtypes, like=like, like_name=like_name)
        try:
            out = torch.broadcast_to(value.detach(), tuple(rows_shape))
        except RuntimeError:
            raise ValueError(
                f"{name}: expected a number or a tensor broadcastable to {tuple(rows_shape)} (one per row), "
                f"got shape {tuple(value.shape)}"
            ) from None
        if not integer and checks_enabled(validate, value) and value.numel():
            v = value.detach().double()
            bad = ~(((v > low) if open_low else (v >= low)) & (v <= 1.0))
            if bool(bad.any()):
                idx = tuple(int(i) for i in bad.nonzero()[0])
                bracket = "(" if open_low else "["
                raise ValueError(f"{name}: expected values in {bracket}{low}, 1], got {float(v[idx])} at {idx}")
        return out
    if integer:
        return check_int(name, value, minimum=_INT64.min, maximum=_INT64.max)
    return check_number(name, value, minimum=low, maximum=1.0, open_low=open_low)


def _check_sampling(
    support_ids,
    support_offsets,
    top_k,
    top_p,
    min_p,
    sampling_convention,
    keep_targets,
    rows_shape,
    like,
    like_name,
    validate,
) -> Optional[_Sampling]:
    """The sampling-support arguments of both ops (docs/logprobs.md, "Sampling support"), None
    when none is given. Value checks of the CSR need ``validate`` (one host sync)."""
    if not isinstance(keep_targets, bool):
        raise TypeError(f"keep_targets: expected a bool, got {type(keep_targets).__name__}")
    if not isinstance(sampling_convention, str) or sampling_convention not in SAMPLING_CONVENTIONS:
        raise ValueError(
            f"sampling_convention: expected one of {tuple(SAMPLING_CONVENTIONS)}, got {sampling_convention!r}"
        )
    explicit = support_ids is not None or support_offsets is not None
    computed = top_k is not None or top_p is not None or min_p is not None
    if explicit and computed:
        raise ValueError(
            "support_ids: give an explicit support (support_ids, support_offsets) or top_k / top_p / min_p, not both"
        )
    n = math.prod(rows_shape)
    if explicit:
        if support_ids is None or support_offsets is None:
            missing = "support_ids" if support_ids is None else "support_offsets"
            raise ValueError(f"{missing}: expected a tensor (support_ids and support_offsets go together)")
        check_tensor("support_ids", support_ids, dtypes=INDEX_DTYPES, ndim=(1,), like=like, like_name=like_name)
        check_tensor("support_offsets", support_offsets, dtypes=INDEX_DTYPES, ndim=(1,), like=like, like_name=like_name)
        if support_offsets.shape[0] != n + 1:
            raise ValueError(
                f"support_offsets: expected shape ({n + 1},) (one more than the {n} rows), "
                f"got {tuple(support_offsets.shape)}"
            )
        _check_count("support_ids", "ids", support_ids.shape[0])
        return _Sampling(
            support_ids.long(), support_offsets.long(), None, None, None, sampling_convention, keep_targets
        )
    if not computed:
        if keep_targets:
            raise ValueError(
                "keep_targets: only with a sampling support (support_ids + support_offsets, or top_k / top_p / min_p)"
            )
        return None
    return _Sampling(
        None,
        None,
        _check_filter("top_k", top_k, rows_shape, like, like_name, validate, True, 0.0, False),
        _check_filter("top_p", top_p, rows_shape, like, like_name, validate, False, 0.0, True),
        _check_filter("min_p", min_p, rows_shape, like, like_name, validate, False, 0.0, False),
        sampling_convention,
        keep_targets,
    )


def _check_support_values(sampling: _Sampling, vocab_size: int, validate: bool) -> None:
    """The explicit CSR's values (one host sync on CUDA; skipped like :func:`_check_values`):
    offsets from 0 to len(support_ids), non-decreasing; ids in [0, V)."""
    if sampling.ids is None or not checks_enabled(validate, sampling.ids, sampling.offsets):
        return
    off, ids = sampling.offsets, sampling.ids
    if int(off[0]) != 0 or int(off[-1]) != ids.shape[0] or bool((off[1:] < off[:-1]).any()):
        raise ValueError(
            f"support_offsets: expected non-decreasing offsets from 0 to len(support_ids) = {ids.shape[0]}, "
            f"got [{int(off[0])}, ..., {int(off[-1])}]"
        )
    if ids.numel() and bool(((ids < 0) | (ids >= vocab_size)).any()):
        raise ValueError(
            f"support_ids: expected ids in [0, {vocab_size}), got values in [{int(ids.min())}, {int(ids.max())}]"
        )


def _support_bits(sampling: _Sampling, n: int, vocab: int, backend: str) -> torch.Tensor:
    """The MASK support (int32 [N, ceil(V / 32)]) of an explicit CSR, on the device without a
    host sync, a sort or an [N, V] temporary (the ``support_bits`` kernels)."""
    return _support_bits_op(sampling.ids, sampling.offsets, vocab, "auto" if backend == "reference" else backend)


@torch.library.custom_op("rlvr_kernels::support_bits", mutates_args=())
def _support_bits_op(
    support_ids: torch.Tensor, support_offsets: torch.Tensor, vocab: int, backend: str
) -> torch.Tensor:
    """bits [N, ceil(V / 32)] int32 of the kernel contract ("Sampling support")."""
    return _dispatch.run("support_bits", backend, support_ids.device, support_ids, support_offsets, vocab)


@_support_bits_op.register_fake
def _(support_ids, support_offsets, vocab, backend):
    return support_ids.new_empty((support_offsets.shape[0] - 1, (vocab + 31) // 32), dtype=torch.int32)


def _filter_rows(value, n: int, device, dtype, off) -> torch.Tensor:
    """A filter as the threshold kernels take it: [n] contiguous, ``off`` where not given."""
    if value is None:
        return torch.full((n,), off, device=device, dtype=dtype)
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).reshape(n).contiguous()
    return torch.full((n,), value, device=device, dtype=dtype)


def _filters(sampling: _Sampling, n: int, device, dtype) -> _Triple:
    """(top_k int64 [N], top_p [N], min_p [N]) of the threshold kernels; an absent filter off."""
    return (
        _filter_rows(sampling.top_k, n, device, torch.int64, 0),
        _filter_rows(sampling.top_p, n, device, dtype, 1.0),
        _filter_rows(sampling.min_p, n, device, dtype, 0.0),
    )


def _sampling_kwargs(sampling: Optional[_Sampling]) -> dict:
    """The reference's keyword arguments for a sampling support."""
    if sampling is None:
        return {}
    return dict(
        support_ids=sampling.ids,
        support_offsets=sampling.offsets,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        min_p=sampling.min_p,
        sampling_convention=sampling.convention,
        keep_targets=sampling.keep_targets,
    )


# ------------------------------------------------------------------ public functions
def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    row_index: Optional[torch.Tensor] = None,
    temperature: Union[float, torch.Tensor] = 1.0,
    bias: Optional[torch.Tensor] = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    outputs: Sequence[str] = (),
    logits_precision: str = "fp32",
    support_ids: Optional[torch.Tensor] = None,
    support_offsets: Optional[torch.Tensor] = None,
    top_k: Union[None, int, torch.Tensor] = None,
    top_p: Union[None, float, torch.Tensor] = None,
    min_p: Union[None, float, torch.Tensor] = None,
    sampling_convention: str = "vllm",
    keep_targets: bool = False,
    process_group=None,
    validate: bool = True,
    backend: str = "auto",
) -> LinearLogprobs:
    """Log-probs of ``targets`` (and per-row statistics) straight from hidden states and the
    LM head, never materialising the ``[N, V]`` logits (docs/logprobs.md).

    y_n = hidden_n · Wᵀ + b,  z_n = softcap · tanh(logit_scale · y_n / softcap) / T_n
    (without ``softcap``: logit_scale · y_n / T_n; the order of TRL's and Gemma's heads:
    scale, soft-cap, temperature),  logp_m = z_{row(m), t_m} − logsumexp(z_{row(m)}),
    entropy_n = logsumexp(z_n) − Σ_v softmax(z_n)_v · z_{n,v}.

    Args:
        hidden: ``[N, H]`` hidden states (fp16/bf16/fp32/fp64). Gets a gradient.
        weight: ``[V, H]`` LM head, same dtype and device (with ``process_group``: this
            rank's vocabulary shard; shards in rank order). Gets a gradient.
        targets: ``[M]`` int32/int64 token ids in ``[0, V)``, or ``ignore_index`` (log-prob
            0, no gradient).
        row_index: ``[M]`` the hidden row predicting each target (prefix-tree branch
            points predict several); default the identity (then M must equal N).
        temperature: a float in [1e-30, 1e30] or a tensor broadcastable to ``[N]`` (one per
            row; no gradient).
        bias: ``[V]`` optional LM-head bias (gets a gradient).
        return_entropy: also return the ``[N]`` entropies (with their gradient).
        ignore_index: the target id that is skipped.
        logit_scale: a multiplier of the logits before the soft-cap (Cohere, Granite:
            ``1 / logits_scaling``, ...): 0, or of magnitude in [1e-6, 1e6].
        softcap: ``final_logit_softcapping`` (Gemma 2/3): a number in [1e-6, 1e6], or None.
        outputs: optional statistics, names from :data:`OPTIONAL_OUTPUTS`: ``"entropy"``
            ([N], with its gradient), ``"log_sum_sq_probs"`` ([N], log Σ_v p_v²),
            ``"mean_logits"`` ([N], the mean over the vocabulary of z, so after the
            soft-cap and the temperature), ``"is_top1"`` ([M] bool: the target is the
            first argmax of its row; False for ignored targets). The last three carry no
            gradient. Each costs only when requested.
        logits_precision: how y is formed (docs/logprobs.md, "Logits precision"):
            ``"fp32"`` (the operands as given, accumulated in fp32; fp64 for fp64 inputs),
            ``"tf32"`` (hidden and W rounded to tf32 — 10-bit mantissa, to nearest, ties
            away from zero — then accumulated in fp32: a TF32 GEMM) or ``"bf16"`` (hidden,
            W and b rounded to bf16, to nearest even, accumulated in fp32, and y rounded to
            bf16: the logits of a bf16 LM head). The scale, soft-cap, temperature and
            softmax run in the compute dtype after it. The gradient passes straight
            through every rounding: it is that of the softmax of the rounded logits, with
            d y / d(unrounded y) = 1 and the GEMM gradients formed with the operands as
            given (not rounded).
        support_ids, support_offsets: an explicit sampling support (docs/logprobs.md,
            "Sampling support"), the set the rollout engine kept for each hidden row: the ids
            of row n are ``support_ids[support_offsets[n]:support_offsets[n + 1]]`` (int32/int64;
            duplicates allowed; ``support_offsets`` has N + 1 entries from 0 to
            len(support_ids)). The log-probs and entropy are then those of the distribution
            restricted to the kept ids (after the temperature); a target outside gets −inf
            and is flagged in the result's ``outside_support``; an empty row has entropy 0.
        top_k, top_p, min_p: a computed sampling support, the rollout engine's filters (a
            number, or a tensor broadcastable to ``[N]``): ``top_k`` an int (<= 0 or >= V: off),
            ``top_p`` in (0, 1] (1: off), ``min_p`` in [0, 1] (0: off), on the logits after the
            temperature, with ties kept whole; found inside the kernels without a sort or an
            ``[N, V]`` tensor. Not together with an explicit support.
        sampling_convention: whose definition of the filters: ``"vllm"`` (min-p, then top-k,
            then top-p over the renormalised survivors) or ``"sglang"`` (each on the full
            distribution). With a support, ``outputs`` may hold ``"entropy"`` only, and
            ``process_group`` is refused. The gradient is that of the restricted
            distribution (the support itself is a constant).
        keep_targets: with a support, a target outside its row's kept set joins that set
            (its row's distribution is over kept ∪ {its targets}) instead of getting −inf:
            a sampled token was in the engine's kept set, and a trainer recomputing it may
            miss one at the boundary. ``outside_support`` is then all False. Costs one host
            sync on CUDA and, per joined target, one dot product over H.
        process_group: vocab-parallel group (``torch.distributed``): every rank passes
            the same hidden/targets and its own weight shard; the result equals the
            unsharded op (soft-cap, logit scale and every output included; is_top1's
            tie goes to the first column of the whole vocabulary). Eager only (collectives run in the op).
            A bad input on one rank, or shapes or options that differ between the ranks,
            raise on every rank (a handshake before the first collective), never hang.
        validate: check target / row_index ranges and temperatures (a host sync on
            CUDA); skipped under torch.compile and on meta tensors (kernels never go out
            of bounds anyway).
        backend: ``"auto"``, or ``"reference"``, ``"cpu"``, ``"triton"``.

    Returns:
        A :class:`LinearLogprobs` (logp [M], entropy [N], log_sum_sq_probs [N],
        mean_logits [N], is_top1 [M]) in fp32 (fp64 for fp64 inputs; is_top1 bool), None
        for those not requested (``return_entropy=True`` requests the entropy), whatever
        is asked; ``.outside_support`` ([M] bool) flags the targets outside a sampling
        support.
    """
    if process_group is not None:
        collectives.check_eager("linear_logprobs")
    try:
        _dispatch.check_backend(backend)
        x = _validate_linear(
            hidden,
            weight,
            targets,
            row_index,
            temperature,
            bias,
            ignore_index,
            validate,
            logit_scale,
            softcap,
            outputs,
            return_entropy,
            logits_precision,
        )
        sampling = _check_sampling(
            support_ids,
            support_offsets,
            top_k,
            top_p,
            min_p,
            sampling_convention,
            keep_targets,
            (x.num_rows,),
            hidden,
            "hidden",
            validate,
        )
        if sampling is not None:
            _check_support_options(x.outputs, process_group)
        if process_group is not None and backend == "reference":
            raise ValueError("process_group: the reference backend is single-process; pass backend='auto'")
    except Exception:
        if process_group is not None and collectives.is_initialized():
            _vocab_layout(None, ignore_index, process_group)  # joins the handshake, then raises here
        raise
    vocab_start, vocab_size = (0, x.vocab) if process_group is None else _vocab_layout(x, ignore_index, process_group)
    if "is_top1" in x.outputs and vocab_size > _MAX_TOP1_VOCAB:
        raise ValueError(f"outputs: 'is_top1' supports vocabularies of at most {_MAX_TOP1_VOCAB}, got {vocab_size}")
    _check_values(x.targets, x.row_index, vocab_size, x.num_rows, ignore_index, validate)
    if sampling is not None:
        _check_support_values(sampling, vocab_size, validate)
    if backend == "reference":
        wanted = tuple(o for o in OPTIONAL_OUTPUTS if o in x.outputs)
        out = _dispatch.kernel("linear_logprobs", "reference")(
            x.hidden,
            x.weight,
            x.targets,
            row_index=x.row_index,
            temperature=x.temperature,
            bias=x.bias,
            return_entropy=return_entropy,
            ignore_index=ignore_index,
            logit_scale=x.logit_scale,
            softcap=x.softcap,
            outputs=wanted,
            logits_precision=x.logits_precision,
            **_sampling_kwargs(sampling),
        )
        # The reference gives the bare log-probs when nothing else is asked.
        return LinearLogprobs(*out) if (wanted or sampling is not None) else LinearLogprobs(out, None, None, None, None)
    n = x.num_rows
    row_ptr, order = _csr(x.row_index, n, x.hidden.device)
    out_scale, tanh_scale = _transform_scales(x.logit_scale, x.softcap)
    inv_t = _inv_temperature(x.temperature, n, x.hidden.device, _compute_dtype(x.hidden.dtype), out_scale)
    precision = int(LOGITS_PRECISIONS[x.logits_precision])
    support, support_mode = None, int(SupportMode.NONE)
    if sampling is not None and sampling.ids is not None:
        support, support_mode = _support_bits(sampling, n, x.vocab, backend), int(SupportMode.MASK)
    elif sampling is not None:
        # (the support is a constant of the loss: the threshold op has no autograd)
        support = _linear_threshold(
            x.hidden.detach(),
            x.weight.detach(),
            None if x.bias is None else x.bias.detach(),
            inv_t,
            *_filters(sampling, n, x.hidden.device, inv_t.dtype),
            tanh_scale,
            precision,
            int(SAMPLING_CONVENTIONS[sampling.convention]),
            backend,
        )
        support_mode = int(SupportMode.THRESHOLD)
    args = _LinearArgs(
        hidden=x.hidden,
        weight=x.weight,
        bias=x.bias,
        targets=x.targets,
        row_index=x.row_index,
        row_ptr=row_ptr,
        order=order,
        inv_temperature=inv_t,
        ignore_index=int(ignore_index),
        return_entropy="entropy" in x.outputs,
        tanh_scale=tanh_scale,
        need_sum_sq="log_sum_sq_probs" in x.outputs,
        need_sum_z="mean_logits" in x.outputs,
        need_top1="is_top1" in x.outputs,
        logits_precision=precision,
        support=support,
        support_mode=support_mode,
        keep_targets=sampling is not None and sampling.keep_targets,
        backend=backend,
    )
    if process_group is None:
        logp, entropy, _, log_sum_sq, mean_logits, is_top1, _ = _linear_logprobs(*args)
    else:
        shard = _VocabShard(collectives.group_name(process_group), vocab_start, vocab_size)
        logp, entropy, _, log_sum_sq, mean_logits, is_top1, _ = _linear_logprobs_vocab_parallel(*args, *shard)
    return LinearLogprobs(
        logp,
        _unsaved(entropy) if args.return_entropy else None,
        log_sum_sq if args.need_sum_sq else None,
        mean_logits if args.need_sum_z else None,
        is_top1 if args.need_top1 else None,
    )


def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: Union[float, torch.Tensor] = 1.0,
    return_entropy: bool = False,
    *,
    ignore_index: int = -100,
    logits_precision: str = "fp32",
    support_ids: Optional[torch.Tensor] = None,
    support_offsets: Optional[torch.Tensor] = None,
    top_k: Union[None, int, torch.Tensor] = None,
    top_p: Union[None, float, torch.Tensor] = None,
    min_p: Union[None, float, torch.Tensor] = None,
    sampling_convention: str = "vllm",
    keep_targets: bool = False,
    validate: bool = True,
    backend: str = "auto",
) -> LogprobsFromLogits:
    """Log-probs of ``targets`` (and entropy) from logits that already exist (docs/logprobs.md):
    one pass over each row, no ``[N, V]`` temporaries (the backward writes the logits'
    gradient and nothing else of that size).

    Args:
        logits: ``[..., V]`` (fp16/bf16/fp32/fp64), last dimension contiguous. Leading
            dimensions that flatten to one row stride are read in place, stride 0 included
            (an expanded view such as ``x[None].expand(N, V)``); others (e.g.
            ``logits[:, :-1]`` or ``x[:, None, :].expand(N, K, V)``) are copied once.
        targets: ``[...]`` (``logits.shape[:-1]``) int32/int64 ids in ``[0, V)`` or
            ``ignore_index`` (log-prob 0, no gradient).
        temperature: a float in [1e-30, 1e30] or a tensor broadcastable to ``targets`` (no
            gradient).
        return_entropy: also return the entropies (with their gradient).
        logits_precision: ``"fp32"`` (the logits as given) or ``"bf16"``: the logits are
            rounded to bf16 (to nearest even) before the temperature and the softmax, the
            logits a bf16 LM head would have given; the gradient passes straight through
            the rounding. Unless the logits are bf16 already (then it changes nothing)
            this makes one rounded copy of them. ``"tf32"`` is refused (it rounds GEMM
            operands, and given logits have none).
        support_ids, support_offsets, top_k, top_p, min_p, sampling_convention: a sampling
            support, as in :func:`linear_logprobs`, for the rows of the flattened leading
            dimensions (``support_offsets`` has prod(targets.shape) + 1 entries; the filters
            are numbers or tensors broadcastable to ``targets``).
        keep_targets: as in :func:`linear_logprobs`.
        validate, backend: as in :func:`linear_logprobs`.

    Returns:
        A :class:`LogprobsFromLogits` (logp, entropy), both shaped like ``targets`` (fp32;
        fp64 for fp64 logits); entropy is None without ``return_entropy``;
        ``.outside_support`` flags the targets outside a sampling support.
    """
    _dispatch.check_backend(backend)
    x = _validate_from_logits(logits, targets, temperature, ignore_index, validate, logits_precision)
    sampling = _check_sampling(
        support_ids,
        support_offsets,
        top_k,
        top_p,
        min_p,
        sampling_convention,
        keep_targets,
        x.lead,
        logits,
        "logits",
        validate,
    )
    flat_targets = einops.rearrange(targets, "... -> (...)").long()
    _check_values(flat_targets, None, x.vocab, x.num_rows, ignore_index, validate)
    if sampling is not None:
        _check_support_values(sampling, x.vocab, validate)
    if backend == "reference":
        ref = _dispatch.kernel("logprobs_from_logits", "reference")
        out = ref(
            logits,
            targets,
            x.temperature,
            return_entropy,
            ignore_index=ignore_index,
            logits_precision=logits_precision,
            **_sampling_kwargs(sampling),
        )
        if sampling is not None:
            return LogprobsFromLogits(*out)
        return LogprobsFromLogits(*out) if return_entropy else LogprobsFromLogits(out, None)
    if logits_precision == "bf16" and logits.dtype != torch.bfloat16:
        logits = _RoundBF16.apply(logits)  # the kernels then see bf16-exact logits
    # One row per leading index: a view whenever the leading dimensions share one stride.
    rows = einops.rearrange(logits, "... v -> (...) v")
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    inv_t = _inv_temperature(x.temperature, x.num_rows, logits.device, _compute_dtype(logits.dtype))
    support, support_mode = None, int(SupportMode.NONE)
    if sampling is not None and sampling.ids is not None:
        support, support_mode = _support_bits(sampling, x.num_rows, x.vocab, backend), int(SupportMode.MASK)
    elif sampling is not None:
        filters = _filters(sampling, x.num_rows, logits.device, inv_t.dtype)
        conv = int(SAMPLING_CONVENTIONS[sampling.convention])
        support, support_mode = (
            _logits_threshold(rows.detach(), inv_t, *filters, conv, backend),
            int(SupportMode.THRESHOLD),
        )
    args = _LogitsArgs(
        logits=rows,
        targets=flat_targets,
        inv_temperature=inv_t,
        ignore_index=int(ignore_index),
        return_entropy=bool(return_entropy),
        support=support,
        support_mode=support_mode,
        keep_targets=sampling is not None and sampling.keep_targets,
        backend=backend,
    )
    logp, entropy, _, _ = _from_logits(*args)
    logp = logp.reshape(x.lead)
    return LogprobsFromLogits(logp, _unsaved(entropy.reshape(x.lead)) if return_entropy else None)


def logprobs_from_logits_grad_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    grad_of: Callable[[torch.Tensor, Optional[torch.Tensor]], Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]],
    temperature: Union[float, torch.Tensor] = 1.0,
    return_entropy: bool = False,
    *,
    ignore_index: int = -100,
    validate: bool = True,
    backend: str = "auto",
) -> Tuple[LogprobsFromLogits, bool]:
    """Log-probs (and entropies) of ``targets`` under ``logits`` ``[N, V]`` and, in the same
    call, the logits' gradient written over the logits: for a caller whose logits are a
    scratch buffer of its own (an LM head taken a chunk of rows at a time), so that the
    gradient needs no second ``[N, V]`` tensor.

    ``grad_of(logp, entropy)`` gets the detached log-probs (entropies, or None) and returns the
    loss's gradients with respect to them (each may be None: no gradient). Returns
    (:class:`LogprobsFromLogits` (detached), whether a gradient was written); when
    ``grad_of`` returns no gradient at all the logits are left as they were. The gradient is
    the one ``logprobs_from_logits``' backward gives, bit for bit (the same kernels; the
    reference backend runs the reference and copies its gradient in). ``logits``: 2-D,
    contiguous, no autograd history wanted (read and overwritten outside it); no sampling
    support and no ``logits_precision`` rounding (those keep ``logprobs_from_logits``).
    """
    _dispatch.check_backend(backend)
    if not callable(grad_of):
        raise TypeError("grad_of: expected a callable")
    x = _validate_from_logits(logits, targets, temperature, ignore_index, validate)
    if logits.dim() != 2 or not logits.is_contiguous():
        raise ValueError(f"logits: expected a contiguous [N, V] tensor (written over), got shape {tuple(logits.shape)}")
    flat_targets = targets.long()
    _check_values(flat_targets, None, x.vocab, x.num_rows, ignore_index, validate)
    if backend == "reference":
        return _logits_grad_by_reference(logits, targets, grad_of, x.temperature, return_entropy, ignore_index)
    with torch.no_grad():
        inv_t = _inv_temperature(x.temperature, x.num_rows, logits.device, _compute_dtype(logits.dtype))
        none = int(SupportMode.NONE)
        logp, entropy, lse, _ = _from_logits(
            logits, flat_targets, inv_t, int(ignore_index), bool(return_entropy), None, none, False, backend
        )
        out = LogprobsFromLogits(logp, entropy if return_entropy else None)
        g_logp, g_ent = grad_of(out.logp, out.entropy)
        if g_logp is None and (g_ent is None or not return_entropy):
            return out, False
        as_ctx = types.SimpleNamespace(ignore_index=ignore_index, return_entropy=return_entropy)
        g, h = _upstream(as_ctx, g_logp, g_ent, flat_targets, None, lse)
        local = _local_sorted_targets(flat_targets, None, ignore_index, 0)
        _from_logits_bwd_inplace(logits, local, inv_t, g, lse, entropy, h, None, none, backend)
    return out, True


def _logits_grad_by_reference(logits, targets, grad_of, temperature, return_entropy, ignore_index):
    """``logprobs_from_logits_grad_`` on the reference: its autograd, the gradient copied in."""
    ref = _dispatch.kernel("logprobs_from_logits", "reference")
    with torch.enable_grad():
        leaf = logits.detach().clone().requires_grad_()
        res = ref(leaf, targets, temperature, return_entropy, ignore_index=ignore_index)
        logp, entropy = (res[0], res[1]) if return_entropy else (res, None)
        out = LogprobsFromLogits(logp.detach(), None if entropy is None else entropy.detach())
        g_logp, g_ent = grad_of(out.logp, out.entropy)
        outs, seeds = [], []
        if g_logp is not None:
            outs, seeds = [logp], [g_logp.to(logp.dtype)]
        if entropy is not None and g_ent is not None:
            outs.append(entropy)
            seeds.append(g_ent.to(entropy.dtype))
        if not outs:
            return out, False
        (grad,) = torch.autograd.grad(outs, [leaf], seeds)
    with torch.no_grad():
        logits.copy_(grad)
    return out, True


# ------------------------------------------------------------------ helpers


class _RoundBF16(torch.autograd.Function):
    """The logits rounded to bf16 (to nearest even; fp64 through fp32, as the reference),
    kept in their dtype; the gradient passes straight through (identity)."""

    @staticmethod
    def forward(ctx, logits):
        return logits.to(torch.float32).to(torch.bfloat16).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _check_support_options(outputs: frozenset, process_group) -> None:
    """What a sampling support does not combine with (each raises, naming the argument)."""
    extra = sorted(outputs - {"entropy"})
    if extra:
        raise ValueError(f"outputs: {extra} are not defined with a sampling support; only 'entropy' is")
    if process_group is not None:
        raise ValueError("process_group: a sampling support is not supported with a vocab-parallel head")


def _unsaved(entropy: torch.Tensor) -> torch.Tensor:
    """The entropy the caller gets: the op saves its own entropy output for the backward, so
    when autograd recorded the call the caller gets a copy ([N], cheap next to the [N, V]
    pass) and may modify it in place (``masked_fill_``) before calling backward."""
    return entropy.clone() if entropy.requires_grad else entropy


def _grads_by_name(args_cls, **grads) -> tuple:
    """One gradient per input of a custom op, in schema order: those named, None for the rest."""
    return tuple(grads.get(name) for name in args_cls._fields)


def _inv_temperature(temperature, n: int, device, dtype, scale: float = 1.0) -> torch.Tensor:
    """scale / T per row, [n] contiguous in the compute dtype (T: a float or a validated
    tensor of n elements, maybe a broadcast view). scale = 1 gives exactly 1 / T."""
    if isinstance(temperature, torch.Tensor):
        return (scale / temperature.to(dtype)).reshape(n).contiguous()
    return torch.full((n,), scale / temperature, device=device, dtype=dtype)


def _transform_scales(logit_scale: float, softcap: Optional[float]) -> Tuple[float, float]:
    """(the per-row factor's numerator, tanh_scale) of the kernel contract for z =
    softcap·tanh(logit_scale·y/softcap)/T: (softcap, logit_scale/softcap) with a soft-cap,
    (logit_scale, 0) without. logit_scale = 0 makes z = 0 either way (tanh(0) = 0), so it
    takes the uncapped form (tanh_scale = 0 means no cap). Any other accepted pair gives
    |tanh_scale| >= 1e-12 (``_check_logit_transform``): never 0 in fp32."""
    if softcap is None or logit_scale == 0.0:
        return logit_scale, 0.0
    return softcap, logit_scale / softcap


def _row_statistics(stats: torch.Tensor, vocab_size: int, need_entropy: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """lse and entropy from the stats columns (max, Σexp(z−max), Σexp(z−max)(z−max)).

    entropy = lse − Σ p z = log s − u/s: no max term, so no cancellation between large
    numbers. s ≥ 1 (the max itself contributes exp(0)) and u ≤ 0, so it is ≥ 0 as
    computed; the clamp at log V only removes the last-ulp rounding of a flat row."""
    m, s, u = stats[:, :3].unbind(-1)  # MAX, SUM_EXP, SUM_EXP_SHIFT (a test checks the order)
    log_s = torch.log(s)
    lse = m + log_s
    if not need_entropy:
        return lse, torch.zeros_like(lse)
    # s = 0 only for a row whose sampling support is empty (lse = −inf): entropy 0.
    entropy = torch.where(s > 0, log_s - u / s, torch.zeros_like(s))
    return lse, entropy.clamp(0.0, math.log(vocab_size))


def _optional_statistics(
    stats, vocab_size: int, targets, row_index, ignore_index: int, need_sum_sq: bool, need_sum_z: bool, need_top1: bool
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_sum_sq_probs [N], mean_logits [N], is_top1 [M] bool) from the stats columns, an
    empty [0] tensor for each not requested. log Σ p² = log Σ exp(2(z − max)) − 2 log Σ
    exp(z − max); is_top1: the row's first argmax is the target (ignored targets: False)."""
    log_sum_sq = (
        torch.log(stats[:, LogprobsStat.SUM_EXP_SQ]) - 2 * torch.log(stats[:, LogprobsStat.SUM_EXP])
        if need_sum_sq
        else stats.new_empty((0,))  # (distinct empties: a custom op's outputs must not alias)
    )
    mean_logits = stats[:, LogprobsStat.SUM_Z] / vocab_size if need_sum_z else stats.new_empty((0,))
    if need_top1:
        argmax = stats[:, LogprobsStat.ARGMAX].long()
        row_argmax = argmax if row_index is None else argmax.index_select(0, row_index)
        is_top1 = (row_argmax == targets) & (targets != ignore_index)
    else:
        is_top1 = targets.new_empty((0,), dtype=torch.bool)
    return log_sum_sq, mean_logits, is_top1


def _target_logprobs(target_logits, lse, row_index, order, ignored) -> torch.Tensor:
    """log p_m = z_t − lse_{row(m)} in the callers' target order; 0 for ignored targets.
    z_t ≤ max ≤ lse as computed (same rounding of z), so it is ≤ 0; the clamp is a guard
    for NaN-free but degenerate inputs (±inf logits)."""
    if order is not None:
        target_logits = torch.empty_like(target_logits).index_copy_(0, order, target_logits)
    row_lse = lse if row_index is None else lse.index_select(0, row_index)
    # A target outside a sampling support has z_t = −inf: −inf, also in an empty row (lse = −inf).
    logp = torch.where(torch.isneginf(target_logits), target_logits, target_logits - row_lse)
    return logp.clamp(max=0.0).masked_fill(ignored, 0.0)


def _local_sorted_targets(targets, order, ignore_index: int, vocab_start: int) -> torch.Tensor:
    """Targets in CSR order as local vocabulary ids of this shard; ignored ones → −1 (never
    a column). Another shard's targets fall outside [0, V) and match nothing here."""
    t = targets.long() if order is None else targets.long().index_select(0, order)
    local = t - vocab_start if vocab_start else t
    return torch.where(t == ignore_index, torch.full_like(local, -1), local)


def _upstream(ctx, g_logp, g_entropy, targets, order, lse, outside=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The kernels' upstream gradients: g in CSR order (0 for ignored targets, for targets
    outside the sampling support and when the log-probs carry no gradient) and the
    entropies' (None when they carry none)."""
    dt = lse.dtype
    if g_logp is None:
        g_logp = torch.zeros(targets.shape, dtype=dt, device=lse.device)
    g = g_logp.to(dt).masked_fill(targets == ctx.ignore_index, 0.0)
    if outside is not None:
        g = g.masked_fill(outside, 0.0)
    g = (g if order is None else g.index_select(0, order)).contiguous()
    grad_entropy = g_entropy.to(dt).contiguous() if (g_entropy is not None and ctx.return_entropy) else None
    return g, grad_entropy


# ------------------------------------------------------------------ keep_targets
# A sampled token is in the engine's kept set by construction; the trainer's own kept set
# (its filters on its own logits, or ids with a gap) may still miss it. With keep_targets
# such a target joins its row's support: the row's distribution is over kept ∪ {those
# targets}. The kernels see the support as it is; the ops layer folds the few extra
# columns into the row statistics (forward) and adds their terms of dz (backward), so every
# backend shares one implementation of it.
_WIDEN_CHUNK = 4096  # (row, column) pairs per [chunk, H] gather of the linear head's z


def _csr_rows(row_ptr: torch.Tensor, n: int) -> torch.Tensor:
    """The row of each CSR position ([M] int64)."""
    return torch.repeat_interleave(torch.arange(n, device=row_ptr.device), row_ptr.diff())


def _outside_logits(tlog, local, rows, z_of) -> torch.Tensor:
    """[M] (CSR order): z of each target the kernels found outside its row's support (their
    target logit −inf for a column in range), −inf for every other target. ``z_of(r, c)``
    forms z of the (row, column) pairs as the kernels would. A target whose own z is −inf
    (or NaN) stays outside: it has no mass to add."""
    out = torch.isneginf(tlog) & (local >= 0)
    widened = torch.full_like(tlog, float("-inf"))
    idx = out.nonzero().squeeze(1)  # (one host sync on CUDA; outside targets are few)
    if idx.numel():
        z = torch.cat([z_of(rows[i], local[i]) for i in idx.split(_WIDEN_CHUNK)])
        widened[idx] = torch.where(torch.isfinite(z), z, torch.full_like(z, float("-inf")))
    return widened


def _unique_pairs(widened, rows, local, vocab: int):
    """(positions [K'], inverse [K'], rows [K], columns [K], z [K]) of the distinct (row, column)
    pairs among the targets with a finite ``widened`` (a row may hold one token twice)."""
    idx = torch.isfinite(widened).nonzero().squeeze(1)
    key = rows[idx] * vocab + local[idx]
    uniq, inverse = torch.unique(key, return_inverse=True)
    z = widened.new_empty(uniq.shape).scatter_(0, inverse, widened[idx])
    return idx, inverse, uniq // vocab, uniq % vocab, z


def _widen_support(stats, tlog, rows, local, widened, vocab: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(stats, target logits) of each row's support with its ``widened`` targets added: MAX,
    SUM_EXP and SUM_EXP_SHIFT of the union (a row's old sums rescaled to the new max; an empty
    row's are 0), the joined targets' logits their z. Rows without one are unchanged, bit for bit."""
    idx, _, r, _, z = _unique_pairs(widened, rows, local, vocab)
    if not idx.numel():
        return stats, tlog
    stats = stats.clone()
    m, s, u = stats[:, LogprobsStat.MAX], stats[:, LogprobsStat.SUM_EXP], stats[:, LogprobsStat.SUM_EXP_SHIFT]
    m2 = m.scatter_reduce(0, r, z, "amax")
    nonempty = s > 0
    shift = torch.where(nonempty, m - m2, torch.zeros_like(m))  # <= 0; m = −inf only when empty
    scale = torch.where(nonempty, shift.exp(), torch.zeros_like(m))
    zs = z - m2[r]
    e = zs.exp()
    stats[:, LogprobsStat.SUM_EXP_SHIFT] = ((u + s * shift) * scale).index_add(0, r, e * zs)
    stats[:, LogprobsStat.SUM_EXP] = (s * scale).index_add(0, r, e)
    stats[:, LogprobsStat.MAX] = m2
    return stats, torch.where(torch.isfinite(widened), widened, tlog)


def _widened_dz(widened, rows, local, g, lse, entropy, grad_entropy, vocab: int):
    """(rows [K], columns [K], dz [K]) at the joined (row, column) pairs, the terms the kernels
    leave out (they give dz = 0 off the support): dz = Σ g of the pair's targets − G_n p −
    gH_n p (z − lse_n + H_n), p = exp(z − lse_n), G_n the row's Σ g (lse, H: the union's)."""
    idx, inverse, r, c, z = _unique_pairs(widened, rows, local, vocab)
    p = (z - lse[r]).exp()
    row_g = torch.zeros_like(lse).index_add(0, rows, g)
    dz = torch.zeros_like(z).index_add(0, inverse, g[idx]) - row_g[r] * p
    if grad_entropy is not None:
        dz = dz - grad_entropy[r] * p * (z - lse[r] + entropy[r])
    return r, c, dz


def _linear_logits(hidden, weight, bias, inv_temperature, tanh_scale: float, logits_precision: int, rows, cols):
    """(y, z) of the (row, column) pairs of the linear head as the kernels form them (the
    rounding of ``logits_precision``, the transform, 1 / T; a dot product's sum order aside)."""
    dt = inv_temperature.dtype
    h = hidden.detach().index_select(0, rows).to(dt)
    w = weight.detach().index_select(0, cols).to(dt)
    b = None if bias is None else bias.detach().index_select(0, cols).to(dt)
    precision = LogitsPrecision(logits_precision)
    if precision == LogitsPrecision.BF16:
        h, w, b = round_bf16(h), round_bf16(w), None if b is None else round_bf16(b)
    elif precision == LogitsPrecision.TF32:
        h, w = round_tf32(h), round_tf32(w)
    y = torch.einsum("kh,kh->k", h, w)
    if b is not None:
        y = y + b
    if precision == LogitsPrecision.BF16:
        y = round_bf16(y)
    inv_t = inv_temperature[rows]
    return y, (y * inv_t if tanh_scale == 0.0 else torch.tanh(y * tanh_scale) * inv_t)


@torch.library.custom_op(
    "rlvr_kernels::keep_targets_linear_bwd", mutates_args=("grad_hidden", "grad_weight", "grad_bias")
)
def _keep_targets_linear_bwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    inv_temperature: torch.Tensor,
    row_ptr: torch.Tensor,
    targets: torch.Tensor,
    grad_logp: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_entropy: Optional[torch.Tensor],
    widened: torch.Tensor,
    tanh_scale: float,
    logits_precision: int,
    grad_hidden: Optional[torch.Tensor],
    grad_weight: Optional[torch.Tensor],
    grad_bias: Optional[torch.Tensor],
) -> None:
    """Adds the joined pairs' terms to the kernels' gradients, in place (targets, grad_logp,
    widened in CSR order): dy = dz · dz/dy, straight through the rounding, then d hidden = dy · W
    and d W = dy · hidden with the operands as given, d b = dy. An op of its own, so that a
    traced backward sees no data-dependent shape."""
    rows = _csr_rows(row_ptr, hidden.shape[0])
    r, c, dz = _widened_dz(widened, rows, targets, grad_logp, lse, entropy, grad_entropy, weight.shape[0])
    head = (hidden, weight, bias, inv_temperature, tanh_scale, logits_precision)
    dt = inv_temperature.dtype
    for part in torch.arange(r.numel(), device=r.device).split(_WIDEN_CHUNK):
        rr, cc = r[part], c[part]
        y, _ = _linear_logits(*head, rr, cc)
        dy = dz[part] * inv_temperature[rr]
        if tanh_scale != 0.0:
            dy = dy * tanh_scale * (1 - torch.tanh(y * tanh_scale) ** 2)
        if grad_hidden is not None:
            grad_hidden.index_add_(0, rr, (dy[:, None] * weight.index_select(0, cc).to(dt)).to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight.index_add_(0, cc, (dy[:, None] * hidden.index_select(0, rr).to(dt)).to(grad_weight.dtype))
        if grad_bias is not None:
            grad_bias.index_add_(0, cc, dy.to(grad_bias.dtype))


@_keep_targets_linear_bwd.register_fake
def _(*args):
    return None


@torch.library.custom_op("rlvr_kernels::keep_targets_logits_bwd", mutates_args=("grad_logits",))
def _keep_targets_logits_bwd(
    targets: torch.Tensor,
    inv_temperature: torch.Tensor,
    grad_logp: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_entropy: Optional[torch.Tensor],
    widened: torch.Tensor,
    grad_logits: torch.Tensor,
) -> None:
    """The same for ``logprobs_from_logits`` (one target per row): d logits = dz / T."""
    rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
    r, c, dz = _widened_dz(widened, rows, targets, grad_logp, lse, entropy, grad_entropy, grad_logits.shape[1])
    grad_logits.index_put_((r, c), (dz * inv_temperature[r]).to(grad_logits.dtype), accumulate=True)


@_keep_targets_logits_bwd.register_fake
def _(*args):
    return None


def _csr(row_index: Optional[torch.Tensor], n: int, device) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(row_ptr [N+1], order [M] or None): the targets grouped by the hidden row that
    predicts them (a stable sort, so each row keeps its targets' order). Static shapes
    and no host sync, so it traces under torch.compile."""
    if row_index is None:
        return torch.arange(n + 1, device=device, dtype=torch.int64), None
    rows = row_index.long()
    order = torch.argsort(rows, stable=True)
    bounds = torch.arange(n + 1, device=device, dtype=torch.int64)
    return torch.searchsorted(rows.index_select(0, order), bounds), order


def _all_reduce_stats(
    stats, target_logits, group, vocab_start: int, need_sum_sq: bool, need_sum_z: bool, need_argmax: bool
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row statistics of the whole vocabulary from each shard's: one MAX all-reduce of
    the row maxima, then one SUM all-reduce of the rescaled Σexp, Σexp·(z−max), the target
    logits (each target is in exactly one shard; the others contribute 0) and, when
    requested, the rescaled Σexp² and the Σz; with ``need_argmax`` one MIN all-reduce of the
    global ids of the shards' argmax that reach the global max (the first one wins, as in
    one shard). Columns not requested stay as the kernel left them (0)."""
    m, s, u, q, zs, am = stats.unbind(-1)  # the columns, in LogprobsStat order
    m_all = m.clone()
    collectives.all_reduce(m_all, group, "max")
    # Σ exp(z−M)(z−M) = e^{m−M} Σ exp(z−m)((z−m) + (m−M)), with M the global max.
    scale = torch.exp(m - m_all)
    n = m.shape[0]
    parts = [s * scale, (u + (m - m_all) * s) * scale]
    if need_sum_sq:
        parts.append(q * scale * scale)
    if need_sum_z:
        parts.append(zs)
    packed = torch.cat([*parts, target_logits])
    collectives.all_reduce(packed, group, "sum")
    summed = list(packed[: len(parts) * n].split(n))
    s, u = summed[0], summed[1]
    q = summed[2] if need_sum_sq else q
    zs = summed[-1] if need_sum_z else zs
    if need_argmax:
        big = torch.full_like(am, float(_MAX_TOP1_VOCAB))
        am = torch.where(m == m_all, am + vocab_start, big)
        collectives.all_reduce(am, group, "min")
    return torch.stack([m_all, s, u, q, zs, am], dim=-1), packed[len(parts) * n :]


_VOCAB_HINT = "every rank passes the same hidden states, targets and options, and its own weight shard"
_VOCAB_FIELDS = (
    collectives.Field("weight.shape[0] (this rank's vocabulary shard)", agree=False),
    collectives.Field("hidden.shape[0]", hint=_VOCAB_HINT),
    collectives.Field("hidden.shape[1]", hint=_VOCAB_HINT),
    collectives.Field("targets.shape[0]", hint=_VOCAB_HINT),
    collectives.Field(
        "the options (dtype, bias, temperature, logit_scale, softcap, outputs, ignore_index, logits_precision)",
        show=False,
        hint=_VOCAB_HINT,
    ),
)


def _vocab_layout(x: Optional[_LinearInputs], ignore_index, group) -> Tuple[int, int]:
    """The handshake of the vocab-parallel path; returns (first vocabulary id of this rank's
    shard, whole vocabulary size): shards are laid out in rank order and may differ in size.
    ``x`` None: this rank failed its own checks (it joins; the caller raises its error)."""
    values = None
    if x is not None:
        temperature = "per-row" if isinstance(x.temperature, torch.Tensor) else x.temperature
        options = (
            x.hidden.dtype,
            x.bias is not None,
            temperature,
            x.logit_scale,
            x.softcap,
            sorted(x.outputs),
            int(ignore_index),
            x.logits_precision,
        )
        values = [x.vocab, x.num_rows, x.hidden.shape[1], x.targets.shape[0], collectives.fingerprint(*options)]
    device = collectives.group_device(group, None if x is None else x.weight)
    table = collectives.handshake("linear_logprobs", group, _VOCAB_FIELDS, values, device=device, check=True)
    if table is None:
        return 0, 0
    sizes = [int(v) for v in table[:, 0].tolist()]
    rank = collectives.rank(group)
    return sum(sizes[:rank]), sum(sizes)
