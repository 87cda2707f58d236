"""``linear_logprobs``' logit transform (``logit_scale``, ``softcap``) and optional outputs
(``outputs=``: entropy, log Σ p², mean logit, is_top1) on every backend against the fp64
reference (the tolerance rule, odd sizes, several targets per row, ignored targets, per-row
temperatures, bias, fp32 / bf16 / fp64); the default call is unchanged by them; argmax
ties; their validation; and TRL 1.16's own ``trl.kernels.ChunkedLogProbFunction`` against
our op and against the adapter that replaces it (values and gradients, autocast)."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from _backends import ALL, FAST

import rlvr_kernels as rk
from rlvr_kernels.integrations import trl as rk_trl
from rlvr_kernels.integrations.trl.kernels import ChunkedLogProbFunction
from rlvr_kernels.ops.logprobs import OPTIONAL_OUTPUTS, LinearLogprobs
from rlvr_kernels.testing import as_float64, random_logprobs_case
from rlvr_kernels.testing._compare import compare

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
TRANSFORMS = {
    "scale": dict(logit_scale=0.37),
    "softcap+scale": dict(softcap=4.0, logit_scale=1.6),
    "softcap": dict(softcap=30.0),
}


def _case(name: str, dtype, device, **kw):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    x = random_logprobs_case(
        gen,
        N=kw.pop("N", 11),
        H=kw.pop("H", 24),
        V=kw.pop("V", 203),
        dtype=dtype,
        bias=True,
        branching=True,
        ignore_fraction=0.15,
        temperature="rows",
        device=device,
        **kw,
    )
    x.pop("return_entropy")
    # About half the targets are their row's argmax, so is_top1 has both answers.
    z = x["hidden"].double() @ x["weight"].double().T + x["bias"].double()
    rows = x["row_index"].long()
    pick = torch.rand(rows.shape[0], generator=gen) < 0.5
    x["targets"] = torch.where(pick.to(device) & (x["targets"] != -100), z.argmax(-1)[rows], x["targets"])
    up = (
        torch.randn(x["targets"].shape[0], generator=gen, dtype=F64),
        torch.randn(x["hidden"].shape[0], generator=gen, dtype=F64),
    )
    return x, up


def _run(x, backend, up, **kw):
    """Forward (every optional output) and backward of logp·u + entropy·v on fresh leaves."""
    x = dict(x)
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in ("hidden", "weight", "bias")}
    x.update(leaves)
    r = rk.linear_logprobs(**x, outputs=OPTIONAL_OUTPUTS, backend=backend, **kw)
    assert isinstance(r, LinearLogprobs)
    loss = (r.logp * up[0].to(r.logp)).sum() + (r.entropy * up[1].to(r.entropy)).sum()
    loss.backward()
    out = {k: getattr(r, k).detach() for k in r._fields}
    out.update({f"grad.{n}": leaf.grad for n, leaf in leaves.items()})
    return out


def _z64(x, logit_scale=1.0, softcap=None):
    z = (x["hidden"].double() @ x["weight"].double().T + x["bias"].double()) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / x["temperature"].double()[:, None]


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_options_match_the_fp64_reference(backend, device, dtype, transform):
    kw = TRANSFORMS[transform]
    x, up = _case(f"{transform}-{dtype}", dtype, device)
    ref64 = _run(as_float64(x), "reference", up, **kw)
    same = _run(x, "reference", up, **kw)
    fast = _run(x, backend, up, **kw)
    z = _z64(as_float64({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in x.items()}), **kw)
    scale = max(1.0, float(z.abs().max()))
    for k in ref64:
        if k == "is_top1":
            continue
        out_dtype = dtype if k.startswith("grad.") else F32
        c = compare(k, fast[k], ref64[k], same[k], out_dtype, scale)
        assert c.ok, c
        assert fast[k].dtype == (dtype if k.startswith("grad.") else (F64 if dtype == F64 else F32)), k
    # is_top1: exact, except where the row's top two logits are within rounding of each other.
    rows = x["row_index"].long().cpu()
    top2 = z.topk(2, dim=-1).values
    clear = ((top2[:, 0] - top2[:, 1]) > 1e-3 * scale)[rows]
    assert fast["is_top1"].dtype == torch.bool
    assert torch.equal(fast["is_top1"].cpu()[clear], ref64["is_top1"].cpu()[clear])
    assert bool(ref64["is_top1"].any()) and not bool(ref64["is_top1"].all())
    ignored = (x["targets"] == -100).cpu()
    assert not bool(fast["is_top1"].cpu()[ignored].any()) and bool((fast["logp"].cpu()[ignored] == 0).all())
    # Invariants: log p ≤ 0, 0 ≤ entropy ≤ log V, log Σ p² ∈ [−log V, 0], the mean logit in the cap.
    V = x["weight"].shape[0]
    assert bool((fast["logp"] <= 0).all())
    assert bool((fast["entropy"] >= 0).all() & (fast["entropy"] <= math.log(V) + 1e-6).all())
    lss = fast["log_sum_sq_probs"]
    assert bool((lss <= 1e-6).all() & (lss >= -math.log(V) - 1e-4).all())


@pytest.mark.parametrize("backend,device", FAST)
def test_defaults_are_unchanged_by_the_new_options(backend, device):
    """logit_scale=1, no softcap, no outputs: bit for bit the call without the keywords; and
    requesting statistics changes neither the log-probs, nor the entropies, nor a gradient."""
    x, up = _case("defaults", F32, device)
    kw = dict(x)
    a = rk.linear_logprobs(**kw, return_entropy=True, backend=backend)
    b = rk.linear_logprobs(**kw, return_entropy=True, backend=backend, logit_scale=1.0, softcap=None, outputs=())
    assert torch.equal(a.logp, b.logp) and torch.equal(a.entropy, b.entropy)
    assert torch.equal(rk.linear_logprobs(**kw, backend=backend, outputs=()).logp, a.logp)
    plain = _run_plain(x, backend, up)
    full = _run(x, backend, up)
    for k in ("logp", "entropy", "grad.hidden", "grad.weight", "grad.bias"):
        assert torch.equal(plain[k], full[k]), k


def _run_plain(x, backend, up):
    x = dict(x)
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in ("hidden", "weight", "bias")}
    x.update(leaves)
    logp, ent = rk.linear_logprobs(**x, return_entropy=True, backend=backend)[:2]
    ((logp * up[0].to(logp)).sum() + (ent * up[1].to(ent)).sum()).backward()
    out = {"logp": logp.detach(), "entropy": ent.detach()}
    out.update({f"grad.{n}": leaf.grad for n, leaf in leaves.items()})
    return out


@pytest.mark.parametrize("backend,device", FAST)
def test_torch_compile_fullgraph_with_options(backend, device):
    """The soft-capped op with every output traces into one graph (fake kernels, autograd) and
    matches eager, values and gradients."""
    x, up = _case("compile", F32, device)

    def step(hidden, weight, bias):
        r = rk.linear_logprobs(
            hidden,
            weight,
            x["targets"],
            row_index=x["row_index"],
            bias=bias,
            temperature=x["temperature"],
            softcap=5.0,
            logit_scale=1.3,
            outputs=OPTIONAL_OUTPUTS,
            backend=backend,
        )
        loss = (r.logp * up[0].to(r.logp)).sum() + (r.entropy * up[1].to(r.entropy)).sum()
        return loss, r.log_sum_sq_probs, r.mean_logits, r.is_top1

    results = []
    torch._dynamo.reset()
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = [x[n].detach().clone().requires_grad_(True) for n in ("hidden", "weight", "bias")]
        loss, *stats = fn(*leaves)
        loss.backward()
        results.append([loss.detach(), *stats, *(t.grad for t in leaves)])
    for a, b in zip(*results):
        if a.dtype == torch.bool:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend,device", ALL)
def test_outputs_subsets_and_return_forms(backend, device):
    x, _ = _case("subsets", F32, device)
    for outputs in (("mean_logits",), ("is_top1", "log_sum_sq_probs"), ["entropy"]):
        r = rk.linear_logprobs(**x, outputs=outputs, backend=backend, softcap=5.0)
        assert isinstance(r, LinearLogprobs)
        for name in OPTIONAL_OUTPUTS:
            assert (getattr(r, name) is None) == (name not in outputs), (outputs, name)
    r = rk.linear_logprobs(**x, outputs=("mean_logits",), return_entropy=True, backend=backend)
    assert r.entropy is not None and r.mean_logits is not None and r.is_top1 is None
    # The statistics that carry no gradient are marked so.
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in ("hidden", "weight")}
    r = rk.linear_logprobs(**{**x, **leaves}, outputs=OPTIONAL_OUTPUTS, backend=backend)
    assert r.logp.requires_grad and r.entropy.requires_grad
    assert not r.log_sum_sq_probs.requires_grad and not r.mean_logits.requires_grad and not r.is_top1.requires_grad


@pytest.mark.parametrize("backend,device", ALL)
def test_one_return_type_whatever_is_asked(backend, device):
    """linear_logprobs returns a LinearLogprobs and logprobs_from_logits a
    LogprobsFromLogits for every request, None in the fields not asked for."""
    x, _ = _case("return type", F32, device)
    asks = [dict(), dict(return_entropy=True), dict(outputs=("mean_logits",)), dict(outputs=OPTIONAL_OUTPUTS)]
    for ask in asks:
        r = rk.linear_logprobs(**x, backend=backend, **ask)
        assert type(r) is LinearLogprobs and len(r) == 5, ask
        wanted = set(ask.get("outputs", ())) | ({"entropy"} if ask.get("return_entropy") else set())
        for name in OPTIONAL_OUTPUTS:
            assert (getattr(r, name) is None) == (name not in wanted), (ask, name)
        assert r.logp.shape == x["targets"].shape
    logits = torch.randn(2, 3, 11, device=device)
    targets = torch.randint(0, 11, (2, 3), device=device)
    for entropy in (False, True):
        r = rk.logprobs_from_logits(logits, targets, return_entropy=entropy, backend=backend)
        assert type(r) is rk.LogprobsFromLogits and len(r) == 2
        assert r.logp.shape == (2, 3) and (r.entropy is None) == (not entropy)
        if entropy:
            assert r.entropy.shape == (2, 3)


@pytest.mark.parametrize("backend,device", ALL)
def test_is_top1_ties_go_to_the_earlier_column(backend, device):
    """Two columns share the row maximum exactly: only the first is the top-1 (torch.argmax's
    and TRL's rule), in whichever tile each lands."""
    gen = torch.Generator().manual_seed(3)
    N, H, V = 6, 8, 150
    hidden = torch.randn(N, H, generator=gen).to(device)
    weight = (0.1 * torch.randn(V, H, generator=gen)).to(device)
    bias = torch.zeros(V, device=device)
    weight[140] = weight[3]
    bias[3] = bias[140] = 50.0  # columns 3 and 140 tie for every row's max
    targets = torch.tensor([3, 140, 3, 140, 5, 3], device=device)
    for kw in ({}, {"softcap": 20.0}):
        r = rk.linear_logprobs(hidden, weight, targets, bias=bias, outputs=("is_top1",), backend=backend, **kw)
        assert r.is_top1.cpu().tolist() == [True, False, True, False, False, True], kw


@pytest.mark.cpu_kernel
@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
def test_cpu_kernel_statistics_across_blocks_and_chunks(dtype):
    """The C++ kernel folds the optional statistics across its 512-column tiles, 4096-column
    work items and 128-row blocks: V and N past each, an argmax tie across two work items, a
    soft-cap, and the gradients."""
    gen = torch.Generator().manual_seed(21)
    N, H, V = 131, 12, 4600
    hidden = torch.randn(N, H, generator=gen, dtype=F64)
    weight = 0.3 * torch.randn(V, H, generator=gen, dtype=F64)
    bias = torch.zeros(V, dtype=F64)
    weight[4400] = weight[700]
    bias[700] = bias[4400] = 4.0  # often the max, tied between two work items
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[:40] = 700
    targets[40:80] = 4400
    x = dict(hidden=hidden, weight=weight, bias=bias, targets=targets, temperature=0.9)
    up = (torch.randn(N, generator=gen, dtype=F64), torch.randn(N, generator=gen, dtype=F64))
    for kw in ({}, {"softcap": 3.0, "logit_scale": 1.2}):
        cast = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in x.items()}
        ref64 = _run(x, "reference", up, **kw)
        same = _run(cast, "reference", up, **kw)
        fast = _run(cast, "cpu", up, **kw)
        for k in ref64:
            if k != "is_top1":
                c = compare(k, fast[k], ref64[k], same[k], dtype if k.startswith("grad.") else F32, 10.0)
                assert c.ok, (kw, c)
        assert torch.equal(fast["is_top1"], ref64["is_top1"]), kw
        assert bool(fast["is_top1"][:40].any()) and not bool(fast["is_top1"][40:80].any())


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(softcap=0.0), ValueError, "softcap"),
        (dict(softcap=-2.0), ValueError, "softcap"),
        (dict(softcap=math.inf), ValueError, "softcap"),
        (dict(softcap=math.nan), ValueError, "softcap"),
        (dict(softcap="30"), TypeError, "softcap"),
        (dict(logit_scale=math.inf), ValueError, "logit_scale"),
        (dict(logit_scale=math.nan), ValueError, "logit_scale"),
        (dict(logit_scale=None), TypeError, "logit_scale"),
        # Outside [1e-6, 1e6] (logit_scale's magnitude, unless 0) a kernel factor would leave
        # the normal fp32 numbers: 0 (read as "no soft-cap"), a subnormal, or an overflow.
        (dict(logit_scale=1e-44, softcap=30.0), ValueError, r"logit_scale: expected 0 or a magnitude in \[1e-06"),
        (dict(logit_scale=9e-7), ValueError, "logit_scale"),
        (dict(logit_scale=-1.1e6), ValueError, "logit_scale"),
        (dict(logit_scale=1e39), ValueError, "logit_scale"),
        (dict(softcap=1e-39), ValueError, r"softcap: expected a finite number in \[1e-06, 1000000.0\]"),
        (dict(softcap=9e-7), ValueError, "softcap"),
        (dict(softcap=1.1e6), ValueError, "softcap"),
        (dict(softcap=1e300), ValueError, "softcap"),
        (dict(outputs="entropy"), TypeError, "outputs"),
        (dict(outputs=("entropy", "logits")), ValueError, "outputs"),
        (dict(outputs=None), TypeError, "outputs"),
    ],
)
@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_validation_names_the_argument(kwargs, error, match, backend):
    x, _ = _case("validation", F32, "cpu", N=3, H=4, V=7)
    with pytest.raises(error, match=match):
        rk.linear_logprobs(**x, backend=backend, **kwargs)


