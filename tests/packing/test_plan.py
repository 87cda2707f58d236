"""plan_rows: TRL 1.16's TokenBudgetBatcher placement reproduced exactly (policy="trl"), the
balanced policy's invariants and its advantage over TRL, oversize samples, bad input."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from collections import defaultdict

import numpy as np
import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import trl.experimental.async_grpo.async_grpo_trainer as trl_trainer  # noqa: E402

from rlvr_kernels.packing import RowPlan, pack_prefix_tree, pack_rows, plan_rows  # noqa: E402

pytestmark = pytest.mark.cpu_kernel

KEYS = ("token+next", "token")


def workload(seed: int, *, groups=(2, 12), group_size=(1, 8), prompt=(1, 20), completion=(0, 20), system=None):
    """A seeded GRPO-like batch: groups sharing a prompt (sometimes behind a system prompt
    common to all groups), a small vocabulary so completions share prefixes too, duplicates,
    samples that are prefixes of others, multi-turn masks (untrained spans inside the
    completion) and empty completions. Returns (samples, masks, group ids), group-major."""
    rng = random.Random(seed)
    vocab = rng.choice([3, 6, 50])
    head = [rng.randrange(vocab) for _ in range(rng.randint(1, 8) if system is None and rng.random() < 0.3 else 0)]
    if system:
        head = [rng.randrange(vocab) for _ in range(system)]
    samples, masks, gids = [], [], []
    for g in range(rng.randint(*groups)):
        p = head + [rng.randrange(vocab) for _ in range(rng.randint(*prompt))]
        members = []
        for _ in range(rng.randint(*group_size)):
            roll = rng.random()
            if members and roll < 0.15:
                s, m = members[rng.randrange(len(members))]  # a duplicate
            elif members and roll < 0.3:
                s, m = members[rng.randrange(len(members))]  # a prefix of another sample
                cut = rng.randint(len(p), len(s))
                s, m = s[:cut], m[:cut]
            else:
                c = [rng.randrange(vocab) for _ in range(rng.randint(*completion))]
                s = p + c
                m = [0] * len(p) + [1] * len(c)
                if rng.random() < 0.3 and len(c) > 2:  # multi-turn: a tool turn inside the completion
                    a = rng.randrange(len(c))
                    b = rng.randint(a, len(c))
                    m[len(p) + a : len(p) + b] = [0] * (b - a)
            members.append((list(s), list(m)))
        for s, m in members:
            samples.append(s)
            masks.append(m)
            gids.append(g)
    return samples, masks, gids


def interleave(seed: int, samples, masks, gids):
    """The same samples in an order where groups arrive interleaved (async rollouts)."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    return [samples[i] for i in order], [masks[i] for i in order], [gids[i] for i in order]


def trl_batches(samples, masks, gids, num_rows: int, budget: int, monkeypatch):
    """TRL's TokenBudgetBatcher over the samples as a stream: the micro-batches it yields, then
    the partial one it holds when the stream ends (it never yields that one), as TreeRows."""
    created = []

    class Recorded(trl_trainer.TreeRow):
        def __init__(self):
            super().__init__()
            created.append(self)

    monkeypatch.setattr(trl_trainer, "TreeRow", Recorded)
    # TRL warns through accelerate's logger, which needs an initialised accelerate state.
    monkeypatch.setattr(trl_trainer, "logger", logging.getLogger("trl.async_grpo"))
    stream = [
        {
            "input_ids": torch.tensor(s, dtype=torch.long),
            "completion_mask": torch.tensor(m, dtype=torch.long),
            "old_log_probs": torch.zeros(len(s)),
            "advantage": 0.0,
            "group_id": g,
            "index": i,
        }
        for i, (s, m, g) in enumerate(zip(samples, masks, gids))
    ]
    metrics = defaultdict(list)
    batches = [list(rows) for rows in trl_trainer.TokenBudgetBatcher(stream, num_rows, budget, metrics)]
    tail = created[-num_rows:]
    if any(row.samples for row in tail):
        batches.append(tail)
    return batches, metrics


def indices(batches):
    return [[[s["index"] for s in row.samples] for row in rows] for rows in batches]


def as_lists(plan: RowPlan):
    return [[list(row) for row in batch] for batch in plan]


def check_rows(plan: RowPlan, samples, masks, key: str):
    """Each planned row priced by building its pack: the plan's numbers are the pack's, and
    within the budget."""
    for k, batch in enumerate(plan):
        assert len(batch) == plan.num_rows
        for r, row in enumerate(batch):
            trained = sum(sum(masks[i]) for i in row)
            if row:
                pack = pack_prefix_tree([samples[i] for i in row], completion_mask=[masks[i] for i in row], key=key)
                tokens, load = pack.num_tokens, pack.load
            else:
                tokens = load = 0
            assert (int(plan.tokens[k, r]), int(plan.trained[k, r]), int(plan.load[k, r])) == (tokens, trained, load)
            assert tokens <= plan.token_budget and trained <= plan.token_budget


