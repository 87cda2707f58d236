"""The C++ prefix-tree builder: TRL 1.16's TreeRow tensor for tensor, the reference trie for
both keys and groups, the layout's invariants, determinism over thread counts, bad input."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlvr_kernels.packing import TreeRowBuilder, pack_prefix_tree, pack_rows
from rlvr_kernels.packing._tree import _flatten, build_rows

from .forests import ancestors, forests

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from trl.experimental.async_grpo.packing import TreeRow

pytestmark = pytest.mark.cpu_kernel


def _pack(f, **kw):
    return pack_prefix_tree(f.ids, completion_mask=f.mask, old_log_probs=f.old, advantages=f.adv, **kw)


def _assert_same(ref: dict, got: dict):
    assert list(ref) == list(got)
    for k in ref:
        assert ref[k].dtype == got[k].dtype, k
        assert torch.equal(ref[k], got[k]), (k, ref[k], got[k])


def _trl_pack(samples):
    row = TreeRow()
    for s in samples:
        row.add(s)
    return row


@given(forests())
def test_to_trl_equals_treerow(f):
    f = f.nonempty()
    samples = f.trl_samples()
    if not samples:
        return  # TRL's pack() takes max() over no segments: it cannot pack an empty row
    _assert_same(_trl_pack(samples).pack(), _pack(f).to_trl())


@given(forests(), st.lists(st.integers(0, 40), min_size=1, max_size=4))
def test_builder_matches_treerow(f, budgets):
    f = f.nonempty()
    trl, ours = TreeRow(), TreeRowBuilder()
    for s in f.trl_samples():
        for budget in budgets:
            assert ours.fits(s, budget) == trl.fits(s, budget)
        trl.add(s)
        ours.add(s)
        assert (ours.load, ours.trained, ours.tokens.tolist()) == (trl.load, trl.trained, trl.tokens)
        assert ours.groups == trl.groups and ours.samples == trl.samples
    if any(len(s) for s in f.ids):
        _assert_same(trl.pack(), ours.pack())


@settings(max_examples=15)
@given(forests(), st.sampled_from(["token+next", "token"]), st.booleans())
def test_cpp_equals_reference(f, key, grouped):
    group = f.group if grouped else None
    a = _pack(f, key=key, group_index=group)
    b = _pack(f, key=key, group_index=group, backend="reference")
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), name
        else:
            assert x == y, name


@given(forests(), st.sampled_from(["token+next", "token"]), st.booleans())
def test_layout_invariants(f, key, grouped):
    p = _pack(f, key=key, group_index=f.group if grouped else None)
    flat = torch.tensor([t for s in f.ids for t in s], dtype=torch.int64)
    pos = torch.tensor([i for s in f.ids for i in range(len(s))], dtype=torch.int64)
    # every sample's tokens and positions come back
    assert torch.equal(p.input_ids[p.gather_index], flat)
    assert torch.equal(p.position_ids[p.gather_index], pos)
    assert p.num_tokens_unpacked == len(flat) and p.num_tokens <= len(flat)
    # targets: sample-major, the trained tokens after each sample's first, predicted by their predecessor
    exp = [(b, q) for b, (s, m) in enumerate(zip(f.ids, f.mask)) for q in range(1, len(s)) if m[q]]
    assert p.segment_id.tolist() == [b for b, _ in exp] and p.token_pos.tolist() == [q for _, q in exp]
    starts = p.cu_tokens[p.segment_id] + p.token_pos
    assert torch.equal(p.target_ids, flat[starts])
    assert torch.equal(p.token_index, p.gather_index[starts - 1])
    assert p.cu_seqlens.tolist() == [0] + np.cumsum(np.bincount(p.segment_id.numpy(), minlength=len(f.ids))).tolist()
    old = torch.tensor([v for s in f.old for v in s], dtype=torch.float32)
    assert torch.equal(p.old_log_probs, old[starts])
    assert torch.equal(p.advantages, torch.tensor(f.adv, dtype=torch.float32)[p.segment_id])
    # visibility: enter/leave and the gathered K/V paths give the ancestor relation
    anc = ancestors(f.ids, p)
    enter, leave = p.enter.tolist(), p.leave.tolist()
    for q, keys in anc.items():
        assert {k for k in range(p.num_tokens) if enter[k] <= enter[q] < leave[k]} == keys
    cu_q, cu_k, kv = p.tree_cu_seqlens_q.tolist(), p.tree_cu_seqlens_k.tolist(), p.tree_kv_index.tolist()
    for s in range(p.num_segments):
        path = kv[cu_k[s] : cu_k[s + 1]]
        assert path[-(cu_q[s + 1] - cu_q[s]) :] == list(range(cu_q[s], cu_q[s + 1]))
        assert set(path) == anc[cu_q[s + 1] - 1]
    # each sample is whole segments along one root path
    ends = set(cu_q[1:])
    for b in range(len(f.ids)):
        if f.ids[b]:
            assert int(p.gather_index[p.cu_tokens[b + 1] - 1]) + 1 in ends
    # a label per position: one target (or none / several under key="token")
    for q in range(p.num_tokens):
        targets = set(p.target_ids[p.token_index == q].tolist())
        assert int(p.shift_labels[q]) == (targets.pop() if len(targets) == 1 else -100)
    if key == "token+next":
        assert all(len(set(p.target_ids[p.token_index == q].tolist())) <= 1 for q in range(p.num_tokens))


def test_key_token_shares_the_branch_token():
    prompt, comps = [5, 6, 7], [[1, 2], [1, 3], [4]]
    ids = [prompt + c for c in comps]
    a = pack_prefix_tree(ids, completion_start=3)
    b = pack_prefix_tree(ids, completion_start=3, key="token")
    # token+next: 5 6 shared, 7 once per distinct next token (1, 4), then 1 once per next (2, 3)
    assert a.num_tokens == 2 + 2 + 2 * 2 + 1
    # token: 5 6 7 shared, 1 shared by two samples, then 2, 3, 4
    assert b.num_tokens == 3 + 1 + 3
    assert torch.equal(b.token_index[b.target_ids == 1], torch.tensor([2, 2]))


def test_nothing_shared_is_plain_packing():
    ids = [[1, 2, 3], [2, 3], [3, 1, 2, 2]]
    p = pack_prefix_tree(ids, completion_start=1)
    assert p.input_ids.tolist() == [t for s in ids for t in s]
    assert p.position_ids.tolist() == [i for s in ids for i in range(len(s))]
    assert p.tree_cu_seqlens_q.tolist() == [0, 3, 5, 9] and p.segment_parent.tolist() == [-1, -1, -1]
    assert p.tree_kv_index.tolist() == list(range(9)) and p.compression == 1.0


def test_group_index_restricts_sharing():
    ids = [[1, 2, 3], [1, 2, 4], [1, 2, 5]]
    shared = pack_prefix_tree(ids, completion_start=2)
    split = pack_prefix_tree(ids, completion_start=2, group_index=[7, 7, 9])
    assert shared.num_tokens == 1 + 3 * 2 and split.num_tokens == (1 + 2 * 2) + 3


def test_input_forms_agree():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 9, size=n) for n in (5, 0, 7, 3)]
    lengths = torch.tensor([len(s) for s in seqs])
    padded = torch.zeros(4, 7, dtype=torch.int32)
    masks = torch.zeros(4, 7, dtype=torch.bool)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = torch.from_numpy(s)
        masks[i, 1 : len(s)] = True
    base = pack_prefix_tree([s.tolist() for s in seqs], completion_start=[1, 0, 1, 1])
    for pack in (
        pack_prefix_tree(seqs, completion_start=[1, 0, 1, 1]),
        pack_prefix_tree(
            [torch.from_numpy(s) for s in seqs], completion_mask=[m[: len(s)] for m, s in zip(masks, seqs)]
        ),
        pack_prefix_tree(padded, lengths=lengths, completion_mask=masks),
        pack_prefix_tree(padded, lengths=lengths.tolist(), completion_start=torch.tensor([1, 0, 1, 1])),
    ):
        for name in ("input_ids", "token_index", "target_ids", "leave", "tree_kv_index", "cu_seqlens"):
            assert torch.equal(getattr(pack, name), getattr(base, name)), name


def test_rows_in_one_call_equal_rows_alone():
    torch.manual_seed(0)
    prompts = [torch.randint(0, 50, (int(n),)) for n in torch.randint(1, 30, (9,))]
    samples = [
        torch.cat([p, torch.randint(0, 50, (int(torch.randint(0, 20, ())),))]) for p in prompts for _ in range(3)
    ]
    start = [len(p) for p in prompts for _ in range(3)]
    flat = _flatten(samples, None, None, start, None, None, None)
    row_cu = torch.tensor([0, 3, 3, 10, 27])  # an empty row too
    rows = build_rows(flat, torch.arange(27), row_cu, "token+next")
    for r, pack in enumerate(rows):
        a, b = int(row_cu[r]), int(row_cu[r + 1])
        alone = pack_prefix_tree(samples[a:b], completion_start=start[a:b])
        for name in alone.__dataclass_fields__:
            x, y = getattr(pack, name), getattr(alone, name)
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, name


def test_same_pack_whatever_the_thread_count():
    torch.manual_seed(1)
    samples = [torch.randint(0, 7, (int(n),)) for n in torch.randint(1, 60, (64,))]
    flat = _flatten(samples, None, None, 1, None, None, None)
    row_cu = torch.arange(0, 65, 4)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(build_rows(flat, torch.arange(64), row_cu, "token"))
    finally:
        torch.set_num_threads(before)
    for packs in outs[1:]:
        for a, b in zip(outs[0], packs):
            for name in a.__dataclass_fields__:
                x, y = getattr(a, name), getattr(b, name)
                assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_empty_inputs():
    p = pack_prefix_tree([], completion_start=0)
    assert p.num_tokens == 0 and p.num_targets == 0 and p.cu_seqlens.tolist() == [0]
    p = pack_prefix_tree([[], []], completion_start=0, old_log_probs=[[], []], advantages=[1.0, 2.0])
    assert p.num_tokens == 0 and p.cu_seqlens.tolist() == [0, 0, 0] and p.old_log_probs.shape == (0,)
    p = pack_prefix_tree([[3, 4]], completion_mask=[[0, 0]])
    assert p.num_targets == 0 and p.shift_labels.tolist() == [-100, -100]


def _meta(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype, device="meta")


def _ab(**kw):
    """pack_prefix_tree's arguments for the sample [1, 2] trained from position 0, with ``kw``."""
    return dict(samples=[[1, 2]], completion_start=0, **kw)


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(samples=[[1, -2]], completion_start=0), ValueError, "samples\\[0\\]: token ids must be non-negative"),
        (dict(samples=[[1.5, 2]], completion_start=0), TypeError, "samples\\[0\\]"),
        (dict(samples=[torch.tensor([1.0])], completion_start=0), TypeError, "samples\\[0\\]: token ids must be int"),
        (dict(samples="abc", completion_start=0), TypeError, "samples"),
        (dict(samples=torch.zeros(2, 3, dtype=torch.long), completion_start=0), ValueError, "lengths"),
        (
            dict(samples=torch.zeros(2, 3, dtype=torch.long), lengths=[1, 4], completion_start=0),
            ValueError,
            "lengths: expected values in",
        ),
        (dict(samples=[[1, 2]], completion_mask=[[1]]), ValueError, "completion_mask\\[0\\]: expected 2 values"),
        (dict(samples=[[1, 2]], completion_mask=[[1, 2]]), ValueError, "completion_mask\\[0\\]: expected 0/1"),
        (dict(samples=[[1, 2]], completion_mask=[[1, 1]], completion_start=0), ValueError, "give one of them"),
        (dict(samples=[[1, 2]]), ValueError, "completion_mask"),
        (dict(samples=[[1, 2]], completion_start=3), ValueError, "completion_start: expected 0 <="),
        (dict(samples=[[1, 2]], completion_start=[0, 1]), ValueError, "completion_start: expected 1 entries"),
        (dict(samples=[[1, 2]], completion_start=0, group_index=[1, 2]), ValueError, "group_index: expected 1"),
        (dict(samples=[[1, 2]], completion_start=0, old_log_probs=[[0.1]]), ValueError, "old_log_probs\\[0\\]"),
        (dict(samples=[[1, 2]], completion_start=0, advantages=[1.0, 2.0]), ValueError, "advantages: expected 1"),
        (dict(samples=[[1, 2]], completion_start=0, key="tok"), ValueError, "key: expected one of"),
        (dict(samples=[[1, 2]], completion_start=0, backend="triton"), ValueError, "backend"),
        # Meta tensors hold no values to read.
        (dict(samples=[_meta(2, dtype=torch.long)], completion_start=0), ValueError, "samples\\[0\\]: .*meta"),
        (
            dict(samples=_meta(2, 3, dtype=torch.long), lengths=[3, 3], completion_start=0),
            ValueError,
            "samples: .*meta",
        ),
        (dict(samples=[[1, 2]], completion_mask=[_meta(2)]), ValueError, "completion_mask\\[0\\]: .*meta"),
        (dict(samples=[[1, 2]], completion_start=_meta(1, dtype=torch.long)), ValueError, "completion_start: .*meta"),
        (_ab(group_index=_meta(1, dtype=torch.long)), ValueError, "group_index: .*meta"),
        (_ab(old_log_probs=[_meta(2)]), ValueError, "old_log_probs\\[0\\]: .*meta"),
        (_ab(old_log_probs=_meta(1, 2)), ValueError, "old_log_probs: .*meta"),
        (_ab(advantages=_meta(1)), ValueError, "advantages: .*meta"),
        (_ab(advantages=[_meta()]), ValueError, "advantages\\[0\\]: .*meta"),
        # Arrays and values torch cannot hold as numbers.
        (dict(samples=[np.array([1, 2], dtype=object)], completion_start=0), TypeError, "samples\\[0\\]: expected"),
        (dict(samples=[[1, 2]], completion_start=np.array([0], dtype=object)), TypeError, "completion_start"),
        (dict(samples=[[1, 2]], completion_mask=[np.array([0, 1], dtype=object)]), TypeError, "completion_mask\\[0\\]"),
        (_ab(old_log_probs=["ab"]), TypeError, "old_log_probs\\[0\\]: expected"),
        (_ab(old_log_probs=[["a", "b"]]), TypeError, "old_log_probs\\[0\\]: expected"),
        (_ab(old_log_probs=[[0.1, [0.2]]]), TypeError, "old_log_probs\\[0\\]: expected"),
        (_ab(old_log_probs="ab"), TypeError, "old_log_probs: expected"),
        (_ab(advantages=["a"]), TypeError, "advantages\\[0\\]: expected"),
        (_ab(advantages="a"), TypeError, "advantages: expected"),
        (_ab(advantages=np.array(["a"])), TypeError, "advantages: expected"),
        (_ab(advantages=np.array([1.0], dtype=object)), TypeError, "advantages: expected"),
    ],
)
def test_bad_input_names_the_argument(kwargs, err, match):
    samples = kwargs.pop("samples")
    with pytest.raises(err, match=match):
        pack_prefix_tree(samples, **kwargs)