# Every fp32 factor the kernels read at an end of its range: logit_scale/T or softcap/T per
# row (1e-36 to 1e36), the tanh's scale logit_scale/softcap (1e-12 to 1e12) and their product.
EDGES = {
    "scale 1e-6, T 1e30": (dict(logit_scale=1e-6), 1e30),
    "scale 1e6, T 1e-30": (dict(logit_scale=1e6), 1e-30),
    "scale -1e6, T 1e-30": (dict(logit_scale=-1e6), 1e-30),
    "scale 1e-6, cap 1e6, T 1e30": (dict(logit_scale=1e-6, softcap=1e6), 1e30),
    "scale 1e6, cap 1e-6, T 1e-30": (dict(logit_scale=1e6, softcap=1e-6), 1e-30),
    "scale 1e-6, cap 1e-6, T 1e30": (dict(logit_scale=1e-6, softcap=1e-6), 1e30),
    "scale 1e6, cap 1e6, T 1e-30": (dict(logit_scale=1e6, softcap=1e6), 1e-30),
    "scale 0, cap 30, T 1e-30": (dict(logit_scale=0.0, softcap=30.0), 1e-30),
}


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("per_row", [False, True], ids=["T float", "T per row"])
@pytest.mark.parametrize("edge", list(EDGES))
def test_range_edges_match_the_reference(backend, device, per_row, edge):
    """At the ends of the accepted logit_scale / softcap / temperature ranges every backend
    gives the fp64 reference's log-probs, statistics and gradients (compared relative to
    each output's magnitude), none NaN, a row of zero logits (y = 0) included. The hidden
    states are scaled so that z spans O(1) where the transform allows it."""
    kw, T = EDGES[edge]
    scale, cap = abs(kw["logit_scale"]), kw.get("softcap")
    # y = width·(h·w) puts z ≈ h·w in the unsaturated tanh (width kept in [1e-30, 1e30]).
    width = 1.0 if scale == 0 else min(max(min(T, cap or T) / scale, 1e-30), 1e30)
    gen = torch.Generator().manual_seed(zlib.crc32(edge.encode()))
    N, H, V = 6, 8, 13
    hidden = torch.randn(N, H, generator=gen, dtype=F64) * width
    hidden[0] = 0.0  # a row of zero logits: uniform, the soft-cap's derivative at its steepest
    x = dict(
        hidden=hidden.float().to(device),
        weight=torch.randn(V, H, generator=gen).to(device),
        bias=torch.zeros(V, device=device),
        targets=torch.randint(0, V, (N,), generator=gen).to(device),
        temperature=torch.full((N,), T, device=device) if per_row else T,
    )
    up = (torch.randn(N, generator=gen, dtype=F64), torch.randn(N, generator=gen, dtype=F64))
    # (fp32's nearest to 1e30 is above it: the reference gets T itself.)
    x64 = {**as_float64(x), "temperature": torch.full((N,), T, dtype=F64, device=device) if per_row else T}
    ref64 = _run(x64, "reference", up, **kw)
    same = _run(x, "reference", up, **kw)
    fast = _run(x, backend, up, **kw)
    cpu64 = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in x64.items()}
    z = _z64({**cpu64, "temperature": torch.full((N,), T, dtype=F64)}, **kw)
    z_scale = max(1.0, float(z.abs().max()))
    for k in ref64:
        if k == "is_top1":
            continue
        assert bool(torch.isfinite(fast[k]).all()), (edge, k)
        size = float(ref64[k].abs().max()) or 1.0
        cmp = compare(k, fast[k] / size, ref64[k] / size, same[k] / size, F32, z_scale)
        assert cmp.ok, (edge, cmp)
    V_log = math.log(V)
    assert abs(float(fast["logp"][0]) + V_log) < 1e-5 and abs(float(fast["entropy"][0]) - V_log) < 1e-5


