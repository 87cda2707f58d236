"""``TreePack`` and ``pack_prefix_tree``: a row of samples folded into a prefix tree.

The layout is TRL 1.16's ``TreeRow.pack()`` (AsyncGRPO), built by the C++ trie in
``csrc/packing.cpp``. Sizes: N forwarded (unique) tokens, S segments, K gathered K/V rows,
M targets (trained tokens; a shared position serves every sample that shares it), B samples.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from .._core import dispatch as _dispatch
from .._core.validation import MAX_COUNT, check_has_data, numpy_to_tensor

KEYS = ("token+next", "token")

# The fields ``to_trl()`` returns, in TRL's order.
TRL_FIELDS = (
    "input_ids",
    "position_ids",
    "shift_labels",
    "tree_kv_index",
    "tree_cu_seqlens_q",
    "tree_cu_seqlens_k",
    "tree_max_seqlens",
    "token_index",
    "old_log_probs",
    "advantages",
    "segment_id",
)


@dataclasses.dataclass(frozen=True)
class TreePack:
    """One packed row. Every index is into this row.

    Forwarded tokens (DFS pre-order of the trie, unary chains merged into segments):
        input_ids [N] int64, position_ids [N] int64 (a token's position in its samples = its
        depth), shift_labels [N] int64 (the next token a position predicts; -100 where no
        sample trains it, and under ``key="token"`` where it predicts several different ones).
    Visibility: ``enter [N]``, ``leave [N]`` int32; query q sees key k iff
        enter[k] <= enter[q] < leave[k] (k is q or an ancestor of q). In DFS pre-order
        ``enter`` is the packed position.
    Segments: ``tree_cu_seqlens_q [S+1]`` int32 (segment boundaries), ``segment_parent [S]``
        int32 (-1 for a root), ``tree_kv_index [K]`` int64 and ``tree_cu_seqlens_k [S+1]``
        int32 (each segment's root-to-segment path of packed positions, laid end to end),
        ``tree_max_seqlens [2]`` int64 (longest segment, longest path).
    Targets, sample-major (sample b owns ``cu_seqlens[b]:cu_seqlens[b+1]``):
        ``token_index [M]`` int64 (the position whose hidden state predicts the target),
        ``target_ids [M]`` int64, ``token_pos [M]`` int64 (the target's position in its
        sample), ``segment_id [M]`` int64 (its sample), ``cu_seqlens [B+1]`` int32,
        ``old_log_probs [M]`` / ``advantages [M]`` float32 when given to the builder.
    Samples: ``gather_index [T]`` int64 (packed position of every input token, sample-major,
        T = ``num_tokens_unpacked``), ``cu_tokens [B+1]`` int64 (sample boundaries in it).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor
    enter: torch.Tensor
    leave: torch.Tensor
    tree_kv_index: torch.Tensor
    tree_cu_seqlens_q: torch.Tensor
    tree_cu_seqlens_k: torch.Tensor
    tree_max_seqlens: torch.Tensor
    segment_parent: torch.Tensor
    token_index: torch.Tensor
    target_ids: torch.Tensor
    token_pos: torch.Tensor
    segment_id: torch.Tensor
    cu_seqlens: torch.Tensor
    gather_index: torch.Tensor
    cu_tokens: torch.Tensor
    old_log_probs: Optional[torch.Tensor]
    advantages: Optional[torch.Tensor]
    key: str
    load: int  # attention cost, sum over nodes of (depth + 1): TRL's TreeRow.load

    @property
    def num_tokens(self) -> int:
        """N, the tokens a forward over the pack processes."""
        return self.input_ids.shape[0]

    @property
    def num_tokens_unpacked(self) -> int:
        """The tokens of the samples laid end to end (a padding-free unpacked batch)."""
        return self.gather_index.shape[0]

    @property
    def num_samples(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @property
    def num_segments(self) -> int:
        return self.segment_parent.shape[0]

    @property
    def num_targets(self) -> int:
        return self.token_index.shape[0]

    @property
    def sample_lengths(self) -> torch.Tensor:
        return self.cu_tokens.diff()

    @property
    def compression(self) -> float:
        """Unpacked tokens over forwarded tokens (1.0 when nothing is shared)."""
        return self.num_tokens_unpacked / max(self.num_tokens, 1)

    def to(self, device, non_blocking: bool = False) -> "TreePack":
        """The pack with every tensor on ``device`` (devices only: the index tensors must stay
        integers, so a dtype is refused)."""
        if isinstance(device, torch.dtype):
            raise TypeError("device: TreePack.to moves tensors between devices; a dtype would corrupt its indices")
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def clone(self) -> "TreePack":
        """A standalone copy. The rows of one ``pack_rows`` call are views into buffers shared
        by the whole call; clone a row to keep (or ``torch.save``) it without the others."""
        return self._map(torch.clone)

    def _map(self, fn) -> "TreePack":
        return dataclasses.replace(
            self,
            **{
                f.name: fn(getattr(self, f.name))
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )

    def to_trl(self) -> Dict[str, torch.Tensor]:
        """Exactly the dict TRL 1.16's ``TreeRow.pack()`` returns for the same samples in the
        same order (``key="token+next"``, no ``group_index``): same keys, dtypes and values."""
        if self.key != "token+next":
            raise ValueError(
                "to_trl: TRL's layout has one label per position, which only key='token+next' gives; "
                f"this pack was built with key={self.key!r}"
            )
        if self.old_log_probs is None or self.advantages is None:
            missing = [n for n in ("old_log_probs", "advantages") if getattr(self, n) is None]
            raise ValueError(
                f"to_trl: TRL's layout carries {' and '.join(missing)}; give them to the builder "
                "(pack_prefix_tree's arguments, or each TreeRowBuilder sample's 'old_log_probs' and 'advantage')"
            )
        return {name: getattr(self, name) for name in TRL_FIELDS}


# ----------------------------------------------------------------------------- inputs


def _as_int_tensor(name: str, x, what: str = "token ids") -> torch.Tensor:
    """``x`` (a list, 1-D tensor or numpy array of integers) as a CPU int64 tensor."""
    if isinstance(x, torch.Tensor):
        t = check_has_data(name, x)
    elif isinstance(x, np.ndarray):
        if x.dtype == np.uint64 and x.size and int(x.max()) > np.iinfo(np.int64).max:
            raise ValueError(f"{name}: {what} must fit in int64, got {int(x.max())}")
        t = numpy_to_tensor(name, x, f"integer {what}")
    elif isinstance(x, (list, tuple)):
        try:
            # No dtype= here: torch would truncate 1.5 to 1 silently; the inferred dtype is checked below.
            t = torch.tensor(x) if len(x) else torch.zeros(0, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise TypeError(f"{name}: expected a sequence of integer {what} (int64)") from None
    else:
        raise TypeError(f"{name}: expected a list, 1-D tensor or numpy array of {what}, got {type(x).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name}: {what} must be integers, got dtype {str(t.dtype).replace('torch.', '')}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of {what}, got shape {tuple(t.shape)}")
    return t.to("cpu", torch.int64)


def _flat_samples(samples, lengths, backend: str):
    """(tokens [T] int64, per-sample lengths list) from either input form. Per-sample sequences
    are read by the C++ reader in one pass (``csrc/packing_py.cpp``), or under
    ``backend="reference"`` one tensor per sample, here."""
    if isinstance(samples, torch.Tensor) and samples.dim() == 2:
        check_has_data("samples", samples)
        if lengths is None:
            raise ValueError("lengths: a padded [B, L] samples tensor needs lengths= (the tokens of each row)")
        if samples.dtype.is_floating_point or samples.dtype.is_complex or samples.dtype == torch.bool:
            raise TypeError(
                f"samples: token ids must be integers, got dtype {str(samples.dtype).replace('torch.', '')}"
            )
        B, L = samples.shape
        lens = _as_int_tensor("lengths", lengths, "lengths")
        if lens.shape[0] != B:
            raise ValueError(f"lengths: expected {B} entries (one per row of samples), got {lens.shape[0]}")
        if B and (int(lens.min()) < 0 or int(lens.max()) > L):
            raise ValueError(f"lengths: expected values in [0, {L}] (the padded width of samples)")
        keep = torch.arange(L).unsqueeze(0) < lens.unsqueeze(1)
        tokens = samples.to("cpu", torch.int64)[keep]
        return tokens, lens.tolist()
    if lengths is not None:
        raise ValueError("lengths: only for a padded [B, L] samples tensor")
    if isinstance(samples, (str, bytes)) or not isinstance(samples, Sequence) and not isinstance(samples, torch.Tensor):
        raise TypeError(
            f"samples: expected a list of token-id sequences or a padded [B, L] tensor, got {type(samples).__name__}"
        )
    if isinstance(samples, torch.Tensor):
        raise ValueError(f"samples: a tensor must be a padded [B, L] batch, got shape {tuple(samples.shape)}")
    if backend != "reference":
        tokens, cu = _dispatch.extension_module().read_token_ids(samples, "samples")
        return tokens, cu.diff().tolist()
    parts = [_as_int_tensor(f"samples[{i}]", s) for i, s in enumerate(samples)]
    tokens = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return tokens, [p.shape[0] for p in parts]


def _per_token(name: str, x, lengths: List[int], kind: str, backend: str) -> torch.Tensor:
    """A per-token value given per sample (list of sequences) or padded [B, L], flattened to [T].
    Per-sample sequences outside the reference are read by the C++ reader, which checks them as
    it reads: ``kind="mask"`` gives a bool mask (0/1 values), ``"values"`` float32 numbers (at
    least one sample floating-point, as their concatenation's dtype would be)."""
    B = len(lengths)
    if isinstance(x, torch.Tensor) and x.dim() == 2:
        check_has_data(name, x)
        if x.shape[0] != B or (B and x.shape[1] < max(lengths)):
            raise ValueError(
                f"{name}: a padded tensor must be [B, L] with B = {B} and L >= the longest sample "
                f"({max(lengths) if B else 0}), got {tuple(x.shape)}"
            )
        keep = torch.arange(x.shape[1]).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
        out = x.to("cpu")[keep]
    else:
        if isinstance(x, (torch.Tensor, str, bytes)) or not isinstance(x, Sequence):
            raise TypeError(f"{name}: expected a padded [B, L] tensor or a list of B per-sample sequences")
        if len(x) != B:
            raise ValueError(f"{name}: expected {B} per-sample sequences (one per sample), got {len(x)}")
        if backend != "reference":
            cu = torch.zeros(B + 1, dtype=torch.int64)
            torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0, out=cu[1:])
            return _dispatch.extension_module().read_per_token(x, name, cu, kind, True)
        parts = []
        for i, (v, n) in enumerate(zip(x, lengths)):
            t = _numbers(f"{name}[{i}]", v).to("cpu").reshape(-1)
            if t.shape[0] != n:
                raise ValueError(f"{name}[{i}]: expected {n} values (the sample's length), got {t.shape[0]}")
            parts.append(t)
        out = torch.cat(parts) if parts else torch.zeros(0)
    return out


def _numbers(name: str, v) -> torch.Tensor:
    """A per-sample sequence of numbers (tensor, numpy array, list) as a tensor."""
    if isinstance(v, torch.Tensor):
        return check_has_data(name, v)
    if not isinstance(v, np.ndarray):
        try:
            v = np.asarray(v)
        except (TypeError, ValueError):  # ragged nesting
            raise TypeError(f"{name}: expected a sequence of numbers, got {type(v).__name__}") from None
        if v.dtype.kind not in "biufc":  # (strings, objects; complex is the callers' to refuse)
            raise TypeError(f"{name}: expected a sequence of numbers, got {v.dtype} values")
    return numpy_to_tensor(name, v)


def _trained_mask(completion_mask, completion_start, lengths: List[int], T: int, backend: str) -> torch.Tensor:
    """The trained tokens as a bool mask [T], or as each sample's first trained position (int64 [B])."""
    if completion_mask is not None and completion_start is not None:
        raise ValueError("completion_mask, completion_start: give one of them, not both")
    if completion_mask is not None:
        m = _per_token("completion_mask", completion_mask, lengths, "mask", backend)
        if m.dtype.is_complex:
            raise TypeError("completion_mask: expected a bool, integer or float mask")
        if m.dtype != torch.bool and bool(((m != 0) & (m != 1)).any()):
            raise ValueError("completion_mask: expected 0/1 values")
        return m != 0
    B = len(lengths)
    lens = torch.tensor(lengths, dtype=torch.int64)
    if completion_start is None:
        raise ValueError("completion_mask: give completion_mask (per token) or completion_start (per sample)")
    if isinstance(completion_start, (int, np.integer)) and not isinstance(completion_start, (bool, np.bool_)):
        start = torch.full((B,), int(completion_start), dtype=torch.int64)
    else:
        start = _as_int_tensor("completion_start", completion_start, "positions")
        if start.shape[0] != B:
            raise ValueError(f"completion_start: expected {B} entries (one per sample), got {start.shape[0]}")
    if B and (bool((start < 0).any()) or bool((start > lens).any())):
        i = int(((start < 0) | (start > lens)).nonzero()[0, 0])
        raise ValueError(
            f"completion_start: expected 0 <= completion_start[b] <= len(samples[b]), got {int(start[i])} for "
            f"sample {i} of length {lengths[i]}"
        )
    return start.contiguous()  # the builder expands it per row: no [T] mask in Python


def _group_codes(group_index, B: int) -> torch.Tensor:
    if group_index is None:
        return torch.zeros(0, dtype=torch.int64)
    g = _as_int_tensor("group_index", group_index, "group ids")
    if g.shape[0] != B:
        raise ValueError(f"group_index: expected {B} entries (one per sample), got {g.shape[0]}")
    return torch.unique(g, return_inverse=True)[1].to(torch.int64).contiguous()


def _advantages(advantages, lengths: List[int], backend: str):
    """(values, per_sample): one value per sample ([B]) or per token ([T])."""
    B = len(lengths)
    if isinstance(advantages, torch.Tensor) and advantages.dim() <= 1 or isinstance(advantages, np.ndarray):
        a = _numbers("advantages", advantages).reshape(-1).to("cpu")
        if a.shape[0] != B:
            raise ValueError(f"advantages: expected {B} values (one per sample), got {a.shape[0]}")
        if not a.dtype.is_floating_point:
            raise TypeError("advantages: expected floating-point values")
        return a, True

    def scalar(v) -> bool:
        return isinstance(v, (int, float, np.number)) or isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim == 0

    if isinstance(advantages, Sequence) and len(advantages) and all(scalar(v) for v in advantages):
        if len(advantages) != B:
            raise ValueError(f"advantages: expected {B} values (one per sample), got {len(advantages)}")
        for i, v in enumerate(advantages):
            if isinstance(v, torch.Tensor):
                check_has_data(f"advantages[{i}]", v)
        return torch.tensor([float(v) for v in advantages], dtype=torch.float64), True
    a = _per_token("advantages", advantages, lengths, "values", backend)
    if not a.dtype.is_floating_point:
        raise TypeError("advantages: expected floating-point values")
    return a, False


# ----------------------------------------------------------------------------- build


@dataclasses.dataclass(frozen=True)
class _Flat:
    tokens: torch.Tensor
    cu_tokens: torch.Tensor
    trained: torch.Tensor
    group: torch.Tensor
    old_log_probs: Optional[torch.Tensor]  # [T]
    advantages: Optional[torch.Tensor]  # [B] when advantages_per_sample, else [T]
    advantages_per_sample: bool = False


def _flatten(
    samples, lengths, completion_mask, completion_start, old_log_probs, advantages, group_index, backend: str = "cpu"
) -> _Flat:
    """The inputs checked and laid end to end; ``backend="reference"`` reads per-sample
    sequences in Python (no C++ needed), any other through the C++ reader."""
    tokens, lens = _flat_samples(samples, lengths, backend)
    T = tokens.shape[0]
    if T > MAX_COUNT:
        raise ValueError(f"samples: {T} tokens in all exceeds {MAX_COUNT}")
    if T and int(tokens.min()) < 0:
        i = int((tokens < 0).nonzero()[0, 0])
        raise ValueError(f"samples: token ids must be non-negative, got {int(tokens[i])}")
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    trained = _trained_mask(completion_mask, completion_start, lens, T, backend).contiguous()
    old = None if old_log_probs is None else _per_token("old_log_probs", old_log_probs, lens, "values", backend)
    if old is not None and not old.dtype.is_floating_point:
        raise TypeError("old_log_probs: expected floating-point values")
    adv, per_sample = (None, False) if advantages is None else _advantages(advantages, lens, backend)
    return _Flat(tokens.contiguous(), cu, trained, _group_codes(group_index, len(lens)), old, adv, per_sample)


def _key(key: str) -> bool:
    if key not in KEYS:
        raise ValueError(f"key: expected one of {KEYS}, got {key!r}")
    return key == "token+next"


def build_rows(
    flat: _Flat, order: torch.Tensor, row_cu: torch.Tensor, key: str, backend: str = "cpu"
) -> List[TreePack]:
    """One TreePack per row: row r packs samples ``order[row_cu[r]:row_cu[r+1]]`` of ``flat``,
    all rows built in one call (in parallel by the C++ builder, which also gathers the values
    the targets carry)."""
    next_key = _key(key)
    build = _dispatch.kernel("prefix_tree_build", backend)
    columns = []  # per-token values: old log-probs, then advantages given per token
    if flat.old_log_probs is not None:
        columns.append(flat.old_log_probs.to(torch.float32))
    if flat.advantages is not None and not flat.advantages_per_sample:
        columns.append(flat.advantages.to(torch.float32))
    token_values = None
    if len(columns) == 1:  # a view, not a copy of a [T] column
        token_values = columns[0].contiguous().reshape(-1, 1)
    elif columns:
        token_values = torch.stack(columns, 1)
    sample_values = None
    if flat.advantages is not None and flat.advantages_per_sample:
        sample_values = flat.advantages.to(torch.float32).reshape(-1, 1).contiguous()
    outputs = build(
        flat.tokens, flat.cu_tokens, flat.trained, flat.group, order, row_cu, token_values, sample_values, next_key
    )
    tok, smp = outputs[15], outputs[16]
    old = tok[:, 0] if flat.old_log_probs is not None else None
    adv = None
    if flat.advantages is not None:
        adv = smp[:, 0] if flat.advantages_per_sample else tok[:, -1]
    lengths = flat.cu_tokens.diff()[order]
    return packs_from_layout(outputs[:15], lengths, row_cu, key, old, adv)


def packs_from_layout(
    outputs, lengths: torch.Tensor, row_cu: torch.Tensor, key: str, old: Optional[torch.Tensor], adv
) -> List[TreePack]:
    """Slice the builder's concatenated outputs (``csrc/packing.cpp``) into one TreePack per row;
    ``lengths`` are the samples' lengths in row order, ``old``/``adv`` the targets' values [M]."""
    (ids, pos, labels, leave, cu_q, parent, kv, cu_k, gather, tidx, tgt, tpos, seg, cu_m, sizes) = outputs
    packs = []
    s0 = k0 = m0 = 0
    for r, (n, s, k, m, load, max_q, max_k, t0) in enumerate(sizes.tolist()):
        b0, b1 = int(row_cu[r]), int(row_cu[r + 1])
        cu_tokens = torch.zeros(b1 - b0 + 1, dtype=torch.int64)
        torch.cumsum(lengths[b0:b1], 0, out=cu_tokens[1:])
        packs.append(
            TreePack(
                input_ids=ids[t0 : t0 + n],
                position_ids=pos[t0 : t0 + n],
                shift_labels=labels[t0 : t0 + n],
                enter=torch.arange(n, dtype=torch.int32),
                leave=leave[t0 : t0 + n],
                tree_kv_index=kv[k0 : k0 + k],
                tree_cu_seqlens_q=cu_q[s0 + r : s0 + r + s + 1],
                tree_cu_seqlens_k=cu_k[s0 + r : s0 + r + s + 1],
                tree_max_seqlens=torch.tensor([max_q, max_k], dtype=torch.int64),
                segment_parent=parent[s0 : s0 + s],
                token_index=tidx[m0 : m0 + m],
                target_ids=tgt[m0 : m0 + m],
                token_pos=tpos[m0 : m0 + m],
                segment_id=seg[m0 : m0 + m],
                cu_seqlens=cu_m[b0 + r : b1 + r + 1],
                gather_index=gather[t0 : t0 + int(cu_tokens[-1])],
                cu_tokens=cu_tokens,
                old_log_probs=None if old is None else old[m0 : m0 + m],
                advantages=None if adv is None else adv[m0 : m0 + m],
                key=key,
                load=load,
            )
        )
        s0, k0, m0 = s0 + s, k0 + k, m0 + m
    return packs


def pack_prefix_tree(
    samples,
    *,
    lengths=None,
    completion_mask=None,
    completion_start=None,
    old_log_probs=None,
    advantages=None,
    group_index=None,
    key: str = "token+next",
    backend: str = "cpu",
) -> TreePack:
    """Fold ``samples`` into one prefix tree (one row: a data-parallel rank's forward).

    Args:
        samples: B token-id sequences (lists, 1-D integer tensors or numpy arrays), or a
            padded ``[B, L]`` integer tensor with ``lengths`` [B].
        completion_mask: which tokens are trained, per token (B sequences or ``[B, L]``, 0/1);
            multi-turn tool and user turns are 0. A trained token at position 0 has no
            predecessor and gives no target (as in TRL).
        completion_start: instead of ``completion_mask``, the first trained position of each
            sample (an int for all, or B ints).
        old_log_probs: per-token generator log-probs aligned with the samples' tokens; the pack
            carries the targets' values as ``old_log_probs [M]`` float32.
        advantages: one value per sample ([B]) or per token; carried as ``advantages [M]``.
        group_index: [B] group ids; when given, only samples of one group share tokens.
        key: ``"token+next"`` (TRL's trie: a node is keyed on its token and the next one, so
            every position has one label and ``to_trl()`` reproduces ``TreeRow.pack()``) or
            ``"token"`` (maximal sharing: the branch token is shared too, and a branch position
            predicts several targets; score them with
            ``linear_logprobs(hidden, weight, pack.target_ids, row_index=pack.token_index)``).
        backend: ``"cpu"`` (the C++ builder) or ``"reference"`` (the readable Python trie of
            ``rlvr_kernels.reference.packing``, same output, slow).
    """
    _key(key)
    if backend not in ("cpu", "reference"):
        raise ValueError(f"backend: expected 'cpu' or 'reference' (the build runs on the host), got {backend!r}")
    flat = _flatten(
        samples, lengths, completion_mask, completion_start, old_log_probs, advantages, group_index, backend
    )
    B = flat.cu_tokens.shape[0] - 1
    # One row: its own tensors, not views into buffers sized for every input token.
    return build_rows(flat, torch.arange(B), torch.tensor([0, B]), key, backend)[0].clone()


def pack_rows(
    samples,
    rows: Sequence[Sequence[int]],
    *,
    lengths=None,
    completion_mask=None,
    completion_start=None,
    old_log_probs=None,
    advantages=None,
    group_index=None,
    key: str = "token+next",
) -> List[TreePack]:
    """One :class:`TreePack` per row, built in one C++ call with the rows in parallel.

    ``rows`` lists the sample indices of each row (a micro-batch of ``plan_rows``); the other
    arguments are those of :func:`pack_prefix_tree`, for all samples. ``segment_id`` and
    ``cu_seqlens`` of a pack count the row's samples in the order ``rows`` gives them. The
    packs are views into buffers shared by the call (``TreePack.clone()`` detaches one).
    """
    _key(key)
    flat = _flatten(samples, lengths, completion_mask, completion_start, old_log_probs, advantages, group_index)
    B = flat.cu_tokens.shape[0] - 1
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise TypeError(f"rows: expected a list of per-row lists of sample indices, got {type(rows).__name__}")
    if any(isinstance(row, (str, bytes)) or not isinstance(row, (Sequence, np.ndarray, torch.Tensor)) for row in rows):
        raise TypeError("rows: expected a list of per-row lists of sample indices")
    order = [int(i) if isinstance(i, torch.Tensor) and i.dim() == 0 else i for row in rows for i in row]
    if any(not isinstance(i, (int, np.integer)) or isinstance(i, bool) or not 0 <= i < B for i in order):
        raise ValueError(f"rows: sample indices must be integers in [0, {B})")
    if len(set(order)) != len(order):
        raise ValueError("rows: a sample index appears more than once")
    row_cu = torch.zeros(len(rows) + 1, dtype=torch.int64)
    row_cu[1:] = torch.cumsum(torch.tensor([len(r) for r in rows], dtype=torch.int64), 0)
    return build_rows(flat, torch.tensor(order, dtype=torch.int64), row_cu, key)
