"""Reference linear-attention layers on a prefix tree: the definition, one segment and one
token at a time.

A packed row is a trie cut into segments (``tree_cu_seqlens_q [S+1]``, DFS pre-order) with
``segment_parent [S]`` (-1 for a root). Every sample is a root-to-leaf path, so a recurrent
layer on the tree must give each token the state that its own path left, exactly as if its
sample ran alone:

- a segment's recurrence starts from the state its parent segment ended with (zeros at a
  root), and siblings never see each other;
- a token's causal convolution of width K reads the K - 1 inputs before it on its path
  (within its segment, then back through its ancestors), zeros before the root.

The gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next), per head, state S [Dk, Dv]:
    S  <- exp(g_t) · S
    S  <- S + k_t ⊗ β_t (v_t − S^T k_t)
    o_t = S^T q_t · scale,        scale = Dk^-1/2 unless given,
with q_t, k_t L2-normalised first under ``use_qk_l2norm`` (x / sqrt(Σx² + 1e-6)).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

__all__ = ["l2norm", "path_predecessors", "tree_causal_conv1d", "tree_gated_delta_rule"]


def path_predecessors(segment_parent: torch.Tensor, cu_seqlens: torch.Tensor) -> List[int]:
    """The packed position before each position on its root path (-1 at a root's first token)."""
    parent, cu = segment_parent.tolist(), cu_seqlens.tolist()
    prev = []
    for s in range(len(parent)):
        for p in range(cu[s], cu[s + 1]):
            if p > cu[s]:
                prev.append(p - 1)
            elif parent[s] >= 0:
                prev.append(cu[parent[s] + 1] - 1)  # the parent segment's last token
            else:
                prev.append(-1)
    return prev


def tree_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    segment_parent: torch.Tensor,
    cu_seqlens: torch.Tensor,
    activation: Optional[str] = None,
) -> torch.Tensor:
    """Depthwise causal convolution along each token's root path.

    x [N, C], weight [C, K] (tap K-1 is the token itself), bias [C] or None; activation
    None or ``"silu"``. Returns [N, C]:
        out[p] = act(bias + Σ_j weight[:, K-1-j] · x[pred^j(p)]),  pred^0(p) = p,
    a term dropped where the path ends before j steps."""
    prev = path_predecessors(segment_parent, cu_seqlens)
    K = weight.shape[1]
    out = []
    for p in range(x.shape[0]):
        acc = torch.zeros_like(x[p]) if bias is None else bias.to(x.dtype).clone()
        q = p
        for j in range(K):
            if q < 0:
                break
            acc = acc + weight[:, K - 1 - j] * x[q]
            q = prev[q]
        out.append(acc)
    y = torch.stack(out) if out else x.new_zeros(x.shape)
    if activation in ("silu", "swish"):
        y = torch.nn.functional.silu(y)
    elif activation is not None:
        raise ValueError(f"activation: expected None or 'silu', got {activation!r}")
    return y


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σx² + 1e-6) over the last dim (transformers' l2norm, fla's use_qk_l2norm_in_kernel)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def tree_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    segment_parent: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule on the tree, sequentially. q, k [N, H, Dk], v [N, H, Dv], g, beta
    [N, H] (g the log decay, <= 0). Returns (o [N, H, Dv], final state of every segment
    [S, H, Dk, Dv]). Segments come parents first (DFS pre-order)."""
    parent, cu = segment_parent.tolist(), cu_seqlens.tolist()
    H, Dk, Dv = q.shape[1], q.shape[2], v.shape[2]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    scale = Dk**-0.5 if scale is None else scale
    finals, out = [], [None] * q.shape[0]
    for s, ps in enumerate(parent):
        if ps >= s:
            raise ValueError(f"segment_parent: segment {s} has parent {ps}; parents come first (DFS pre-order)")
        state = q.new_zeros(H, Dk, Dv) if ps < 0 else finals[ps]
        for t in range(cu[s], cu[s + 1]):
            state = state * g[t].exp()[:, None, None]
            recalled = torch.einsum("hkv,hk->hv", state, k[t])
            delta = beta[t][:, None] * (v[t] - recalled)
            state = state + k[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", state, q[t]) * scale
        finals.append(state)
    o = torch.stack(out) if out else v.new_zeros(v.shape)
    states = torch.stack(finals) if finals else q.new_zeros(0, H, Dk, Dv)
    return o, states
