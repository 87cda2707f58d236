"""Tree attention over a ``TreePack``: masks, three attention paths, and their registration
with ``transformers``' attention interface.

Visibility in a packed row (docs/packing.md): query q sees key k iff k is q or an ancestor of q in
the trie, i.e. ``enter[k] <= enter[q] < leave[k]``. Equivalently, each segment's queries
attend causally, bottom-right aligned, to the K/V of the segment's root-to-segment path
(``tree_kv_index[tree_cu_seqlens_k[s]:tree_cu_seqlens_k[s+1]]``), which is TRL's varlen form.

The paths, all with ``transformers``' ``AttentionInterface`` signature and the same result:
  ``"rk_tree_sdpa"``   the reference, any device: SDPA with the dense ``[N, N]`` mask for rows
                       up to ``DENSE_MAX_TOKENS`` tokens, else one SDPA call per segment over
                       its gathered path (``tree_sdpa_path=`` forces one of the two).
  ``"rk_tree_flex"``   FlexAttention with a ``BlockMask`` built at block granularity from
                       ``enter``/``leave`` (no ``[N, N]`` tensor, no ``torch.compile`` to
                       build it). On CUDA the attention itself runs compiled; on CPU it runs
                       eagerly (torch's unfused implementation, forward only: FlexAttention
                       has no CPU backward).
  ``"rk_tree_varlen"`` TRL's gathered-K/V path through ``flash_attn.flash_attn_varlen_func``
                       (CUDA, flash-attn installed).

The layout reaches the attention as a keyword of the model call, which ``transformers``
forwards to every attention layer: ``model(input_ids=pack.input_ids[None],
position_ids=pack.position_ids[None], tree_pack=pack)``. TRL's own keywords
(``tree_kv_index``, ``tree_cu_seqlens_q``, ``tree_cu_seqlens_k``, ``tree_max_seqlen_q``,
``tree_max_seqlen_k``, as AsyncGRPO passes them) are accepted too, so these paths also run
inside TRL's trainer.

Options: ``scaling``, GQA (fewer K/V heads than query heads), ``sliding_window`` (a key is
visible only within ``sliding_window`` positions of its query along the path, as in
``transformers``), ``softcap`` (scores ``softcap·tanh(s/softcap)``) on every path;
``dropout`` on the SDPA and varlen paths (FlexAttention has none: it raises). Attention sinks
(``s_aux``) and a caller-built ``attention_mask`` raise.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

SDPA = "rk_tree_sdpa"
FLEX = "rk_tree_flex"
VARLEN = "rk_tree_varlen"
NAMES = (SDPA, FLEX, VARLEN)

# Above this many tokens ``rk_tree_sdpa`` goes per segment. The dense path costs N² mask
# entries and N² scores per head whatever the tree; the per-segment path Σ_s |seg_s|·|path_s|
# scores (a G-way fork of a P-token prompt into R-token completions: P² + G·R·(P+R) against
# (P+G·R)²) plus one SDPA call per segment. Forward + backward on one CPU thread (8 heads of
# 64): N = 326 in 6 segments 11 ms dense, 3 ms per segment; N = 463 in 126 segments 25 / 7 ms;
# N = 1543 (G=8, P=512, R=128) 270 / 80 ms. Dense wins only on small rows of many short
# segments, where the per-call cost dominates.
DENSE_MAX_TOKENS = 512
SDPA_PATHS = ("auto", "dense", "segments")

# FlexAttention's own default tile (torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE).
DEFAULT_BLOCK_SIZE = 128

_TRL_KWARGS = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k", "tree_max_seqlen_q", "tree_max_seqlen_k")


@dataclasses.dataclass(frozen=True)
class TreeLayout:
    """What the attention paths read, from a ``TreePack`` or from TRL's keywords (the same
    field names and meaning as ``TreePack``'s)."""

    enter: torch.Tensor  # [N] int
    leave: torch.Tensor  # [N] int
    position_ids: torch.Tensor  # [N] int, the depth of each token
    tree_kv_index: torch.Tensor  # [K] int64
    tree_cu_seqlens_q: torch.Tensor  # [S+1] int32
    tree_cu_seqlens_k: torch.Tensor  # [S+1] int32
    # (longest segment, longest path): a [2] tensor (TreePack) or two ints (TRL); only the
    # varlen path reads it, as ints, so the other paths never sync on it.
    tree_max_seqlens: object

    @property
    def num_tokens(self) -> int:
        return self.enter.shape[0]

    @classmethod
    def from_pack(cls, pack) -> "TreeLayout":
        if isinstance(pack, TreeLayout):
            return pack
        missing = [n for n in ("enter", "leave", "position_ids", "tree_kv_index") if not hasattr(pack, n)]
        if missing:
            raise TypeError(f"tree_pack: expected a TreePack, got {type(pack).__name__} (no {', '.join(missing)})")
        return cls(
            pack.enter,
            pack.leave,
            pack.position_ids,
            pack.tree_kv_index,
            pack.tree_cu_seqlens_q,
            pack.tree_cu_seqlens_k,
            pack.tree_max_seqlens,
        )

    @classmethod
    def from_trl(
        cls, num_tokens, tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k, tree_max_seqlen_q, tree_max_seqlen_k
    ):
        """The layout of TRL's keywords. TRL lays the trie out in DFS pre-order too, so
        ``enter`` is the position; a key's ``leave`` is one past the last query that sees it,
        the largest end of a segment whose path holds it (an O(K) scatter); a token's depth is
        its offset in its segment's path."""
        cu_q, cu_k, kv = tree_cu_seqlens_q, tree_cu_seqlens_k, tree_kv_index
        n = num_tokens
        seg_len, path_len = cu_q.diff().long(), cu_k.diff().long()
        ends = torch.repeat_interleave(cu_q[1:].long(), path_len)
        leave = torch.zeros(n, dtype=torch.int64, device=kv.device).scatter_reduce_(
            0, kv.long(), ends, "amax", include_self=False
        )
        segment = torch.repeat_interleave(torch.arange(seg_len.numel(), device=kv.device), seg_len)
        position = torch.arange(n, device=kv.device) + (path_len - seg_len - cu_q[:-1].long())[segment]
        return cls(
            torch.arange(n, dtype=torch.int32, device=kv.device),
            leave.to(torch.int32),
            position,
            kv,
            cu_q,
            cu_k,
            (int(tree_max_seqlen_q), int(tree_max_seqlen_k)),
        )