# ----------------------------------------------------------------------------- policy="trl"


@pytest.mark.parametrize("seed", range(16))
def test_trl_policy_reproduces_token_budget_batcher(seed, monkeypatch):
    rng = random.Random(seed)
    samples, masks, gids = workload(seed, prompt=(1, 20))
    if seed % 2:
        samples, masks, gids = interleave(seed, samples, masks, gids)
    num_rows = rng.randint(1, 4)
    longest = max(map(len, samples))
    budget = rng.randint(longest, 3 * longest)
    batches, metrics = trl_batches(samples, masks, gids, num_rows, budget, monkeypatch)
    assert not metrics  # nothing dropped: every sample is within the budget
    plan = plan_rows(
        samples, num_rows=num_rows, token_budget=budget, completion_mask=masks, group_index=gids, policy="trl"
    )
    assert as_lists(plan) == indices(batches)
    assert plan.tokens.tolist() == [[len(row.tokens) for row in rows] for rows in batches]
    assert plan.trained.tolist() == [[row.trained for row in rows] for rows in batches]
    assert plan.load.tolist() == [[row.load for row in rows] for rows in batches]
    assert (plan.num_rows, plan.token_budget, plan.policy, plan.key) == (num_rows, budget, "trl", "token+next")


def test_trl_policy_with_a_common_system_prompt_and_tight_budget(monkeypatch):
    """Groups share a system prompt, so the unique-token price of a sample depends on the row;
    a budget near the longest sample forces many closes and group splits."""
    samples, masks, gids = workload(7, groups=(8, 8), group_size=(4, 8), system=12)
    samples, masks, gids = interleave(7, samples, masks, gids)
    budget = max(map(len, samples)) + 5
    batches, _ = trl_batches(samples, masks, gids, 3, budget, monkeypatch)
    plan = plan_rows(samples, num_rows=3, token_budget=budget, completion_mask=masks, group_index=gids, policy="trl")
    assert len(plan) > 2
    assert as_lists(plan) == indices(batches)


def test_trl_policy_keeps_every_emitted_micro_batch_full():
    samples, masks, gids = workload(3, groups=(6, 6), group_size=(3, 6))
    plan = plan_rows(samples, num_rows=4, token_budget=max(map(len, samples)), completion_mask=masks, policy="trl")
    for batch in list(plan)[:-1]:
        assert all(batch)


# ----------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("policy", ("balanced", "trl"))
@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("seed", range(4))
def test_every_sample_placed_once_within_the_budget(seed, key, policy):
    rng = random.Random(100 + seed)
    samples, masks, gids = workload(100 + seed)
    num_rows = rng.randint(1, 5)
    longest = max(map(len, samples))
    budget = rng.randint(longest, 4 * longest)
    plan = plan_rows(
        samples, num_rows=num_rows, token_budget=budget, completion_mask=masks, group_index=gids, policy=policy, key=key
    )
    placed = sorted(i for batch in plan for row in batch for i in row)
    assert placed == list(range(len(samples)))
    assert plan.tokens.shape == plan.trained.shape == plan.load.shape == (len(plan), num_rows)
    check_rows(plan, samples, masks, key)
    # Empty rows only in the last micro-batch; under the balanced policy only when no row has
    # a sample to spare.
    for batch in list(plan)[:-1]:
        assert all(batch)
    if policy == "balanced" and not all(plan[-1]):
        assert all(len(row) <= 1 for batch in plan for row in batch)


@pytest.mark.parametrize("seed", range(3))
def test_balanced_never_worse_than_trl(seed, monkeypatch):
    """On seeded streams: no more micro-batches than TRL, a smaller sum over micro-batches of
    the slowest row's attention cost, and a micro-batch imbalance (max / mean row cost) no
    worse than TRL's worst."""
    rng = random.Random(200 + seed)
    samples, masks, gids = workload(200 + seed, groups=(6, 20), group_size=(2, 10), prompt=(5, 40))
    num_rows = rng.randint(2, 5)
    longest = max(map(len, samples))
    budget = rng.randint(longest, 3 * longest)
    kwargs = dict(num_rows=num_rows, token_budget=budget, completion_mask=masks, group_index=gids)
    trl = plan_rows(samples, policy="trl", **kwargs)
    balanced = plan_rows(samples, policy="balanced", **kwargs)
    assert len(balanced) <= len(trl)
    assert balanced.critical_load <= trl.critical_load
    assert float(balanced.imbalance.max()) <= float(trl.imbalance.max())
    check_rows(balanced, samples, masks, "token+next")