def test_is_top1_refuses_vocabularies_beyond_exact_indices():
    """The argmax travels as a number in the compute dtype: exact up to 2^24 (checked on meta
    tensors, before any kernel)."""
    hidden = torch.empty(2, 4, device="meta")
    weight = torch.empty(2**24 + 1, 4, device="meta")
    targets = torch.zeros(2, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="outputs: 'is_top1'"):
        rk.linear_logprobs(hidden, weight, targets, outputs=("is_top1",))


# ------------------------------------------------------------------ TRL's ChunkedLogProbFunction
def _trl_case(name, dtype=F32, N=29, H=16, V=157):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    hidden = torch.randn(N, H, generator=gen, dtype=F64)
    weight = torch.randn(V, H, generator=gen, dtype=F64) / H**0.5 * 2
    bias = 0.5 * torch.randn(V, generator=gen, dtype=F64)
    z = hidden @ weight.T + bias
    targets = torch.where(torch.rand(N, generator=gen) < 0.5, z.argmax(-1), torch.randint(0, V, (N,), generator=gen))
    up = torch.randn(N, generator=gen, dtype=F64), torch.randn(N, generator=gen, dtype=F64)
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype), targets, up


def _call(fn, hidden, weight, bias, targets, up, *args):
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    out = fn(*leaves[:2], leaves[2], targets, *args)
    logp, entropy = out[0], out[1]
    loss = (logp * up[0].to(logp)).sum()
    if entropy is not None:
        loss = loss + (entropy * up[1].to(entropy)).sum()
    grads = torch.autograd.grad(loss, leaves)
    return out, grads


