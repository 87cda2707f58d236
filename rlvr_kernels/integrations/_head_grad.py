"""The LM head of a logit-free training step with the loss's gradient formed in the forward.

A logit-free step through :func:`rlvr_kernels.linear_logprobs` runs four ``[rows, H] x [H, V]``
GEMMs: the forward's logits, and in the backward the logits again, the hidden states' gradient
and the head's. Where the step's loss is *separable over tokens* (a token's gradient depends on
its own log-prob and entropy and on data fixed before the step: the clip-family policy losses
under any of the linear aggregations, a per-token KL, an entropy bonus), a row's gradient is
known as soon as its log-prob is. :func:`head_logprobs` then takes the rows a chunk at a time;
while a chunk's logits exist (``[chunk, V]``, never all of them):

1. its log-probs (and entropies) are read off them (:func:`rlvr_kernels.logprobs_from_logits`,
   with the head options the caller passes);
2. the caller's ``probe`` evaluates the step's loss on the log-probs known so far (zeros where
   not yet known) and returns its gradient; the chunk's rows of it are kept;
3. the logits' gradient, and from it the chunk's hidden-state gradient and its share of the
   head's gradient, are formed: three GEMMs in all instead of four. Without head options the
   logits' gradient is written over the logits (:func:`rlvr_kernels.ops.logprobs.
   logprobs_from_logits_grad_`): the chunks share one ``[chunk, V]`` buffer and nothing else
   of that size.

The backward returns those gradients. It is exact whatever the loss: it compares the gradient
it is handed with the one the probe gave and runs the rows where the two differ (any bit)
through the head again with the difference (the four-GEMM schedule, on those rows only). A
loss that is not separable, a probe that is wrong or a backward of a scaled loss cost time,
never correctness; :data:`STATS` counts the rows run again (a caller that turns this on only
for separable losses expects none, and its tests assert it). Finding those rows reads the
difference on the host: one synchronisation per backward on a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from ..ops.logprobs import linear_logprobs, logprobs_from_logits, logprobs_from_logits_grad_
from ._patch import record, uncounted

__all__ = [
    "CHUNK_ELEMENTS",
    "MIN_MACS",
    "STATS",
    "check_setting",
    "chosen",
    "head_logprobs",
    "loss_gradient",
    "step_head",
]

# Logits held at once: chunk rows × vocabulary ≤ this (64 MiB of fp32), at least one row.
CHUNK_ELEMENTS = 1 << 24

# ``grad_in_forward=None`` of the integrations ("auto"): formed in the forward where that was
# measured faster, the rows on the CPU and at least this many multiply-adds in each of the head's
# GEMMs (below, the loss evaluations cost more than the GEMM saved; on a GPU, where the GEMM is
# far cheaper than a loss evaluation's launches and host reads, it has not been measured).
MIN_MACS = 1 << 30

# The profiler range of the forward (every gradient of the head is formed in it), named with the
# rows and the vocabulary: "<PROFILE_RANGE>[<rows>x<vocab>]".
PROFILE_RANGE = "rlvr_kernels.head_grad_in_forward"

# Counters (for tests and benchmark notes): steps served, rows whose gradient was formed in the
# forward, rows the backward ran through the head again.
STATS: Dict[str, int] = {"steps": 0, "rows": 0, "rerun_rows": 0}

# probe(logp [N], entropy [N] or None) -> (∂loss/∂logp [N], ∂loss/∂entropy [N] or None)
Probe = Callable[[torch.Tensor, Optional[torch.Tensor]], Tuple[torch.Tensor, Optional[torch.Tensor]]]


def _chunks(n: int, vocab: int, chunk_rows: Optional[int]) -> List[Tuple[int, int]]:
    """Row ranges of at most ``chunk_rows`` (default: CHUNK_ELEMENTS // vocab) rows, as even as
    that allows (the buffer is the first chunk's size, the memory the head holds)."""
    most = chunk_rows if chunk_rows is not None else max(1, CHUNK_ELEMENTS // max(vocab, 1))
    if n == 0:
        return []
    count = -(-n // most)
    bounds = [n * k // count for k in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _temperature_rows(temperature: Any, lo: int, hi: int) -> Any:
    return temperature[lo:hi] if isinstance(temperature, torch.Tensor) and temperature.dim() > 0 else temperature


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the chunks' GEMMs and accumulators compute in: fp32 (fp64 for fp64 inputs), as
    ``linear_logprobs`` accumulates; a bf16 / fp16 head's products are exact in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Grads:
    """The gradients of the head's inputs, accumulated chunk by chunk in the compute dtype and
    rounded to the inputs' dtypes once, at the end."""

    def __init__(self, rows: Optional[torch.Tensor], need_weight: bool):
        self.rows = rows
        self.weight: Optional[torch.Tensor] = None
        self.need_weight = need_weight

    @classmethod
    def fresh(cls, rows: torch.Tensor, need_rows: bool, need_weight: bool, dtype: torch.dtype) -> "_Grads":
        """For the forward, whose chunks cover every row once: the rows' gradient written chunk by
        chunk (never read before), the head's made by the first chunk's GEMM (no zero fill)."""
        return cls(torch.empty(rows.shape, dtype=dtype, device=rows.device) if need_rows else None, need_weight)

    def add(self, d_logits: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, where) -> None:
        if self.rows is not None:
            if isinstance(where, slice):  # the forward's chunks: disjoint, written once
                torch.mm(d_logits, weight, out=self.rows[where])
            else:
                self.rows.index_add_(0, where, d_logits @ weight)
        if self.need_weight:
            if self.weight is None:
                self.weight = d_logits.t() @ rows
            else:
                self.weight.addmm_(d_logits.t(), rows)

    def result(self, rows: torch.Tensor, weight: torch.Tensor) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        w = self.weight
        if w is None and self.need_weight:  # no chunk (no rows) or no gradient reached the head
            w = torch.zeros_like(weight)
        r = self.rows
        return (
            None if r is None else r.to(rows.dtype),
            None if w is None else w.to(weight.dtype),
        )


def _chunk_pass(
    rows: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: Any,
    entropy: bool,
    head: Dict[str, Any],
    backend: str,
    grad_of: Callable[[torch.Tensor, Optional[torch.Tensor]], Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]],
    grads: _Grads,
    where,
    buffer: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One chunk (``rows`` and ``weight`` in the compute dtype): its logits (into the first rows
    of ``buffer`` when it has enough: one allocation for the chunks), its log-probs (entropies),
    then the logits' gradient for the gradients ``grad_of`` gives, added to ``grads``. Without
    head keywords the gradient is written over the logits (the chunk's one ``[rows, V]``
    tensor). Returns the chunk's log-probs (entropies)."""
    with torch.no_grad():
        if buffer is not None and buffer.shape[0] >= rows.shape[0]:
            logits = torch.mm(rows, weight.t(), out=buffer[: rows.shape[0]])
        else:
            logits = rows @ weight.t()
    if not head or head == {"logits_precision": "fp32"}:
        res, formed = logprobs_from_logits_grad_(logits, labels, grad_of, temperature, entropy, backend=backend)
        logp, ent, d_logits = res.logp, res.entropy, (logits if formed else None)
    else:
        with torch.enable_grad():
            logits.requires_grad_()
            res = logprobs_from_logits(logits, labels, temperature, entropy, backend=backend, **head)
            logp = res.logp.detach()
            ent = res.entropy.detach() if entropy else None
            g_logp, g_ent = grad_of(logp, ent)
            outs, seeds = [], []
            if g_logp is not None:
                outs.append(res.logp)
                seeds.append(g_logp.to(res.logp.dtype))
            if entropy and g_ent is not None:
                outs.append(res.entropy)
                seeds.append(g_ent.to(res.entropy.dtype))
            d_logits = torch.autograd.grad(outs, [logits], seeds)[0] if outs else None
    with torch.no_grad():  # the inputs require grad: no graph of the gradient's own GEMMs
        if d_logits is not None:
            grads.add(d_logits, rows, weight, where)
        elif grads.rows is not None and isinstance(where, slice):
            grads.rows[where].zero_()  # no gradient reached these rows
    return logp, ent


class _HeadGradInForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weight, labels, temperature, entropy, head, backend, probe, chunk_rows):
        n = rows.shape[0]
        dtype = _compute_dtype(rows.dtype)
        w = weight.to(dtype)  # (no copy for an fp32 head)
        grads = _Grads.fresh(rows, ctx.needs_input_grad[0], ctx.needs_input_grad[1], dtype)
        logp_all = torch.zeros(n, dtype=dtype, device=rows.device)
        ent_all = torch.zeros_like(logp_all) if entropy else None
        g_logp_all = torch.zeros_like(logp_all)
        g_ent_all = torch.zeros_like(logp_all) if entropy else None
        chunks = _chunks(n, weight.shape[0], chunk_rows)
        buffer = (
            torch.empty((chunks[0][1], weight.shape[0]), dtype=dtype, device=rows.device) if len(chunks) > 1 else None
        )
        for lo, hi in chunks:

            def grad_of(logp, ent, lo=lo, hi=hi):
                logp_all[lo:hi] = logp
                if entropy:
                    ent_all[lo:hi] = ent
                g_logp, g_ent = probe(logp_all.clone(), ent_all.clone() if entropy else None)
                g_l = None if g_logp is None else g_logp[lo:hi]
                g_e = None if not entropy or g_ent is None else g_ent[lo:hi]
                if g_l is not None:
                    g_logp_all[lo:hi] = g_l
                if g_e is not None:
                    g_ent_all[lo:hi] = g_e
                return g_l, g_e

            _chunk_pass(
                rows[lo:hi].to(dtype), w, labels[lo:hi], _temperature_rows(temperature, lo, hi), entropy, head,
                backend, grad_of, grads, slice(lo, hi), buffer,
            )  # fmt: skip
        del buffer, w
        ctx.grads = grads  # rounded to the inputs' dtypes in the backward, once
        ctx.predicted = (g_logp_all, g_ent_all)
        ctx.save_for_backward(rows, weight, labels, temperature if isinstance(temperature, torch.Tensor) else None)
        ctx.temperature = None if isinstance(temperature, torch.Tensor) else temperature
        ctx.entropy, ctx.head, ctx.backend, ctx.chunk_rows = entropy, head, backend, chunk_rows
        STATS["steps"] += 1
        STATS["rows"] += n
        return (logp_all, ent_all) if entropy else (logp_all,)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logp, *g_rest):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError(
                "rlvr_kernels' LM head with the gradient formed in the forward: a second backward through it "
                "(retain_graph=True) is not supported"
            )
        ctx.grads = None  # released with this backward (the graph may outlive it)
        rows, weight, labels, t_rows = ctx.saved_tensors
        temperature = t_rows if t_rows is not None else ctx.temperature
        p_logp, p_ent = ctx.predicted
        ctx.predicted = None
        delta = (g_logp if g_logp is not None else torch.zeros_like(p_logp)) - p_logp
        differs = delta != 0
        d_ent = None
        if ctx.entropy:
            g_ent = g_rest[0] if g_rest and g_rest[0] is not None else torch.zeros_like(p_ent)
            d_ent = g_ent - p_ent
            differs |= d_ent != 0
        idx = differs.nonzero(as_tuple=True)[0]
        if idx.numel():
            STATS["rerun_rows"] += int(idx.numel())
            dtype = _compute_dtype(rows.dtype)
            w = weight.to(dtype)
            for lo, hi in _chunks(idx.numel(), weight.shape[0], ctx.chunk_rows):
                sel = idx[lo:hi]
                t = temperature[sel] if isinstance(temperature, torch.Tensor) and temperature.dim() > 0 else temperature

                def grad_of(_logp, _ent, sel=sel):
                    return delta[sel], (d_ent[sel] if d_ent is not None else None)

                _chunk_pass(
                    rows[sel].to(dtype), w, labels[sel], t, ctx.entropy, ctx.head, ctx.backend, grad_of, grads, sel
                )
        d_rows, d_weight = grads.result(rows, weight)
        return d_rows, d_weight, None, None, None, None, None, None, None


def check_setting(value: Any) -> Optional[bool]:
    """An integration's ``grad_in_forward``: True, False or None (auto, :func:`chosen`)."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"grad_in_forward: expected a bool or None (auto), got {type(value).__name__}")
    return value


def chosen(setting: Optional[bool], rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a step whose loss is separable forms the head's gradient in the forward:
    ``setting`` itself when it is a bool; None (auto): the rows on the CPU and at least
    :data:`MIN_MACS` multiply-adds per GEMM."""
    if setting is not None:
        return setting
    return rows.device.type == "cpu" and rows.shape[0] * rows.shape[1] * weight.shape[0] >= MIN_MACS


def head_logprobs(
    rows: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: Any = 1.0,
    entropy: bool = False,
    probe: Probe,
    head: Optional[Dict[str, Any]] = None,
    backend: str = "auto",
    chunk_rows: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log-probs ``[N]``, entropies ``[N]`` or None) of ``labels`` under ``rows @ weight.T /
    temperature``, with their gradients formed in the forward from ``probe`` (module docstring).

    ``rows`` ``[N, H]`` and ``weight`` ``[V, H]`` in the head's dtype (the chunks' GEMMs multiply
    them in fp32, fp64 for fp64 inputs, and accumulate there, as ``linear_logprobs`` does; a bf16
    head is copied to fp32 once per call); ``temperature`` a float or ``[N]``; ``head``: the head
    keywords of :func:`rlvr_kernels.logprobs_from_logits` (``logits_precision``, a sampling
    support). ``probe(logp, entropy)`` evaluates the step's loss at full-length log-probs (and
    entropies) and returns its gradient with respect to them (None: no gradient), without side
    effects the step would see. Log-probs and entropies come back in fp32 (fp64 for fp64 rows).
    """
    if rows.dim() != 2 or weight.dim() != 2 or rows.shape[1] != weight.shape[1]:
        raise ValueError(f"rows, weight: expected [N, H] and [V, H], got {tuple(rows.shape)} and {tuple(weight.shape)}")
    if labels.shape != (rows.shape[0],):
        raise ValueError(f"labels: expected [{rows.shape[0]}], got {tuple(labels.shape)}")
    if not callable(probe):
        raise TypeError("probe: expected a callable")
    with torch.profiler.record_function(f"{PROFILE_RANGE}[{rows.shape[0]}x{weight.shape[0]}]"):
        out = _HeadGradInForward.apply(
            rows, weight, labels, temperature, bool(entropy), dict(head or {}), backend, probe, chunk_rows
        )
    return (out[0], out[1]) if entropy else (out[0], None)


def loss_gradient(
    logp: torch.Tensor, entropy: Optional[torch.Tensor], loss_of: Callable[..., torch.Tensor], *contexts
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """What a probe returns: the gradient of ``loss_of(logp, entropy)`` (a scalar) with respect to
    the two (None: no gradient), evaluated on detached copies with gradients on, the calls of the
    patched entry points not counted (they are not the step's own), inside ``contexts``."""
    leaves = [logp.detach().requires_grad_()]
    if entropy is not None:
        leaves.append(entropy.detach().requires_grad_())
    with contextlib.ExitStack() as stack:
        for context in (torch.enable_grad(), uncounted(), *contexts):
            stack.enter_context(context)
        loss = loss_of(leaves[0], leaves[1] if entropy is not None else None)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return grads[0], (grads[1] if entropy is not None else None)


def _schedulable(head: Dict[str, Any]) -> bool:
    """Whether the chunks can reproduce ``linear_logprobs`` with these head keywords: not with
    ``logits_precision="tf32"`` (it rounds the GEMM's operands, which logprobs_from_logits has
    not) nor a per-row tensor among them (a sampling support or filter per row)."""
    return head.get("logits_precision", "fp32") != "tf32" and not any(
        isinstance(v, torch.Tensor) for v in head.values()
    )


def step_head(
    rows: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: Any,
    entropy: bool,
    probe: Optional[Probe],
    setting: Optional[bool],
    head: Dict[str, Any],
    backend: str,
    counted_as: str,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The head of an integration's logit-free step: :func:`head_logprobs` where the step gives a
    ``probe`` (its loss is separable), a gradient is wanted, the head keywords can be reproduced
    chunk by chunk and :func:`chosen` says so for ``setting`` (counted as ``counted_as``), else
    :func:`rlvr_kernels.linear_logprobs` and its backward (the same numbers). (log-probs,
    entropies or None)."""
    needs_grad = torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad)
    if probe is not None and needs_grad and _schedulable(head) and chosen(setting, rows, weight):
        record(counted_as)
        return head_logprobs(
            rows, weight, labels, temperature=temperature, entropy=entropy, probe=probe, head=head, backend=backend
        )
    res = linear_logprobs(
        rows, weight, labels, temperature=temperature, return_entropy=entropy, backend=backend, **head
    )
    return res.logp, res.entropy
