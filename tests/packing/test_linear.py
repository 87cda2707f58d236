"""Linear-attention layers on a tree (``rlvr_kernels.packing.linear``): the depth-batched
causal convolution and gated delta rule against the sequential reference
(``rlvr_kernels.reference.packing_linear``) on random segment trees (depth up to 6, odd
lengths, segments shorter than the convolution kernel), values and gradients, fp64; the
reference against transformers' own recurrence and convolution on a single sequence; a
segment's state is its parent's; on packs of random forests every sample gets the results of
its own sequence; the "fla" path's batching against flash-linear-attention's contract (a
plain-torch stand-in: no GPU here); TRL's keywords give the same tree; errors name the
argument."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rlvr_kernels.packing import linear as L
from rlvr_kernels.packing import pack_prefix_tree
from rlvr_kernels.reference import packing_linear as R

from .forests import forests


def _random_tree(seed: int, max_depth: int = 6):
    """Segments in DFS pre-order: each new segment hangs under a random segment on the
    current root path (or starts a new root), lengths 1..9 (many below the kernel width)."""
    g = torch.Generator().manual_seed(seed)
    parent, depth, stack = [], [], []
    lengths = []
    for s in range(int(torch.randint(3, 14, (), generator=g))):
        # pop to a random ancestor depth: a new sibling, a cousin or a new root
        deeper = float(torch.rand((), generator=g)) < 0.6
        keep = len(stack) if deeper else int(torch.randint(0, len(stack) + 1, (), generator=g))
        if keep == len(stack) and len(stack) == max_depth:
            keep -= 1
        del stack[keep:]
        parent.append(stack[-1] if stack else -1)
        depth.append(len(stack))
        stack.append(s)
        lengths.append(int(torch.randint(1, 10, (), generator=g)))
    cu = torch.tensor([0] + lengths).cumsum(0)
    return torch.tensor(parent), cu, max(depth), g


def _inputs(n, g, H=3, Dk=5, Dv=4, C=7, dtype=torch.float64):
    q, k = torch.randn(n, H, Dk, generator=g, dtype=dtype), torch.randn(n, H, Dk, generator=g, dtype=dtype)
    v = torch.randn(n, H, Dv, generator=g, dtype=dtype)
    decay = -torch.rand(n, H, generator=g, dtype=dtype)  # log decay <= 0
    beta = torch.rand(n, H, generator=g, dtype=dtype)
    x = torch.randn(n, C, generator=g, dtype=dtype)
    w, b = torch.randn(C, 4, generator=g, dtype=dtype), torch.randn(C, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, decay, beta, x, w, b)]


def test_the_random_trees_are_deep_and_short():
    trees = [_random_tree(seed) for seed in range(8)]
    assert max(depth for _, _, depth, _ in trees) == 5  # six levels of segments
    assert all(parent.numel() > 2 for parent, _, _, _ in trees)
    assert sum(int((cu.diff() < 3).sum()) for _, cu, _, _ in trees) >= 4  # shorter than the kernel's reach
    assert sum(int((cu.diff() % 2).sum()) for _, cu, _, _ in trees) >= 4  # odd lengths


@pytest.mark.parametrize("chunk_size", [3, 64])
@pytest.mark.parametrize("seed", range(8))
def test_depth_batched_equals_the_sequential_reference(seed, chunk_size):
    parent, cu, depth, g = _random_tree(seed)
    tree = L.SegmentTree(cu, parent)
    q, k, v, decay, beta, x, w, b = _inputs(int(cu[-1]), g)
    want_o, want_s = R.tree_gated_delta_rule(q, k, v, decay, beta, parent, cu, use_qk_l2norm=True, scale=0.3)
    got_o, got_s = L.tree_gated_delta_rule(
        q, k, v, decay, beta, tree, use_qk_l2norm=True, scale=0.3, backend="torch", chunk_size=chunk_size
    )
    torch.testing.assert_close(got_o, want_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_s, want_s, rtol=1e-10, atol=1e-10)
    want_y = R.tree_causal_conv1d(x, w, b, parent, cu, "silu")
    got_y = L.tree_causal_conv1d(x, w, b, tree, "silu")
    torch.testing.assert_close(got_y, want_y, rtol=1e-12, atol=1e-12)
    # gradients, through the states handed from parents to children
    gen = torch.Generator().manual_seed(100 + seed)
    wo, ws, wy = (torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in (want_o, want_s, want_y))
    inputs = (q, k, v, decay, beta, x, w, b)

    def grads(o, s, y):
        loss = (wo * o).sum() + (ws * s).sum() + (wy * y).sum()
        return torch.autograd.grad(loss, inputs)

    for name, got, want in zip("q k v g beta x w b".split(), grads(got_o, got_s, got_y), grads(want_o, want_s, want_y)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=name)


def test_a_child_starts_from_its_parent_state_and_siblings_are_apart():
    """Two siblings under a root: each child's outputs equal running root+child as one
    sequence; changing one sibling's inputs leaves the other's outputs bit for bit."""
    parent, cu = torch.tensor([-1, 0, 0]), torch.tensor([0, 5, 7, 10])
    g = torch.Generator().manual_seed(3)
    q, k, v, decay, beta, x, w, b = (t.detach() for t in _inputs(10, g))
    tree = L.SegmentTree(cu, parent)
    o, _ = L.tree_gated_delta_rule(q, k, v, decay, beta, tree, backend="torch")
    y = L.tree_causal_conv1d(x, w, b, tree)
    for child in ([5, 6], [7, 8, 9]):
        path = list(range(5)) + child
        chain = L.SegmentTree(torch.tensor([0, len(path)]), torch.tensor([-1]))
        o1, _ = L.tree_gated_delta_rule(q[path], k[path], v[path], decay[path], beta[path], chain, backend="torch")
        torch.testing.assert_close(o[path], o1, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(y[path], L.tree_causal_conv1d(x[path], w, b, chain), rtol=1e-12, atol=1e-12)
    v2, x2 = v.clone(), x.clone()
    v2[7:], x2[7:] = 10.0, -3.0
    o2, _ = L.tree_gated_delta_rule(q, k, v2, decay, beta, tree, backend="torch")
    assert torch.equal(o2[:7], o[:7])
    assert torch.equal(L.tree_causal_conv1d(x2, w, b, tree)[:7], y[:7])


@pytest.mark.parametrize("length", [1, 3, 70, 129])
def test_reference_equals_transformers_recurrence_and_convolution(length):
    """On one sequence the reference is transformers' Gated DeltaNet: its chunked and its
    step-by-step gated delta rule (fp32), and its causal Conv1d + SiLU."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    g = torch.Generator().manual_seed(length)
    q, k, v, decay, beta, x, w, b = (t.detach() for t in _inputs(length, g, dtype=torch.float32))
    chain = (torch.tensor([-1]), torch.tensor([0, length]))
    want, state = R.tree_gated_delta_rule(q, k, v, decay, beta, *chain, use_qk_l2norm=True)
    for fn in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        o, s = fn(q[None], k[None], v[None], decay[None], beta[None], initial_state=None, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)  # fmt: skip
        torch.testing.assert_close(o[0], want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s[0], state[0], rtol=1e-4, atol=1e-5)
    conv = torch.nn.Conv1d(7, 7, 4, groups=7, padding=3, bias=True)
    with torch.no_grad():
        conv.weight.copy_(w[:, None, :])
        conv.bias.copy_(b)
        hf = F.silu(conv(x.t()[None])[..., :length])[0].t()
    torch.testing.assert_close(R.tree_causal_conv1d(x, w, b, *chain, "silu"), hf, rtol=1e-5, atol=1e-6)