TRL_TRANSFORMS = [(None, 1.0), (None, 0.5), (30.0, 1.0), (3.0, 1.7)]


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("softcap,scale", TRL_TRANSFORMS, ids=["plain", "scale", "softcap", "softcap+scale"])
def test_adapter_matches_trl_chunked_logprob_function(backend, device, softcap, scale):
    """Our ChunkedLogProbFunction (TRL's signature, on linear_logprobs) against TRL's own, fp32,
    every output, bias, TRL's temperature: values and gradients within 1e-5."""
    import trl.kernels as trl_kernels

    hidden, weight, bias, targets, up = _trl_case(f"trl-{softcap}-{scale}")
    args = (0.7, 64, softcap, scale, OPTIONAL_OUTPUTS)
    want, want_g = _call(trl_kernels.ChunkedLogProbFunction.apply, hidden, weight, bias, targets, up, *args)
    on = [t.to(device) for t in (hidden, weight, bias, targets)]
    with rk_trl.use_backend(backend):
        got, got_g = _call(ChunkedLogProbFunction.apply, *on, up, *args)
    assert len(got) == 5
    for name, a, b in zip(("log_probs",) + OPTIONAL_OUTPUTS, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if b.dtype == torch.bool:
            assert torch.equal(a.cpu(), b), name
        else:
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert got[1].requires_grad and not any(t.requires_grad for t in got[2:])
    for name, a, b in zip(("hidden", "weight", "bias"), got_g, want_g):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("outputs", [(), ("log_probs",), ("entropy",), ("is_top1", "mean_logits")])
def test_adapter_returns_trls_none_pattern(outputs):
    import trl.kernels as trl_kernels

    hidden, weight, bias, targets, up = _trl_case("none-pattern")
    args = (1.0, 64, None, 1.0, outputs)
    want = trl_kernels.ChunkedLogProbFunction.apply(hidden, weight, bias, targets, *args)
    got = ChunkedLogProbFunction.apply(hidden, weight, bias, targets, *args)
    assert [t is None for t in got] == [t is None for t in want]
    for a, b in zip(got, want):
        if b is not None:
            assert a.dtype == b.dtype
            if b.dtype != torch.bool:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_adapter_fp64_inputs_give_trls_fp32_outputs():
    import trl.kernels as trl_kernels

    hidden, weight, bias, targets, up = _trl_case("fp64", dtype=F64)
    args = (0.9, 64, 5.0, 0.8, OPTIONAL_OUTPUTS)
    want, want_g = _call(trl_kernels.ChunkedLogProbFunction.apply, hidden, weight, bias, targets, up, *args)
    got, got_g = _call(ChunkedLogProbFunction.apply, hidden, weight, bias, targets, up, *args)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(got_g, want_g):
        assert a.dtype == b.dtype == F64
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_adapter_computes_in_the_autocast_dtype_like_trl():
    """Under CPU autocast to bf16 TRL computes in bf16 (its compute dtype); the adapter casts
    hidden / weight / bias to bf16 too: it returns what our op returns on the bf16 inputs (fp32
    values), the gradients come back in the parameters' own fp32, and it is at least as close
    to the fp64 truth on those bf16 inputs as TRL (whose CPU tiles round the logits to bf16)."""
    import trl.kernels as trl_kernels

    hidden, weight, bias, targets, up = _trl_case("autocast")
    args = (1.0, 64, 30.0, 1.0, OPTIONAL_OUTPUTS)
    with torch.autocast("cpu", dtype=BF16):
        got, got_g = _call(ChunkedLogProbFunction.apply, hidden, weight, bias, targets, up, *args)
        want, _ = _call(trl_kernels.ChunkedLogProbFunction.apply, hidden, weight, bias, targets, up, *args)
    assert [t.dtype for t in got] == [t.dtype for t in want] == [F32] * 4 + [torch.bool]
    assert all(g.dtype == F32 for g in got_g)
    h16, w16, b16 = (t.to(BF16) for t in (hidden, weight, bias))
    direct = rk.linear_logprobs(h16, w16, targets, bias=b16, softcap=30.0, outputs=OPTIONAL_OUTPUTS)
    assert torch.equal(got[0], direct.logp) and torch.equal(got[1], direct.entropy.detach())
    truth = rk.linear_logprobs(
        *(t.double() for t in (h16, w16)),
        targets,
        bias=b16.double(),
        softcap=30.0,
        outputs=("entropy",),
        backend="reference",
    )
    for k, (a, b) in enumerate(zip((x.detach() for x in got[:2]), (x.detach() for x in want[:2]))):
        t = (truth.logp, truth.entropy)[k]
        assert float((a.double() - t).abs().max()) <= float((b.double() - t).abs().max()) + 1e-6, k


def test_adapter_records_its_calls_and_reads_trls_softcap_quirk():
    """A falsy ``final_logit_softcapping`` (0.0) caps at 1.0 in TRL (``softcap or 1.0``);
    the adapter reads it the same way."""
    import trl.kernels as trl_kernels

    from rlvr_kernels.integrations import _patch

    hidden, weight, bias, targets, up = _trl_case("quirk")
    args = (1.0, 64, 0.0, 1.0, ("entropy",))
    want = trl_kernels.ChunkedLogProbFunction.apply(hidden, weight, bias, targets, *args)
    _patch.set_counting(True)
    try:
        _patch.reset_call_counts()
        got = ChunkedLogProbFunction.apply(hidden, weight, bias, targets, *args)
        assert _patch.call_counts() == {"trl.kernels.ChunkedLogProbFunction": 1}
    finally:
        _patch.set_counting(False)
        _patch.reset_call_counts()
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1].detach(), rtol=1e-5, atol=1e-5)