def test_to_trl_needs_trl_semantics():
    with pytest.raises(ValueError, match="key='token\\+next'"):
        pack_prefix_tree(
            [[1, 2]], completion_start=1, key="token", old_log_probs=[[0.0, 0.0]], advantages=[1.0]
        ).to_trl()
    with pytest.raises(ValueError, match="old_log_probs and advantages"):
        pack_prefix_tree([[1, 2]], completion_start=1).to_trl()


def test_kernel_rejects_inconsistent_inputs():
    """The registered op is reachable without the Python checks: it must refuse, not read out of bounds."""
    from rlvr_kernels._core.dispatch import kernel

    build = kernel("prefix_tree_build", "cpu")
    tok = torch.tensor([1, 2, 3])
    cu = torch.tensor([0, 3])
    ok = dict(tokens=tok, cu_tokens=cu, trained=torch.ones(3, dtype=torch.bool), group=torch.zeros(0, dtype=torch.long))
    bad = [
        dict(cu_tokens=torch.tensor([0, 4])),
        dict(cu_tokens=torch.tensor([0, 2, 1, 3])),
        dict(tokens=torch.tensor([1, -1, 3])),
        dict(trained=torch.ones(2, dtype=torch.bool)),
        dict(trained=torch.tensor([4])),
        dict(group=torch.tensor([0, 1])),
        dict(group=torch.tensor([-3])),
    ]
    for change in bad:
        args = {**ok, **change}
        row_cu = torch.tensor([0, args["cu_tokens"].numel() - 1])
        with pytest.raises(RuntimeError, match="prefix_tree_build"):
            order = torch.arange(args["cu_tokens"].numel() - 1)
            build(args["tokens"], args["cu_tokens"], args["trained"], args["group"], order, row_cu, True)
    with pytest.raises(RuntimeError, match="row_cu"):
        build(tok, cu, ok["trained"], ok["group"], torch.tensor([0]), torch.tensor([0, 2]), True)
    with pytest.raises(RuntimeError, match="order"):
        build(tok, cu, ok["trained"], ok["group"], torch.tensor([1]), torch.tensor([0, 1]), True)


