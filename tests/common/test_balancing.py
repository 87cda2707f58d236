"""balance_groups: whole groups over data-parallel ranks. Invariants on generated batches (every
sample once, groups whole, equal counts, determinism), quality against verl's partitioner run
at group granularity and against LPT, the prefix-tree cost on forests with shared prompts, and
bad input."""

from __future__ import annotations

import contextlib
import io
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions, karmarkar_karp

from rlvr_kernels.distributed import DEFAULT_ATTENTION_COEFFICIENTS, RankAssignment, balance_groups
from rlvr_kernels.packing.balancing import TREE_KEYS

A, B = DEFAULT_ATTENTION_COEFFICIENTS


def attention(n: int) -> int:
    return A * n + B * n * (n + 1) // 2


@st.composite
def batches(draw, max_groups: int = 24):
    """Groups of uneven sizes with ids that are neither contiguous nor sorted (some negative),
    their samples interleaved in the batch; lengths from 0 up, with a few long outliers."""
    num_groups = draw(st.integers(1, max_groups))
    ids = draw(st.lists(st.integers(-50, 10**6), min_size=num_groups, max_size=num_groups, unique=True))
    group_index, lengths = [], []
    for gid in ids:
        prompt = draw(st.integers(0, 300))
        for _ in range(draw(st.integers(1, 6))):
            group_index.append(gid)
            lengths.append(prompt + draw(st.one_of(st.integers(0, 200), st.integers(0, 5000))))
    order = draw(st.permutations(range(len(lengths))))
    return [lengths[i] for i in order], [group_index[i] for i in order]


def check_invariants(out: RankAssignment, lengths, group_index, num_ranks: int, cost_of):
    assert out.num_ranks == len(out) == num_ranks
    everything = sorted(i for rank in out.sample_indices for i in rank)
    assert everything == list(range(len(lengths)))  # every sample exactly once
    rank_of = out.rank_of_samples()
    for i, g in enumerate(group_index):  # groups whole
        first = group_index.index(g)
        assert rank_of[i] == rank_of[first]
    for r, rank in enumerate(out.sample_indices):
        assert list(rank) == sorted(rank)
        assert set(out.groups[r]) == {group_index[i] for i in rank}
        assert out.costs[r] == sum(cost_of(lengths[i]) for i in rank)
    assert out.imbalance >= 1.0


