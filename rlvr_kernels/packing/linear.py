"""Linear-attention layers on a ``TreePack``: the causal convolution and the gated delta rule
(Gated DeltaNet) along each sample's own root path.

The definition is ``rlvr_kernels/reference/packing_linear.py``: a segment's recurrence starts
from the state its parent segment ended with, its convolution reads the last K - 1 inputs of
its path, and siblings never see each other. Here:

- :func:`tree_causal_conv1d` gathers, for every position, the K - 1 positions before it on its
  path (K - 1 pointer jumps over ``[N]``: within the segment, then the parent's last tokens)
  and takes the depthwise convolution over that ``[N, K, C]`` window: one pass, any device.
- :func:`tree_gated_delta_rule` runs the segments of one depth together, depth by depth, each
  starting from its parent's final state (``[B_d, H, Dk, Dv]`` gathered from the previous
  depth's final states, so gradients flow back through them to the parents):
  ``backend="torch"`` pads the segments of a depth to their longest and runs
  :func:`chunked_gated_delta_rule` (the chunked WY form on PyTorch ops, fp32 or fp64; the
  padded steps have g = 0, β = 0 and zero q/k/v, so the state passes them unchanged and the
  final state is each segment's own); ``backend="fla"`` runs flash-linear-attention's
  ``chunk_gated_delta_rule`` on the depth's segments as one variable-length batch
  (``cu_seqlens``, per-sequence ``initial_state``, ``output_final_state``), no padding.
  ``"auto"`` is ``"fla"`` on CUDA and ``"torch"`` elsewhere.

The schedule (segment depths, the padded gather per depth) is read on the host once per call.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "torch", "fla")

_TRL_KWARGS = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")


@dataclasses.dataclass(frozen=True)
class _Level:
    segments: torch.Tensor  # [B] segment ids of this depth
    parent_rows: Optional[torch.Tensor]  # [B] row of each parent in the previous depth (None at depth 0)
    index: torch.Tensor  # [B, L] packed positions, padded with 0
    valid: torch.Tensor  # [B, L] bool
    lengths: List[int]


@dataclasses.dataclass(frozen=True)
class SegmentTree:
    """The segments of a packed row and their parents: ``cu_seqlens [S+1]`` (DFS pre-order
    segment boundaries), ``parent [S]`` (-1 for a root), on the row's device."""

    cu_seqlens: torch.Tensor
    parent: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1]) if self.cu_seqlens.numel() else 0

    @classmethod
    def from_pack(cls, pack) -> "SegmentTree":
        if isinstance(pack, SegmentTree):
            return pack
        missing = [n for n in ("tree_cu_seqlens_q", "segment_parent") if not hasattr(pack, n)]
        if missing:
            raise TypeError(f"tree_pack: expected a TreePack, got {type(pack).__name__} (no {', '.join(missing)})")
        return cls(pack.tree_cu_seqlens_q.long(), pack.segment_parent.long())

    @classmethod
    def from_trl(cls, tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k) -> "SegmentTree":
        """The tree of TRL's keywords: a segment's path ends with its own tokens, so the path
        entry just before them is its parent's last token (none at a root)."""
        cu_q, cu_k, kv = tree_cu_seqlens_q.long(), tree_cu_seqlens_k.long(), tree_kv_index.long()
        seg_len, path_len = cu_q.diff(), cu_k.diff()
        if kv.numel() == 0:
            return cls(cu_q, torch.full_like(seg_len, -1))
        owner = torch.repeat_interleave(torch.arange(seg_len.numel(), device=kv.device), seg_len)
        before = kv[(cu_k[1:] - seg_len - 1).clamp(min=0)]  # the path entry before the segment's own tokens
        parent = torch.where(path_len > seg_len, owner[before], -1)
        return cls(cu_q, parent)

    def predecessors(self) -> torch.Tensor:
        """``[N]`` int64: the position before each position on its path, -1 at a root's first."""
        cu, parent = self.cu_seqlens, self.parent
        n = self.num_tokens
        seg_len = cu.diff()
        owner = torch.repeat_interleave(torch.arange(seg_len.numel(), device=cu.device), seg_len, output_size=n)
        pos = torch.arange(n, device=cu.device)
        first = pos == cu[:-1][owner]
        par = parent[owner]
        from_parent = torch.where(par >= 0, cu[1:][par.clamp(min=0)] - 1, -1)
        return torch.where(first, from_parent, pos - 1)

    def levels(self) -> List[_Level]:
        """Segments grouped by depth (host read of the parents and lengths)."""
        parent = self.parent.tolist()
        lengths = self.cu_seqlens.diff().tolist()
        starts = self.cu_seqlens[:-1].tolist()
        depth, row = [], []
        by_depth: List[List[int]] = []
        for s, p in enumerate(parent):
            if p >= s:
                raise ValueError(f"tree_pack: segment {s} has parent {p}; segments must come parents first")
            d = 0 if p < 0 else depth[p] + 1
            depth.append(d)
            if d == len(by_depth):
                by_depth.append([])
            row.append(len(by_depth[d]))
            by_depth[d].append(s)
        dev = self.cu_seqlens.device
        out = []
        for d, segs in enumerate(by_depth):
            lens = [lengths[s] for s in segs]
            width = max(lens)
            offs = torch.arange(width)
            index = torch.tensor([starts[s] for s in segs])[:, None] + offs[None, :]
            valid = offs[None, :] < torch.tensor(lens)[:, None]
            parent_rows = None if d == 0 else torch.tensor([row[parent[s]] for s in segs], device=dev)
            out.append(
                _Level(torch.tensor(segs, device=dev), parent_rows, index.where(valid, 0).to(dev), valid.to(dev), lens)
            )
        return out