def test_pack_rows_equals_each_row_alone():
    torch.manual_seed(2)
    samples = [torch.randint(0, 5, (int(n),)) for n in torch.randint(0, 12, (11,))]
    start = [min(2, len(s)) for s in samples]
    old = [torch.randn(len(s)) for s in samples]
    rows = [[3, 0, 7], [], [10, 1], [2, 4, 5, 6, 8, 9]]
    packs = pack_rows(samples, rows, completion_start=start, old_log_probs=old, advantages=torch.arange(11.0))
    for row, pack in zip(rows, packs):
        alone = pack_prefix_tree(
            [samples[i] for i in row],
            completion_start=[start[i] for i in row],
            old_log_probs=[old[i] for i in row],
            advantages=[float(i) for i in row],
        )
        for name in alone.__dataclass_fields__:
            x, y = getattr(pack, name), getattr(alone, name)
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, name
    with pytest.raises(ValueError, match="rows: a sample index appears more than once"):
        pack_rows(samples, [[0], [0]], completion_start=start)
    with pytest.raises(ValueError, match="rows: sample indices must be integers in"):
        pack_rows(samples, [[11]], completion_start=start)


def test_advantages_per_sample_in_every_form():
    ids = [[1, 2, 3], [1, 2, 4]]
    want = pack_prefix_tree(ids, completion_start=1, advantages=[0.5, -1.0]).advantages
    for adv in ([torch.tensor(0.5), torch.tensor(-1.0)], np.array([0.5, -1.0]), torch.tensor([0.5, -1.0])):
        assert torch.equal(pack_prefix_tree(ids, completion_start=1, advantages=adv).advantages, want)
    per_token = pack_prefix_tree(ids, completion_start=1, advantages=[[0.0, 0.5, 0.5], [0.0, -1.0, -1.0]])
    assert torch.equal(per_token.advantages, want)