def test_padding_at_the_end_keeps_the_state():
    """The padded steps of a depth (g = 0, β = 0, zero q/k/v) leave the final state as the
    segment's own."""
    g = torch.Generator().manual_seed(5)
    q, k, v, decay, beta, *_ = (t.detach()[None] for t in _inputs(9, g))
    o, s = L.chunked_gated_delta_rule(q, k, v, decay, beta, scale=0.5, chunk_size=4)
    pad = [F.pad(t, (0, 0) * (t.dim() - 2) + (0, 6)) for t in (q, k, v, decay, beta)]
    o_pad, s_pad = L.chunked_gated_delta_rule(*pad, scale=0.5, chunk_size=4)
    torch.testing.assert_close(s_pad, s, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(o_pad[:, :9], o, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("key", ["token+next", "token"])
def test_trl_keywords_give_the_pack_tree(key):
    ids = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 3, 4, 7, 8], [9, 9], [1, 2], [1, 2, 3, 4, 5]]
    pack = pack_prefix_tree(ids, completion_start=1, key=key)
    assert pack.segment_parent.max() >= 1  # nested
    trl = L.segment_tree(
        dict(
            tree_kv_index=pack.tree_kv_index,
            tree_cu_seqlens_q=pack.tree_cu_seqlens_q,
            tree_cu_seqlens_k=pack.tree_cu_seqlens_k,
        )
    )
    assert torch.equal(trl.parent, pack.segment_parent.long())
    assert torch.equal(trl.cu_seqlens, pack.tree_cu_seqlens_q.long())
    assert L.segment_tree({}) is None


