"""Tree attention: the dense mask, the mask_mod, the BlockMask (full and partial tiles,
partial ones through the mask_mod, N not a multiple of the tile) and the gathered-K/V paths
all give the ancestor relation computed from the samples; every attention path equals
attending each sample alone (values and gradients), with GQA, sliding windows and soft-capping;
registration with transformers; errors name the argument."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask

from rlvr_kernels.packing import attention as A
from rlvr_kernels.packing import block_mask, dense_mask, mask_mod, pack_prefix_tree, register_tree_attention

from .forests import forests

KEYS = ["token+next", "token"]

# FlexAttention warns once that it runs unfused without torch.compile: that is the CPU path.
pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")


# ----------------------------------------------------------------------------- brute force


def _node(ids, b, j, key, group):
    """The trie node of token j of sample b, from the samples alone. Under "token+next" a node
    is keyed on (token, next token) at every depth, the last token on None; under "token" on
    the token. With group_index only samples of one group share."""
    g = None if group is None else group[b]
    s = ids[b]
    if key == "token":
        return (g, tuple(s[: j + 1]))
    return (g, tuple(s[: j + 2]), j + 1 == len(s))


def brute_visibility(ids, pack, key, group=None) -> torch.Tensor:
    """[N, N] bool, [q, k] True iff k's node is on q's root path. The nodes come from the
    samples; gather_index only names their packed positions, and is first checked to be a
    one-to-one naming of the nodes onto [0, N)."""
    cu, gather = pack.cu_tokens.tolist(), pack.gather_index.tolist()
    name = {}
    for b in range(len(ids)):
        for j in range(len(ids[b])):
            node, pos = _node(ids, b, j, key, group), gather[cu[b] + j]
            assert name.setdefault(node, pos) == pos
    assert sorted(name.values()) == list(range(pack.num_tokens))
    n = pack.num_tokens
    vis = torch.zeros(n, n, dtype=torch.bool)
    for b in range(len(ids)):
        path = [name[_node(ids, b, j, key, group)] for j in range(len(ids[b]))]
        for j, q in enumerate(path):
            vis[q, path[: j + 1]] = True
    return vis


def _window(vis: torch.Tensor, pack, w):
    if w is None:
        return vis
    p = pack.position_ids
    return vis & ((p[:, None] - p[None, :]) < w)


def _from_block_mask(bm, mm, n: int) -> torch.Tensor:
    """The token-level mask a BlockMask stands for: full tiles all visible, partial tiles
    through mask_mod, other tiles none (cropped to N)."""
    (bq, bk), nb = bm.BLOCK_SIZE, bm.kv_num_blocks.shape[-1]
    out = torch.zeros(nb * bq, bm.kv_indices.shape[-1] * bk, dtype=torch.bool)
    qi = torch.arange(nb * bq)[:, None]
    ki = torch.arange(out.shape[1])[None, :]
    qi, ki = qi.clamp(max=n - 1).expand_as(out), ki.clamp(max=n - 1).expand_as(out)
    full_num, full_idx = bm.full_kv_num_blocks[0, 0], bm.full_kv_indices[0, 0]
    part_num, part_idx = bm.kv_num_blocks[0, 0], bm.kv_indices[0, 0]
    for i in range(nb):
        rows = slice(i * bq, (i + 1) * bq)
        for j in full_idx[i, : full_num[i]].tolist():
            out[rows, j * bk : (j + 1) * bk] = True
        for j in part_idx[i, : part_num[i]].tolist():
            cols = slice(j * bk, (j + 1) * bk)
            out[rows, cols] = mm(0, 0, qi[rows, cols], ki[rows, cols])
    return out[:n, :n]


def _segment_visibility(pack) -> torch.Tensor:
    """The relation of the gathered-K/V path: segment s's row r sees path[c] iff c <= r + |path| - |seg|."""
    n = pack.num_tokens
    vis = torch.zeros(n, n, dtype=torch.bool)
    cu_q, cu_k, kv = pack.tree_cu_seqlens_q.tolist(), pack.tree_cu_seqlens_k.tolist(), pack.tree_kv_index.tolist()
    for s in range(len(cu_q) - 1):
        path, lq = kv[cu_k[s] : cu_k[s + 1]], cu_q[s + 1] - cu_q[s]
        for r in range(lq):
            vis[cu_q[s] + r, path[: r + len(path) - lq + 1]] = True
    return vis