def test_single_pack_owns_compact_tensors_and_to_moves_devices_only():
    p = pack_prefix_tree([list(range(200)) + [i] * 5 for i in range(4)], completion_start=200)
    assert p.input_ids.untyped_storage().nbytes() == p.num_tokens * 8
    rows = pack_rows([[1, 2, 3], [1, 2, 4], [5, 6]], [[0, 1], [2]], completion_start=1)
    alone = rows[0].clone()
    assert alone.input_ids.untyped_storage().nbytes() == alone.num_tokens * 8
    rows[1].enter.add_(1)  # rows do not share their enter
    assert rows[0].enter.tolist() == list(range(rows[0].num_tokens))
    with pytest.raises(TypeError, match="device"):
        p.to(torch.bfloat16)


def test_builder_refuses_misaligned_or_bad_samples():
    def sample(ids, old):
        mask = torch.tensor([0] + [1] * (len(ids) - 1))
        return dict(input_ids=torch.tensor(ids), completion_mask=mask, old_log_probs=torch.tensor(old), advantage=1.0)

    row = TreeRowBuilder()
    with pytest.raises(ValueError, match="old_log_probs'\\]: expected 3 values"):
        row.add(sample([1, 2, 3], [0.0, 0.1, 0.2, 0.9]))
    with pytest.raises(TypeError, match="input_ids'\\]: token ids must be integers"):
        row.add(dict(input_ids=torch.tensor([1.0]), completion_mask=torch.tensor([1])))
    with pytest.raises(ValueError, match="non-negative"):
        row.add(dict(input_ids=torch.tensor([-1]), completion_mask=torch.tensor([1])))
    with pytest.raises(TypeError, match="rows"):
        pack_rows([[1, 2]], [0], completion_start=0)


