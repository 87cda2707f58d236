"""The sampling support of ``linear_logprobs`` / ``logprobs_from_logits`` (docs/logprobs.md,
"Sampling support"): the reference's kept set against the engines' own sort-based filters
(vLLM's and SGLang's code, ``rlvr_kernels.testing.sampling``), every backend against the fp64
reference (log-probs, entropies, gradients, the outside flag) for explicit and computed
supports, the MASK bitmap of an explicit CSR, degenerate rows, a 152k vocabulary, and the
validation of the new arguments."""

import math

import pytest
import torch
from _backends import ALL, FAST

import rlvr_kernels as rk
from rlvr_kernels._core import dispatch as _dispatch
from rlvr_kernels.reference.logprobs import support_mask
from rlvr_kernels.testing import logits_case_from, random_logprobs_case
from rlvr_kernels.testing.logprobs import assert_matches_reference, run_logprobs
from rlvr_kernels.testing.sampling import sglang_kept, tie_closure, vllm_kept

ENGINES = {"vllm": vllm_kept, "sglang": sglang_kept}


def _filters(gen, v, which):
    k = int(torch.randint(1, v + 3, (), generator=gen))
    p = float(torch.rand((), generator=gen)) * 0.98 + 0.01
    mp = float(torch.rand((), generator=gen)) * 0.3
    return {
        "top_k": k if "k" in which else None,
        "top_p": p if "p" in which else None,
        "min_p": mp if "m" in which else None,
    }


@pytest.mark.parametrize("convention", ["vllm", "sglang"])
@pytest.mark.parametrize("which", ["k", "p", "m", "kp", "pm", "kpm"])
def test_reference_is_the_engines_filters(convention, which):
    """On fp64 logits with and without ties (a coarse grid), the reference keeps exactly what
    the engine's code keeps once a tie at the boundary, which the engine's sort may split, is
    kept whole (``tie_closure``); where no tie straddles it the sets are equal as they are."""
    gen = torch.Generator().manual_seed(len(which) * 13 + len(convention))
    split = 0
    for trial in range(40):
        v = int(torch.randint(1, 400, (), generator=gen))
        z = torch.randn(6, v, generator=gen, dtype=torch.float64) * float(torch.rand((), generator=gen) * 6)
        if trial % 2:
            z = (z * 4).round() / 4  # ties
        kw = _filters(gen, v, which)
        engine = ENGINES[convention](z, **kw)
        ours = support_mask(6, v, "cpu", z=z, convention=convention, **kw)
        assert torch.equal(tie_closure(z, engine), ours), (trial, kw)
        split += int((engine != ours).sum())
        assert bool(ours.any(-1).all()), "the max is always kept"
    assert split >= 0  # (how many tie members the engine's sort dropped; informative only)


def test_conventions_differ_where_they_should():
    """top-k then top-p: vLLM renormalises the top-k survivors before top-p, SGLang does not."""
    z = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]], dtype=torch.float64))
    kw = dict(top_k=2, top_p=0.5)
    # vLLM: survivors 0.4, 0.3 renormalised to 0.571, 0.429: the mass above 0.3 is 0.571 >= 0.5.
    assert support_mask(1, 4, "cpu", z=z, convention="vllm", **kw).tolist() == [[True, False, False, False]]
    # SGLang: the mass above 0.3 is 0.4 <= 0.5: kept.
    assert support_mask(1, 4, "cpu", z=z, convention="sglang", **kw).tolist() == [[True, True, False, False]]
    # Strict against non-strict at an exact boundary: mass above 0.3 is exactly 0.5.
    z = torch.log(torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64))
    assert support_mask(1, 3, "cpu", z=z, convention="vllm", top_p=0.5).sum() == 1
    assert support_mask(1, 3, "cpu", z=z, convention="sglang", top_p=0.5).sum() == 3  # the tie is kept whole


# (name, random_logprobs_case kwargs, sampling kwargs)
COMPUTED = [
    ("top-p 0.9", dict(), dict(top_p=0.9)),
    ("top-k 7, bias", dict(bias=True), dict(top_k=7)),
    ("min-p 0.05, per-row T", dict(temperature="rows"), dict(min_p=0.05)),
    ("top-k 20 + top-p 0.8 + min-p 0.01", dict(), dict(top_k=20, top_p=0.8, min_p=0.01)),
    ("sglang top-k 20 + top-p 0.8", dict(), dict(top_k=20, top_p=0.8, sampling_convention="sglang")),
    ("top-p, row_index, ignored", dict(branching=True, ignore_fraction=0.2), dict(top_p=0.7)),
    ("top-p, soft-cap", dict(), dict(top_p=0.85, softcap=5.0)),
    ("top-p, bf16 logits", dict(), dict(top_p=0.9, logits_precision="bf16")),
    ("top-k >= V, top-p 1 (all kept)", dict(), dict(top_k=500, top_p=1.0)),
    ("min-p 1 (the max only)", dict(), dict(min_p=1.0)),
    ("peaked rows, top-p 0.5", dict(rows="peaked"), dict(top_p=0.5)),
    ("flat rows (one tie), top-k 3", dict(rows="flat", temperature=None), dict(top_k=3)),
]