# ----------------------------------------------------------------------------- layout


def _pack(f, key, grouped):
    return pack_prefix_tree(
        f.ids,
        completion_mask=f.mask,
        old_log_probs=f.old,
        advantages=f.adv,
        key=key,
        group_index=f.group if grouped else None,
    )


@settings(max_examples=30)
@given(forests(max_samples=12), st.sampled_from(KEYS), st.booleans(), st.sampled_from([1, 3, 8, 128]))
def test_masks_give_the_ancestor_relation(f, key, grouped, block):
    p = _pack(f, key, grouped)
    n = p.num_tokens
    vis = brute_visibility(f.ids, p, key, f.group if grouped else None)
    assert torch.equal(dense_mask(p), vis)
    q, k = torch.arange(n)[:, None].expand(n, n), torch.arange(n)[None, :].expand(n, n)
    assert torch.equal(mask_mod(p)(0, 0, q, k), vis)
    assert torch.equal(_segment_visibility(p), vis)
    bm = block_mask(p, block)
    assert bm.seq_lengths == (n, n) and bm.BLOCK_SIZE == (block, block)
    assert torch.equal(_from_block_mask(bm, bm.mask_mod, n), vis)
    if n % block:  # a tile holding padding is never full
        nb = bm.kv_num_blocks.shape[-1]
        full = torch.zeros(nb, nb, dtype=torch.bool)
        for i in range(nb):
            full[i, bm.full_kv_indices[0, 0, i, : bm.full_kv_num_blocks[0, 0, i]].long()] = True
        assert not full[-1].any() and not full[:, -1].any()
    # TRL's keywords give the same layout
    t = A.TreeLayout.from_trl(
        n, p.tree_kv_index, p.tree_cu_seqlens_q, p.tree_cu_seqlens_k, *p.tree_max_seqlens.tolist()
    )
    assert torch.equal(t.enter, p.enter) and torch.equal(t.leave, p.leave)
    assert torch.equal(t.position_ids, p.position_ids)


@settings(max_examples=15)
@given(forests(max_samples=12), st.sampled_from(KEYS), st.integers(1, 4), st.sampled_from([2, 8]))
def test_sliding_window_masks(f, key, w, block):
    p = _pack(f, key, False)
    vis = _window(brute_visibility(f.ids, p, key), p, w)
    n = p.num_tokens
    assert torch.equal(dense_mask(p, sliding_window=w), vis)
    q, k = torch.arange(n)[:, None].expand(n, n), torch.arange(n)[None, :].expand(n, n)
    assert torch.equal(mask_mod(p, sliding_window=w)(0, 0, q, k), vis)
    bm = block_mask(p, block, sliding_window=w)
    assert torch.equal(_from_block_mask(bm, bm.mask_mod, n), vis)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("block", [4, 16])
