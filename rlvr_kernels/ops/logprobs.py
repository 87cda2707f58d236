"""``linear_logprobs`` and ``logprobs_from_logits`` (SPEC §3): validation, the
``rlvr_kernels::linear_logprobs`` / ``rlvr_kernels::logprobs_from_logits`` custom ops with
their autograd, the vocab-parallel (``process_group``) path, and dispatch to the C++ (CPU)
and Triton (CUDA) kernels.

Why the kernels return raw per-row statistics instead of log-probs: the vocab-parallel path
has to all-reduce them between the kernel and the final combine, and a shard only sees its
own slice of the vocabulary. So every kernel works on "local" columns and the combine
(lse, entropy, log-prob = target logit − lse) is a few O(N) torch ops here, shared by the
single-process op and the process-group path.

Kernel contract (both backends; C++ in csrc/logprobs.cpp, Triton in triton/logprobs.py).
"Compute dtype" is fp64 for fp64 inputs, else fp32. z = (hidden·Wᵀ + b) · inv_temperature
(row-wise), accumulated in the compute dtype whatever the input dtype.

  linear_logprobs_fwd(hidden [N,H], weight [V,H], bias [V] or None, inv_temperature [N],
                      row_ptr [N+1], sorted_targets [M], need_entropy)
      -> stats [N,3], target_logits [M]            (compute dtype)
    hidden, weight, bias: one float dtype, contiguous. inv_temperature: compute dtype.
    row_ptr: int64, non-decreasing, row_ptr[0] = 0, row_ptr[N] = M; the targets of row n
    are sorted_targets[row_ptr[n]:row_ptr[n+1]] (a CSR of the rows' targets).
    sorted_targets: int64 local vocabulary ids; a value outside [0, V) never matches any
    column (ignored targets are −1, another shard's targets are out of range) and is never
    used as an address.
    stats[n] = (max_v z, Σ_v exp(z − max), Σ_v exp(z − max)·(z − max)) over the V local
    columns; the third entry is 0 when need_entropy is False.
    target_logits[k] = z[n, sorted_targets[k]] for k in row n if that id is in [0, V), else 0.
    The target logit must come from the same rounding of z as the statistics (take it
    from the tile, not from a separate dot product), so log p = z_t − lse ≤ 0 holds.

  linear_logprobs_bwd(hidden, weight, bias, inv_temperature, row_ptr, sorted_targets,
                      sorted_grad [M], lse [N], entropy [N], grad_entropy [N] or None,
                      need_hidden, need_weight, need_bias)
      -> grad_hidden [N,H] (hidden's dtype), grad_weight [V,H] (weight's dtype),
         grad_bias [V] (bias' dtype); an output that is not needed is an empty [0] tensor.
    sorted_grad, lse, entropy, grad_entropy: compute dtype. lse and entropy are the global
    (all-shard) statistics. With p_v = exp(z_v − lse_n), G_n = Σ_{k in row n} g_k (all of
    the row's targets, matching or not — a target in another shard still pulls every
    column down) and h_n = grad_entropy[n] (0 if None):
        dz[n,v] = inv_T_n · ( Σ_{k in row n, t_k = v} g_k − G_n·p_v − h_n·p_v·(z_v − lse_n + entropy_n) )
        grad_hidden = dz·W,  grad_weight = dzᵀ·hidden,  grad_bias = Σ_n dz
    accumulated in the compute dtype. grad_weight and grad_bias are summed over rows in a
    fixed order (no atomics): bitwise-deterministic whatever the thread count.

  logits_logprobs_fwd(logits [N,V], targets [N], inv_temperature [N], need_entropy)
      -> stats [N,3], target_logits [N]
    logits: any float dtype, rows contiguous (stride(1) == 1, any row stride). targets:
    int64 local ids, out-of-range ones never match (−1 = ignored). z = logits · inv_T.
  logits_logprobs_bwd(logits, targets, inv_temperature, grad_logp [N], lse [N],
                      entropy [N], grad_entropy [N] or None) -> grad_logits [N,V]
    (logits' dtype, contiguous), dz as above with one target per row (G_n = g_n).

Every kernel: N = 0 or M = 0 gives empty outputs; V >= 1 is guaranteed by validation. A
row's forward result is bitwise independent of the other rows in the batch (fixed tiling,
no reduction across rows).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from .. import reference
from ..reference.logprobs import logprobs_from_logits as _reference_from_logits
from . import _dispatch
from ._validation import FLOAT_DTYPES, check_tensor, checks_enabled

INDEX_DTYPES = (torch.int32, torch.int64)
_Triple = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _kernels(backend: str, device: torch.device):
    """The module holding the four kernels of the contract for this backend."""
    if _dispatch.resolve_backend(backend, device) == "cpu":
        return torch.ops.rlvr_kernels_C
    from ..triton import logprobs as triton_logprobs

    return triton_logprobs


# ------------------------------------------------------------------ kernel-level ops
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
    need_entropy: bool,
    backend: str,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(stats [N,3], target_logits [M]) of the kernel contract."""
    k = _kernels(backend, hidden.device)
    return k.linear_logprobs_fwd(hidden, weight, bias, inv_temperature, row_ptr, sorted_targets, need_entropy)