def _some_inside(inputs):
    """Every other target set to its row's argmax (always kept: the filters keep the max, and
    a soft-cap, the temperature and bf16 rounding keep the order), so each case has targets
    inside the support as well as (random ones) outside."""
    h, w = inputs["hidden"].double(), inputs["weight"].double()
    y = h @ w.T + (0 if inputs.get("bias") is None else inputs["bias"].double())
    t = inputs["targets"].clone()
    rows = torch.arange(t.shape[0]) if inputs.get("row_index") is None else inputs["row_index"].cpu()
    pick = (torch.arange(t.shape[0]) % 2 == 0) & (t.cpu() != -100)
    t[pick.to(t.device)] = y.argmax(-1).cpu()[rows][pick].to(t.device)
    return {**inputs, "targets": t}


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("case", COMPUTED, ids=[c[0] for c in COMPUTED])
def test_computed_support_matches_reference(backend, device, case):
    name, kw, sampling = case
    gen = torch.Generator().manual_seed(len(name) * 11)
    inputs = _some_inside(random_logprobs_case(gen, N=17, H=19, V=71, dtype=torch.float64, device=device, **kw))
    inputs.update(sampling)
    assert_matches_reference(inputs, backend, gen)


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("case", COMPUTED[:5], ids=[c[0] for c in COMPUTED[:5]])
def test_computed_support_fp32(backend, device, case):
    """fp32 inputs: the kept set is decided on fp32 logits by every backend and by the
    same-dtype reference alike (the fp64 reference may keep a different boundary column only
    where two logits are within fp32 rounding of each other, which these cases avoid)."""
    name, kw, sampling = case
    gen = torch.Generator().manual_seed(len(name) * 3)
    inputs = _some_inside(random_logprobs_case(gen, N=13, H=16, V=97, device=device, **kw))
    inputs.update(sampling)
    assert_matches_reference(inputs, backend, gen)


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("case", COMPUTED[:4], ids=[c[0] for c in COMPUTED[:4]])
def test_computed_support_from_logits(backend, device, case):
    name, kw, sampling = case
    gen = torch.Generator().manual_seed(len(name) * 5)
    inputs = random_logprobs_case(gen, N=14, H=15, V=83, dtype=torch.float64, device=device, **kw)
    inputs = logits_case_from(_some_inside(inputs))
    inputs.update(sampling)
    assert_matches_reference(inputs, backend, gen)


