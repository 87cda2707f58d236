"""``logits_precision`` (docs/logprobs.md, "Logits precision"): every backend against the fp64
reference with the same rounding steps (log-probs, entropies, straight-through gradients), the
roundings themselves on values whose answer is known, the bf16 logits of the kernels against an
independent emulation of a bf16 LM head, validation and empty inputs. The default "fp32" is the
rest of tests/logprobs."""

import pytest
import torch
from _backends import ALL, FAST

import rlvr_kernels as rk
from rlvr_kernels.contracts.logprobs import LogitsPrecision
from rlvr_kernels.reference.logprobs import round_bf16, round_tf32
from rlvr_kernels.testing import (
    logits_case_from,
    random_logprobs_case,
)
from rlvr_kernels.testing.logprobs import assert_matches_reference

PRECISIONS = ["tf32", "bf16"]


def bf16_exact_sums(inputs, gen):
    """The case with hidden / weight / bias moved to values that bf16 rounds to a coarse grid
    (±k/4, ±k/16, ±k/8 with k in 1..8, times 1 + u·2^-10): the rounded operands' GEMM is then
    exact in fp32 whatever the order of the sum, so y and its bf16 rounding are the same in
    every backend and in fp64, while the rounding of both the operands and y still acts."""

    def grid(t, step):
        k = torch.randint(1, 9, t.shape, generator=gen).double()
        sign = torch.where(torch.rand(t.shape, generator=gen) < 0.5, -1.0, 1.0).double()
        noise = 1 + (torch.rand(t.shape, generator=gen, dtype=torch.float64) * 2 - 1) * 2**-10
        return (sign * k * step * noise).to(t.dtype)

    out = dict(inputs)
    out["hidden"] = grid(inputs["hidden"], 1 / 4)
    out["weight"] = grid(inputs["weight"], 1 / 16)
    if inputs.get("bias") is not None:
        out["bias"] = grid(inputs["bias"], 1 / 8)
    return out


# (name, random_logprobs_case kwargs, extra linear_logprobs kwargs)
CASES = [
    ("normal, bias", dict(bias=True), {}),
    ("per-row temperature, ignored, row_index", dict(temperature="rows", ignore_fraction=0.2, branching=True), {}),
    ("bf16 inputs, bias", dict(dtype=torch.bfloat16, bias=True), {}),
    ("fp16 inputs", dict(dtype=torch.float16), {}),
    ("fp64 inputs, bias (rounded through fp32, fp64 sums)", dict(dtype=torch.float64, bias=True), {}),
    ("soft-cap and logit scale after the rounding", dict(bias=True), dict(softcap=4.0, logit_scale=0.8)),
]


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_linear_matches_reference(backend, device, precision, case):
    name, kw, call = case
    gen = torch.Generator().manual_seed(len(name) * 7 + len(precision))
    inputs = random_logprobs_case(gen, N=13, H=21, V=67, device="cpu", **kw)
    if precision == "bf16":
        inputs = bf16_exact_sums(inputs, gen)
    inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    inputs.update(call, logits_precision=precision)
    assert_matches_reference(inputs, backend, gen)


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_from_logits_bf16_matches_reference(backend, device, dtype):
    gen = torch.Generator().manual_seed(5)
    inputs = logits_case_from(random_logprobs_case(gen, N=12, H=17, V=53, dtype=dtype, device=device))
    inputs["logits_precision"] = "bf16"
    assert_matches_reference(inputs, backend, gen)