@_linear_stats.register_fake
def _(
    hidden,
    weight,
    bias,
    inv_temperature,
    row_ptr,
    sorted_targets,
    need_entropy,
    backend,
):
    dt = _compute_dtype(hidden.dtype)
    return hidden.new_empty((hidden.shape[0], 3), dtype=dt), hidden.new_empty(sorted_targets.shape, dtype=dt)


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
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    backend: str,
) -> _Triple:
    """(grad_hidden, grad_weight, grad_bias) of the kernel contract."""
    k = _kernels(backend, hidden.device)
    return k.linear_logprobs_bwd(
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
        need_hidden,
        need_weight,
        need_bias,
    )


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
    need_hidden,
    need_weight,
    need_bias,
    backend,
):
    empty = hidden.new_empty((0,))
    return (
        torch.empty_like(hidden) if need_hidden else empty,
        torch.empty_like(weight) if need_weight else weight.new_empty((0,)),
        torch.empty_like(bias) if need_bias and bias is not None else weight.new_empty((0,)),
    )


# ------------------------------------------------------------------ combine (shared)
def _row_statistics(stats: torch.Tensor, vocab_size: int, need_entropy: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """lse and entropy from (max, Σexp(z−max), Σexp(z−max)(z−max)).

    entropy = lse − Σ p z = log s − u/s: no max term, so no cancellation between large
    numbers. s ≥ 1 (the max itself contributes exp(0)) and u ≤ 0, so it is ≥ 0 as
    computed; the clamp at log V only removes the last-ulp rounding of a flat row."""
    m, s, u = stats.unbind(-1)
    log_s = torch.log(s)
    lse = m + log_s
    if not need_entropy:
        return lse, torch.zeros_like(lse)
    return lse, (log_s - u / s).clamp(0.0, math.log(vocab_size))


def _target_logprobs(target_logits, lse, row_index, order, ignored) -> torch.Tensor:
    """log p_m = z_t − lse_{row(m)} in the callers' target order; 0 for ignored targets.
    z_t ≤ max ≤ lse as computed (same rounding of z), so it is ≤ 0; the clamp is a guard
    for NaN-free but degenerate inputs (±inf logits)."""
    if order is not None:
        target_logits = torch.empty_like(target_logits).index_copy_(0, order, target_logits)
    row_lse = lse if row_index is None else lse.index_select(0, row_index)
    return (target_logits - row_lse).clamp(max=0.0).masked_fill(ignored, 0.0)


def _local_sorted_targets(targets, order, ignore_index: int, vocab_start: int) -> torch.Tensor:
    """Targets in CSR order as local vocabulary ids of this shard; ignored ones → −1 (never
    a column). Another shard's targets fall outside [0, V) and match nothing here."""
    t = targets.long() if order is None else targets.long().index_select(0, order)
    local = t - vocab_start if vocab_start else t
    return torch.where(t == ignore_index, torch.full_like(local, -1), local)


def _upstream(ctx, g_logp, g_entropy, targets, order, lse) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The kernels' upstream gradients: g in CSR order (0 for ignored targets and when the
    log-probs carry no gradient) and the entropies' (None when they carry none)."""
    dt = lse.dtype
    if g_logp is None:
        g_logp = torch.zeros(targets.shape, dtype=dt, device=lse.device)
    g = g_logp.to(dt).masked_fill(targets == ctx.ignore_index, 0.0)
    g = (g if order is None else g.index_select(0, order)).contiguous()
    grad_entropy = g_entropy.to(dt).contiguous() if (g_entropy is not None and ctx.return_entropy) else None
    return g, grad_entropy


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


