"""Sequence-length balancing across data-parallel ranks that never splits a group.

Ranks meet at every collective, so a step runs at the pace of its costliest rank. GRPO wants
a group's samples on one rank (its statistics and its shared prompt stay local), so the unit
placed here is the GROUP: every sample of a group lands on the same rank, and whole groups are
spread over ``num_ranks`` ranks minimising the largest per-rank cost (multiway number
partitioning). verl's ``get_seqlen_balanced_partitions`` balances single samples, which
splits groups; run at group granularity on the same costs, this module's result is never
worse than it (the same Karmarkar–Karp ordering, then a local search that only improves).

Cost models (per sample of length L, or per group for ``"tree"``):
    ``"attention"``  a·L + b·L(L+1)/2: the linear layers cost a per token and attention b per
                     score pair (causal attention scores L(L+1)/2 query/key pairs, which is
                     what causal flash attention computes). Per layer, a dense transformer's
                     forward costs 24·h² FLOPs per token (QKV 6h², output 2h², MLP 16h²) and
                     4·h per score pair (QKᵀ and AV, 2h each); divided by 4h that is
                     a = 6h, b = 1. The default (24576, 1) is h = 4096 (a 7B model), verl's
                     calibration (verl's ``calculate_workload`` is 24576·L + L²: it counts the
                     full square). Pass ``attention_coefficients=(6 * hidden, 1)`` for
                     another width.
    ``"tokens"``     L.
    ``"tree"``       a·N + b·P for the group's prefix tree (``rlvr_kernels.packing``): N its
                     unique (forwarded) tokens and P its score pairs, the sum over unique
                     tokens of depth + 1 (``TreePack.load``). A group that shares nothing
                     costs exactly its samples' ``"attention"`` costs; a shared prompt is paid
                     once. Priced by the C++ trie (``TreeRowBuilder``), statistics only.
    callable         ``cost(lengths)`` with lengths an int64 tensor [B], returning B
                     non-negative finite per-sample costs.
    ``"given"``      the first argument already holds per-sample costs (non-negative, finite).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .._core.validation import MAX_COUNT, check_int

METHODS = ("kk", "lpt")
COST_MODELS = ("attention", "tokens", "tree", "given")
TREE_KEYS = ("token+next", "token")  # rlvr_kernels.packing's, imported lazily with the packing

# a per token, b per score pair: a = 6·h for hidden size h = 4096 (see the module docstring).
DEFAULT_ATTENTION_COEFFICIENTS = (24576, 1)


@dataclasses.dataclass(frozen=True)
class RankAssignment:
    """Which samples each data-parallel rank gets.

    ``sample_indices[r]``: rank r's sample indices, ascending (the batch order, so a group's
    samples keep their order); ``groups[r]``: rank r's group ids, in the order of their first
    sample; ``costs[r]``: rank r's cost under the cost model (an int for the integer models,
    a float for ``"given"``/callable costs). The order of the ranks carries no meaning beyond
    being the same on every process (rank r of the trainer takes entry r).
    """

    sample_indices: Tuple[Tuple[int, ...], ...]
    groups: Tuple[Tuple[Any, ...], ...]
    costs: Tuple[Union[int, float], ...]
    method: str
    equal_counts: bool

    @property
    def num_ranks(self) -> int:
        return len(self.sample_indices)

    @property
    def imbalance(self) -> float:
        """max over mean of the per-rank costs (1.0 is perfect balance, and an all-zero batch)."""
        total = math.fsum(self.costs)
        if total <= 0:
            return 1.0
        return max(self.costs) / (total / len(self.costs))

    def __getitem__(self, rank: int) -> Tuple[int, ...]:
        return self.sample_indices[rank]

    def __len__(self) -> int:
        return len(self.sample_indices)

    def rank_of_samples(self) -> List[int]:
        """[B]: the rank of every sample."""
        out = [0] * sum(len(s) for s in self.sample_indices)
        for r, samples in enumerate(self.sample_indices):
            for i in samples:
                out[i] = r
        return out


def balance_groups(
    lengths,
    group_index,
    num_ranks: int,
    *,
    method: str = "kk",
    cost: Union[str, Callable[[torch.Tensor], Any]] = "attention",
    equal_counts: bool = False,
    samples=None,
    key: str = "token+next",
    attention_coefficients: Tuple[float, float] = DEFAULT_ATTENTION_COEFFICIENTS,
    allow_empty_ranks: bool = False,
    refine: bool = True,
) -> RankAssignment:
    """Assign whole groups to ``num_ranks`` ranks, minimising the largest per-rank cost.

    Args:
        lengths: [B] per-sample token counts (a list, 1-D integer tensor or numpy array); under
            ``cost="given"`` the per-sample costs instead. May be None under ``cost="tree"``
            (taken from ``samples``).
        group_index: [B] integer group ids (samples of one prompt); None makes every sample
            its own group (plain sample balancing, as verl's).
        num_ranks: the data-parallel world size (>= 1).
        method: ``"kk"`` (Karmarkar–Karp largest differencing, k-way, in verl's ordering) or
            ``"lpt"`` (longest processing time first: costliest group to the least-loaded rank).
        cost: ``"attention"`` (default), ``"tokens"``, ``"tree"``, ``"given"`` or a callable;
            see the module docstring.
        equal_counts: every rank gets the same number of groups (verl's ``equal_size``; with
            groups of one size, GRPO's n, the same number of samples). Needs the number of
            groups to be a multiple of ``num_ranks``.
        samples: the token ids, for ``cost="tree"``: B sequences, or a padded [B, L] integer
            tensor with ``lengths``.
        key: the trie key for ``cost="tree"`` (as ``pack_prefix_tree``'s).
        attention_coefficients: (a, b) of the ``"attention"`` and ``"tree"`` models.
        allow_empty_ranks: with fewer groups than ranks some rank gets nothing, which stalls
            FSDP/DDP collectives in most trainers, so it raises unless this is True.
        refine: after the partitioner, move or swap groups between the costliest rank and the
            others while that lowers the costliest (never makes the result worse).

    Returns:
        A :class:`RankAssignment`. Deterministic: the same input gives the same assignment on
        every rank (ties go to the lower group and sample index; nothing depends on hashing).

    Raises:
        ValueError / TypeError naming the argument: num_ranks < 1, lengths negative or not
        integers, group_index of another length or not integers, fewer groups than ranks
        (unless ``allow_empty_ranks``), ``equal_counts`` with a group count that ``num_ranks``
        does not divide, an unknown method or cost, a callable's bad output.
    """
    num_ranks = check_int("num_ranks", num_ranks, minimum=1)
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    for name, flag in (("equal_counts", equal_counts), ("allow_empty_ranks", allow_empty_ranks), ("refine", refine)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    if not callable(cost) and cost not in COST_MODELS:
        raise ValueError(f"cost: expected one of {COST_MODELS} or a callable, got {cost!r}")
    if key not in TREE_KEYS:
        raise ValueError(f"key: expected one of {TREE_KEYS} (the trie key of cost='tree'), got {key!r}")
    coef = _coefficients(attention_coefficients)

    inputs = _sample_inputs(lengths, cost, samples)
    B = inputs.num_samples
    group_order, members = _groups(group_index, B)
    G = len(group_order)
    if G < num_ranks and not allow_empty_ranks:
        raise ValueError(
            f"num_ranks: {num_ranks} ranks but only {G} groups, so some rank would get no sample (a rank forwarding "
            "nothing stalls the trainer's collectives); pass allow_empty_ranks=True to accept that, or split groups"
        )
    if equal_counts and G % num_ranks:
        raise ValueError(
            f"equal_counts: {G} groups cannot be dealt equally to num_ranks={num_ranks} ranks "
            "(the number of groups must be a multiple of num_ranks)"
        )

    if cost == "tree":
        group_costs = _tree_costs(inputs.tokens, inputs.lengths, members, key, coef)
    else:
        sample_costs = inputs.costs if inputs.costs is not None else _sample_costs(cost, inputs.lengths, coef)
        group_costs = [_sum([sample_costs[i] for i in m]) for m in members]

    if method == "kk":
        parts = _karmarkar_karp(group_costs, num_ranks, equal_counts)
    else:
        parts = _lpt(group_costs, num_ranks, equal_counts)
    _fill_empty(parts, group_costs)
    if refine and num_ranks > 1:
        _refine(parts, group_costs, equal_counts)

    sample_indices, groups, costs = [], [], []
    for part in parts:
        part = sorted(part)  # group positions are in order of first sample
        sample_indices.append(tuple(sorted(i for g in part for i in members[g])))
        groups.append(tuple(group_order[g] for g in part))
        costs.append(_sum([group_costs[g] for g in part]))
    return RankAssignment(tuple(sample_indices), tuple(groups), tuple(costs), method, equal_counts)


# ----------------------------------------------------------------------------- partitioners


# A Karmarkar–Karp subset (one rank's groups in a state) is the tuple (sum, count, first, tree):
# its cost, its number of groups, its first group (-1 when empty) and its groups as a tree of
# pairs with group indices at the leaves (so a merge is O(1), not a copy of both lists).
# Tuples order as verl's ``Set``: by sum, then size, then the (index, cost) item lists, which
# hold disjoint groups and so differ at their first item: comparing ``first`` is the same.
_EMPTY = (0, 0, -1, ())


def _join(x: tuple, y: tuple) -> tuple:
    if not x[1]:
        return y
    if not y[1]:
        return x
    return (x[0] + y[0], x[1] + y[1], x[2], (x[3], y[3]))


def _leaves(tree) -> List[int]:
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, int):
            out.append(node)
        elif node:
            stack += (node[1], node[0])  # left first, as verl appends the other set's items after its own
    return out


class _State:
    """k subsets, largest first. The heap pops the state of largest spread (largest minus
    smallest subset), ties to the one whose largest subset is larger: verl's order, so the
    partition is the one verl's ``karmarkar_karp`` returns on the same costs."""

    __slots__ = ("subsets", "spread")

    def __init__(self, subsets: List[tuple]):
        self.subsets = sorted(subsets, reverse=True)
        self.spread = self.subsets[0][0] - self.subsets[-1][0]

    def __lt__(self, other: "_State") -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return other.subsets[0][:3] < self.subsets[0][:3]


def _karmarkar_karp(costs: Sequence, k: int, equal_counts: bool) -> List[List[int]]:
    """Largest differencing: start from one state per group (its group alone in a subset, the
    others empty; under ``equal_counts`` one state per k consecutive groups in cost order, one
    group per subset), then repeatedly combine the two states of largest spread, the largest
    subset of one with the smallest of the other, until one state is left."""
    order = sorted(range(len(costs)), key=lambda g: (costs[g], g))
    heap: List[_State] = []
    step = k if equal_counts else 1
    for start in range(0, len(order), step):
        chunk = order[start : start + step]
        heap.append(_State([(costs[g], 1, g, g) for g in chunk] + [_EMPTY] * (k - len(chunk))))
    if not heap:
        return [[] for _ in range(k)]
    heapq.heapify(heap)
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        heapq.heappush(heap, _State([_join(x, y) for x, y in zip(a.subsets, reversed(b.subsets))]))
    return [_leaves(s[3]) for s in heap[0].subsets]


def _lpt(costs: Sequence, k: int, equal_counts: bool) -> List[List[int]]:
    """Costliest group first, each to the least-loaded rank (ties: fewer groups, then the
    lower rank); under ``equal_counts`` a rank holding its share takes no more."""
    cap = len(costs) // k if equal_counts else math.inf
    parts: List[List[int]] = [[] for _ in range(k)]
    heap = [(0, 0, r) for r in range(k)]
    for g in sorted(range(len(costs)), key=lambda g: (-costs[g], g)):
        load, count, r = heapq.heappop(heap)
        parts[r].append(g)
        if count + 1 < cap:
            heapq.heappush(heap, (load + costs[g], count + 1, r))
    return parts


def _fill_empty(parts: List[List[int]], costs: Sequence) -> None:
    """Give each empty rank the cheapest group of the rank holding the most groups, while one
    holds two: Karmarkar–Karp can leave a rank empty (zero-cost groups) though there are groups
    enough. The moved group costs no more than its donor did, so the costliest rank stays."""
    while True:
        empty = [r for r, p in enumerate(parts) if not p]
        if not empty:
            return
        donor = max(range(len(parts)), key=lambda r: (len(parts[r]), -r))
        if len(parts[donor]) < 2:
            return
        g = min(parts[donor], key=lambda g: (costs[g], g))
        parts[donor].remove(g)
        parts[empty[0]].append(g)


def _refine(parts: List[List[int]], costs: Sequence, equal_counts: bool) -> None:
    """Local search in place: while moving one group (not under ``equal_counts``) or swapping
    two between the costliest rank and another lowers the larger of the pair below the
    costliest, apply the best such change. The sorted vector of rank costs falls
    lexicographically at each step, so it ends; a cap bounds the time on huge batches."""
    k = len(parts)
    loads = [_sum([costs[g] for g in p]) for p in parts]
    for _ in range(4 * sum(len(p) for p in parts) + k):
        top = max(range(k), key=lambda r: (loads[r], -r))
        best = None  # (new larger of the pair, rank, group out of top, group into top or None)
        for r in sorted(range(k), key=lambda r: (loads[r], r)):
            gap = loads[top] - loads[r]
            if r == top or gap <= 0:
                continue
            if not equal_counts:
                for g in parts[top]:
                    if 0 < costs[g] < gap:
                        cand = (max(loads[top] - costs[g], loads[r] + costs[g]), r, g, -1)
                        best = cand if best is None or cand < best else best
            # Swap g (top) with h (r), d = c_g - c_h in (0, gap); the best d is nearest gap / 2.
            theirs = sorted((costs[h], h) for h in parts[r])
            values = [c for c, _ in theirs]
            for g in parts[top]:
                want = costs[g] - gap / 2
                j = bisect.bisect_left(values, want)
                for c_h, h in theirs[max(0, j - 1) : j + 1]:
                    d = costs[g] - c_h
                    if 0 < d < gap:
                        cand = (max(loads[top] - d, loads[r] + d), r, g, h)
                        best = cand if best is None or cand < best else best
        if best is None or not best[0] < loads[top]:
            return
        _, r, g, h = best
        parts[top].remove(g)
        parts[r].append(g)
        moved = costs[g]
        if h != -1:
            parts[r].remove(h)
            parts[top].append(h)
            moved = costs[g] - costs[h]
        loads[top] -= moved
        loads[r] += moved


# ----------------------------------------------------------------------------- costs


def _sample_costs(cost, lens: torch.Tensor, coef: Tuple[Any, Any]) -> List[Any]:
    if cost == "tokens":
        return lens.tolist()
    if cost == "attention":
        a, b = coef
        return [a * n + b * (n * (n + 1) // 2) for n in lens.tolist()]
    out = cost(lens.clone())
    values = _cost_vector("cost", out, what="the callable's output")
    if len(values) != lens.shape[0]:
        raise ValueError(f"cost: the callable returned {len(values)} costs for {lens.shape[0]} samples")
    return values


def _tree_costs(tokens: torch.Tensor, lens: torch.Tensor, members, key: str, coef) -> List[Any]:
    """a·N + b·P per group, from the group's own trie (the C++ builder's statistics)."""
    from ._builder import TreeRowBuilder

    a, b = coef
    cu = [0] + torch.cumsum(lens, 0).tolist()
    out = []
    for m in members:
        row = TreeRowBuilder(key)
        for i in m:
            ids = tokens[cu[i] : cu[i + 1]]
            row.add({"input_ids": ids, "completion_mask": torch.zeros_like(ids)})
        out.append(a * row.num_tokens + b * row.load)
    return out


def _coefficients(coef) -> Tuple[Any, Any]:
    if not isinstance(coef, (tuple, list)) or len(coef) != 2:
        raise TypeError("attention_coefficients: expected a pair (a per token, b per score pair)")
    for v in coef:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"attention_coefficients: expected two finite numbers >= 0, got {tuple(coef)!r}")
    return tuple(coef)


def _sum(values: Sequence) -> Any:
    """Exact for ints; for floats fsum, which does not depend on the order of the terms."""
    if all(isinstance(v, int) for v in values):
        return sum(values)
    return math.fsum(values)


# ----------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class _Samples:
    """The per-sample input of one cost model: lengths [B] int64 (None under ``"given"``),
    the flat token ids [T] (``"tree"`` only) or the given costs."""

    lengths: Optional[torch.Tensor]
    tokens: Optional[torch.Tensor] = None
    costs: Optional[List[Any]] = None

    @property
    def num_samples(self) -> int:
        return len(self.costs) if self.costs is not None else self.lengths.shape[0]


def _sample_inputs(lengths, cost, samples) -> _Samples:
    if cost != "tree":
        if samples is not None:
            raise ValueError(f"samples: only used by cost='tree', got cost={cost!r}")
        if lengths is None:
            raise ValueError("lengths: expected [B] per-sample lengths (or costs under cost='given')")
        if cost == "given":
            return _Samples(None, costs=_cost_vector("lengths", lengths))
        return _Samples(_int_vector("lengths", lengths, "lengths"))
    if samples is None:
        raise ValueError("samples: cost='tree' prices each group's prefix tree, so it needs the token ids")
    from ._tree import _flat_samples

    padded = isinstance(samples, torch.Tensor) and samples.dim() == 2
    tokens, tree_lens = _flat_samples(samples, lengths if padded else None)
    if tokens.numel() and int(tokens.min()) < 0:
        raise ValueError(f"samples: token ids must be non-negative, got {int(tokens.min())}")
    if lengths is not None and not padded:
        if _int_vector("lengths", lengths, "lengths").tolist() != tree_lens:
            raise ValueError("lengths: must equal the lengths of samples (or be None under cost='tree')")
    return _Samples(torch.tensor(tree_lens, dtype=torch.int64), tokens)


def _as_tensor(name: str, x, what: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
    elif isinstance(x, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(x))
    elif isinstance(x, (list, tuple)):
        if any(isinstance(v, (list, tuple, str, bytes)) for v in x):
            raise TypeError(f"{name}: expected a flat sequence of {what}")
        try:
            t = torch.tensor(x) if len(x) else torch.zeros(0, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise TypeError(f"{name}: expected a sequence of {what}") from None
    else:
        raise TypeError(f"{name}: expected a list, 1-D tensor or numpy array of {what}, got {type(x).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of {what}, got shape {tuple(t.shape)}")
    return t


def _int_vector(name: str, x, what: str) -> torch.Tensor:
    t = _as_tensor(name, x, what)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name}: {what} must be integers, got dtype {str(t.dtype).replace('torch.', '')}")
    t = t.to(torch.int64)
    if name == "lengths" and t.numel():
        if int(t.min()) < 0:
            raise ValueError(f"lengths: must be >= 0, got {int(t.min())} at sample {int(t.argmin())}")
        if int(t.max()) > MAX_COUNT:
            raise ValueError(f"lengths: must be <= {MAX_COUNT}, got {int(t.max())}")
    return t


def _cost_vector(name: str, x, what: str = "costs") -> List[Any]:
    t = _as_tensor(name, x, what)
    if t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name}: {what} must be real numbers, got dtype {str(t.dtype).replace('torch.', '')}")
    if t.numel() and (not bool(torch.isfinite(t.double()).all()) or bool((t < 0).any())):
        raise ValueError(f"{name}: {what} must be finite and >= 0")
    return t.tolist()


def _groups(group_index, B: int) -> Tuple[List[Any], List[List[int]]]:
    """(group ids in order of their first sample, each group's sample indices ascending)."""
    if group_index is None:
        return list(range(B)), [[i] for i in range(B)]
    g = _int_vector("group_index", group_index, "group ids")
    if g.shape[0] != B:
        raise ValueError(f"group_index: expected {B} entries (one per sample), got {g.shape[0]}")
    ids: dict = {}  # insertion-ordered: positions follow the first sample of each group
    members: List[List[int]] = []
    for i, gid in enumerate(g.tolist()):
        pos = ids.setdefault(gid, len(ids))
        if pos == len(members):
            members.append([])
        members[pos].append(i)
    return list(ids), members