def test_empty_tree_and_bad_arguments():
    tree = L.SegmentTree(torch.tensor([0]), torch.zeros(0, dtype=torch.long))
    q = torch.zeros(0, 2, 3, requires_grad=True)
    o, s = L.tree_gated_delta_rule(q, q, q, q[..., 0], q[..., 0], tree)
    assert o.shape == (0, 2, 3) and s.shape == (0, 2, 3, 3)
    o.sum().backward()
    parent, cu = torch.tensor([-1, 0]), torch.tensor([0, 2, 3])
    q, k, v, decay, beta, x, w, b = (t.detach() for t in _inputs(3, torch.Generator().manual_seed(0)))
    tree = L.SegmentTree(cu, parent)
    with pytest.raises(ValueError, match="tree_linear_backend"):
        L.tree_gated_delta_rule(q, k, v, decay, beta, tree, backend="cuda")
    with pytest.raises(ValueError, match="tree_linear_backend='fla'.*CUDA"):
        L.tree_gated_delta_rule(q, k, v, decay, beta, tree, backend="fla")
    with pytest.raises(ValueError, match="g, beta"):
        L.tree_gated_delta_rule(q, k, v, decay[:, :1], beta, tree)
    with pytest.raises(ValueError, match="q: the tree has 3 tokens"):
        L.tree_gated_delta_rule(q[:2], k[:2], v[:2], decay[:2], beta[:2], tree)
    with pytest.raises(ValueError, match="activation"):
        L.tree_causal_conv1d(x, w, b, tree, "gelu")
    with pytest.raises(ValueError, match="parents first"):
        L.tree_gated_delta_rule(q, k, v, decay, beta, L.SegmentTree(cu, torch.tensor([1, -1])))
    with pytest.raises(TypeError, match="tree_pack"):
        L.tree_causal_conv1d(x, w, b, {"segment_parent": parent})


@settings(max_examples=20)
@given(forest=forests(max_samples=8, vocab=3), key=st.sampled_from(["token+next", "token"]))
def test_every_sample_of_a_forest_gets_its_own_sequence(forest, key):
    """On packs of random forests (shared prompts, nesting, duplicates, prefixes, empty
    samples), every sample's outputs of the tree convolution and recurrence equal running
    the ops on that sample's own token sequence."""
    pack = pack_prefix_tree(forest.ids, completion_start=0, key=key)
    n = pack.num_tokens
    g = torch.Generator().manual_seed(n)
    q, k, v, decay, beta, x, w, b = (t.detach() for t in _inputs(n, g))
    o, _ = L.tree_gated_delta_rule(q, k, v, decay, beta, pack, use_qk_l2norm=True, chunk_size=4)
    y = L.tree_causal_conv1d(x, w, b, pack, "silu")
    cu = pack.cu_tokens.tolist()
    for s in range(pack.num_samples):
        path = pack.gather_index[cu[s] : cu[s + 1]]
        if not path.numel():
            continue
        chain = L.SegmentTree(torch.tensor([0, path.numel()]), torch.tensor([-1]))
        o1, _ = L.tree_gated_delta_rule(
            q[path], k[path], v[path], decay[path], beta[path], chain, use_qk_l2norm=True, chunk_size=4
        )
        torch.testing.assert_close(o[path], o1, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(y[path], L.tree_causal_conv1d(x[path], w, b, chain, "silu"), rtol=1e-12, atol=1e-12)


def _fla_stand_in(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel):
    """flash-linear-attention's ``chunk_gated_delta_rule`` contract in plain torch: one row
    [1, T, H, D] of ``cu_seqlens`` sequences, one initial state each, their final states."""
    assert q.shape[0] == 1 and output_final_state and not use_qk_l2norm_in_kernel
    assert cu_seqlens.dtype == torch.int64 and initial_state.shape[0] == cu_seqlens.numel() - 1
    outs, finals = [], []
    bounds = cu_seqlens.tolist()
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        o, s = L.chunked_gated_delta_rule(
            *(x[:, a:b] for x in (q, k, v, g, beta)), initial_state=initial_state[i : i + 1], scale=scale
        )
        outs.append(o)
        finals.append(s)
    return torch.cat(outs, dim=1), torch.cat(finals)


def test_fla_backend_batches_each_depth_as_variable_length_sequences(monkeypatch):
    """The "fla" path hands each depth to the kernel as one variable-length batch with the
    parents' final states; with the kernel's contract in plain torch it gives the reference."""
    monkeypatch.setattr(L, "_fla_kernel", lambda device: _fla_stand_in)
    parent, cu, _, g = _random_tree(3)
    q, k, v, decay, beta, *_ = _inputs(int(cu[-1]), g)
    want_o, want_s = R.tree_gated_delta_rule(q, k, v, decay, beta, parent, cu, use_qk_l2norm=True)
    got_o, got_s = L.tree_gated_delta_rule(
        q, k, v, decay, beta, L.SegmentTree(cu, parent), use_qk_l2norm=True, backend="fla"
    )
    torch.testing.assert_close(got_o, want_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_s, want_s, rtol=1e-10, atol=1e-10)
    (gq,) = torch.autograd.grad(got_o.sum() + got_s.sum(), q)
    (wq,) = torch.autograd.grad(want_o.sum() + want_s.sum(), q)
    torch.testing.assert_close(gq, wq, rtol=1e-9, atol=1e-9)
