"""Planning which samples run together: whole GRPO groups over data-parallel ranks
(:func:`balance_groups`) and the rows of prefix-tree micro-batches (:func:`plan_rows`).

Ranks meet at every collective, so a step runs at the pace of its costliest rank (or row).
Both entry points price a set of samples forwarded together with one cost model::

    cost = a·N + b·P

N the set's unique (forwarded) tokens and P its score pairs, the sum over unique tokens of
depth + 1 (``TreePack.load``, TRL's ``TreeRow.load``), both read from the set's prefix tree
(:class:`TreeRowBuilder`, the C++ trie), so a shared prefix is paid once. A sample that
shares nothing, of length L, has N = L and P = L(L+1)/2, the query/key pairs causal
attention scores. The linear layers cost a per token and attention b per score pair: per
layer, a dense transformer's forward costs 24·h² FLOPs per token (QKV 6h², output 2h², MLP
16h²) and 4·h per score pair (QKᵀ and AV, 2h each); divided by 4h that is a = 6h, b = 1. The
default (24576, 1) is h = 4096 (a 7B model), verl's calibration (verl's
``calculate_workload`` is 24576·L + L²: it counts the full square).

Both place units (a group, or part of one) costliest first into the cheapest row that takes
them (LPT, :class:`_Rows`), and lend a member to any row left empty while another holds two
(a rank forwarding nothing stalls the trainer's collectives).

:func:`balance_groups` (data parallelism) places whole groups, a group's samples on one rank
(its statistics and its shared prompt stay local), over ``num_ranks`` ranks minimising the
largest per-rank cost (multiway number partitioning). verl's ``get_seqlen_balanced_partitions``
balances single samples, which splits groups; run at group granularity on the same costs,
this result is never worse than it (the same Karmarkar–Karp ordering, then a local search
that only improves). Its costs (per sample of length L, or per group for ``"tree"``):

    ``"attention"``  a·L + b·L(L+1)/2, each sample priced alone. Pass
                     ``attention_coefficients=(6 * hidden, 1)`` for another width.
    ``"tokens"``     L (a = 1, b = 0).
    ``"tree"``       a·N + b·P of the group's own prefix tree. A group that shares nothing
                     costs exactly its samples' ``"attention"`` costs; a shared prompt is paid
                     once.
    callable         ``cost(lengths)`` with lengths an int64 tensor [B], returning B
                     non-negative finite per-sample costs.
    ``"given"``      the first argument already holds per-sample costs (non-negative, finite).

:func:`plan_rows` (micro-batches) splits a batch into micro-batches of ``num_rows`` rows, one
per rank, each packed into its own prefix tree. A row is bounded by ``token_budget`` twice, as
in TRL 1.16's AsyncGRPO planner: its unique tokens N bound activation memory, and its trained
tokens (the sum of its samples' completion masks) bound the loss terms, which packing does not
shrink. Within the budget the rows are balanced on P alone (a = 0, b = 1: TRL's
``TreeRow.load`` and its ``batch/row_imbalance``), the part that grows superlinearly in length;
the budget already bounds each row's per-token work.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .._core.validation import MAX_COUNT, check_int
from ._builder import TreeRowBuilder
from ._tree import KEYS, _flatten, _key

METHODS = ("kk", "lpt")
COST_MODELS = ("attention", "tokens", "tree", "given")
POLICIES = ("balanced", "trl")

# a per token, b per score pair: a = 6·h for hidden size h = 4096 (see the module docstring).
DEFAULT_ATTENTION_COEFFICIENTS = (24576, 1)


# ----------------------------------------------------------------------------- the cost model


class _CostModel(NamedTuple):
    """cost = a·N + b·P of samples forwarded together (N unique tokens, P score pairs)."""

    per_token: Any  # a
    per_pair: Any  # b

    def of_tree(self, row: TreeRowBuilder) -> Any:
        """The samples of ``row`` packed into one prefix tree: each shared prefix paid once."""
        return self.per_token * row.num_tokens + self.per_pair * row.load

    def of_lengths(self, lengths: List[int]) -> List[Any]:
        """Each sample alone, sharing nothing: N = L, P = L(L+1)/2."""
        a, b = self
        return [a * n + b * (n * (n + 1) // 2) for n in lengths]


_TOKENS = _CostModel(1, 0)  # balance_groups' cost="tokens"
_LOAD = _CostModel(0, 1)  # plan_rows' rows: score pairs alone, TRL's TreeRow.load


# ----------------------------------------------------------------------------- balance_groups


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
    if key not in KEYS:
        raise ValueError(f"key: expected one of {KEYS} (the trie key of cost='tree'), got {key!r}")
    model = _CostModel(*_coefficients(attention_coefficients))

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
        # Each group priced as its own trie (no sharing across groups: they go to any rank).
        group_costs = [_unit([inputs.items[i] for i in m], (key, False), model).cost for m in members]
    else:
        sample_costs = inputs.costs if inputs.costs is not None else _sample_costs(cost, inputs.lengths, model)
        group_costs = [_sum([sample_costs[i] for i in m]) for m in members]

    if method == "kk":
        parts = _karmarkar_karp(group_costs, num_ranks, equal_counts)
    else:
        parts = _lpt(group_costs, num_ranks, equal_counts)
    _fill_empty_ranks(parts, group_costs)
    if refine and num_ranks > 1:
        _refine(parts, group_costs, equal_counts)

    sample_indices, groups, costs = [], [], []
    for part in parts:
        part = sorted(part)  # group positions are in order of first sample
        sample_indices.append(tuple(sorted(i for g in part for i in members[g])))
        groups.append(tuple(group_order[g] for g in part))
        costs.append(_sum([group_costs[g] for g in part]))
    return RankAssignment(tuple(sample_indices), tuple(groups), tuple(costs), method, equal_counts)


# ----------------------------------------------------------------------------- plan_rows


@dataclasses.dataclass(frozen=True, eq=False)
class RowPlan:
    """The rows of every micro-batch, as indices into the planned samples.

    ``plan[k][r]`` (also ``plan.micro_batches[k][r]``) is the tuple of sample indices rank
    ``r`` forwards in micro-batch ``k``; iterating a plan yields its micro-batches. Every
    micro-batch has ``num_rows`` rows, and only the last can hold an empty one: under
    ``policy="trl"`` when the batch ends before it fills (as TRL's stream never does), under
    ``policy="balanced"`` only when no row holds two samples to share.

    Per row, ``[K, R]`` int64 tensors: ``tokens`` (unique tokens forwarded), ``trained``
    (trained tokens, the sum of the row's completion masks as TRL counts them) and ``load``
    (attention cost, TRL's ``TreeRow.load``). A row's numbers do not depend on the order of its
    samples, so they hold for ``pack_prefix_tree`` over the row's samples in any order
    (without ``group_index``, which would stop groups from sharing a common prefix).
    """

    micro_batches: Tuple[Tuple[Tuple[int, ...], ...], ...]
    tokens: torch.Tensor
    trained: torch.Tensor
    load: torch.Tensor
    num_rows: int
    token_budget: int
    policy: str
    key: str

    def __eq__(self, other) -> bool:
        if not isinstance(other, RowPlan):
            return NotImplemented
        return all(
            torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
            for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))
        )

    __hash__ = None  # equal plans must hash alike, and tensors do not hash by value

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __iter__(self) -> Iterator[Tuple[Tuple[int, ...], ...]]:
        return iter(self.micro_batches)

    def __getitem__(self, k: int) -> Tuple[Tuple[int, ...], ...]:
        return self.micro_batches[k]

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)

    @property
    def imbalance(self) -> torch.Tensor:
        """[K] float64: each micro-batch's max row load over its mean row load (TRL's
        ``batch/row_imbalance``); 1.0 is perfect balance."""
        load = self.load.to(torch.float64)
        return load.amax(1) / load.mean(1).clamp_min(1e-30)

    @property
    def critical_load(self) -> int:
        """The sum over micro-batches of the largest row load: the attention cost of the
        plan when every micro-batch waits for its slowest rank."""
        return int(self.load.amax(1).sum()) if len(self.micro_batches) else 0


def plan_rows(
    samples,
    *,
    num_rows: int,
    token_budget: int,
    lengths=None,
    completion_mask=None,
    completion_start=None,
    group_index=None,
    policy: str = "balanced",
    key: str = "token+next",
    separate_groups: bool = False,
) -> RowPlan:
    """Split ``samples`` into micro-batches of ``num_rows`` rows (one per data-parallel rank).

    Every row holds at most ``token_budget`` unique tokens and ``token_budget`` trained tokens;
    every sample lands in exactly one row. The rows of a micro-batch are non-empty whenever
    there are samples enough (a rank forwarding nothing would desync FSDP/EP collectives),
    and a group's samples stay in one row where they can, since they share their prompt.

    Args:
        samples: B token-id sequences, or a padded ``[B, L]`` tensor with ``lengths`` (as
            :func:`pack_prefix_tree`).
        num_rows: rows per micro-batch (the data-parallel world size).
        token_budget: the most unique tokens, and the most trained tokens, in one row.
        completion_mask / completion_start: the trained tokens, as for :func:`pack_prefix_tree`.
        group_index: [B] group ids (samples of one prompt). Without it, samples with the same
            prompt (the tokens before their first trained token) form a group.
        policy: ``"balanced"`` (default) plans the whole batch at once, free to reorder it:
            each group is priced as one trie and placed costliest first into the least-loaded
            row that takes it (LPT), a group being split only where the budget or the balance
            needs it; a tight best-fit packing and TRL's own placement compete, and the plan
            with the fewest micro-batches (never more than ``"trl"``'s), then the least sum
            over micro-batches of the slowest row's load, wins. Rows are then dealt into
            micro-batches by cost, so rows of similar cost run together.
            ``"trl"`` reproduces TRL 1.16's streaming ``TokenBudgetBatcher`` exactly: samples
            in the given order, each into the least-loaded row that fits, rows holding its
            group first; a micro-batch closes when the sample fits no row, or none of its
            group's rows while every row holds a sample. TRL never emits its last, partial
            micro-batch (its stream does not end); here it is the plan's last micro-batch.
        key: the trie key, as for :func:`pack_prefix_tree`; ``"token"`` shares more and so
            prices samples lower.
        separate_groups: price rows as trees that share nothing across groups, which is what
            ``pack_rows(..., group_index=)`` builds; by default rows share any common prefix
            across groups (a system prompt), as TRL's rows and ``pack_rows`` without
            ``group_index`` do. Pack with the same choice the plan was made with, or the budget
            does not hold. Needs ``group_index``.

    Returns:
        A :class:`RowPlan`; ``plan[k][r]`` are the sample indices of row ``r`` of micro-batch
        ``k`` (ascending under ``"balanced"``, in placement order under ``"trl"``).

    Raises:
        ValueError: a sample longer than ``token_budget`` (or with more trained tokens) fits
            in no row. TRL drops such a sample with a warning; a plan never drops one, under
            either policy, so the caller raises the budget or truncates the sample.
    """
    num_rows = check_int("num_rows", num_rows, minimum=1)
    token_budget = check_int("token_budget", token_budget, minimum=1)
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    _key(key)
    if not isinstance(separate_groups, bool):
        raise TypeError(f"separate_groups: expected a bool, got {type(separate_groups).__name__}")
    if separate_groups and group_index is None:
        raise ValueError("separate_groups: needs group_index (the groups pack_rows keeps apart)")
    spec = (key, separate_groups)
    flat = _flatten(samples, lengths, completion_mask, completion_start, None, None, group_index)
    items = _sample_dicts(flat, group_by="prompt" if group_index is None else "index")
    for b, item in enumerate(items):
        n, t = item["input_ids"].shape[0], item["trained"]
        if n > token_budget or t > token_budget:
            raise ValueError(
                f"token_budget: sample {b} has {n} tokens ({t} trained), more than token_budget={token_budget}, "
                "so it fits in no row; raise token_budget to at least the longest sample or truncate the sample"
            )
    if policy == "trl":
        batches = _plan_trl(items, num_rows, token_budget, spec)
        rows = [[[s["index"] for s in row.samples] for row in batch] for batch in batches]
    else:
        batches = _plan_balanced(items, num_rows, token_budget, spec)
        rows = [[sorted(s["index"] for s in row.samples) for row in batch] for batch in batches]
    return RowPlan(
        micro_batches=tuple(tuple(tuple(row) for row in batch) for batch in rows),
        tokens=_stat(batches, num_rows, lambda row: row.num_tokens),
        trained=_stat(batches, num_rows, lambda row: row.trained),
        load=_stat(batches, num_rows, lambda row: row.load),
        num_rows=num_rows,
        token_budget=token_budget,
        policy=policy,
        key=key,
    )


def _stat(batches: Sequence[Sequence[TreeRowBuilder]], num_rows: int, value) -> torch.Tensor:
    out = torch.tensor([[value(row) for row in batch] for batch in batches], dtype=torch.int64)
    return out.reshape(len(batches), num_rows)


# ----------------------------------------------------------------------------- units: samples priced together


class _Unit(NamedTuple):
    """Samples placed together (a group, or part of one) and their price as one trie, read
    once: the placements read it many times."""

    samples: List[Dict[str, Any]]
    num_tokens: int
    trained: int
    cost: Any


def _builder(items, key: Tuple[str, bool]) -> TreeRowBuilder:
    row = TreeRowBuilder(*key)
    for item in items:
        row.add(item)
    return row


def _unit(items, key: Tuple[str, bool], model: _CostModel = _LOAD) -> _Unit:
    row = _builder(items, key)
    return _Unit(list(items), row.num_tokens, row.trained, model.of_tree(row))


def _sample_dicts(flat, group_by: Optional[str]) -> List[Dict[str, Any]]:
    """TRL's rollout dicts (what TreeRowBuilder takes), with each sample's index and trained
    token count. ``group_id``: the sample's code in ``flat.group`` (``group_by="index"``), its
    prompt's (``"prompt"``), or None."""
    cu = flat.cu_tokens.tolist()
    trained = flat.trained
    if trained.dtype != torch.bool:
        # Given as each sample's first trained position: the rollout dicts need the mask.
        lens = flat.cu_tokens.diff()
        pos = torch.arange(flat.tokens.shape[0]) - torch.repeat_interleave(flat.cu_tokens[:-1], lens)
        trained = pos >= torch.repeat_interleave(trained, lens)
    items = []
    prompts: Dict[bytes, int] = {}
    for b in range(len(cu) - 1):
        ids = flat.tokens[cu[b] : cu[b + 1]]
        mask = trained[cu[b] : cu[b + 1]]
        group = None
        if group_by == "index":
            group = int(flat.group[b])
        elif group_by == "prompt":
            # The prompt is what a group's samples share by construction: the tokens before the
            # first trained one (all of them when none is trained).
            first = int(mask.nonzero()[0, 0]) if bool(mask.any()) else ids.shape[0]
            group = prompts.setdefault(ids[:first].numpy().tobytes(), len(prompts))
        count = int(mask.sum())
        items.append({"input_ids": ids, "completion_mask": mask, "group_id": group, "index": b, "trained": count})
    return items


def _by_group(ids) -> Tuple[List[Any], List[List[int]]]:
    """(the group ids in order of their first sample, each group's sample positions ascending)."""
    first: dict = {}  # insertion-ordered: positions follow the first sample of each group
    members: List[List[int]] = []
    for i, gid in enumerate(ids):
        pos = first.setdefault(gid, len(first))
        if pos == len(members):
            members.append([])
        members[pos].append(i)
    return list(first), members


# ----------------------------------------------------------------------------- placement


class _Rows:
    """``num`` rows (or ranks) being filled, priced additively (a row's cost is the sum of its
    units'), kept sorted so that finding a row is a bisection: by (cost, members) to balance
    (LPT takes the cheapest row that takes the unit), by free tokens to pack tightly (best fit
    takes the row with the least room that takes it, after every empty row has been given a
    unit). A row takes a unit while it stays within ``budget`` tokens and ``budget`` trained
    tokens and holds fewer than ``cap`` members."""

    def __init__(self, num: int, budget=math.inf, tight: bool = False, cap=math.inf):
        self.budget, self.tight, self.cap = budget, tight, cap
        self.tokens, self.trained, self.cost = [0] * num, [0] * num, [0] * num
        self.members: List[List[Any]] = [[] for _ in range(num)]
        self.order = sorted(self._key(r) for r in range(num))

    def _key(self, r: int):
        if self.tight:
            return (bool(self.members[r]), self.budget - self.tokens[r], r)
        # Empty rows first among equal costs: a zero-cost unit (empty samples) still gets a row
        # of its own while one is free.
        return (self.cost[r], len(self.members[r]), r)

    def fits(self, r: int, tokens: int, trained: int) -> bool:
        return (
            len(self.members[r]) < self.cap
            and self.tokens[r] + tokens <= self.budget
            and self.trained[r] + trained <= self.budget
        )

    def rank(self, r: int):
        """Which of several rows that fit to prefer (smaller first)."""
        return (-self.tokens[r], r) if self.tight else (self.cost[r], len(self.members[r]), r)

    def find(self, tokens: int, trained: int) -> Optional[int]:
        start = 0
        if self.tight and self.order and self.order[0][0]:
            # No empty row left: best fit, the least room that takes the tokens.
            start = bisect.bisect_left(self.order, (True, tokens, -1))
        for entry in itertools.islice(self.order, start, None):
            if self.fits(entry[-1], tokens, trained):
                return entry[-1]
        return None

    def add(self, r: int, tokens: int, trained: int, cost, members) -> None:
        del self.order[bisect.bisect_left(self.order, self._key(r))]
        self.tokens[r] += tokens
        self.trained[r] += trained
        self.cost[r] += cost
        self.members[r].extend(members)
        bisect.insort(self.order, self._key(r))


def _lender(sizes: Sequence[int], tiebreak: Callable[[int], Any]) -> Optional[Tuple[int, int]]:
    """(donor, empty): the first empty row and the row with the most members (ties to the
    larger ``tiebreak(r)``), while that one holds two to spare one; None otherwise. A rank
    forwarding nothing stalls the trainer's collectives."""
    empty = next((r for r, n in enumerate(sizes) if not n), None)
    if empty is None:
        return None
    donor = max(range(len(sizes)), key=lambda r: (sizes[r], tiebreak(r)))
    return (donor, empty) if sizes[donor] >= 2 else None


# ----------------------------------------------------------------------------- balance_groups: partitioners


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
    ranks = _Rows(k, cap=len(costs) // k if equal_counts else math.inf)
    for g in sorted(range(len(costs)), key=lambda g: (-costs[g], g)):
        ranks.add(ranks.find(0, 0), 0, 0, costs[g], [g])  # the ranks' shares add up to every group
    return ranks.members


def _fill_empty_ranks(parts: List[List[int]], costs: Sequence) -> None:
    """Give each empty rank the cheapest group of the rank holding the most groups (ties: the
    lower rank), while one holds two: Karmarkar–Karp can leave a rank empty (zero-cost groups)
    though there are groups enough. The moved group costs no more than its donor did, so the
    costliest rank stays."""
    while (move := _lender([len(p) for p in parts], lambda r: -r)) is not None:
        donor, empty = move
        g = min(parts[donor], key=lambda g: (costs[g], g))
        parts[donor].remove(g)
        parts[empty].append(g)


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


# ----------------------------------------------------------------------------- balance_groups: costs and inputs


def _sample_costs(cost, lens: torch.Tensor, model: _CostModel) -> List[Any]:
    if cost == "tokens":
        return _TOKENS.of_lengths(lens.tolist())
    if cost == "attention":
        return model.of_lengths(lens.tolist())
    out = cost(lens.clone())
    values = _cost_vector("cost", out, what="the callable's output")
    if len(values) != lens.shape[0]:
        raise ValueError(f"cost: the callable returned {len(values)} costs for {lens.shape[0]} samples")
    return values


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


@dataclasses.dataclass(frozen=True)
class _Samples:
    """The per-sample input of one cost model: lengths [B] int64 (None under ``"given"``),
    the samples as rollout dicts (``"tree"`` only) or the given costs."""

    lengths: Optional[torch.Tensor]
    items: Optional[List[Dict[str, Any]]] = None
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
    padded = isinstance(samples, torch.Tensor) and samples.dim() == 2
    # Every token marked trained: the mask changes no tree's tokens or score pairs.
    flat = _flatten(samples, lengths if padded else None, None, 0, None, None, None)
    tree_lens = flat.cu_tokens.diff()
    if lengths is not None and not padded:
        if _int_vector("lengths", lengths, "lengths").tolist() != tree_lens.tolist():
            raise ValueError("lengths: must equal the lengths of samples (or be None under cost='tree')")
    return _Samples(tree_lens, _sample_dicts(flat, group_by=None))


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
    return _by_group(g.tolist())


# ----------------------------------------------------------------------------- policy="trl"


def _plan_trl(items, num_rows: int, budget: int, key: Tuple[str, bool]) -> List[List[TreeRowBuilder]]:
    """TRL 1.16's ``TokenBudgetBatcher.__iter__``, over a finite stream."""
    batches = []
    rows = [TreeRowBuilder(*key) for _ in range(num_rows)]
    for item in items:
        # Terminates: every sample fits an empty row (checked against the budget up front).
        while True:
            row = _trl_place(rows, item, budget)
            if row is not None:
                row.add(item)
                break
            batches.append(rows)
            rows = [TreeRowBuilder(*key) for _ in range(num_rows)]
    if any(row.samples for row in rows):
        batches.append(rows)
    return batches


def _trl_place(rows: List[TreeRowBuilder], item, budget: int) -> Optional[TreeRowBuilder]:
    """TRL 1.16's ``TokenBudgetBatcher._place``: the rows holding the sample's group get first
    refusal; when none has room, the micro-batch closes unless a row is still empty."""

    def least_loaded(candidates):
        # min() keeps the first of equal loads, as TRL's does: ties go to the lowest rank.
        return min((row for row in candidates if row.fits(item, budget)), key=lambda row: row.load, default=None)

    home = [row for row in rows if item["group_id"] in row.groups]
    placed = least_loaded(home)
    if placed is not None:
        return placed
    if home and all(row.samples for row in rows):
        return None
    return least_loaded(rows)


# ----------------------------------------------------------------------------- policy="balanced"


# The balanced policy's candidate placements: (split_above, tight). ``split_above`` is the factor
# over the mean row cost above which a group is split for balance (None: only as the budget
# requires; a split repeats the group's prompt and can cost a micro-batch); ``tight`` packs for
# the fewest micro-batches instead of balancing. Each is tried and the best kept.
_CANDIDATES = ((None, False), (1.0, False), (1.5, False), (None, True))


def _plan_balanced(items, num_rows: int, budget: int, key: Tuple[str, bool]) -> List[List[TreeRowBuilder]]:
    """The best candidate over the fewest micro-batches any candidate achieves: fewest
    micro-batches first (each is a step of every rank), then the least sum over micro-batches
    of the slowest row, then the fewest tokens forwarded.

    TRL's streaming placement is a candidate at its own count of micro-batches, so the plan
    never needs more micro-batches than it. The other placements price each unit (a group, or a
    part of one) as its own trie and add the prices up, an upper bound on the packed row
    (a prefix common to several groups, like a system prompt, is counted once per group), so
    placing is arithmetic; the rows are priced exactly once placed.
    """
    if not items:
        return []
    units = _group_units(items, budget, key)
    streamed = [row for batch in _plan_trl(items, num_rows, budget, key) for row in batch]
    most = len(streamed) // num_rows
    # No plan has fewer micro-batches than this: trained tokens add up across rows, and the
    # rows together forward at least the batch's own unique tokens.
    whole = _builder(items, key)
    fewest = max(1, math.ceil(max(whole.num_tokens, whole.trained) / (num_rows * budget)))
    # With one row per micro-batch there is nothing to balance.
    candidates = [c for c in _CANDIDATES if num_rows > 1 or c[0] is None]
    total = sum(unit.cost for unit in units)

    def placements(k: int) -> List[List[List[Dict[str, Any]]]]:
        out = []
        for split_above, tight in candidates:
            target = math.inf if split_above is None else split_above * total / (k * num_rows)
            # Balancing gives every row a unit by splitting groups beforehand, into even
            # halves; packing tightly would waste room that way, so it lends samples to empty
            # rows after.
            split = _split(units, 0 if tight else k * num_rows, target, key)
            rows = _place_units(split, k * num_rows, budget, key, tight)
            if rows is not None:
                out.append(rows)
        return out

    # The fewest micro-batches a placement reaches, by bisection between the bound and TRL's
    # count (a placement that fits in k micro-batches nearly always fits in k + 1).
    found: Dict[int, List[List[List[Dict[str, Any]]]]] = {}
    low, high = min(fewest, most), most
    while low < high:
        mid = (low + high) // 2
        found[mid] = placements(mid)
        if found[mid]:
            high = mid
        else:
            low = mid + 1
    plans = [[list(row.samples) for row in streamed]] if low == most else []
    plans += found[low] if low in found else placements(low)
    best, best_cost = None, None
    for members in plans:
        rows = [_builder(sorted(row, key=lambda item: item["index"]), key) for row in members]
        _fill_empty_rows(rows, key)
        # Rows sorted by cost and dealt into consecutive micro-batches put rows of similar cost
        # together, which minimises the sum over micro-batches of the slowest row; empty rows,
        # if any, all land in the last micro-batch.
        rows.sort(
            key=lambda row: (-_LOAD.of_tree(row), -len(row.samples), min((s["index"] for s in row.samples), default=0))
        )
        batches = [rows[i : i + num_rows] for i in range(0, len(rows), num_rows)]
        cost = (sum(_LOAD.of_tree(batch[0]) for batch in batches), sum(row.num_tokens for row in rows))
        if best_cost is None or cost < best_cost:
            best, best_cost = batches, cost
    return best


def _fits_alone(unit: _Unit, budget: int) -> bool:
    return unit.num_tokens <= budget and unit.trained <= budget


def _group_units(items, budget: int, key: Tuple[str, bool]) -> List[_Unit]:
    """Each group priced as one trie; a group over the budget is cut into the fewest chunks of
    consecutive samples, of even sample counts, that each fit a row (even chunks balance
    better than filling each to the brim and leaving a small remainder)."""
    units = []
    for positions in _by_group(item["group_id"] for item in items)[1]:
        members = [items[i] for i in positions]
        whole = _unit(members, key)
        # Fewer chunks than this cannot fit; with one sample per chunk every chunk fits
        # (checked up front), so the search ends.
        fewest = max(1, math.ceil(max(whole.num_tokens, whole.trained) / budget))
        for count in range(fewest, len(members) + 1):
            chunks = [whole] if count == 1 else [_unit(part, key) for part in _even_parts(members, count)]
            if all(_fits_alone(chunk, budget) for chunk in chunks):
                break
        units.extend(chunks)
    return units


def _even_parts(members: List[Any], count: int) -> List[List[Any]]:
    size, extra = divmod(len(members), count)
    bounds = [0]
    for i in range(count):
        bounds.append(bounds[-1] + size + (i < extra))
    return [members[bounds[i] : bounds[i + 1]] for i in range(count)]


def _split(units: List[_Unit], count: int, target: float, key: Tuple[str, bool]) -> List[_Unit]:
    """Halve the costliest unit while there are fewer than ``count`` units (so every row can
    get one, TRL's ``FixedCountBatcher`` rule) or while it costs more than ``target``, the mean
    row cost (a unit above it makes its row the slowest whatever the placement)."""
    done = [u for u in units if len(u.samples) < 2]
    # A max-heap on cost of the units that can still be halved; the position breaks ties.
    heap = [(-u.cost, i, u) for i, u in enumerate(units) if len(u.samples) > 1]
    heapq.heapify(heap)
    serial = len(units)
    while heap and (len(done) + len(heap) < count or -heap[0][0] > target):
        _, _, unit = heapq.heappop(heap)
        for part in _even_parts(unit.samples, 2):
            half = _unit(part, key)
            if len(part) > 1:
                heapq.heappush(heap, (-half.cost, serial, half))
                serial += 1
            else:
                done.append(half)
    return done + [u for _, _, u in heap]


def _place_units(
    units, num: int, budget: int, key: Tuple[str, bool], tight: bool
) -> Optional[List[List[Dict[str, Any]]]]:
    """Each row's samples with every unit placed in one of ``num`` rows, or None when some
    sample fits nowhere (more micro-batches are needed).

    Balancing (``tight=False``) is LPT: costliest unit first, each into the least-loaded row
    that takes it whole. Packing (``tight=True``) is best-fit decreasing: largest unit first,
    into an empty row while one is left, then into the row with the least room that takes it;
    it balances worse but can fit the budget in fewer micro-batches. Either way a unit no row
    takes whole is spread sample by sample, onto the rows already holding part of it first
    (where the sample costs only what it does not share with that part).
    """
    rows = _Rows(num, budget, tight)
    if tight:
        order = sorted(units, key=lambda u: (-u.num_tokens, -u.trained, u.samples[0]["index"]))
    else:
        order = sorted(units, key=lambda u: (-u.cost, u.samples[0]["index"]))
    for unit in order:
        r = rows.find(unit.num_tokens, unit.trained)
        if r is not None:
            rows.add(r, unit.num_tokens, unit.trained, unit.cost, unit.samples)
            continue
        parts: Dict[int, TreeRowBuilder] = {}  # row -> this unit's samples placed there
        for item in unit.samples:
            n, t = item["input_ids"].shape[0], item["trained"]
            home = [r for r, part in parts.items() if rows.fits(r, n - _shared(part, item), t)]
            r = min(home, key=rows.rank) if home else rows.find(n, t)
            if r is None:
                return None
            part = parts.setdefault(r, TreeRowBuilder(*key))
            before = (part.num_tokens, part.trained, _LOAD.of_tree(part))
            part.add(item)
            rows.add(r, part.num_tokens - before[0], part.trained - before[1], _LOAD.of_tree(part) - before[2], [item])
    return rows.members


def _fill_empty_rows(rows: List[TreeRowBuilder], key: Tuple[str, bool]) -> None:
    """Move the last sample of the row with the most samples (ties: the costlier, then the
    lower row) into each empty row, while one has two. Taking a sample out of a row never
    raises its tokens, and a sample alone always fits."""
    while (move := _lender([len(row.samples) for row in rows], lambda r: (_LOAD.of_tree(rows[r]), -r))) is not None:
        donor, empty = move
        members = rows[donor].samples
        rows[donor] = _builder(members[:-1], key)
        rows[empty] = _builder(members[-1:], key)


def _shared(row: TreeRowBuilder, item: Dict[str, Any]) -> int:
    """How many leading tokens of the sample the row already holds (the part ``fits`` does
    not charge for)."""
    return row.shared_prefix(item)