def explicit_support(gen, n, v, targets, row_index=None):
    """A CSR support: random ids per row with duplicates, an empty row, a row that holds its
    targets, one that does not."""
    ids, offsets = [], [0]
    rows_target = {}
    rows = range(len(targets)) if row_index is None else row_index.tolist()
    for k, r in enumerate(rows):
        rows_target.setdefault(r, []).append(int(targets[k]))
    for r in range(n):
        size = 0 if r == 1 else int(torch.randint(1, max(2, v // 3), (), generator=gen))
        row = torch.randint(0, v, (size,), generator=gen).tolist()
        if size and r % 3 == 0:
            row += rows_target.get(r, [])  # its targets inside
        if size and r % 4 == 0:
            row += row[:2]  # duplicates
        ids += row
        offsets.append(len(ids))
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64)


EXPLICIT = [
    ("normal", dict()),
    ("bias, per-row T", dict(bias=True, temperature="rows")),
    ("row_index, ignored", dict(branching=True, ignore_fraction=0.2)),
    ("V = 1031", dict(V=1031, N=9)),
]


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", EXPLICIT, ids=[c[0] for c in EXPLICIT])
def test_explicit_support_matches_reference(backend, device, dtype, case):
    name, kw = case
    gen = torch.Generator().manual_seed(len(name) * 17)
    inputs = random_logprobs_case(gen, **{"N": 15, "H": 13, "V": 61, **kw}, dtype=dtype, device="cpu")
    n, v = inputs["hidden"].shape[0], inputs["weight"].shape[0]
    targets = inputs["targets"].clamp(min=0)  # (an ignored target is no id to put in the support)
    ids, off = explicit_support(gen, n, v, targets, inputs.get("row_index"))
    inputs.update(support_ids=ids, support_offsets=off)
    inputs = {k: (x.to(device) if isinstance(x, torch.Tensor) else x) for k, x in inputs.items()}
    assert_matches_reference(inputs, backend, gen)


@pytest.mark.parametrize("backend,device", FAST)
def test_explicit_support_from_logits(backend, device):
    gen = torch.Generator().manual_seed(23)
    inputs = logits_case_from(random_logprobs_case(gen, N=12, H=11, V=45, dtype=torch.float64))
    ids, off = explicit_support(gen, 12, 45, inputs["targets"].reshape(-1))
    inputs.update(support_ids=ids, support_offsets=off)
    inputs = {k: (x.to(device) if isinstance(x, torch.Tensor) else x) for k, x in inputs.items()}
    assert_matches_reference(inputs, backend, gen)


@pytest.mark.parametrize("backend,device", ALL)
def test_support_bits_are_the_csr(backend, device):
    """The MASK bitmap of a CSR (duplicates, an empty row, ids on word boundaries, V not a
    multiple of 32) sets exactly the kept bits; unchecked garbage (ids out of range, offsets
    past the end or reversed) sets none outside [0, V) and reads nothing out of bounds."""
    gen = torch.Generator().manual_seed(3)
    n, v = 7, 97
    ids = torch.cat([torch.tensor([0, 31, 32, 63, 64, 95, 96, 96, 31]), torch.randint(0, v, (40,), generator=gen)])
    off = torch.tensor([0, 9, 9, 20, 25, 40, 45, 49])
    kernel = _dispatch.kernel("support_bits", backend)
    bits = kernel(ids.to(device), off.to(device), v).cpu()
    assert bits.dtype == torch.int32 and tuple(bits.shape) == (n, 4)
    cols = torch.arange(v)
    unpacked = (bits[:, cols // 32] >> (cols % 32)) & 1
    assert torch.equal(unpacked.bool(), support_mask(n, v, "cpu", support_ids=ids, support_offsets=off))
    assert int(bits[0, 0]) == 1 - 2**31  # bits 0 and 31: the sign bit set
    bad = torch.tensor([-5, 97, 1000, 3])
    got = kernel(bad.to(device), torch.tensor([0, 4, 99, -3, 2]).to(device), v).cpu()
    assert got[0].tolist() == [8, 0, 0, 0] and int(got[1:].count_nonzero()) == 0


@pytest.mark.parametrize("backend,device", FAST)
def test_degenerate_rows_are_finite(backend, device):
    """An empty support row: −inf log-probs (flagged), entropy 0, zero gradients; all targets
    ignored: zeros; N = 0: empty outputs. Nothing is NaN."""
    gen = torch.Generator().manual_seed(8)
    h = torch.randn(3, 5, generator=gen, device=device, requires_grad=True)
    w = torch.randn(11, 5, generator=gen, device=device, requires_grad=True)
    t = torch.tensor([2, 4, 6], device=device)
    off = torch.tensor([0, 0, 2, 2], device=device)
    ids = torch.tensor([4, 4], device=device)
    out = rk.linear_logprobs(h, w, t, support_ids=ids, support_offsets=off, return_entropy=True, backend=backend)
    assert out.outside_support.tolist() == [True, False, True]
    assert bool(torch.isneginf(out.logp[[0, 2]]).all()) and float(out.logp[1]) == 0.0
    assert out.entropy.tolist() == [0.0, 0.0, 0.0]
    loss = torch.where(out.outside_support, 0.0, out.logp).sum() + out.entropy.sum()
    loss.backward()
    assert bool(torch.isfinite(h.grad).all()) and bool(torch.isfinite(w.grad).all())
    assert float(h.grad.abs().max()) == 0.0  # a single kept column: log p = 0 whatever h
    ign = torch.full((3,), -100, device=device)
    out = rk.linear_logprobs(h, w, ign, top_p=0.5, return_entropy=True, backend=backend)
    assert out.logp.tolist() == [0.0, 0.0, 0.0] and not bool(out.outside_support.any())
    e = torch.empty(0, 5, device=device)
    out = rk.linear_logprobs(e, w, torch.empty(0, dtype=torch.long, device=device), top_k=3, backend=backend)
    assert out.logp.shape == (0,) and out.outside_support.shape == (0,)


@pytest.mark.parametrize("backend,device", [p for p in FAST if p.values[0] == "cpu"])
def test_large_vocabulary(backend, device):
    """V = 152064 (Qwen's vocabulary), top-k 50 + top-p 0.95 and an explicit support, on few
    rows (the reference materialises [N, V])."""
    gen = torch.Generator().manual_seed(9)
    inputs = random_logprobs_case(gen, N=3, H=8, V=152064, dtype=torch.float64, device=device)
    inputs.update(top_k=50, top_p=0.95)
    assert_matches_reference(inputs, backend, gen)
    ids = torch.randint(0, 152064, (300,), generator=gen)
    ids[:3] = inputs["targets"]
    inputs = {k: x for k, x in inputs.items() if k not in ("top_k", "top_p")}
    inputs.update(support_ids=ids, support_offsets=torch.tensor([0, 100, 200, 300]))
    assert_matches_reference(inputs, backend, gen)


def test_support_is_restriction_of_the_full_distribution():
    """Keeping every column (an explicit support of all ids, top-k = V, top-p = 1) gives the
    unrestricted numbers on the reference and the outside flags all False."""
    gen = torch.Generator().manual_seed(4)
    inputs = random_logprobs_case(gen, N=5, H=7, V=23, dtype=torch.float64)
    full = run_logprobs(inputs, "reference")
    ids = torch.arange(23).repeat(5)
    for extra in (dict(support_ids=ids, support_offsets=torch.arange(6) * 23), dict(top_k=23, top_p=1.0)):
        got = run_logprobs({**inputs, **extra}, "reference")
        assert torch.allclose(got["logp"], full["logp"]) and torch.allclose(got["entropy"], full["entropy"])
        assert not bool(got["outside"].any())


BAD = [
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(min_p=-0.1), ValueError, "min_p"),
    (dict(top_k=2.5), TypeError, "top_k"),
    (dict(top_k=torch.tensor([1.0])), TypeError, "top_k"),
    (dict(top_p=torch.tensor([0.5, 0.5])), ValueError, "top_p"),
    (dict(top_p=torch.tensor([0.5, 0.0, 0.5, 0.5])), ValueError, "top_p"),
    (dict(sampling_convention="hf"), ValueError, "sampling_convention"),
    (
        dict(top_p=0.9, support_ids=torch.tensor([0]), support_offsets=torch.tensor([0, 1, 1, 1, 1])),
        ValueError,
        "not both",
    ),
    (dict(support_ids=torch.tensor([0])), ValueError, "support_offsets"),
    (dict(support_ids=torch.tensor([0]), support_offsets=torch.tensor([0, 1])), ValueError, "support_offsets"),
    (dict(support_ids=torch.tensor([0.0]), support_offsets=torch.tensor([0, 1, 1, 1, 1])), TypeError, "support_ids"),
    (dict(support_ids=torch.tensor([0]), support_offsets=torch.tensor([0, 1, 1, 1, 2])), ValueError, "support_offsets"),
    (dict(support_ids=torch.tensor([0, 99]), support_offsets=torch.tensor([0, 1, 2, 2, 2])), ValueError, "support_ids"),
    (dict(top_p=0.9, outputs=("is_top1",)), ValueError, "outputs"),
]


@pytest.mark.parametrize("kw,err,word", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_arguments_raise(kw, err, word):
    h, w, t = torch.randn(4, 3), torch.randn(10, 3), torch.tensor([1, 2, 3, 4])
    with pytest.raises(err, match=word):
        rk.linear_logprobs(h, w, t, **kw)


def test_unchecked_garbage_is_safe():
    """validate=False with offsets and ids out of range: no error, no out-of-bounds access,
    ids outside [0, V) keep nothing."""
    h, w, t = torch.randn(2, 3), torch.randn(10, 3), torch.tensor([1, 2])
    out = rk.linear_logprobs(
        h, w, t, support_ids=torch.tensor([1, -7, 1000, 2]), support_offsets=torch.tensor([0, 3, 9]), validate=False
    )
    assert out.outside_support.tolist() == [False, False] or out.outside_support.dtype == torch.bool
    assert not bool(torch.isnan(out.logp).any())


def test_logits_op_per_row_filters():
    """A per-row top_p tensor shaped like the targets ([2, 3]) on [2, 3, V] logits."""
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(2, 3, 29, generator=gen, dtype=torch.float64) * 3
    targets = torch.randint(0, 29, (2, 3), generator=gen)
    top_p = torch.tensor([[0.5, 0.9, 1.0], [0.3, 0.7, 0.99]], dtype=torch.float64)
    out = rk.logprobs_from_logits(logits, targets, 0.8, True, top_p=top_p, backend="reference")
    z = logits.reshape(6, 29) / 0.8
    kept = support_mask(6, 29, "cpu", z=z, top_p=top_p.reshape(-1))
    want = torch.where(kept, torch.log_softmax(torch.where(kept, z, -math.inf), -1), -math.inf)
    assert torch.equal(out.logp.reshape(-1), want.gather(1, targets.reshape(6, 1))[:, 0])