def test_balanced_beats_trl_on_a_grpo_batch():
    """Groups of 8 with long shared prompts arriving in order: TRL fills rows as samples come,
    the balanced plan prices whole groups and places the costliest first."""
    rng = random.Random(5)
    samples, gids, starts = [], [], []
    for g in range(12):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(20, 120))]
        for _ in range(8):
            samples.append(prompt + [rng.randrange(1000) for _ in range(rng.randint(5, 60))])
            gids.append(g)
            starts.append(len(prompt))
    kwargs = dict(num_rows=4, token_budget=600, completion_start=starts, group_index=gids)
    trl = plan_rows(samples, policy="trl", **kwargs)
    balanced = plan_rows(samples, policy="balanced", **kwargs)
    assert len(balanced) <= len(trl)
    assert balanced.critical_load < 0.9 * trl.critical_load
    assert float(balanced.imbalance.max()) < float(trl.imbalance.max())


def test_balanced_keeps_groups_whole_when_they_balance():
    """Six groups of the same shape over three rows: whole groups balance exactly, so none is
    split (splitting would forward a prompt twice)."""
    rng = random.Random(11)
    samples, gids, starts = [], [], []
    for g in range(6):
        prompt = [rng.randrange(100) for _ in range(16)]
        for _ in range(4):
            samples.append(prompt + [rng.randrange(100) for _ in range(10)])
            gids.append(g)
            starts.append(16)
    plan = plan_rows(samples, num_rows=3, token_budget=1000, completion_start=starts, group_index=gids)
    assert len(plan) == 1
    for row in plan[0]:
        assert len(row) == 8 and len({gids[i] for i in row}) == 2
    assert float(plan.imbalance[0]) == 1.0


def test_balanced_splits_a_group_over_the_budget():
    """Six samples sharing three tokens (the fourth is keyed on a different next token): a row
    of n of them forwards 3 + 4n tokens, so a budget of 15 takes three per row."""
    samples = [[1, 2, 3, 4, 5 + i, 6, 7] for i in range(6)]
    masks = [[0] * 4 + [1] * 3 for _ in samples]
    plan = plan_rows(samples, num_rows=2, token_budget=15, completion_start=4, group_index=[0] * 6)
    assert as_lists(plan) == [[[0, 1, 2], [3, 4, 5]]]
    check_rows(plan, samples, masks, "token+next")
    # One row short: a third row, alone in its micro-batch but for a sample lent to the other
    # rank so that neither forwards nothing.
    plan = plan_rows(samples, num_rows=2, token_budget=11, completion_start=4, group_index=[0] * 6)
    assert len(plan) == 2 and all(all(batch) for batch in plan)
    check_rows(plan, samples, masks, "token+next")


def test_groups_default_to_shared_prompts():
    """Without group_index, samples with the same tokens before their first trained token form
    a group."""
    samples, masks, gids = workload(21, groups=(5, 5), group_size=(3, 5))
    samples, masks, gids = interleave(21, samples, masks, gids)
    prompts = {}
    derived = []
    for s, m in zip(samples, masks):
        first = m.index(1) if 1 in m else len(s)
        derived.append(prompts.setdefault(tuple(s[:first]), len(prompts)))
    for policy in ("balanced", "trl"):
        kwargs = dict(num_rows=3, token_budget=2 * max(map(len, samples)), completion_mask=masks, policy=policy)
        assert plan_rows(samples, **kwargs) == plan_rows(samples, group_index=derived, **kwargs)


def test_padded_samples_and_completion_start():
    samples, _, gids = workload(31, completion=(1, 12))
    starts = [len(s) - 3 if len(s) > 3 else 0 for s in samples]
    lengths = [len(s) for s in samples]
    padded = torch.zeros(len(samples), max(lengths), dtype=torch.int32)
    for b, s in enumerate(samples):
        padded[b, : len(s)] = torch.tensor(s)
    kwargs = dict(num_rows=2, token_budget=max(lengths) * 2, completion_start=starts, group_index=gids)
    assert plan_rows(padded, lengths=lengths, **kwargs) == plan_rows(samples, **kwargs)


@pytest.mark.parametrize("policy", ("balanced", "trl"))
def test_small_batches(policy):
    empty = plan_rows([], num_rows=3, token_budget=8, completion_start=0, policy=policy)
    assert len(empty) == 0 and empty.tokens.shape == (0, 3) and empty.critical_load == 0
    few = plan_rows([[1, 2, 3], [4, 5]], num_rows=4, token_budget=8, completion_start=1, policy=policy)
    assert len(few) == 1 and sorted(len(row) for row in few[0]) == [0, 0, 1, 1]
    one = plan_rows([[1, 2, 3], [1, 2, 4], [5]], num_rows=1, token_budget=4, completion_start=1, policy=policy)
    assert sorted(i for batch in one for row in batch for i in row) == [0, 1, 2]
    assert all(int(t) <= 4 for t in one.tokens.flatten())
    # Empty samples (no tokens) are placed too.
    blank = plan_rows([[], [1, 2], []], num_rows=2, token_budget=4, completion_start=0, policy=policy)
    assert sorted(i for batch in blank for row in batch for i in row) == [0, 1, 2]