# ----------------------------------------------------------------------------- masks


def dense_mask(pack, *, sliding_window: Optional[int] = None) -> torch.Tensor:
    """``[N, N]`` bool, ``[q, k]`` True iff query q sees key k (on the pack's device)."""
    t = TreeLayout.from_pack(pack)
    e, l = t.enter.long(), t.leave.long()
    visible = (e[None, :] <= e[:, None]) & (e[:, None] < l[None, :])
    if sliding_window is not None:
        p = t.position_ids.long()
        visible &= (p[:, None] - p[None, :]) < _window(sliding_window)
    return visible


def mask_mod(pack, *, sliding_window: Optional[int] = None) -> Callable:
    """FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` of the pack: q sees k iff
    enter[k] <= enter[q] < leave[k] (and, with ``sliding_window``, pos[q] − pos[k] < window).
    Indices must lie in [0, N)."""
    t = TreeLayout.from_pack(pack)
    return _mask_mod(t.enter.long(), t.leave.long(), t.position_ids.long(), sliding_window)


def block_mask(pack, block_size: int = DEFAULT_BLOCK_SIZE, *, sliding_window: Optional[int] = None):
    """FlexAttention ``BlockMask`` of the pack, built at block granularity: O(N + (N/block)²)
    tensor work, no ``[N, N]`` tensor, no ``torch.compile``.

    A (query block, key block) tile is *full* when every pair in it is visible, *partial*
    (resolved through the mask_mod) when some may be, and absent otherwise. With query block
    Q and key block Kb: full iff max enter[Kb] <= min enter[Q] and min leave[Kb] > max enter[Q];
    possibly visible iff min enter[Kb] <= max enter[Q] and max leave[Kb] > min enter[Q]. In DFS
    pre-order (enter = position) both tests are exact. A tile holding the padding past N is
    never full, so a kernel never takes a padded key unmasked; the mask_mod reads tensors
    padded to whole blocks with entries no query sees.
    """
    from torch.nn.attention.flex_attention import BlockMask

    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    t = TreeLayout.from_pack(pack)
    n, dev = t.num_tokens, t.enter.device
    nb = max(-(-n // block_size), 1)
    pad = nb * block_size - n

    def blocks(x: torch.Tensor, fill: int) -> torch.Tensor:
        return F.pad(x.long(), (0, pad), value=fill).view(nb, block_size)

    big, small = n + 1, -1
    e, l = t.enter, t.leave
    e_min, e_max = blocks(e, big).amin(1), blocks(e, small).amax(1)
    l_min, l_max = blocks(l, big).amin(1), blocks(l, small).amax(1)
    # [q block, kv block]
    maybe = (e_min[None, :] <= e_max[:, None]) & (l_max[None, :] > e_min[:, None])
    full = (e_max[None, :] <= e_min[:, None]) & (l_min[None, :] > e_max[:, None])
    if sliding_window is not None:
        w = _window(sliding_window)
        p = t.position_ids
        p_min, p_max = blocks(p, big).amin(1), blocks(p, small).amax(1)
        maybe &= (p_min[:, None] - p_max[None, :]) < w
        full &= (p_max[:, None] - p_min[None, :]) < w
    if pad:
        full[-1, :] = False
        full[:, -1] = False
    partial = maybe & ~full

    def table(m: torch.Tensor):
        # FlexAttention's order (create_block_mask): a row's listed blocks first, ascending.
        num = m.sum(1, dtype=torch.int32)
        idx = torch.sort(m.to(torch.int8), dim=1, descending=True, stable=True).indices.to(torch.int32)
        return num[None, None], idx[None, None]

    kv_num, kv_idx = table(partial)
    full_num, full_idx = table(full)
    padded = F.pad(t.enter.long(), (0, pad), value=n), F.pad(t.leave.long(), (0, pad), value=n)
    pos = F.pad(t.position_ids.long(), (0, pad), value=0)
    return BlockMask.from_kv_blocks(
        kv_num.to(dev),
        kv_idx.to(dev),
        full_num.to(dev),
        full_idx.to(dev),
        BLOCK_SIZE=block_size,
        mask_mod=_mask_mod(padded[0], padded[1], pos, sliding_window),
        seq_lengths=(n, n),
    )


def _mask_mod(enter: torch.Tensor, leave: torch.Tensor, position: torch.Tensor, sliding_window) -> Callable:
    if sliding_window is None:

        def tree_mask(b, h, q_idx, kv_idx):
            return (enter[kv_idx] <= enter[q_idx]) & (enter[q_idx] < leave[kv_idx])

        return tree_mask
    w = _window(sliding_window)

    def tree_window_mask(b, h, q_idx, kv_idx):
        visible = (enter[kv_idx] <= enter[q_idx]) & (enter[q_idx] < leave[kv_idx])
        return visible & (position[q_idx] - position[kv_idx] < w)

    return tree_window_mask


def _window(sliding_window) -> int:
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window: expected a positive int or None, got {sliding_window!r}")
    return sliding_window


# ----------------------------------------------------------------------------- attention paths


def tree_sdpa_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    *,
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    tree_sdpa_path: str = "auto",
    **kwargs,
):
    """``"rk_tree_sdpa"``: query ``[1, Hq, N, D]``, key/value ``[1, Hkv, N, D]`` -> ``([1, N, Hq, D], None)``.

    ``tree_sdpa_path``: ``"dense"`` (one SDPA over the ``[N, N]`` mask), ``"segments"`` (one
    SDPA per segment over its gathered path), or ``"auto"`` (dense up to
    ``DENSE_MAX_TOKENS`` tokens)."""
    t = _layout(SDPA, query, key, value, attention_mask, kwargs)
    if tree_sdpa_path not in SDPA_PATHS:
        raise ValueError(f"tree_sdpa_path: expected one of {SDPA_PATHS}, got {tree_sdpa_path!r}")
    dense = tree_sdpa_path == "dense" or tree_sdpa_path == "auto" and t.num_tokens <= DENSE_MAX_TOKENS
    if sliding_window is not None:
        _window(sliding_window)
    if dense:
        out = _attend(query, key, value, dense_mask(t, sliding_window=sliding_window), scaling, dropout, softcap)
    else:
        out = _per_segment(t, query, key, value, scaling, dropout, sliding_window, softcap)
    return out.transpose(1, 2).contiguous(), None


def tree_flex_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    *,
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    tree_block_size: int = DEFAULT_BLOCK_SIZE,
    **kwargs,
):
    """``"rk_tree_flex"``: FlexAttention with ``block_mask(pack, tree_block_size)``."""
    t = _layout(FLEX, query, key, value, attention_mask, kwargs)
    if dropout:
        raise ValueError(f"dropout: FlexAttention has no attention dropout (got {dropout}); use {SDPA!r}")
    bm = block_mask(t, tree_block_size, sliding_window=sliding_window)
    score_mod = None
    if softcap is not None:
        cap = float(softcap)

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

    if not torch.is_grad_enabled():
        # FlexAttention refuses CPU inputs that require grad even under no_grad, where no
        # backward can follow: detaching changes nothing else.
        query, key, value = query.detach(), key.detach(), value.detach()
    hq, hkv = query.shape[1], key.shape[1]
    # As transformers' flex integration: FlexAttention's GQA wants a power-of-two head count.
    gqa = hq != hkv and hq & (hq - 1) == 0
    if hq != hkv and not gqa:
        key, value = (x.repeat_interleave(hq // hkv, dim=1) for x in (key, value))
    try:
        out = _flex_attention(query.device)(
            query, key, value, score_mod=score_mod, block_mask=bm, scale=scaling, enable_gqa=gqa
        )
    except NotImplementedError as err:
        raise ValueError(
            f"attn_implementation={FLEX!r}: FlexAttention cannot run this call on {query.device.type} "
            f"({err}); on CPU it has no backward: run under torch.no_grad() or use {SDPA!r}"
        ) from err
    return out.transpose(1, 2).contiguous(), None


def tree_varlen_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    *,
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    **kwargs,
):
    """``"rk_tree_varlen"``: TRL's path. Each segment's queries against its gathered path,
    causal bottom-right (flash-attn >= 2.1 aligns causal masks bottom-right), in flash-attn's
    dtype (fp32 inputs run in the autocast or weight dtype, as transformers' flash path)."""
    t = _layout(VARLEN, query, key, value, attention_mask, kwargs)
    varlen = _flash_attn_varlen(query.device)
    if sliding_window is not None:
        _window(sliding_window)
    dtype = _flash_dtype(query, module)
    q, k, v = (x.transpose(1, 2)[0].to(dtype) for x in (query, key, value))
    kv_index = t.tree_kv_index.long()
    m = t.tree_max_seqlens
    max_q, max_k = (int(x) for x in (m.tolist() if isinstance(m, torch.Tensor) else m))
    out = varlen(
        q,
        k.index_select(0, kv_index),
        v.index_select(0, kv_index),
        t.tree_cu_seqlens_q.to(torch.int32),
        t.tree_cu_seqlens_k.to(torch.int32),
        max_q,
        max_k,
        dropout_p=dropout,
        softmax_scale=scaling,
        causal=True,
        window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
        # flash-attn takes softcap from 2.6 on: pass it only when set, as TRL does.
        **({"softcap": float(softcap)} if softcap else {}),
    )
    out = out[0] if isinstance(out, tuple) else out
    return out.to(query.dtype).unsqueeze(0), None


ATTENTION_FUNCTIONS = {SDPA: tree_sdpa_attention, FLEX: tree_flex_attention, VARLEN: tree_varlen_attention}


def _no_mask(**kwargs):
    """The mask function registered with the attention names: the paths build their own
    visibility from the tree, so ``transformers`` must not build a causal mask."""
    return None


def register_tree_attention() -> None:
    """Register ``rk_tree_sdpa``, ``rk_tree_flex`` and ``rk_tree_varlen`` with
    ``transformers.AttentionInterface`` (and a mask function returning None with
    ``AttentionMaskInterface``, as TRL does). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name, fn in ATTENTION_FUNCTIONS.items():
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, _no_mask)


def check_attn_implementation(attn_implementation, device) -> None:
    """Raise unless ``attn_implementation`` is one of ours and can run on ``device``."""
    if attn_implementation not in NAMES:
        raise ValueError(f"attn_implementation: expected one of {NAMES}, got {attn_implementation!r}")
    if attn_implementation == VARLEN:
        _flash_attn_varlen(torch.device(device))


# ----------------------------------------------------------------------------- helpers


def _layout(name: str, query, key, value, attention_mask, kwargs) -> TreeLayout:
    if attention_mask is not None:
        raise ValueError(
            f"attention_mask: {name} builds its visibility from the tree; call the model without an attention_mask"
        )
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"s_aux: {name} does not support attention sinks")
    pack = kwargs.get("tree_pack")
    if pack is not None:
        t = TreeLayout.from_pack(pack)
    elif all(kwargs.get(k) is not None for k in _TRL_KWARGS):
        t = TreeLayout.from_trl(query.shape[2], *(kwargs[k] for k in _TRL_KWARGS))
    else:
        raise ValueError(
            f"tree_pack: {name} needs the tree layout: call the model with tree_pack=<TreePack> "
            f"(or TRL's {', '.join(_TRL_KWARGS)})"
        )
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"query: {name} runs one packed row, [1, heads, N, head_dim]; got {tuple(query.shape)}")
    if key.shape[2] != query.shape[2] or value.shape[2] != query.shape[2]:
        raise ValueError(
            f"key: {name} expects as many keys as queries (no KV cache); got {key.shape[2]} and {query.shape[2]}"
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"key: {key.shape[1]} K/V heads do not divide {query.shape[1]} query heads")
    if t.num_tokens != query.shape[2]:
        raise ValueError(f"tree_pack: the tree has {t.num_tokens} tokens but the model got {query.shape[2]}")
    if t.enter.device != query.device:
        raise ValueError(f"tree_pack: on {t.enter.device}, the model runs on {query.device}; use pack.to(device)")
    return t


def _attend(q, k, v, mask, scaling, dropout, softcap) -> torch.Tensor:
    """Attention of q [1, Hq, Lq, D] over k, v [1, Hkv, Lk, D] under a bool [Lq, Lk] mask.
    SDPA has no score soft-capping, so with ``softcap`` the scores are formed explicitly
    (transformers' eager attention, with the same mask)."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=k.shape[1] != q.shape[1]
        )
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    # Softmax in fp32 at least (transformers' eager attention), fp64 for fp64 inputs.
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, v)


