"""The per-sample input forms (Python lists, numpy arrays, tensors) read by the C++ reader:
the same pack bit for bit from each form, from the reference's Python reading, and from the
incremental builder; bad values refused naming the field, by every entry point."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlvr_kernels._core import dispatch
from rlvr_kernels.packing import TreePack, TreeRowBuilder, pack_prefix_tree
from rlvr_kernels.packing._tree import _flatten

from .forests import forests

pytestmark = pytest.mark.cpu_kernel

FORMS = ("list", "numpy", "tensor")


def _as(form, seq, dtype):
    if form == "list":
        return list(seq)
    if form == "numpy":
        return np.asarray(seq, dtype={torch.int64: np.int64, torch.float64: np.float64}[dtype])
    return torch.tensor(seq, dtype=dtype)


def _assert_same_pack(a: TreePack, b: TreePack):
    for f in dataclasses.fields(TreePack):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        else:
            assert x == y, f.name


def _old64(f, seed):
    """float64 log-probs (most not representable in float32: the rounding is compared too)."""
    gen = np.random.default_rng(seed)
    return [list(-gen.random(len(s))) for s in f.ids]


@given(forests(), st.sampled_from(["token+next", "token"]), st.integers(0, 3))
def test_every_form_packs_alike(f, key, seed):
    old = _old64(f, seed)
    adv_tok = [list(np.random.default_rng(seed + 1).standard_normal(len(s))) for s in f.ids]
    want = pack_prefix_tree(
        f.ids, completion_mask=f.mask, old_log_probs=old, advantages=f.adv, key=key, backend="reference"
    )
    want_tok = pack_prefix_tree(f.ids, completion_mask=f.mask, advantages=adv_tok, key=key, backend="reference")
    for form in FORMS:
        ids = [_as(form, s, torch.int64) for s in f.ids]
        mask = [_as(form, m, torch.int64) for m in f.mask]
        o = [_as(form, v, torch.float64) for v in old]
        got = pack_prefix_tree(ids, completion_mask=mask, old_log_probs=o, advantages=f.adv, key=key)
        _assert_same_pack(want, got)
        a = [_as(form, v, torch.float64) for v in adv_tok]
        _assert_same_pack(want_tok, pack_prefix_tree(ids, completion_mask=mask, advantages=a, key=key))


@given(forests())
def test_mixed_forms_and_dtypes_read_alike(f):
    """Each sample in its own form and dtype (int32 ids, bool or float masks, float32 values):
    the C++ reader gives the flat inputs the Python reading gives."""
    forms = [FORMS[i % 3] for i in range(len(f.ids))]
    ids = [np.asarray(s, dtype=np.int32) if k == "numpy" else _as(k, s, torch.int64) for s, k in zip(f.ids, forms)]
    mask = [
        np.asarray(m, dtype=bool) if k == "numpy" else torch.tensor(m, dtype=torch.float32) if k == "tensor" else m
        for m, k in zip(f.mask, forms)
    ]
    old = [np.asarray(v, dtype=np.float32) if k == "numpy" else v for v, k in zip(f.old, forms)]
    a = _flatten(ids, None, mask, None, old, f.adv, f.group, "reference")
    b = _flatten(ids, None, mask, None, old, f.adv, f.group, "cpu")
    for field in ("tokens", "cu_tokens", "trained", "group", "advantages"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert torch.equal(a.old_log_probs.to(torch.float32), b.old_log_probs)


@given(forests(), st.sampled_from(FORMS), st.booleans())
def test_builder_packs_as_pack_prefix_tree(f, form, separate_groups):
    """The incremental builder over the forest's rollout dicts (each form) gives pack_prefix_tree's
    pack of the same samples, values included."""
    row = TreeRowBuilder(separate_groups=separate_groups)
    for ids, mask, old, adv, g in zip(f.ids, f.mask, f.old, f.adv, f.group):
        sample = dict(
            input_ids=_as(form, ids, torch.int64),
            completion_mask=_as(form, mask, torch.int64),
            old_log_probs=_as(form, old, torch.float64),
            advantage=adv,
            group_id=g,
        )
        assert row.shared_prefix(sample) <= len(ids)
        row.add(sample)
    want = pack_prefix_tree(
        f.ids,
        completion_mask=f.mask,
        old_log_probs=f.old,
        advantages=f.adv,
        group_index=f.group if separate_groups else None,
    )
    _assert_same_pack(want, row.tree_pack())


def test_builder_holds_samples_by_reference():
    """pack() reads the samples' log-probs when it runs, as TRL's TreeRow does."""
    row = TreeRowBuilder()
    sample = dict(input_ids=[1, 2, 3], completion_mask=[0, 1, 1], old_log_probs=[0.0, -1.0, -2.0], advantage=1.0)
    row.add(sample)
    assert row.samples[0] is sample
    sample["old_log_probs"] = np.array([0.0, -3.0, -4.0])
    assert row.pack()["old_log_probs"].tolist() == [-3.0, -4.0]
    sample["old_log_probs"] = [0.0]
    with pytest.raises(ValueError, match="sample\\['old_log_probs'\\]: expected 3 values"):
        row.pack()


BAD_SAMPLES = [
    (dict(samples=[[1, 2.5]]), TypeError, "^samples\\[0\\]: token ids must be integers"),
    (dict(samples=[[1], [True]]), TypeError, "^samples\\[1\\]: token ids must be integers"),
    (dict(samples=[[1], ["a"]]), TypeError, "^samples\\[1\\]: expected a sequence of integer token ids"),
    (dict(samples=[[1], [[1]]]), TypeError, "^samples\\[1\\]: expected a sequence of integer token ids"),
    (dict(samples=[[2**63]]), TypeError, "^samples\\[0\\]: expected a sequence of integer token ids"),
    (dict(samples=[[1, -2]]), ValueError, "^samples\\[0\\]: token ids must be non-negative, got -2"),
    (dict(samples=[np.array([1, -2])]), ValueError, "^samples\\[0\\]: token ids must be non-negative"),
    (dict(samples=[np.array([1.0])]), TypeError, "^samples\\[0\\]: token ids must be integers, got dtype float64"),
    (dict(samples=[np.array([[1]])]), ValueError, "^samples\\[0\\]: expected a 1-D sequence"),
    (dict(samples=[np.array([2**64 - 1], dtype=np.uint64)]), ValueError, "^samples\\[0\\]: token ids must fit"),
    (dict(samples=[np.array([1], dtype=">i8")]), TypeError, "^samples\\[0\\]: expected integer token ids"),
    (dict(samples=[torch.tensor([1, -2])]), ValueError, "^samples\\[0\\]: token ids must be non-negative"),
    (dict(samples=[torch.tensor([True])]), TypeError, "^samples\\[0\\]: token ids must be integers, got dtype bool"),
    (dict(samples=[{1, 2}]), TypeError, "^samples\\[0\\]: expected a list, 1-D tensor or numpy array"),
    (dict(completion_mask=[[0, 1], [1]]), ValueError, "^completion_mask\\[1\\]: expected 2 values"),
    (dict(completion_mask=[[0, 2], [1, 1]]), ValueError, "^completion_mask\\[0\\]: expected 0/1 values"),
    (dict(completion_mask=[[0, 1], np.array([0.5, 1])]), ValueError, "^completion_mask\\[1\\]: expected 0/1"),
    (dict(completion_mask=[[0, 1], ["a", "b"]]), TypeError, "^completion_mask\\[1\\]: expected a sequence"),
    (dict(completion_mask=[[0, 1], [1j, 1]]), TypeError, "^completion_mask\\[1\\]: expected a sequence"),
    (dict(completion_mask=[[0, 1], np.ones(2, complex)]), TypeError, "^completion_mask\\[1\\]: expected a bool"),
    (dict(completion_mask=[[0, 1]]), ValueError, "^completion_mask: expected 2 per-sample sequences"),
    (dict(old_log_probs=[[0.0, 0.0], [0.0]]), ValueError, "^old_log_probs\\[1\\]: expected 2 values"),
    (dict(old_log_probs=[[0, 0], [0, 0]]), TypeError, "^old_log_probs: expected floating-point values"),
    (dict(old_log_probs=[[0.0, 0.0], [0.0, None]]), TypeError, "^old_log_probs\\[1\\]: expected a sequence"),
    (dict(advantages=[[0.0, 0.0], [0.0, 0.0, 1.0]]), ValueError, "^advantages\\[1\\]: expected 2 values"),
]


@pytest.mark.parametrize("k", range(len(BAD_SAMPLES)))
def test_reader_refuses_bad_values_naming_the_field(k):
    change, err, match = BAD_SAMPLES[k]
    args = dict(samples=[[1, 2], [3, 4]], completion_mask=[[0, 1], [1, 1]])
    args.update(change)
    samples = args.pop("samples")
    if len(samples) != 2 and "completion_mask" not in change:
        args["completion_mask"] = [[1] * len(s) if isinstance(s, list) else [1] for s in samples]
    with pytest.raises(err, match=match):
        pack_prefix_tree(samples, **args)


BAD_ROLLOUTS = [
    (dict(input_ids=[1, 2.0, 3]), TypeError, "^sample\\['input_ids'\\]: token ids must be integers"),
    (dict(input_ids=np.array([1, -2, 3])), ValueError, "^sample\\['input_ids'\\]: token ids must be non-negative"),
    (dict(input_ids="abc"), TypeError, "^sample\\['input_ids'\\]: expected a list, 1-D tensor or numpy array"),
    (dict(completion_mask=[0, 1]), ValueError, "^sample\\['completion_mask'\\]: expected shape \\(3,\\)"),
    (dict(completion_mask=np.ones((1, 3))), ValueError, "^sample\\['completion_mask'\\]: expected shape"),
    (dict(completion_mask=[0, 1, 3]), ValueError, "^sample\\['completion_mask'\\]: expected 0/1 values"),
    (dict(completion_mask=np.array(["0", "1", "1"])), TypeError, "^sample\\['completion_mask'\\]: expected numbers"),
    (dict(old_log_probs=[0.0, 0.0]), ValueError, "^sample\\['old_log_probs'\\]: expected 3 values"),
    (dict(old_log_probs=np.ones(3, complex)), TypeError, "^sample\\['old_log_probs'\\]: expected real numbers"),
]


@pytest.mark.parametrize("k", range(len(BAD_ROLLOUTS)))
def test_builder_refuses_bad_fields_of_every_form(k):
    change, err, match = BAD_ROLLOUTS[k]
    sample = {**dict(input_ids=[1, 2, 3], completion_mask=[0, 1, 1]), **change}
    row = TreeRowBuilder()
    row.add(dict(input_ids=[1, 2, 3], completion_mask=[0, 1, 1]))
    if "old_log_probs" not in change:
        with pytest.raises(err, match=match):
            row.fits(sample, 10)
    with pytest.raises(err, match=match):
        row.add(sample)
    assert (row.num_tokens, row.trained, len(row.samples)) == (3, 2, 1)


def test_cpp_entry_points_check_their_inputs():
    """The extension module's functions are reachable without the Python checks."""
    C = dispatch.extension_module()
    cu = torch.tensor([0, 2])
    with pytest.raises(ValueError, match="cu_tokens"):
        C.read_per_token([[0, 1]], "m", cu.to(torch.int32), "mask", False)
    with pytest.raises(ValueError, match="cu_tokens"):
        C.read_per_token([[0, 1]], "m", torch.tensor([1, 2]), "mask", False)
    with pytest.raises(ValueError, match="cu_tokens"):
        C.read_per_token([[0, 1], []], "m", torch.tensor([0, 2, 1]), "mask", False)
    with pytest.raises(ValueError, match="kind"):
        C.read_per_token([[0, 1]], "m", cu, "weights", False)
    with pytest.raises(TypeError, match="^m: expected a padded"):
        C.read_per_token(torch.ones(1, 2), "m", cu, "mask", False)
    with pytest.raises(TypeError, match="^s: expected a list of token-id sequences"):
        C.read_token_ids("ab", "s")
    assert C.read_per_token([[0, 1]], "m", cu, "values", False).dtype == torch.float32
    trie = C.PrefixTrie(True)
    sample = dict(input_ids=[1, 2], completion_mask=[0, 1], old_log_probs=[0.0, -1.0], advantage=1.0)
    with pytest.raises(ValueError, match="group"):
        trie.add(sample, -2)
    with pytest.raises(ValueError, match="budget"):
        trie.fits(sample, -1, -1)
    trie.add(sample, -1)
    pos, seg = torch.tensor([1]), torch.tensor([0])
    with pytest.raises(ValueError, match="samples: expected the row's 1 samples"):
        trie.target_values([], pos, seg)
    with pytest.raises(ValueError, match="token_pos"):
        trie.target_values([sample], pos.to(torch.int32), seg)
    with pytest.raises(ValueError, match="token_pos"):
        trie.target_values([sample], torch.tensor([2]), seg)
    with pytest.raises(ValueError, match="token_pos"):
        trie.target_values([sample], pos, torch.tensor([1]))
    with pytest.raises(TypeError, match="advantage"):
        trie.target_values([dict(sample, advantage="x")], pos, seg)
    old, adv = trie.target_values([sample], pos, seg)
    assert old.tolist() == [-1.0] and adv.tolist() == [1.0]