def test_from_logits_bf16_is_the_rounded_logits():
    """ "bf16" on fp32 logits is exactly the default on the bf16-rounded logits (values and the
    straight-through gradient); on bf16 logits it changes nothing."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(9, 41, generator=gen) * 4
    targets = torch.randint(0, 41, (9,), generator=gen)
    a_in = logits.clone().requires_grad_(True)
    b_in = logits.bfloat16().float().requires_grad_(True)
    a = rk.logprobs_from_logits(a_in, targets, 0.8, True, logits_precision="bf16", backend="cpu")
    b = rk.logprobs_from_logits(b_in, targets, 0.8, True, backend="cpu")
    assert torch.equal(a.logp, b.logp) and torch.equal(a.entropy, b.entropy)
    (a.logp.sum() + a.entropy.sum()).backward()
    (b.logp.sum() + b.entropy.sum()).backward()
    assert torch.equal(a_in.grad, b_in.grad)
    x = logits.bfloat16()
    assert torch.equal(
        rk.logprobs_from_logits(x, targets, logits_precision="bf16", backend="cpu").logp,
        rk.logprobs_from_logits(x, targets, backend="cpu").logp,
    )


# Known roundings: (x, tf32(x), bf16(x)). tf32 ties go away from zero, bf16 ties to even.
KNOWN = [
    (1 + 2**-11, 1 + 2**-10, 1.0),  # tf32 tie: up; bf16: below half an ulp
    (1 + 2**-11 - 2**-23, 1.0, 1.0),
    (1 + 3 * 2**-11, 1 + 2**-9, 1.0),  # tf32 tie between 1 + 2^-10 and 1 + 2^-9: away
    (1 + 2**-8, 1 + 2**-8, 1.0),  # bf16 tie between 1 and 1 + 2^-7: even (1)
    (1 + 3 * 2**-8, 1 + 3 * 2**-8, 1 + 2**-6),  # bf16 tie: even (1 + 2^-6)
    (-(1 + 2**-11), -(1 + 2**-10), -1.0),
    (torch.finfo(torch.float32).max, float("inf"), float("inf")),  # both round up past the largest value
    (-2.5, -2.5, -2.5),
]


def test_reference_roundings():
    x = torch.tensor([k[0] for k in KNOWN], dtype=torch.float32)
    assert torch.equal(round_tf32(x), torch.tensor([k[1] for k in KNOWN], dtype=torch.float32))
    assert torch.equal(round_bf16(x), torch.tensor([k[2] for k in KNOWN], dtype=torch.float32))
    assert torch.equal(round_tf32(x.double()), round_tf32(x).double())
    special = torch.tensor([float("inf"), float("-inf"), float("nan")])
    assert torch.equal(round_tf32(special)[:2], special[:2]) and bool(round_tf32(special)[2].isnan())


def kernel_logits(hidden, weight, bias, precision, backend):
    """Every logit z = y (T = 1) as the forward kernel computes it: each row targets every column."""
    N, V = hidden.shape[0], weight.shape[0]
    dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    inv_t = torch.ones(N, dtype=dt, device=hidden.device)
    row_ptr = torch.arange(N + 1, device=hidden.device) * V
    targets = torch.arange(V, device=hidden.device).repeat(N)
    code = int(LogitsPrecision[precision.upper()])
    _, z = torch.ops.rlvr_kernels.linear_logprobs_stats(
        hidden, weight, bias, inv_t, row_ptr, targets, None, 0.0, False, False, False, False, code, 0, backend
    )
    return z.reshape(N, V)


@pytest.mark.parametrize("backend,device", FAST)
def test_kernels_round_known_values(backend, device):
    """hidden = [[1]]: z is the rounded weight itself (its rounding, then y's)."""
    w = torch.tensor([[k[0]] for k in KNOWN[:-2]] + [[-2.5]], dtype=torch.float32, device=device)
    h = torch.ones(1, 1, device=device)
    want = {"tf32": [k[1] for k in KNOWN[:-2]] + [-2.5], "bf16": [k[2] for k in KNOWN[:-2]] + [-2.5]}
    for precision in PRECISIONS:
        z = kernel_logits(h, w, None, precision, backend).cpu()
        assert torch.equal(z[0], torch.tensor(want[precision])), precision
    z = kernel_logits(h, w, None, "fp32", backend).cpu()
    assert torch.equal(z[0], w[:, 0].cpu())


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("shape", [(13, 48, 61), (5, 8, 70)])
def test_bf16_logits_match_emulation(backend, device, shape):
    """The kernels' bf16 logits against (h.bf16 · W.bf16ᵀ + b.bf16) in fp32, then .bfloat16():
    equal wherever the exact y is not within the fp32 accumulator's error of a bf16 rounding
    boundary; those places are few, and differ by one bf16 ulp at most."""
    N, H, V = shape
    gen = torch.Generator().manual_seed(N + H + V)
    h = torch.randn(N, H, generator=gen) * 2
    w = torch.randn(V, H, generator=gen) / H**0.5
    b = torch.randn(V, generator=gen)
    hb, wb, bb = (t.bfloat16().float() for t in (h, w, b))
    emul = (hb @ wb.T + bb).bfloat16().float()
    z = kernel_logits(h.to(device), w.to(device), b.to(device), "bf16", backend).cpu()
    exact = hb.double() @ wb.double().T + bb.double()
    # Within the worst-case error of an fp32 sum of H + 1 exact products of a bf16 boundary.
    slack = (H + 1) * 2.0**-24 * ((hb.abs().double() @ wb.abs().double().T) + bb.abs().double())
    near = round_bf16(exact - slack) != round_bf16(exact + slack)
    assert int(near.sum()) <= near.numel() // 10, int(near.sum())
    assert torch.equal(z[~near], emul[~near]) and torch.equal(z[~near], round_bf16(exact)[~near].float())
    differ = z != emul
    assert int(differ.sum()) <= max(2, differ.numel() // 100), int(differ.sum())
    ulp = torch.where(differ, (z - emul).abs() / emul.abs().clamp_min(2.0**-126), 0.0)
    assert float(ulp.max()) <= 2.0**-7
    # "tf32": fp32 logits of the rounded operands (no output rounding), to fp32 accuracy.
    zt = kernel_logits(h.to(device), w.to(device), b.to(device), "tf32", backend).cpu()
    want = round_tf32(h).double() @ round_tf32(w).double().T + b.double()
    assert torch.allclose(zt.double(), want, rtol=0, atol=1e-5)
    assert not torch.equal(zt, kernel_logits(h.to(device), w.to(device), b.to(device), "fp32", backend).cpu())


@pytest.mark.parametrize("backend,device", [FAST[0]])
def test_bf16_large_vocab(backend, device):
    """A 152k vocabulary (Qwen's) on the C++ kernel: bf16 operands and logits, every gradient."""
    gen = torch.Generator().manual_seed(152)
    inputs = bf16_exact_sums(random_logprobs_case(gen, N=3, H=16, V=152_064, bias=True), gen)
    inputs["logits_precision"] = "bf16"
    assert_matches_reference(inputs, backend, gen)


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_empty_and_all_ignored(backend, device, precision):
    w = torch.randn(11, 5, device=device, requires_grad=True)
    h = torch.randn(4, 5, device=device, requires_grad=True)
    out = rk.linear_logprobs(
        h,
        w,
        torch.full((4,), -100, device=device),
        return_entropy=False,
        logits_precision=precision,
        backend=backend,
    )
    assert torch.equal(out.logp, torch.zeros(4, device=device))
    out.logp.sum().backward()
    assert torch.equal(h.grad, torch.zeros_like(h)) and torch.equal(w.grad, torch.zeros_like(w))
    empty = rk.linear_logprobs(
        h[:0], w, torch.zeros(0, dtype=torch.int64, device=device), logits_precision=precision, backend=backend
    )
    assert empty.logp.shape == (0,)
    lg = rk.logprobs_from_logits(
        torch.randn(3, 7, device=device),
        torch.full((3,), -100, device=device),
        logits_precision="bf16",
        backend=backend,
    )
    assert torch.equal(lg.logp, torch.zeros(3, device=device))


@pytest.mark.parametrize("bad", ["fp16", "BF16", None, 2, LogitsPrecision.BF16])
def test_bad_precision_is_refused(bad):
    h, w, t = torch.randn(2, 3), torch.randn(5, 3), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="logits_precision"):
        rk.linear_logprobs(h, w, t, logits_precision=bad)
    with pytest.raises(ValueError, match="logits_precision"):
        rk.logprobs_from_logits(torch.randn(2, 5), t, logits_precision=bad)


def test_from_logits_refuses_tf32():
    with pytest.raises(ValueError, match="logits_precision.*tf32"):
        rk.logprobs_from_logits(torch.randn(2, 5), torch.zeros(2, dtype=torch.int64), logits_precision="tf32")
