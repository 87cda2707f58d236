"""Planning rows: which samples each data-parallel rank forwards, micro-batch by micro-batch.

A micro-batch is ``num_rows`` rows, one per rank, each packed into its own prefix tree. A
row is bounded by ``token_budget`` twice, as in TRL 1.16's AsyncGRPO planner: its unique
(forwarded) tokens bound activation memory, and its trained tokens (the sum of its samples'
completion masks) bound the loss terms, which packing does not shrink. Ranks meet at every
micro-batch's all-reduce, so the slowest row sets the pace: rows are balanced on attention
cost (TRL's ``TreeRow.load``, the sum over unique tokens of depth + 1), not on token count,
because attention is superlinear in length.

Every price comes from :class:`TreeRowBuilder` (the C++ trie), so a sample costs only what it
does not already share with its row.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .._core.validation import check_int
from ._builder import TreeRowBuilder
from ._tree import _flatten, _key

POLICIES = ("balanced", "trl")


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
    items = _sample_dicts(flat, group_index is not None)
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


# ----------------------------------------------------------------------------- inputs


def _sample_dicts(flat, have_groups: bool) -> List[Dict[str, Any]]:
    """TRL's rollout dicts (what TreeRowBuilder takes), with each sample's index."""
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
        if have_groups:
            group = int(flat.group[b])
        else:
            # The prompt is what a group's samples share by construction: the tokens before the
            # first trained one (all of them when none is trained).
            first = int(mask.nonzero()[0, 0]) if bool(mask.any()) else ids.shape[0]
            group = prompts.setdefault(ids[:first].numpy().tobytes(), len(prompts))
        count = int(mask.sum())
        items.append({"input_ids": ids, "completion_mask": mask, "group_id": group, "index": b, "trained": count})
    return items


def _stat(batches: Sequence[Sequence[TreeRowBuilder]], num_rows: int, value) -> torch.Tensor:
    out = torch.tensor([[value(row) for row in batch] for batch in batches], dtype=torch.int64)
    return out.reshape(len(batches), num_rows)


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
    total = sum(unit.load for unit in units)

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
        _fill_empty(rows, key)
        # Rows sorted by cost and dealt into consecutive micro-batches put rows of similar cost
        # together, which minimises the sum over micro-batches of the slowest row; empty rows,
        # if any, all land in the last micro-batch.
        rows.sort(key=lambda row: (-row.load, -len(row.samples), min((s["index"] for s in row.samples), default=0)))
        batches = [rows[i : i + num_rows] for i in range(0, len(rows), num_rows)]
        cost = (sum(batch[0].load for batch in batches), sum(row.num_tokens for row in rows))
        if best_cost is None or cost < best_cost:
            best, best_cost = batches, cost
    return best


def _builder(items, key: Tuple[str, bool]) -> TreeRowBuilder:
    row = TreeRowBuilder(*key)
    for item in items:
        row.add(item)
    return row


class _Unit(NamedTuple):
    """Samples placed together (a group, or part of one) and their price as one trie, read
    once: the placements read it many times."""

    samples: List[Dict[str, Any]]
    num_tokens: int
    trained: int
    load: int


def _unit(items, key: Tuple[str, bool]) -> _Unit:
    row = _builder(items, key)
    return _Unit(list(items), row.num_tokens, row.trained, row.load)


def _fits_alone(unit: _Unit, budget: int) -> bool:
    return unit.num_tokens <= budget and unit.trained <= budget


def _group_units(items, budget: int, key: Tuple[str, bool]) -> List[_Unit]:
    """Each group priced as one trie; a group over the budget is cut into the fewest chunks of
    consecutive samples, of even sample counts, that each fit a row (even chunks balance
    better than filling each to the brim and leaving a small remainder)."""
    groups: Dict[int, List[Dict[str, Any]]] = {}
    for item in items:
        groups.setdefault(item["group_id"], []).append(item)
    units = []
    for members in groups.values():
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
    heap = [(-u.load, i, u) for i, u in enumerate(units) if len(u.samples) > 1]
    heapq.heapify(heap)
    serial = len(units)
    while heap and (len(done) + len(heap) < count or -heap[0][0] > target):
        _, _, unit = heapq.heappop(heap)
        for part in _even_parts(unit.samples, 2):
            half = _unit(part, key)
            if len(part) > 1:
                heapq.heappush(heap, (-half.load, serial, half))
                serial += 1
            else:
                done.append(half)
    return done + [u for _, _, u in heap]


class _Rows:
    """``num`` rows being filled, priced additively (see :func:`_plan_balanced`), kept sorted
    so that finding a row is a bisection: by (load, samples) to balance (LPT takes the
    least-loaded row that fits), by free tokens to pack tightly (best fit takes the row with
    the least room that fits, after every empty row has been given a unit)."""

    def __init__(self, num: int, budget: int, tight: bool):
        self.budget, self.tight = budget, tight
        self.tokens, self.trained, self.load = [0] * num, [0] * num, [0] * num
        self.members: List[List[Dict[str, Any]]] = [[] for _ in range(num)]
        self.order = sorted(self._key(r) for r in range(num))

    def _key(self, r: int):
        if self.tight:
            return (bool(self.members[r]), self.budget - self.tokens[r], r)
        # Empty rows first among equal loads: a zero-load unit (empty samples) still gets a row
        # of its own while one is free.
        return (self.load[r], len(self.members[r]), r)

    def fits(self, r: int, tokens: int, trained: int) -> bool:
        return self.tokens[r] + tokens <= self.budget and self.trained[r] + trained <= self.budget

    def rank(self, r: int):
        """Which of several rows that fit to prefer (smaller first)."""
        return (-self.tokens[r], r) if self.tight else (self.load[r], len(self.members[r]), r)

    def find(self, tokens: int, trained: int) -> Optional[int]:
        start = 0
        if self.tight and self.order and self.order[0][0]:
            # No empty row left: best fit, the least room that takes the tokens.
            start = bisect.bisect_left(self.order, (True, tokens, -1))
        for entry in itertools.islice(self.order, start, None):
            if self.fits(entry[-1], tokens, trained):
                return entry[-1]
        return None

    def add(self, r: int, tokens: int, trained: int, load: int, items) -> None:
        del self.order[bisect.bisect_left(self.order, self._key(r))]
        self.tokens[r] += tokens
        self.trained[r] += trained
        self.load[r] += load
        self.members[r].extend(items)
        bisect.insort(self.order, self._key(r))


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
        order = sorted(units, key=lambda u: (-u.load, u.samples[0]["index"]))
    for unit in order:
        r = rows.find(unit.num_tokens, unit.trained)
        if r is not None:
            rows.add(r, unit.num_tokens, unit.trained, unit.load, unit.samples)
            continue
        parts: Dict[int, TreeRowBuilder] = {}  # row -> this unit's samples placed there
        for item in unit.samples:
            n, t = item["input_ids"].shape[0], item["trained"]
            home = [r for r, part in parts.items() if rows.fits(r, n - _shared(part, item), t)]
            r = min(home, key=rows.rank) if home else rows.find(n, t)
            if r is None:
                return None
            part = parts.setdefault(r, TreeRowBuilder(*key))
            before = (part.num_tokens, part.trained, part.load)
            part.add(item)
            rows.add(r, part.num_tokens - before[0], part.trained - before[1], part.load - before[2], [item])
    return rows.members


def _fill_empty(rows: List[TreeRowBuilder], key: Tuple[str, bool]) -> None:
    """Move a sample into each empty row from the row with the most samples, while one has
    two: a rank forwarding nothing would desync collectives. Taking a sample out of a row
    never raises its tokens, and a sample alone always fits."""
    while True:
        empty = [r for r in range(len(rows)) if not rows[r].samples]
        donor = max(range(len(rows)), key=lambda r: (len(rows[r].samples), rows[r].load, -r))
        if not empty or len(rows[donor].samples) < 2:
            return
        members = rows[donor].samples
        rows[donor] = _builder(members[:-1], key)
        rows[empty[0]] = _builder(members[-1:], key)


def _shared(row: TreeRowBuilder, item: Dict[str, Any]) -> int:
    """How many leading tokens of the sample the row already holds (the part ``fits`` does
    not charge for)."""
    return row.shared_prefix(item)