def _rollout(**over):
    sample = dict(input_ids=torch.tensor([1, 2, 3]), completion_mask=torch.tensor([0, 1, 1]))
    sample.update(over)
    return {k: v for k, v in sample.items() if v is not None}


MALFORMED_SAMPLES = [
    (_rollout(input_ids="123"), TypeError, "sample\\['input_ids'\\]: expected a list, 1-D tensor or numpy array"),
    (_rollout(completion_mask={0: 1}), TypeError, "sample\\['completion_mask'\\]: expected a sequence of numbers"),
    (_rollout(completion_mask=None), ValueError, "sample\\['completion_mask'\\]: missing"),
    (_rollout(input_ids=None), ValueError, "sample\\['input_ids'\\]: missing"),
    (_rollout(input_ids=torch.tensor([[1, 2, 3]])), ValueError, "sample\\['input_ids'\\]: expected a 1-D"),
    (_rollout(input_ids=torch.tensor([1.0, 2.0, 3.0])), TypeError, "sample\\['input_ids'\\]: token ids must be"),
    (_rollout(input_ids=torch.tensor([1, -2, 3])), ValueError, "sample\\['input_ids'\\]: token ids must be non"),
    (_rollout(input_ids=np.array([1, 2, 3], dtype=object)), TypeError, "sample\\['input_ids'\\]: expected"),
    (_rollout(input_ids=torch.tensor([1, 2, 3], device="meta")), ValueError, "sample\\['input_ids'\\]: .*meta"),
    (_rollout(completion_mask=torch.tensor([0, 1])), ValueError, "sample\\['completion_mask'\\]: expected shape"),
    (_rollout(completion_mask=torch.tensor([0, 2, 1])), ValueError, "sample\\['completion_mask'\\]: expected 0/1"),
    (_rollout(completion_mask=torch.ones(3, device="meta")), ValueError, "sample\\['completion_mask'\\]: .*meta"),
    ("input_ids", TypeError, "sample: expected a dict"),
]