def test_block_tables_equal_create_block_mask(key, block):
    """Without a window the classification is exact: the same tables as torch's own
    create_block_mask, which evaluates the mask_mod on every pair."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 9, (23,), generator=g).tolist()
    ids = [
        prompt + torch.randint(0, 3, (int(r),), generator=g).tolist() for r in torch.randint(1, 30, (9,), generator=g)
    ]
    ids += [prompt[:7], torch.randint(0, 9, (41,), generator=g).tolist(), list(ids[0])]
    p = pack_prefix_tree(ids, completion_start=1, key=key)
    n = p.num_tokens
    ours = block_mask(p, block)
    ref = create_block_mask(mask_mod(p), None, None, n, n, device="cpu", BLOCK_SIZE=block)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    assert int(ours.full_kv_num_blocks.sum()) > 0 and int(ours.kv_num_blocks.sum()) > 0
    assert n % block  # the tail tile is exercised


# ----------------------------------------------------------------------------- attention values


def _samples(seed: int):
    """A seeded forest: a group prompt with nested sharing, a duplicate, a sample that is a
    prefix of another, a second group on the same system prompt, and a sample sharing nothing."""
    g = torch.Generator().manual_seed(seed)

    def r(n, v=5):
        return torch.randint(0, v, (n,), generator=g).tolist()

    system, p1, p2 = r(4), r(5), r(3)
    mid = r(3)
    ids = [system + p1 + mid + r(4), system + p1 + mid + r(2), system + p1 + r(6), system + p1 + mid + r(4)]
    ids += [list(ids[0]), ids[2][:7], system + p2 + r(5), system + p2 + r(1), [7, 8] + r(6, 9)]
    return ids


def _per_sample(q, k, v, pack, scaling, window, softcap):
    """Each sample attended alone: causal over its own tokens (gathered from the pack)."""
    out = torch.zeros_like(q)
    rep = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    cu = pack.cu_tokens.tolist()
    for b in range(len(cu) - 1):
        idx = pack.gather_index[cu[b] : cu[b + 1]]
        L = idx.numel()
        s = q[:, :, idx] @ kr[:, :, idx].transpose(-1, -2) * scaling
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(L, device=q.device)
        allowed = i[None, :] <= i[:, None]
        if window is not None:
            allowed &= (i[:, None] - i[None, :]) < window
        o = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ vr[:, :, idx]
        out = out.index_copy(2, idx, o)  # a token shared by samples gets the same value from each
    return out


def _varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False, **kw):
    """flash_attn_varlen_func's contract in plain torch: [T, H, D] rows, segment s's queries
    cu_q[s]:cu_q[s+1] against keys cu_k[s]:cu_k[s+1], causal aligned bottom-right, GQA."""
    assert causal and dropout_p == 0.0 and cu_q.dtype == cu_k.dtype == torch.int32
    window, softcap = kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0)
    lens_q, lens_k = cu_q.diff().tolist(), cu_k.diff().tolist()
    assert max(lens_q) == max_q and max(lens_k) == max_k
    rep = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    outs = []
    for qs, ks, vs in zip(q.split(lens_q), k.split(lens_k), v.split(lens_k)):
        lq, lk = qs.shape[0], ks.shape[0]
        s = torch.einsum("qhd,khd->hqk", qs, ks.repeat_interleave(rep, 1)) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        rows, cols = torch.arange(lq)[:, None] + lk - lq, torch.arange(lk)[None, :]
        allowed = cols <= rows
        if window[0] >= 0:
            allowed &= rows - cols <= window[0]
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
        outs.append(torch.einsum("hqk,khd->qhd", p, vs.repeat_interleave(rep, 1)))
    return torch.cat(outs)


PATHS = ["sdpa-dense", "sdpa-segments", "flex-128", "flex-4", "varlen"]


def _run(path, q, k, v, pack, monkeypatch, **kw):
    if path.startswith("sdpa"):
        return A.tree_sdpa_attention(None, q, k, v, None, tree_pack=pack, tree_sdpa_path=path[5:], **kw)[0]
    if path.startswith("flex"):
        with torch.no_grad():  # FlexAttention has no CPU backward
            return A.tree_flex_attention(None, q, k, v, None, tree_pack=pack, tree_block_size=int(path[5:]), **kw)[0]
    monkeypatch.setattr(A, "_flash_attn_varlen", lambda device: _varlen_stand_in)
    return A.tree_varlen_attention(None, q, k, v, None, tree_pack=pack, **kw)[0]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize(
    "heads,window,softcap", [((4, 2), None, None), ((6, 2), 3, None), ((4, 1), None, 5.0), ((4, 4), 2, 3.0)]
)
def test_attention_equals_each_sample_alone(path, key, heads, window, softcap, monkeypatch):
    ids = _samples(3)
    pack = pack_prefix_tree(ids, completion_start=2, key=key)
    g = torch.Generator().manual_seed(4)
    n, (hq, hkv), d = pack.num_tokens, heads, 8
    q, k, v = (torch.randn(1, h, n, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv))
    scaling = 0.3
    out = _run(path, q, k, v, pack, monkeypatch, scaling=scaling, sliding_window=window, softcap=softcap)
    assert out.shape == (1, n, hq, d)
    ref = _per_sample(q, k, v, pack, scaling, window, softcap)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-5, rtol=0)
    if path.startswith("flex"):
        return
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref.transpose(1, 2), (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_auto_path_switches_on_the_token_count(monkeypatch):
    """ "auto" is dense up to DENSE_MAX_TOKENS tokens and per segment above (same values)."""
    pack = pack_prefix_tree(_samples(5), completion_start=1)
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, pack.num_tokens, 4, generator=g) for _ in range(3))
    calls = []
    real = A._per_segment
    monkeypatch.setattr(A, "_per_segment", lambda *a: calls.append(1) or real(*a))
    dense = A.tree_sdpa_attention(None, q, k, v, None, tree_pack=pack)[0]
    assert not calls and pack.num_tokens <= A.DENSE_MAX_TOKENS
    monkeypatch.setattr(A, "DENSE_MAX_TOKENS", pack.num_tokens - 1)
    seg = A.tree_sdpa_attention(None, q, k, v, None, tree_pack=pack)[0]
    assert calls == [1]
    torch.testing.assert_close(seg, dense, atol=1e-6, rtol=0)


def test_trl_keywords_equal_the_pack(monkeypatch):
    """The keywords TRL's trainer passes (tree_kv_index, ..., tree_max_seqlen_k) give the same
    attention as tree_pack, on every path."""
    pack = pack_prefix_tree(_samples(7), completion_start=1)
    kv = dict(
        tree_kv_index=pack.tree_kv_index,
        tree_cu_seqlens_q=pack.tree_cu_seqlens_q,
        tree_cu_seqlens_k=pack.tree_cu_seqlens_k,
        tree_max_seqlen_q=int(pack.tree_max_seqlens[0]),
        tree_max_seqlen_k=int(pack.tree_max_seqlens[1]),
    )
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, h, pack.num_tokens, 4, generator=g) for h in (4, 2, 2))
    monkeypatch.setattr(A, "_flash_attn_varlen", lambda device: _varlen_stand_in)
    for fn, extra in [
        (A.tree_sdpa_attention, {"tree_sdpa_path": "dense"}),
        (A.tree_sdpa_attention, {"tree_sdpa_path": "segments"}),
        (A.tree_flex_attention, {"tree_block_size": 4}),
        (A.tree_varlen_attention, {}),
    ]:
        a = fn(None, q, k, v, None, tree_pack=pack, sliding_window=3, **extra)[0]
        b = fn(None, q, k, v, None, sliding_window=3, **kv, **extra)[0]
        assert torch.equal(a, b), fn.__name__


# ----------------------------------------------------------------------------- registration, errors


def test_register_is_idempotent():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    register_tree_attention()
    register_tree_attention()
    for name, fn in A.ATTENTION_FUNCTIONS.items():
        assert AttentionInterface._global_mapping[name] is fn
        assert AttentionMaskInterface._global_mapping[name](batch_size=1, cache_position=None) is None
    assert set(A.NAMES) == {"rk_tree_sdpa", "rk_tree_flex", "rk_tree_varlen"}


def _qkv(n, hq=2, hkv=2, grad=False):
    g = torch.Generator().manual_seed(9)
    return [torch.randn(1, h, n, 4, generator=g, requires_grad=grad) for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("fn", [A.tree_sdpa_attention, A.tree_flex_attention])
def test_bad_calls_name_the_argument(fn):
    pack = pack_prefix_tree([[1, 2, 3], [1, 2, 4]], completion_start=1)
    n = pack.num_tokens
    q, k, v = _qkv(n)
    with pytest.raises(ValueError, match="tree_pack"):
        fn(None, q, k, v, None)
    with pytest.raises(ValueError, match="attention_mask"):
        fn(None, q, k, v, torch.zeros(1, 1, n, n), tree_pack=pack)
    with pytest.raises(ValueError, match="s_aux"):
        fn(None, q, k, v, None, tree_pack=pack, s_aux=torch.zeros(2))
    with pytest.raises(ValueError, match="query"):
        fn(None, q.expand(2, -1, -1, -1), k, v, None, tree_pack=pack)
    with pytest.raises(ValueError, match="tree_pack: the tree has"):
        fn(None, *_qkv(n + 1), None, tree_pack=pack)
    with pytest.raises(ValueError, match="key"):
        fn(None, q, k[:, :, :-1], v, None, tree_pack=pack)
    with pytest.raises(ValueError, match="key"):
        fn(None, *_qkv(n, hq=3, hkv=2), None, tree_pack=pack)
    with pytest.raises(ValueError, match="sliding_window"):
        fn(None, q, k, v, None, tree_pack=pack, sliding_window=0)
    with pytest.raises(ValueError, match="tree_pack: on meta"):
        fn(None, q, k, v, None, tree_pack=pack.to("meta"))
    with pytest.raises(TypeError, match="tree_pack"):
        fn(None, q, k, v, None, tree_pack=object())


def _real_flash_attn() -> bool:
    """flash_attn installed (not absent, nor another test's placeholder module)."""
    spec = importlib.util.find_spec("flash_attn")
    return spec is not None and spec.origin is not None


def test_path_specific_errors():
    pack = pack_prefix_tree([[1, 2, 3], [1, 2, 4]], completion_start=1)
    q, k, v = _qkv(pack.num_tokens)
    with pytest.raises(ValueError, match="tree_sdpa_path"):
        A.tree_sdpa_attention(None, q, k, v, None, tree_pack=pack, tree_sdpa_path="sparse")
    with pytest.raises(ValueError, match="dropout"):
        A.tree_flex_attention(None, q, k, v, None, tree_pack=pack, dropout=0.1)
    with pytest.raises(ValueError, match="no backward: run under torch.no_grad"):
        A.tree_flex_attention(None, *_qkv(pack.num_tokens, grad=True), None, tree_pack=pack)
    with pytest.raises(ValueError, match="block_size"):
        block_mask(pack, 0)
    with pytest.raises(ValueError, match="rk_tree_varlen.*on CUDA tensors"):
        A.tree_varlen_attention(None, q, k, v, None, tree_pack=pack)
    with pytest.raises(ValueError, match="attn_implementation"):
        A.check_attn_implementation("sdpa", "cpu")
    with pytest.raises(ValueError, match="attn_implementation='rk_tree_varlen'"):
        A.check_attn_implementation("rk_tree_varlen", "cpu")
    # On a CUDA device the kernel comes from flash_attn: without the package the error says so.
    if not _real_flash_attn():
        with pytest.raises(ValueError, match="needs the flash_attn package"):
            A._flash_attn_varlen(torch.device("cuda"))
    else:
        assert callable(A._flash_attn_varlen(torch.device("cuda")))


@pytest.mark.parametrize("path", ["dense", "segments"])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_dropout_reaches_sdpa(path, softcap):
    """dropout is applied, not ignored, on the SDPA paths (transformers passes it in training)."""
    pack = pack_prefix_tree([[1, 2, 3, 5, 6], [1, 2, 4, 4, 4]], completion_start=1)
    q, k, v = _qkv(pack.num_tokens)
    kw = dict(tree_pack=pack, tree_sdpa_path=path, softcap=softcap)
    plain = A.tree_sdpa_attention(None, q, k, v, None, **kw)[0]
    torch.manual_seed(0)
    dropped = A.tree_sdpa_attention(None, q, k, v, None, dropout=0.5, **kw)[0]
    assert not torch.allclose(plain, dropped)


def test_paths_on_the_test_device(device):
    """On the suite's device (CUDA on a GPU machine: FlexAttention compiled, with its
    backward; flash_attn's real varlen kernel where installed), every path equals each sample
    alone. On CPU FlexAttention is checked forward only and rk_tree_varlen must refuse."""
    ids = _samples(13)
    pack = pack_prefix_tree(ids, completion_start=2).to(device)
    g = torch.Generator().manual_seed(14)
    n = pack.num_tokens
    q, k, v = (torch.randn(1, h, n, 16, generator=g).to(device).requires_grad_() for h in (4, 2, 2))
    ref = _per_sample(q, k, v, pack, 0.25, None, None).transpose(1, 2)
    grad = torch.randn(ref.shape, generator=g).to(device)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    cuda = torch.device(device).type == "cuda"
    runs = [(A.tree_sdpa_attention, {"tree_sdpa_path": p}) for p in ("dense", "segments")]
    runs.append((A.tree_flex_attention, {}))
    for fn, extra in runs:
        with torch.set_grad_enabled(cuda or fn is not A.tree_flex_attention):
            out = fn(None, q, k, v, None, tree_pack=pack, scaling=0.25, **extra)[0]
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        if out.requires_grad:
            for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), want):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    if not cuda or not _real_flash_attn():
        with pytest.raises(ValueError, match="rk_tree_varlen"):
            A.tree_varlen_attention(None, q, k, v, None, tree_pack=pack)
        return
    # flash-attn runs bf16: compare against the per-sample attention of the rounded inputs.
    qb, kb, vb = (x.detach().to(torch.bfloat16) for x in (q, k, v))
    out = A.tree_varlen_attention(None, qb, kb, vb, None, tree_pack=pack, scaling=0.25)[0]
    ref_b = _per_sample(*(x.float() for x in (qb, kb, vb)), pack, 0.25, None, None).transpose(1, 2)
    torch.testing.assert_close(out.float(), ref_b, atol=2e-2, rtol=0)