@given(batches(), st.integers(1, 6), st.sampled_from(["kk", "lpt"]), st.sampled_from(["attention", "tokens"]))
def test_invariants(batch, num_ranks, method, cost):
    lengths, group_index = batch
    num_groups = len(set(group_index))
    out = balance_groups(lengths, group_index, num_ranks, method=method, cost=cost, allow_empty_ranks=True)
    check_invariants(out, lengths, group_index, num_ranks, attention if cost == "attention" else int)
    # Deterministic, and independent of the input's container type.
    again = balance_groups(
        torch.tensor(lengths), np.array(group_index), num_ranks, method=method, cost=cost, allow_empty_ranks=True
    )
    assert again == out
    # Group ids are labels only: relabelling them (order-preserving or not) changes nothing but the labels.
    relabel = {g: 7 * j - 3 for j, g in enumerate(sorted(set(group_index), reverse=True))}
    renamed = balance_groups(
        lengths, [relabel[g] for g in group_index], num_ranks, method=method, cost=cost, allow_empty_ranks=True
    )
    assert renamed.sample_indices == out.sample_indices and renamed.costs == out.costs
    if num_groups >= num_ranks:
        assert all(out.sample_indices)  # no empty rank when there are groups enough
    if num_groups % num_ranks == 0:
        eq = balance_groups(lengths, group_index, num_ranks, method=method, cost=cost, equal_counts=True)
        check_invariants(eq, lengths, group_index, num_ranks, attention if cost == "attention" else int)
        assert {len(g) for g in eq.groups} == {num_groups // num_ranks}


def _max_load(parts, costs):
    return max(sum(costs[g] for g in p) for p in parts)


@given(st.lists(st.integers(0, 10**9), min_size=1, max_size=40), st.integers(1, 8), st.booleans())
def test_quality_against_verl_and_lpt(group_costs, num_ranks, equal):
    """One sample per group, so the group costs are the given costs: verl's partitioner at
    group granularity gets the same problem. Unrefined Karmarkar–Karp is verl's partition
    exactly; refined, it is never worse than verl's or than unrefined LPT."""
    if len(group_costs) < num_ranks or (equal and len(group_costs) % num_ranks):
        return
    gi = list(range(len(group_costs)))
    kw = dict(cost="given", equal_counts=equal)
    raw = balance_groups(group_costs, gi, num_ranks, refine=False, **kw)
    verl = karmarkar_karp(group_costs, num_ranks, equal)
    if all(verl):  # (verl's KK can leave a rank empty; ours then hands it a group)
        assert sorted(map(sorted, verl)) == sorted(map(list, raw.sample_indices))
    verl_max = _max_load(verl, group_costs)
    kk = balance_groups(group_costs, gi, num_ranks, **kw)
    lpt_raw = balance_groups(group_costs, gi, num_ranks, method="lpt", refine=False, **kw)
    lpt = balance_groups(group_costs, gi, num_ranks, method="lpt", **kw)
    assert max(kk.costs) <= verl_max
    assert max(lpt.costs) <= max(lpt_raw.costs)
    # List scheduling's bound: the costliest rank is at most the mean plus the costliest group.
    if not equal:
        assert max(lpt_raw.costs) <= sum(group_costs) / num_ranks + max(group_costs)
    for out in (kk, lpt, raw, lpt_raw):
        assert all(out.sample_indices)  # groups enough: no rank is left empty


def test_verl_splits_groups_ours_does_not():
    """verl balances samples: on a GRPO batch its partition scatters groups over ranks;
    ours keeps each group on one rank, at an imbalance at least as good as verl's at group
    granularity."""
    rng = random.Random(0)
    num_groups, n, num_ranks = 64, 8, 8
    lengths, group_index = [], []
    for g in range(num_groups):
        prompt = rng.randint(50, 2000)
        lengths += [prompt + rng.randint(1, 6000) for _ in range(n)]
        group_index += [g] * n
    costs = [attention(n) for n in lengths]
    verl_samples = get_seqlen_balanced_partitions(costs, num_ranks, True)
    rank = {i: r for r, p in enumerate(verl_samples) for i in p}
    assert any(len({rank[g * n + j] for j in range(n)}) > 1 for g in range(num_groups))

    out = balance_groups(lengths, group_index, num_ranks, equal_counts=True)
    check_invariants(out, lengths, group_index, num_ranks, attention)
    assert {len(rank) for rank in out} == {len(lengths) // num_ranks}  # groups of one size: equal samples
    group_costs = [sum(costs[g * n : (g + 1) * n]) for g in range(num_groups)]
    verl_groups = get_seqlen_balanced_partitions(group_costs, num_ranks, True)
    assert max(out.costs) <= _max_load(verl_groups, group_costs)
    assert out.imbalance < 1.001


def test_deterministic_across_processes():
    """Same input, same assignment in another process with another hash seed (as on another
    rank): nothing depends on set or dict hashing order."""
    code = (
        "import random\n"
        "from rlvr_kernels.distributed import balance_groups\n"
        "rng = random.Random(1)\n"
        "g = [rng.randrange(40) for _ in range(300)]\n"
        "L = [rng.choice([5, 17, 400]) for _ in g]\n"
        "for m in ('kk', 'lpt'):\n"
        "    out = balance_groups(L, g, 6, method=m)\n"
        "    print(out.sample_indices, out.costs)\n"
    )
    env = dict(os.environ, PYTHONHASHSEED=str(hash("rank") % 1000 + 1))
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    here = io.StringIO()
    with contextlib.redirect_stdout(here):
        exec(code, {})
    assert other.stdout == here.getvalue()


def test_cost_models():
    lengths, group_index = [3, 0, 7, 7, 1], [5, 5, 9, 2, 9]
    # Groups 5: 3 + 0, 9: 7 + 1, 2: 7 tokens; the best split over 2 ranks is {8} | {3, 7}.
    tokens = balance_groups(lengths, group_index, 2, cost="tokens")
    assert sorted(tokens.costs) == [8, 10] and tokens.groups[0] == (5, 2)
    att = balance_groups(lengths, group_index, 2, attention_coefficients=(2, 3))
    assert sum(att.costs) == sum(2 * n + 3 * n * (n + 1) // 2 for n in lengths)
    called = balance_groups(lengths, group_index, 2, cost=lambda L: L.double() ** 2 + 0.5)
    assert sum(called.costs) == pytest.approx(sum(n * n + 0.5 for n in lengths))
    given_costs = balance_groups([0.5, 0.25, 4.0, 1.0, 2.0], group_index, 2, cost="given")
    assert sorted(given_costs.costs) == [1.75, 6.0]
    # Without group_index every sample is its own group.
    single = balance_groups(lengths, None, 3, cost="tokens")
    assert max(single.costs) == 7 and sorted(i for r in single for i in r) == list(range(5))


def test_empty_ranks():
    out = balance_groups([4, 4, 9], [0, 0, 1], 4, allow_empty_ranks=True)
    assert sorted(len(r) for r in out) == [0, 0, 1, 2]
    empty = balance_groups([], [], 3, allow_empty_ranks=True)
    assert empty.sample_indices == ((), (), ()) and empty.imbalance == 1.0


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(num_ranks=0), ValueError, "num_ranks"),
        (dict(num_ranks=2.0), TypeError, "num_ranks"),
        (dict(num_ranks=True), TypeError, "num_ranks"),
        (dict(num_ranks=5), ValueError, "num_ranks"),  # 3 groups: a rank would be empty
        (dict(lengths=[1, -2, 3, 4]), ValueError, "lengths"),
        (dict(lengths=[1.5, 2, 3, 4]), TypeError, "lengths"),
        (dict(lengths=[[1], [2], [3], [4]]), TypeError, "lengths"),
        (dict(lengths=torch.ones(2, 2, dtype=torch.int64)), ValueError, "lengths"),
        (dict(lengths=None), ValueError, "lengths"),
        (dict(group_index=[0, 1, 1]), ValueError, "group_index"),
        (dict(group_index=[0.0, 1.0, 1.0, 2.0]), TypeError, "group_index"),
        (dict(group_index="0112"), TypeError, "group_index"),
        (dict(method="greedy"), ValueError, "method"),
        (dict(cost="flops"), ValueError, "cost"),
        (dict(cost=lambda L: [1.0]), ValueError, "cost"),
        (dict(cost=lambda L: -L), ValueError, "cost"),
        (dict(cost=lambda L: L.double() / 0), ValueError, "cost"),
        (dict(cost="given", lengths=[1.0, float("nan"), 2.0, 1.0]), ValueError, "lengths"),
        (dict(cost="tree"), ValueError, "samples"),
        (dict(samples=[[1], [2], [3], [4]]), ValueError, "samples"),
        (dict(cost="tree", lengths=None, samples=[[1], [2, -1], [3], [4]]), ValueError, "samples"),
        (dict(cost="tree", lengths=None, samples=[[1], [2.5], [3], [4]]), TypeError, "samples"),
        (dict(key="node"), ValueError, "key"),
        (dict(equal_counts=True), ValueError, "equal_counts"),  # 3 groups over 2 ranks
        (dict(equal_counts=1), TypeError, "equal_counts"),
        (dict(allow_empty_ranks="yes"), TypeError, "allow_empty_ranks"),
        (dict(attention_coefficients=(1, -1)), ValueError, "attention_coefficients"),
        (dict(attention_coefficients=1), TypeError, "attention_coefficients"),
    ],
)
def test_validation(kwargs, exc, name):
    args = dict(lengths=[1, 2, 3, 4], group_index=[0, 1, 1, 2], num_ranks=2)
    args.update(kwargs)
    with pytest.raises(exc, match=rf"^{name}(\[\d+\])?:"):
        balance_groups(args.pop("lengths"), args.pop("group_index"), args.pop("num_ranks"), **args)