def segment_tree(kwargs) -> Optional[SegmentTree]:
    """The tree a model call carries: ``tree_pack=`` (a ``TreePack``) or TRL's keywords; None
    if the call carries neither."""
    pack = kwargs.get("tree_pack")
    if pack is not None:
        return SegmentTree.from_pack(pack)
    if all(kwargs.get(k) is not None for k in _TRL_KWARGS):
        return SegmentTree.from_trl(*(kwargs[k] for k in _TRL_KWARGS))
    return None


# ----------------------------------------------------------------------------- convolution


def tree_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tree,
    activation: Optional[str] = None,
) -> torch.Tensor:
    """Depthwise causal convolution along each position's root path: x [N, C], weight [C, K]
    (tap K-1 the position itself), bias [C] or None, activation None or ``"silu"``
    (``"swish"``) -> [N, C]. Positions before a root read zeros."""
    t = SegmentTree.from_pack(tree)
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation: the tree convolution takes None or 'silu', got {activation!r}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x, weight: expected [N, C] and [C, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[0] != t.num_tokens:
        raise ValueError(f"x: the tree has {t.num_tokens} tokens, got {x.shape[0]}")
    K = weight.shape[1]
    prev = t.predecessors()
    cols = [torch.arange(x.shape[0], device=x.device)]
    for _ in range(K - 1):  # column j: the position j steps back on the path
        c = cols[-1]
        cols.append(torch.where(c >= 0, prev[c.clamp(min=0)], -1))
    index = torch.stack(cols[::-1], dim=1)  # [N, K], tap order
    padded = torch.cat([x.new_zeros(1, x.shape[1]), x])  # row 0 reads as "before the root"
    window = padded[index + 1]  # [N, K, C]
    y = torch.einsum("nkc,ck->nc", window, weight.to(x.dtype))
    if bias is not None:
        y = y + bias.to(x.dtype)
    return F.silu(y) if activation is not None else y


# ----------------------------------------------------------------------------- gated delta rule


def tree_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    tree,
    *,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
    backend: str = "auto",
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule on the tree: q, k [N, H, Dk], v [N, H, Dv], g, beta [N, H] ->
    (o [N, H, Dv] in v's dtype, final state of every segment [S, H, Dk, Dv] fp32).
    Differentiable, through the states too."""
    t = SegmentTree.from_pack(tree)
    if backend not in BACKENDS:
        raise ValueError(f"tree_linear_backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "fla" if q.device.type == "cuda" else "torch"
    n = t.num_tokens
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k, v: expected [N, H, Dk], [N, H, Dk], [N, H, Dv]; got {q.shape}, {k.shape}, {v.shape}")
    if g.shape != q.shape[:2] or beta.shape != q.shape[:2]:
        raise ValueError(f"g, beta: expected [N, H] = {tuple(q.shape[:2])}, got {tuple(g.shape)}, {tuple(beta.shape)}")
    if q.shape[0] != n:
        raise ValueError(f"q: the tree has {n} tokens, got {q.shape[0]}")
    H, Dk, Dv = q.shape[1], q.shape[2], v.shape[2]
    if n == 0:
        zero = (q.sum() + k.sum() + v.sum() + g.sum() + beta.sum()) * 0  # keeps the graph
        return v.new_zeros(0, H, Dv) + zero, q.new_zeros(t.parent.numel(), H, Dk, Dv, dtype=torch.float32)
    run = _fla_level if backend == "fla" else _torch_level
    if backend == "fla":
        fla = _fla_kernel(q.device)
    else:
        fla = None
    if use_qk_l2norm:  # once for the row, as the kernels do per token
        q, k = _l2norm(q), _l2norm(k)
    scale = Dk**-0.5 if scale is None else float(scale)
    outs, positions, finals = [], [], []
    state = None
    for level in t.levels():
        init = None if level.parent_rows is None else state.index_select(0, level.parent_rows)
        o, state = run(fla, q, k, v, g, beta, level, init, scale, chunk_size)
        outs.append(o)
        positions.append(level.index[level.valid])
        finals.append((level.segments, state))
    order = torch.cat(positions)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=order.device))
    o = torch.cat(outs).index_select(0, inverse)
    segs = torch.cat([s for s, _ in finals])
    states = torch.cat([st for _, st in finals])
    inv_s = torch.empty_like(segs).scatter_(0, segs, torch.arange(segs.numel(), device=segs.device))
    return o.to(v.dtype), states.index_select(0, inv_s)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # The reference's l2norm (not imported: the package's fast paths never load the reference).
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _torch_level(fla, q, k, v, g, beta, level: _Level, init, scale, chunk_size):
    """One depth on PyTorch ops: the segments padded to the longest, one chunked call."""
    idx, valid = level.index, level.valid
    m = valid[..., None]

    def take(x):  # [B, L, H, ...] with zeros on the padded steps
        y = x[idx]
        return y.masked_fill(~(m[..., None] if y.dim() == 4 else m), 0)

    dtype = torch.promote_types(v.dtype, torch.float32)
    o, final = chunked_gated_delta_rule(
        *(take(x).to(dtype) for x in (q, k, v, g, beta)), initial_state=init, scale=scale, chunk_size=chunk_size
    )
    return o[valid], final


def chunked_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, scale: float, chunk_size: int = 64):
    """The gated delta rule over a batch of equal-length sequences, chunk by chunk (the WY
    form): q, k [B, L, H, Dk], v [B, L, H, Dv], g, beta [B, L, H], initial_state
    [B, H, Dk, Dv] or None -> (o [B, L, H, Dv], final state [B, H, Dk, Dv]), in the inputs'
    dtype (fp32 or fp64).

    Within a chunk, with γ the running sum of g from the chunk's start and S₀ the state it
    starts from, the rule's updates u_t = β_t (v_t − (e^{g_t} S_{t−1})ᵀ k_t) solve the unit
    lower-triangular system (I + A) U = β V − β e^γ K S₀, A_tj = β_t e^{γ_t−γ_j} k_t·k_j
    (j < t); then o_t = scale·(e^{γ_t} S₀ᵀ q_t + Σ_{j≤t} e^{γ_t−γ_j} (q_t·k_j) u_j) and the
    chunk ends in e^{γ_C} S₀ + Σ_j e^{γ_C−γ_j} k_j u_jᵀ. Steps with β = 0, g = 0 and k = 0
    leave the state as it was (the padding)."""
    B, L, H, Dk = q.shape
    Dv = v.shape[-1]
    C = max(1, min(chunk_size, L))
    pad = (-L) % C
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2) for x in (q, k, v))  # [B, H, L', D]
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(1, 2) for x in (g, beta))  # [B, H, L']
    n = (L + pad) // C
    q, k, v = (x.reshape(B, H, n, C, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, C), beta.reshape(B, H, n, C)
    gamma = g.cumsum(-1)
    diff = gamma[..., :, None] - gamma[..., None, :]  # γ_t − γ_j
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = diff.masked_fill(~lower, float("-inf")).exp()  # e^{γ_t−γ_j}, j <= t; 0 above
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    a = (beta[..., None] * decay * (k @ k.transpose(-1, -2))).masked_fill(lower.logical_not() | eye.bool(), 0)
    system = eye + a
    rhs = torch.cat([beta[..., None] * v, (beta * gamma.exp())[..., None] * k], dim=-1)
    # The inverse of the unit triangular system, then one product: on CPU a batched
    # triangular solve against the [C, C] identity is several times faster than against the
    # wider right-hand side (measured, torch 2.13), and it is the same forward substitution.
    inverse = torch.linalg.solve_triangular(system, eye.expand_as(system), upper=False, unitriangular=True)
    solved = inverse @ rhs
    u0, w = solved[..., :Dv], solved[..., Dv:]  # U = u0 − w S₀
    attn = (q @ k.transpose(-1, -2)) * decay  # [B, H, n, C, C]
    qg = q * gamma.exp()[..., None]
    kg = k * (gamma[..., -1:] - gamma).exp()[..., None]
    end = gamma[..., -1].exp()  # [B, H, n]
    state = q.new_zeros(B, H, Dk, Dv) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for i in range(n):
        u = u0[:, :, i] - w[:, :, i] @ state
        outs.append(qg[:, :, i] @ state + attn[:, :, i] @ u)
        state = state * end[:, :, i, None, None] + kg[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).reshape(B, H, n * C, Dv)[:, :, :L] * scale
    return o.transpose(1, 2), state


def _fla_level(fla, q, k, v, g, beta, level: _Level, init, scale, chunk_size):
    """One depth on flash-linear-attention: the segments as one variable-length batch."""
    pos = level.index[level.valid]
    lengths = torch.tensor(level.lengths, device=q.device)
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int64)
    if init is None:
        init = q.new_zeros(len(level.lengths), q.shape[1], q.shape[2], v.shape[2], dtype=torch.float32)
    o, final = fla(
        q[pos][None],
        k[pos][None],
        v[pos][None],
        g=g[pos][None].to(torch.promote_types(g.dtype, torch.float32)),  # the log decays in fp32 at least
        beta=beta[pos][None],
        scale=scale,
        initial_state=init,
        output_final_state=True,
        cu_seqlens=cu,
        use_qk_l2norm_in_kernel=False,
    )
    return o[0], final


def _fla_kernel(device: torch.device):
    if device.type != "cuda":
        raise ValueError(
            f"tree_linear_backend='fla' runs flash-linear-attention's Triton kernels on CUDA tensors; the model is "
            f"on {device.type}: use tree_linear_backend='torch'"
        )
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as err:
        raise ValueError(
            "tree_linear_backend='fla' (the default on CUDA) needs the flash-linear-attention package "
            f"(fla.ops.gated_delta_rule.chunk_gated_delta_rule), which is not importable ({err}): install "
            "flash-linear-attention, or pass tree_linear_backend='torch' (the PyTorch recurrence, slower)"
        ) from err
    return chunk_gated_delta_rule
