"""Every backend of ``rollout_mismatch`` against the fp64 reference (the tolerance rule of
docs/development.md): padded and packed layouts, odd sizes, every input dtype, empty and
all-masked inputs (zeros, never NaN), NaN in the padding, hypothesis, determinism."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlvr_kernels as rk
from rlvr_kernels.testing.rollout_mismatch import compare_mismatch, random_mismatch_case, reference_pair
from tests._backends import ALL, FAST, to

CASES = {
    "padded": dict(layout="padded"),
    "packed": dict(layout="packed"),
    "padded-bf16-float-mask": dict(layout="padded", dtype=torch.bfloat16, mask_dtype=torch.float32),
    "packed-fp16-int-mask": dict(layout="packed", dtype=torch.float16, mask_dtype=torch.int32),
    "packed-fp64": dict(layout="packed", dtype=torch.float64),
    "padded-large-noise": dict(layout="padded", noise=0.7),
    "B1-L1": dict(layout="padded", B=1, L=1, empty_rows=0, mask_fraction=0.0),
    "odd-multi-block": dict(layout="padded", B=3, L=300, empty_rows=0),
    "packed-multi-block": dict(layout="packed", B=2, L=400, empty_rows=0),
    "all-masked": dict(layout="padded", mask_fraction=1.0),
    "all-rows-empty-packed": dict(layout="packed", empty_rows=13),
}


def _check(inputs, backend, **kw):
    ref64, same = reference_pair(inputs, **kw)
    fast = rk.rollout_mismatch(**inputs, backend=backend, **kw)
    bad = [c for c in compare_mismatch(fast, ref64, same, inputs) if not c.ok]
    assert not bad, bad
    for name, v in fast._asdict().items():
        assert torch.isfinite(v.double()).all(), name
    return fast


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend, device", FAST)
def test_matches_reference(case, backend, device):
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    inputs = random_mismatch_case(gen, device=device, **CASES[case])
    out = _check(inputs, backend)
    dtype = inputs["train_logprobs"].dtype
    assert out.k3.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert out.num_tokens.dtype == torch.int64
    assert out.per_seq_abs_diff_max.shape == (13 if "B" not in CASES[case] else CASES[case]["B"],)


@pytest.mark.parametrize("backend, device", ALL)
@pytest.mark.parametrize(
    "shape, packed", [((0, 5), False), ((4, 0), False), ((0,), True), ((6,), True)], ids=["B0", "L0", "T0", "B0-T6"]
)
def test_empty_gives_zeros(backend, device, shape, packed):
    x = torch.full(shape, float("nan"), device=device)
    cu = torch.zeros(1 if packed else 0, dtype=torch.int64, device=device) if packed else None
    out = rk.rollout_mismatch(x, x, cu_seqlens=cu, backend=backend)
    B = 0 if packed else shape[0]
    for name, v in out._asdict().items():
        assert v.shape == ((B,) if name.startswith("per_seq") else ()), name
        assert not v.any(), name


@pytest.mark.parametrize("backend, device", ALL)
def test_all_masked_gives_zeros(backend, device):
    x = torch.randn(3, 4, device=device)
    out = rk.rollout_mismatch(x, x + 1, torch.zeros(3, 4, dtype=torch.bool, device=device), backend=backend)
    assert all(not v.any() for v in out)


@pytest.mark.parametrize("backend, device", FAST)
def test_no_mask_and_mixed_dtypes(backend, device):
    gen = torch.Generator().manual_seed(3)
    inputs = random_mismatch_case(gen, device=device, layout="padded", mask_fraction=0.0, empty_rows=0)
    inputs["train_logprobs"] = torch.nan_to_num(inputs["train_logprobs"], nan=0.0)
    inputs["rollout_logprobs"] = torch.nan_to_num(inputs["rollout_logprobs"], nan=0.0).to(torch.bfloat16)
    inputs["response_mask"] = None
    out = _check(inputs, backend, ratio_bounds=(0.5, 2.0))
    assert int(out.num_tokens) == inputs["train_logprobs"].numel()


@settings(max_examples=10)
@given(
    B=st.integers(0, 5),
    L=st.integers(0, 20),
    layout=st.sampled_from(["padded", "packed"]),
    noise=st.sampled_from([0.0, 0.01, 0.3, 3.0]),
    mask_fraction=st.sampled_from([0.0, 0.5, 1.0]),
    bounds=st.sampled_from([(1 / 1.1, 1.1), (0.0, 2.0), (1.0, 1.0)]),
    seed=st.integers(0, 2**16),
)
def test_property_every_backend(B, L, layout, noise, mask_fraction, bounds, seed):
    gen = torch.Generator().manual_seed(seed)
    kw = dict(B=B, L=L, layout=layout, noise=noise, mask_fraction=mask_fraction)
    for backend, device in (p.values for p in FAST):
        inputs = random_mismatch_case(gen, device=device, **kw)
        _check(inputs, backend, ratio_bounds=bounds)


@pytest.mark.parametrize("backend, device", FAST)
def test_deterministic_and_thread_independent(backend, device):
    gen = torch.Generator().manual_seed(5)
    inputs = random_mismatch_case(gen, device=device, layout="packed", B=9, L=200)
    threads = torch.get_num_threads()
    try:
        a = rk.rollout_mismatch(**inputs, backend=backend)
        torch.set_num_threads(1)
        b = rk.rollout_mismatch(**inputs, backend=backend)
    finally:
        torch.set_num_threads(threads)
    for name in a._fields:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("backend, device", ALL)
def test_hand_computed(backend, device):
    """Two sequences, Δ = (0.1, −0.2) and (0.3,), one empty row; bounds (0.9, 1.1)."""
    train = torch.tensor([[-1.0, -2.0], [-0.5, 0.0], [0.0, 0.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1.1, -1.8], [-0.8, 7.0], [5.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=torch.bool)
    out = rk.rollout_mismatch(
        *to(dict(a=train, b=rollout, m=mask), device).values(), backend=backend, ratio_bounds=(0.9, 1.1)
    )
    d = torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64)
    e = d.exp()
    expect = dict(
        num_tokens=3,
        abs_diff_mean=0.2,
        abs_diff_max=0.3,
        k1=-0.2 / 3,
        k2=float((0.5 * d**2).mean()),
        k3=float((e - d - 1).mean()),
        ratio_mean=float(e.mean()),
        ratio_min=float(e.min()),
        ratio_max=float(e.max()),
        ratio_frac_low=1 / 3,  # e^-0.2 = 0.82 < 0.9
        ratio_frac_high=2 / 3,  # e^0.1 and e^0.3 exceed 1.1
        ratio_frac_outside=1.0,
        seq_abs_diff_mean=(0.15 + 0.3 + 0) / 3,
        log_ppl_diff=(0.05 - 0.3 + 0) / 3,  # d_b = -mean Δ: 0.05, -0.3, 0 (empty row)
        log_ppl_diff_max=0.05,
        log_ppl_diff_min=-0.3,
        training_log_ppl=(1.5 + 0.5 + 0) / 3,
        rollout_log_ppl=(1.45 + 0.8 + 0) / 3,
        seq_ratio_max=float(torch.tensor(0.3, dtype=torch.float64).exp()),
    )
    for name, value in expect.items():
        assert float(getattr(out, name)) == pytest.approx(value, rel=1e-12, abs=1e-12), name
    assert out.per_seq_abs_diff_mean.cpu().tolist() == pytest.approx([0.15, 0.3, 0.0])
    assert out.per_seq_log_ratio.cpu().tolist() == pytest.approx([-0.1, 0.3, 0.0])