@pytest.mark.parametrize("k", range(len(MALFORMED_SAMPLES)))
def test_builder_fits_and_add_check_a_sample_alike(k):
    """fits() and add() share one check of a sample (the error names the field), and fits()
    checks its budget; a refused sample leaves the row as it was."""
    sample, err, match = MALFORMED_SAMPLES[k]
    row = TreeRowBuilder()
    row.add(_rollout())
    with pytest.raises(err, match=match):
        row.fits(sample, 10)
    with pytest.raises(err, match=match):
        row.add(sample)
    assert (row.num_tokens, row.trained, len(row.samples)) == (3, 2, 1)


def test_builder_fits_checks_its_budget_and_counts_as_add():
    row = TreeRowBuilder()
    row.add(_rollout())
    for budget, err in (("10", TypeError), (10.0, TypeError), (-1, ValueError), (True, TypeError)):
        with pytest.raises(err, match="^budget: expected an int"):
            row.fits(_rollout(), budget)
    # numpy fields, and a float 0/1 mask: trained tokens counted as the trie counts them.
    # The row's sample again: no new token, 2 + 2 trained ones (the binding budget).
    sample = dict(input_ids=np.array([1, 2, 3]), completion_mask=np.array([0.0, 1.0, 1.0]))
    assert row.fits(sample, 4) and not row.fits(sample, 3)
    row.add(sample)
    assert (row.num_tokens, row.trained) == (3, 4)


def test_builder_separate_groups_matches_group_index():
    ids = [[1, 2, 3], [1, 2, 4], [1, 2, 5]]
    row = TreeRowBuilder(separate_groups=True)
    for i, g in zip(ids, [7, 7, 9]):
        row.add(dict(input_ids=torch.tensor(i), completion_mask=torch.tensor([0, 1, 1]), group_id=g))
    want = pack_prefix_tree(ids, completion_start=1, group_index=[7, 7, 9])
    got = row.tree_pack()
    assert row.num_tokens == want.num_tokens and torch.equal(got.input_ids, want.input_ids)
    assert torch.equal(got.token_index, want.token_index)
    assert row.shared_prefix(dict(input_ids=torch.tensor([1, 2, 6]), group_id=9)) == 1
    assert row.shared_prefix(dict(input_ids=torch.tensor([1, 2, 6]), group_id=3)) == 0