def _per_segment(t: TreeLayout, q, k, v, scaling, dropout, sliding_window, softcap) -> torch.Tensor:
    """Each segment's queries against its gathered root-to-segment path, bottom-right causal.
    The gather and the splits are one op each, so the backward is one index_add and one cat
    (slicing per segment would zero-fill a full-size gradient per segment). The segment
    lengths are read on the host once per call (a sync on CUDA): this is the reference path,
    the fused ones are flex and varlen."""
    cu_q, cu_k = t.tree_cu_seqlens_q, t.tree_cu_seqlens_k
    seg_len, path_len = torch.stack([cu_q.diff(), cu_k.diff()]).tolist()
    kv_index = t.tree_kv_index.long()
    qs = q.split(seg_len, dim=2)
    ks = k.index_select(2, kv_index).split(path_len, dim=2)
    vs = v.index_select(2, kv_index).split(path_len, dim=2)
    outs = []
    for qi, ki, vi, lq, lk in zip(qs, ks, vs, seg_len, path_len):
        rows = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        cols = torch.arange(lk, device=q.device)[None, :]
        mask = cols <= rows
        if sliding_window is not None:
            mask &= rows - cols < sliding_window
        outs.append(_attend(qi, ki, vi, mask, scaling, dropout, softcap))
    return torch.cat(outs, dim=2) if outs else q.new_zeros(q.shape[:2] + (0, v.shape[-1]))


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex_attention(device: torch.device) -> Callable:
    """Compiled FlexAttention on CUDA (the eager one materialises every score); eager
    elsewhere (CPU: a reference, compiling it would cost far more than the call), and
    eager inside an outer torch.compile, which compiles it itself."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type == "cuda" and not torch.compiler.is_compiling():
        return _compiled_flex()
    return flex_attention


def _flash_attn_varlen(device: torch.device) -> Callable:
    if device.type != "cuda":
        raise ValueError(
            f"attn_implementation={VARLEN!r} runs flash_attn's varlen kernel on CUDA tensors; the model is on "
            f"{device.type}: use {SDPA!r} or {FLEX!r}"
        )
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as err:
        raise ValueError(
            f"attn_implementation={VARLEN!r} needs the flash_attn package (flash_attn.flash_attn_varlen_func), "
            f"which is not importable ({err}): install flash-attn, or use {SDPA!r} or {FLEX!r}"
        ) from err
    return flash_attn_varlen_func


def _flash_dtype(query: torch.Tensor, module) -> torch.dtype:
    """flash-attn runs fp16/bf16 only: fp32 queries run in the autocast dtype, else in the
    dtype of the module's first linear layer (transformers' ``get_target_dtype``)."""
    if query.dtype != torch.float32:
        return query.dtype
    if torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    for layer in module.modules() if module is not None else ():
        if isinstance(layer, torch.nn.Linear):
            return layer.weight.dtype
    return query.dtype