# ------------------------------------------------------------------ the single-process op
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
    backend: str,
) -> _Triple:
    """(logp [M], entropy [N], lse [N]) in the compute dtype; entropy is 0 unless
    ``return_entropy``. lse is returned for the backward only."""
    local = _local_sorted_targets(targets, order, ignore_index, 0)
    stats, tlog = _linear_stats(hidden, weight, bias, inv_temperature, row_ptr, local, return_entropy, backend)
    lse, entropy = _row_statistics(stats, weight.shape[0], return_entropy)
    logp = _target_logprobs(tlog, lse, row_index, order, targets == ignore_index)
    return logp, entropy, lse


@_linear_logprobs.register_fake
def _(
    hidden,
    weight,
    bias,
    targets,
    row_index,
    row_ptr,
    order,
    inv_temperature,
    ignore_index,
    return_entropy,
    backend,
):
    dt = _compute_dtype(hidden.dtype)
    n = hidden.shape[0]
    return (
        hidden.new_empty(targets.shape, dtype=dt),
        hidden.new_empty((n,), dtype=dt),
        hidden.new_empty((n,), dtype=dt),
    )


def _linear_setup_context(ctx, inputs, output):
    (
        hidden,
        weight,
        bias,
        targets,
        row_index,
        row_ptr,
        order,
        inv_t,
        ignore_index,
        return_entropy,
        backend,
    ) = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, bias, targets, row_ptr, order, inv_t, lse, entropy)
    ctx.ignore_index, ctx.return_entropy, ctx.backend = (
        ignore_index,
        return_entropy,
        backend,
    )


def _linear_backward(ctx, g_logp, g_entropy, g_lse):
    hidden, weight, bias, targets, row_ptr, order, inv_t, lse, entropy = ctx.saved_tensors
    need_h, need_w, need_b = (
        ctx.needs_input_grad[0],
        ctx.needs_input_grad[1],
        ctx.needs_input_grad[2],
    )
    if not (need_h or need_w or need_b):
        return (None,) * 11
    g, grad_entropy = _upstream(ctx, g_logp, g_entropy, targets, order, lse)
    local = _local_sorted_targets(targets, order, ctx.ignore_index, 0)
    gh, gw, gb = _linear_bwd(
        hidden,
        weight,
        bias,
        inv_t,
        row_ptr,
        local,
        g,
        lse,
        entropy,
        grad_entropy,
        need_h,
        need_w,
        need_b and bias is not None,
        ctx.backend,
    )
    return (gh if need_h else None, gw if need_w else None, gb if need_b else None) + (None,) * 8


_linear_logprobs.register_autograd(_linear_backward, setup_context=_linear_setup_context)