# ----------------------------------------------------------------------------- cost="tree"

from packing.forests import forests  # noqa: E402

from rlvr_kernels.packing import pack_prefix_tree  # noqa: E402
from rlvr_kernels.packing._tree import KEYS  # noqa: E402


def test_tree_keys_are_the_packing_keys():
    assert TREE_KEYS == KEYS


@pytest.mark.cpu_kernel
@given(forests(max_samples=12), st.integers(1, 3), st.sampled_from(["token+next", "token"]))
def test_tree_cost_is_the_group_pack(forest, num_ranks, key):
    """A group's price is a·N + b·P of its own pack (unique tokens, score pairs); a rank's cost
    is the sum over its groups; a shared prompt is paid once, so the price never exceeds the
    attention model's."""
    num_groups = len(set(forest.group))
    coef = (5, 2)
    out = balance_groups(
        None,
        forest.group,
        num_ranks,
        cost="tree",
        samples=forest.ids,
        key=key,
        attention_coefficients=coef,
        allow_empty_ranks=True,
    )
    price = {}
    for g in set(forest.group):
        members = [s for s, h in zip(forest.ids, forest.group) if h == g]
        pack = pack_prefix_tree(members, completion_mask=[[1] * len(s) for s in members], key=key)
        price[g] = coef[0] * pack.num_tokens + coef[1] * pack.load
        plain = sum(coef[0] * len(s) + coef[1] * len(s) * (len(s) + 1) // 2 for s in members)
        assert price[g] <= plain
    assert sorted(i for r in out for i in r) == list(range(len(forest.ids)))
    for r, groups in enumerate(out.groups):
        assert out.costs[r] == sum(price[g] for g in groups)
        assert set(groups) == {forest.group[i] for i in out.sample_indices[r]}
    if num_groups >= num_ranks:
        assert all(out.sample_indices)


@pytest.mark.cpu_kernel
def test_tree_cost_prices_sharing():
    """Groups of equal unpacked length but different sharing: the tree model sees that a group
    with one long shared prompt is cheap and balances on it; with nothing shared it equals the
    attention model; a padded [B, L] batch gives the same result as the list."""
    rng = random.Random(3)
    samples, group_index = [], []
    for g in range(12):
        shared = rng.randint(0, 3) * 100
        prompt = [rng.randrange(1000) for _ in range(shared)]
        for _ in range(4):
            samples.append(prompt + [rng.randrange(1000) for _ in range(400 - shared)])
            group_index.append(g)
    tree = balance_groups(None, group_index, 4, cost="tree", samples=samples)
    att = balance_groups([len(s) for s in samples], group_index, 4)
    assert sum(tree.costs) < sum(att.costs)
    lengths = [len(s) for s in samples]
    padded = torch.zeros(len(samples), max(lengths), dtype=torch.int64)
    for i, s in enumerate(samples):
        padded[i, : len(s)] = torch.tensor(s)
    assert balance_groups(lengths, group_index, 4, cost="tree", samples=padded) == tree
    assert balance_groups(lengths, group_index, 4, cost="tree", samples=samples) == tree
    with pytest.raises(ValueError, match="^lengths:"):
        balance_groups([1] * len(samples), group_index, 4, cost="tree", samples=samples)
    unshared = [[rng.randrange(10**6) + 1000 for _ in range(n)] for n in (30, 31, 40, 7)]
    lone = balance_groups(None, [0, 1, 2, 3], 2, cost="tree", samples=[[i] + s for i, s in enumerate(unshared)])
    assert sum(lone.costs) == sum(attention(len(s) + 1) for s in unshared)