@pytest.mark.parametrize("key", KEYS)
def test_micro_batches_go_to_pack_rows(key):
    """A micro-batch of the plan is the ``rows`` argument of pack_rows as it is."""
    samples, masks, gids = workload(41)
    plan = plan_rows(samples, num_rows=3, token_budget=2 * max(map(len, samples)), completion_mask=masks, key=key)
    for k, batch in enumerate(plan):
        packs = pack_rows(samples, batch, completion_mask=masks, key=key)
        assert [p.num_tokens for p in packs] == plan.tokens[k].tolist()
        assert [p.load for p in packs] == plan.load[k].tolist()


def test_plan_is_a_frozen_sequence_of_micro_batches():
    plan = plan_rows([[1, 2, 3], [1, 2, 4], [7, 8]], num_rows=2, token_budget=8, completion_start=2)
    assert isinstance(plan, RowPlan) and plan.num_micro_batches == len(plan) == len(list(plan))
    assert plan[0] == plan.micro_batches[0] and isinstance(plan[0][0], tuple)
    assert plan.imbalance.shape == (len(plan),) and plan.imbalance.dtype == torch.float64
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.policy = "trl"
    assert plan != plan.micro_batches and plan != dataclasses.replace(plan, token_budget=9)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("policy", ("balanced", "trl"))
def test_a_sample_over_the_budget_raises(policy, monkeypatch):
    samples = [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [4, 5]]
    with pytest.raises(ValueError, match=r"token_budget: sample 1 has 7 tokens \(5 trained\).*token_budget=6"):
        plan_rows(samples, num_rows=2, token_budget=6, completion_start=2, policy=policy)
    # TRL drops such a sample with a warning; a plan never does.
    masks = [[0, 0] + [1] * (len(s) - 2) for s in samples]
    batches, metrics = trl_batches(samples, masks, [0, 0, 1], 2, 6, monkeypatch)
    assert metrics["batch/dropped_oversize_total"] == [1.0]
    assert sorted(i for rows in indices(batches) for row in rows for i in row) == [0, 2]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_rows=0), ValueError, "num_rows"),
        (dict(num_rows=1.5), TypeError, "num_rows"),
        (dict(num_rows=True), TypeError, "num_rows"),
        (dict(token_budget=0), ValueError, "token_budget"),
        (dict(token_budget="8"), TypeError, "token_budget"),
        (dict(policy="lpt"), ValueError, "policy"),
        (dict(key="next"), ValueError, "key"),
        (dict(group_index=[0, 1]), ValueError, "group_index"),
        (dict(completion_start=None), ValueError, "completion_mask"),
        (dict(completion_start=None, completion_mask=[[0, 1, 1], [0, 1], [1]]), ValueError, r"completion_mask\[1\]"),
        (dict(completion_start=[0, 1, 9]), ValueError, "completion_start"),
        (dict(samples=[[1, 2, -3], [1, 2], [3]]), ValueError, "samples"),
        (dict(samples=[np.array([1.5]), [1, 2], [3]]), TypeError, r"samples\[0\]"),
        (dict(samples="abc"), TypeError, "samples"),
        (dict(lengths=[3, 3, 1]), ValueError, "lengths"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, match):
    args = dict(samples=[[1, 2, 3], [1, 2, 4], [5]], num_rows=2, token_budget=8, completion_start=1)
    args.update(kwargs)
    samples = args.pop("samples")
    with pytest.raises(error, match=match):
        plan_rows(samples, **args)


@pytest.mark.parametrize("policy", ["trl", "balanced"])
def test_separate_groups_prices_what_pack_rows_with_group_index_builds(policy):
    from rlvr_kernels.packing import pack_rows

    system = list(range(10))
    samples, groups, start = [], [], []
    for g in range(4):
        prompt = system + [100 + g] * 3
        for j in range(2):
            samples.append(prompt + [50 + j, 60 + g, 70])
            groups.append(g)
            start.append(len(prompt))
    plan = plan_rows(
        samples,
        num_rows=1,
        token_budget=34,
        completion_start=start,
        group_index=groups,
        separate_groups=True,
        policy=policy,
    )
    for k, batch in enumerate(plan):
        packs = pack_rows(samples, batch, completion_start=start, group_index=groups)
        assert [p.num_tokens for p in packs] == plan.tokens[k].tolist()
        assert all(p.num_tokens <= 34 for p in packs)
    with pytest.raises(ValueError, match="separate_groups: needs group_index"):
        plan_rows(samples, num_rows=1, token_budget=34, completion_start=start, separate_groups=True)