# ------------------------------------------------------------------ vocab-parallel path
def _all_reduce_stats(stats, target_logits, group) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row statistics of the whole vocabulary from each shard's: one MAX all-reduce of
    the row maxima, then one SUM all-reduce of the rescaled Σexp, Σexp·(z−max) and the
    target logits (each target is in exactly one shard; the others contribute 0)."""
    import torch.distributed as dist

    m, s, u = stats.unbind(-1)
    m_all = m.clone()
    dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=group)
    # Σ exp(z−M)(z−M) = e^{m−M} Σ exp(z−m)((z−m) + (m−M)), with M the global max.
    scale = torch.exp(m - m_all)
    n = m.shape[0]
    packed = torch.cat([s * scale, (u + (m - m_all) * s) * scale, target_logits])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return torch.stack([m_all, packed[:n], packed[n : 2 * n]], dim=-1), packed[2 * n :]


def _vocab_layout(weight: torch.Tensor, group) -> Tuple[int, int]:
    """(first vocabulary id of this rank's shard, whole vocabulary size): shards are laid
    out in rank order and may differ in size."""
    import torch.distributed as dist

    size = torch.tensor([weight.shape[0]], dtype=torch.int64, device=weight.device)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(t) for t in sizes]
    rank = dist.get_rank(group)
    return sum(sizes[:rank]), sum(sizes)


class _VocabParallelLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        targets,
        row_index,
        row_ptr,
        order,
        inv_t,
        ignore_index,
        return_entropy,
        backend,
        group,
        vocab_start,
        vocab_size,
    ):
        local = _local_sorted_targets(targets, order, ignore_index, vocab_start)
        stats, tlog = _linear_stats(hidden, weight, bias, inv_t, row_ptr, local, return_entropy, backend)
        stats, tlog = _all_reduce_stats(stats, tlog, group)
        lse, entropy = _row_statistics(stats, vocab_size, return_entropy)
        logp = _target_logprobs(tlog, lse, row_index, order, targets == ignore_index)
        ctx.save_for_backward(hidden, weight, bias, targets, row_ptr, order, inv_t, lse, entropy, local)
        ctx.ignore_index, ctx.return_entropy, ctx.backend, ctx.group = (
            ignore_index,
            return_entropy,
            backend,
            group,
        )
        ctx.mark_non_differentiable(lse)
        return logp, entropy, lse

    @staticmethod
    def backward(ctx, g_logp, g_entropy, g_lse):
        import torch.distributed as dist

        hidden, weight, bias, targets, row_ptr, order, inv_t, lse, entropy, local = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g, grad_entropy = _upstream(ctx, g_logp, g_entropy, targets, order, lse)
        # Every rank holds the same hidden rows, so each rank's dz·W_shard is a partial sum
        # of d hidden over the vocabulary: the matching reduction is an all-reduce.
        gh, gw, gb = _linear_bwd(
            hidden,
            weight,
            bias,
            inv_t,
            row_ptr,
            local,
            g,
            lse,
            entropy,
            grad_entropy,
            True,
            need_w,
            need_b and bias is not None,
            ctx.backend,
        )
        dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=ctx.group)
        return (
            gh if need_h else None,
            gw if need_w else None,
            gb if need_b else None,
        ) + (None,) * 11


# ------------------------------------------------------------------ logits op
@torch.library.custom_op("rlvr_kernels::logprobs_from_logits", mutates_args=())
def _from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    inv_temperature: torch.Tensor,
    ignore_index: int,
    return_entropy: bool,
    backend: str,
) -> _Triple:
    """(logp [N], entropy [N], lse [N]) from logits [N, V] (rows contiguous)."""
    ignored = targets == ignore_index
    local = torch.where(ignored, torch.full_like(targets, -1), targets)
    k = _kernels(backend, logits.device)
    stats, tlog = k.logits_logprobs_fwd(logits, local, inv_temperature, return_entropy)
    lse, entropy = _row_statistics(stats, logits.shape[1], return_entropy)
    return _target_logprobs(tlog, lse, None, None, ignored), entropy, lse


@_from_logits.register_fake
def _(logits, targets, inv_temperature, ignore_index, return_entropy, backend):
    dt = _compute_dtype(logits.dtype)
    n = logits.shape[0]
    return (
        logits.new_empty((n,), dtype=dt),
        logits.new_empty((n,), dtype=dt),
        logits.new_empty((n,), dtype=dt),
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
    backend: str,
) -> torch.Tensor:
    k = _kernels(backend, logits.device)
    return k.logits_logprobs_bwd(logits, targets, inv_temperature, grad_logp, lse, entropy, grad_entropy)


@_from_logits_bwd.register_fake
def _(logits, targets, inv_temperature, grad_logp, lse, entropy, grad_entropy, backend):
    return logits.new_empty(logits.shape)


def _from_logits_setup_context(ctx, inputs, output):
    logits, targets, inv_t, ignore_index, return_entropy, backend = inputs
    _, entropy, lse = output
    ctx.save_for_backward(logits, targets, inv_t, lse, entropy)
    ctx.ignore_index, ctx.return_entropy, ctx.backend = (
        ignore_index,
        return_entropy,
        backend,
    )


def _from_logits_backward(ctx, g_logp, g_entropy, g_lse):
    logits, targets, inv_t, lse, entropy = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return (None,) * 6
    dt = lse.dtype
    if g_logp is None:
        g_logp = torch.zeros(targets.shape, dtype=dt, device=lse.device)
    ignored = targets == ctx.ignore_index
    local = torch.where(ignored, torch.full_like(targets, -1), targets)
    g = g_logp.to(dt).masked_fill(ignored, 0.0).contiguous()
    grad_entropy = g_entropy.to(dt).contiguous() if (g_entropy is not None and ctx.return_entropy) else None
    grad = _from_logits_bwd(logits, local, inv_t, g, lse, entropy, grad_entropy, ctx.backend)
    return (grad,) + (None,) * 5


_from_logits.register_autograd(_from_logits_backward, setup_context=_from_logits_setup_context)


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
    process_group=None,
    validate: bool = True,
    backend: str = "auto",
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Log-probs of ``targets`` (and per-row entropy) straight from hidden states and the
    LM head, never materialising the ``[N, V]`` logits (SPEC §3.1).

    z_n = (hidden_n · Wᵀ + b) / T_n,  logp_m = z_{row(m), t_m} − logsumexp(z_{row(m)}),
    entropy_n = logsumexp(z_n) − Σ_v softmax(z_n)_v · z_{n,v}.

    Args:
        hidden: ``[N, H]`` hidden states (fp16/bf16/fp32/fp64). Gets a gradient.
        weight: ``[V, H]`` LM head, same dtype and device (with ``process_group``: this
            rank's vocabulary shard; shards in rank order). Gets a gradient.
        targets: ``[M]`` int32/int64 token ids in ``[0, V)``, or ``ignore_index`` (log-prob
            0, no gradient).
        row_index: ``[M]`` the hidden row predicting each target (prefix-tree branch
            points predict several); default the identity (then M must equal N).
        temperature: a float > 0 or a per-row ``[N]`` tensor (no gradient).
        bias: ``[V]`` optional LM-head bias (gets a gradient).
        return_entropy: also return the ``[N]`` entropies (with their gradient).
        process_group: vocab-parallel group (``torch.distributed``): every rank passes
            the same hidden/targets and its own weight shard; the result equals the
            unsharded op. Eager only (collectives run in the op).
        validate: check target / row_index ranges and temperatures (a host sync on
            CUDA); skipped under torch.compile (kernels never go out of bounds anyway).
        backend: ``"auto"``, or ``"reference"``, ``"cpu"``, ``"triton"``.

    Returns:
        ``logp [M]`` (fp32; fp64 for fp64 inputs), or ``(logp, entropy [N])``.
    """
    _dispatch.check_backend(backend)
    n, v = _validate_linear(hidden, weight, targets, row_index, temperature, bias, ignore_index)
    if backend == "reference":
        if process_group is not None:
            raise ValueError("process_group: the reference backend is single-process; pass backend='auto'")
        _check_values(targets, row_index, temperature, v, n, ignore_index, validate)
        return reference.linear_logprobs(
            hidden,
            weight,
            targets,
            row_index=row_index,
            temperature=temperature,
            bias=bias,
            return_entropy=return_entropy,
            ignore_index=ignore_index,
        )
    vocab_start, vocab_size = 0, v
    if process_group is not None:
        vocab_start, vocab_size = _vocab_layout(weight, process_group)
    _check_values(targets, row_index, temperature, vocab_size, n, ignore_index, validate)
    cdt = _compute_dtype(hidden.dtype)
    inv_t = _inv_temperature(temperature, n, hidden.device, cdt)
    row_ptr, order = _csr(row_index, n, hidden.device)
    rows = None if row_index is None else row_index.long()
    args = (
        hidden.contiguous(),
        weight.contiguous(),
        None if bias is None else bias.contiguous(),
        targets.long(),
        rows,
        row_ptr,
        order,
        inv_t,
        int(ignore_index),
        bool(return_entropy),
        backend,
    )
    if process_group is None:
        logp, entropy, _ = _linear_logprobs(*args)
    else:
        logp, entropy, _ = _VocabParallelLinearLogprobs.apply(*args, process_group, vocab_start, vocab_size)
    return (logp, entropy) if return_entropy else logp


def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: Union[float, torch.Tensor] = 1.0,
    return_entropy: bool = False,
    *,
    ignore_index: int = -100,
    validate: bool = True,
    backend: str = "auto",
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Log-probs of ``targets`` (and entropy) from logits that already exist (SPEC §3.2):
    one pass over each row, no ``[N, V]`` temporaries (the backward writes the logits'
    gradient and nothing else of that size).

    Args:
        logits: ``[..., V]`` (fp16/bf16/fp32/fp64), last dimension contiguous; a strided
            view that cannot be flattened to rows (e.g. ``logits[:, :-1]``) is copied once.
        targets: ``[...]`` (``logits.shape[:-1]``) int32/int64 ids in ``[0, V)`` or
            ``ignore_index`` (log-prob 0, no gradient).
        temperature: a float > 0 or a tensor broadcastable to ``targets`` (no gradient).
        return_entropy: also return the entropies (with their gradient).
        validate, backend: as in :func:`linear_logprobs`.

    Returns:
        ``logp`` shaped like ``targets`` (fp32; fp64 for fp64 logits), or ``(logp, entropy)``.
    """
    _dispatch.check_backend(backend)
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES)
    check_tensor("targets", targets, dtypes=INDEX_DTYPES)
    if logits.dim() < 1 or tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"targets: expected shape {tuple(logits.shape[:-1])} (logits.shape[:-1]), "
            f"got {tuple(targets.shape)} with logits {tuple(logits.shape)}"
        )
    _same_device("targets", targets, logits, "logits")
    v = logits.shape[-1]
    if v < 1:
        raise ValueError(
            f"logits: expected a vocabulary of at least 1 (last dimension), got shape {tuple(logits.shape)}"
        )
    _check_ignore_index(ignore_index)
    lead = tuple(targets.shape)
    n = targets.numel()
    temp_rows = _check_temperature(temperature, lead, logits)
    if backend == "reference":
        _check_values(targets.reshape(-1), None, temperature, v, n, ignore_index, validate)
        return _reference_from_logits(logits, targets, temperature, return_entropy, ignore_index=ignore_index)
    _check_values(targets.reshape(-1), None, temperature, v, n, ignore_index, validate)
    rows = logits.reshape(n, v)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    inv_t = _inv_temperature(temp_rows, n, logits.device, _compute_dtype(logits.dtype))
    logp, entropy, _ = _from_logits(
        rows, targets.reshape(-1).long(), inv_t, int(ignore_index), bool(return_entropy), backend
    )
    logp = logp.reshape(lead)
    return (logp, entropy.reshape(lead)) if return_entropy else logp


# ------------------------------------------------------------------ validation
def _same_device(name, t, ref, ref_name) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name}: expected a tensor on {ref.device} (where {ref_name} lives), got {t.device}")


def _check_ignore_index(ignore_index) -> None:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")


def _check_temperature(temperature, rows_shape, like: torch.Tensor):
    """Static checks; returns the temperature as a float or a tensor of ``rows_shape``."""
    if isinstance(temperature, torch.Tensor):
        check_tensor("temperature", temperature, dtypes=FLOAT_DTYPES)
        _same_device("temperature", temperature, like, "hidden" if like.dim() == 2 else "logits")
        try:
            return torch.broadcast_to(temperature.detach(), rows_shape)
        except RuntimeError:
            raise ValueError(
                f"temperature: expected a float or a tensor broadcastable to {tuple(rows_shape)} "
                f"(one per row), got shape {tuple(temperature.shape)}"
            ) from None
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature: expected a float or a tensor, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature: expected a finite value > 0, got {temperature}")
    return float(temperature)


def _inv_temperature(temperature, n: int, device, dtype) -> torch.Tensor:
    if isinstance(temperature, torch.Tensor):
        return (1.0 / temperature.to(dtype)).reshape(n).contiguous()
    return torch.full((n,), 1.0 / temperature, device=device, dtype=dtype)


def _validate_linear(hidden, weight, targets, row_index, temperature, bias, ignore_index) -> Tuple[int, int]:
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES, ndim=(2,))
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=(2,))
    n, h = hidden.shape
    v = weight.shape[0]
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: expected dtype {hidden.dtype} (like hidden), got {weight.dtype}; cast one of them")
    _same_device("weight", weight, hidden, "hidden")
    if weight.shape[1] != h:
        raise ValueError(f"weight: expected shape (V, {h}) (H = hidden.shape[1]), got {tuple(weight.shape)}")
    if v < 1:
        raise ValueError(f"weight: expected at least one vocabulary row, got shape {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES)
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias: expected dtype {weight.dtype} (like weight), got {bias.dtype}")
        _same_device("bias", bias, hidden, "hidden")
        if tuple(bias.shape) != (v,):
            raise ValueError(f"bias: expected shape ({v},) (V = weight.shape[0]), got {tuple(bias.shape)}")
    check_tensor("targets", targets, dtypes=INDEX_DTYPES, ndim=(1,))
    _same_device("targets", targets, hidden, "hidden")
    m = targets.shape[0]
    if row_index is None:
        if m != n:
            raise ValueError(
                f"targets: expected shape ({n},) (one per hidden row; pass row_index to predict "
                f"several targets from one row), got {tuple(targets.shape)}"
            )
    else:
        check_tensor("row_index", row_index, dtypes=INDEX_DTYPES, ndim=(1,))
        _same_device("row_index", row_index, hidden, "hidden")
        if row_index.shape[0] != m:
            raise ValueError(f"row_index: expected shape ({m},) (one per target), got {tuple(row_index.shape)}")
    _check_ignore_index(ignore_index)
    _check_temperature(temperature, (n,), hidden)
    return n, v


def _check_values(
    targets,
    row_index,
    temperature,
    vocab_size: int,
    n: int,
    ignore_index: int,
    validate: bool,
):
    """Range checks that read the data (one host sync each on CUDA)."""
    if not checks_enabled(validate):
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
    if isinstance(temperature, torch.Tensor) and temperature.numel():
        t = temperature.detach()
        if not bool((torch.isfinite(t) & (t > 0)).all()):
            raise ValueError(f"temperature: expected finite values > 0, got min {float(t.min())}")
