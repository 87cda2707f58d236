"""rlvr_kernels.dynamics: the seed's values, endpoints, broadcasting, validation, and the fixed
point against an independent root solve and the recursion's limit."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlvr_kernels import dynamics as dyn


def _seed_tilt(p, beta):
    """The seed note's formula as written there (plain floats)."""
    w = math.exp(beta)
    return p * w / (1 - p + p * w)


def _map(p, p_ref, beta, eps=1e-6):
    """F(p) of the recursion exactly as docs/dynamics.md writes it (no logit/sigmoid rewriting)."""
    return 1 / (1 + ((1 - p_ref) / p_ref) * torch.exp(-(1 / beta) / torch.sqrt(p * (1 - p) + eps)))


def _direct_smallest_root(p_ref, beta, eps=1e-6):
    """Smallest root of g(p) = F(p) − p above p_ref: a dense logit-spaced grid finds the first
    sign change, float64 Newton (autograd derivative, kept inside the bracket) polishes it.
    Returns None when g stays positive up to 1 − 1e-12 (the smallest root is then next to 1)."""
    grid = torch.sigmoid(torch.linspace(math.log(p_ref / (1 - p_ref)), 27.6, 200_001, dtype=torch.float64))
    g = _map(grid, p_ref, beta, eps) - grid
    neg = (g <= 0).nonzero()
    if len(neg) == 0:
        return None
    i = int(neg[0])
    lo, hi = float(grid[i - 1]), float(grid[i])
    x = torch.tensor((lo + hi) / 2, dtype=torch.float64)
    for _ in range(60):
        x = x.detach().requires_grad_(True)
        gx = _map(x, p_ref, beta, eps) - x
        (dg,) = torch.autograd.grad(gx, x)
        x = (x - gx / dg).clamp(lo, hi)
    return x.item()


# ---------------------------------------------------------------- tilted success probability
def test_tilt_seed_values():
    assert dyn.tilted_success_probability(0.2, math.log(4)).item() == pytest.approx(0.5, abs=1e-15)
    assert dyn.tilted_success_probability(0.0, 3.0).item() == 0.0
    assert dyn.tilted_success_probability(1.0, -3.0).item() == 1.0
    for p, b in [(0.3, 0.7), (0.01, 5.0), (0.9, -2.0)]:
        assert dyn.tilted_success_probability(p, b).item() == pytest.approx(_seed_tilt(p, b), rel=1e-14)


def test_tilt_endpoints_exact_and_large_beta_does_not_overflow():
    p = torch.tensor([0.0, 1e-300, 0.5, 1.0], dtype=torch.float64)
    out = dyn.tilted_success_probability(p, torch.tensor([[1e4], [-1e4], [0.0]], dtype=torch.float64))
    assert torch.isfinite(out).all()
    assert out[:, 0].eq(0).all() and out[:, 3].eq(1).all()
    assert out[0, 2] == 1.0 and out[1, 2] == 0.0 and torch.equal(out[2], p)  # β = 0 is the identity


def test_tilt_broadcasting_and_dtypes():
    p = torch.tensor([[0.1], [0.5], [0.9]], dtype=torch.float32)
    out = dyn.tilted_success_probability(p, torch.linspace(-1, 1, 4, dtype=torch.float32))
    assert out.shape == (3, 4) and out.dtype == torch.float32
    assert dyn.tilted_success_probability(0.3, 1.0).dtype == torch.float64
    assert dyn.tilted_success_probability(torch.tensor([0, 1]), 1.0).dtype == torch.float64
    ref = torch.tensor([[_seed_tilt(float(pi), float(b)) for b in torch.linspace(-1, 1, 4)] for pi in p.flatten()])
    torch.testing.assert_close(out, ref.float())


@settings(max_examples=60, deadline=None)
@given(st.floats(1e-6, 1 - 1e-6), st.floats(-12, 12), st.floats(1e-3, 5))
def test_tilt_strictly_increasing_in_beta_and_invertible(p, beta, step):
    a = dyn.tilted_success_probability(p, beta).item()
    b = dyn.tilted_success_probability(p, beta + step).item()
    assert b > a
    if 0 < a < 1:  # |β| ≤ 12 keeps 1 − a resolvable in float64, the back-tilt's conditioning
        back = dyn.tilted_success_probability(a, -beta).item()
        assert back == pytest.approx(p, rel=1e-9)


# ---------------------------------------------------------------- recursion
def test_recursion_matches_the_formula_step_by_step():
    seq = dyn.grpo_success_recursion(0.2, 1.0, 6)
    assert seq.shape == (7,) and seq.dtype == torch.float64
    p = 0.2
    expected = [p]
    for _ in range(6):
        p = 1 / (1 + (0.8 / 0.2) * math.exp(-1.0 / math.sqrt(p * (1 - p) + 1e-6)))
        expected.append(p)
    torch.testing.assert_close(seq, torch.tensor(expected, dtype=torch.float64), rtol=1e-13, atol=0)


def test_recursion_shapes_and_p0():
    p_ref = torch.tensor([[0.05], [0.2]], dtype=torch.float64)
    beta = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    seq = dyn.grpo_success_recursion(p_ref, beta, 4)
    assert seq.shape == (2, 3, 5)
    assert torch.equal(seq[..., 0], p_ref.expand(2, 3))
    assert (seq[..., 1:] > p_ref[..., None]).all()  # every update tilts towards success
    p0 = torch.full((2, 3), 0.5, dtype=torch.float64)
    seq0 = dyn.grpo_success_recursion(p_ref, beta, 4, p0=p0)
    assert seq0.shape == (2, 3, 5) and seq0[..., 0].eq(0.5).all()
    assert dyn.grpo_success_recursion(0.2, 1.0, 0).shape == (1,)
    assert dyn.grpo_success_recursion(torch.tensor(0.2), 1.0, 3).dtype == torch.float32


def test_recursion_endpoints_are_constant():
    seq = dyn.grpo_success_recursion(torch.tensor([0.0, 1.0], dtype=torch.float64), 1.0, 5, p0=0.5)
    assert seq[:, 0].eq(0.5).all()
    assert seq[0, 1:].eq(0).all() and seq[1, 1:].eq(1).all()


# ---------------------------------------------------------------- fixed point
def test_fixed_point_spec_values():
    fp = dyn.grpo_fixed_point(torch.tensor([0.2, 0.05], dtype=torch.float64), 1.0)
    assert round(fp[0].item(), 3) == 0.681
    assert round(fp[1].item(), 3) == 0.313


@pytest.mark.parametrize(
    "p_ref,beta",
    [(0.2, 1.0), (0.05, 1.0), (0.001, 0.5), (0.01, 2.0), (0.5, 4.0), (0.8, 10.0), (0.2, 100.0), (0.2, 1000.0)],
)
def test_fixed_point_equals_a_direct_root_solve(p_ref, beta):
    fp = dyn.grpo_fixed_point(p_ref, beta).item()
    direct = _direct_smallest_root(p_ref, beta)
    assert direct is not None
    assert fp == pytest.approx(direct, rel=1e-12, abs=1e-15)
    assert fp > p_ref
    assert abs(_map(torch.tensor(fp, dtype=torch.float64), p_ref, beta).item() - fp) < 1e-13


@pytest.mark.parametrize("p_ref,beta", [(0.2, 0.5), (0.05, 0.25), (0.5, 1.0), (0.8, 2.0)])
def test_without_a_low_fixed_point_the_smallest_is_next_to_one(p_ref, beta):
    # F stays above the diagonal until σ → sqrt(ε) drives it to 1: the only fixed point is
    # within exp(−1/(β·sqrt(ε))) of 1, i.e. 1.0 in float64.
    assert _direct_smallest_root(p_ref, beta) is None
    assert dyn.grpo_fixed_point(p_ref, beta).item() == 1.0
    assert dyn.grpo_success_recursion(p_ref, beta, 30)[-1].item() == 1.0


def test_fixed_point_is_not_unique():
    # Between p* and 1, F dips below the diagonal and comes back: a second (unstable) crossing.
    p = torch.linspace(0.69, 1 - 1e-9, 100_001, dtype=torch.float64)
    g = _map(p, 0.2, 1.0) - p
    crossings = (torch.sign(g[1:]) != torch.sign(g[:-1])).sum().item()
    assert crossings == 1 and g[0] < 0 and g[-1] > 0


@pytest.mark.parametrize("p_ref,beta", [(0.2, 1.0), (0.05, 1.0), (0.5, 4.0), (0.2, 10.0)])
def test_fixed_point_is_the_recursions_limit(p_ref, beta):
    seq = dyn.grpo_success_recursion(p_ref, beta, 400)
    assert abs(seq[-1] - seq[-2]).item() < 1e-14  # converged
    assert seq[-1].item() == pytest.approx(dyn.grpo_fixed_point(p_ref, beta).item(), rel=1e-12)


def test_fixed_point_decreases_as_beta_grows():
    # 1/β is the step's strength: a weaker pull leaves p* closer to p_ref. Strictly on the
    # branch where the low fixed point exists; for small β it jumps to the one next to 1.
    betas = torch.logspace(0, 3, 40, dtype=torch.float64)
    for p_ref in (0.05, 0.2):
        fp = dyn.grpo_fixed_point(p_ref, betas)
        assert (fp[1:] < fp[:-1]).all()
        assert (fp > p_ref).all()
    fp = dyn.grpo_fixed_point(0.2, torch.logspace(-1, 3, 60, dtype=torch.float64))
    assert (fp[1:] <= fp[:-1]).all() and fp[0] == 1.0


def test_fixed_point_shapes_dtypes_endpoints():
    p_ref = torch.tensor([[0.0], [0.2], [1.0]], dtype=torch.float32)
    fp = dyn.grpo_fixed_point(p_ref, torch.tensor([1.0, 2.0]))
    assert fp.shape == (3, 2) and fp.dtype == torch.float32
    assert fp[0].eq(0).all() and fp[2].eq(1).all()
    assert fp[1, 0].item() == pytest.approx(0.6813, abs=1e-4)
    assert dyn.grpo_fixed_point(0.2, 1.0).shape == ()


@settings(max_examples=40, deadline=None)
@given(st.floats(1e-4, 1 - 1e-4), st.floats(0.05, 1e3), st.sampled_from([1e-8, 1e-6, 1e-3]))
def test_fixed_point_is_the_smallest_fixed_point(p_ref, beta, eps):
    fp = dyn.grpo_fixed_point(p_ref, beta, eps=eps).item()
    assert fp > p_ref
    if fp < 1.0:
        f = _map(torch.tensor(fp, dtype=torch.float64), p_ref, beta, eps).item()
        assert abs(f - fp) <= 1e-9 * max(1e-3, 1 - fp)
    # g > 0 everywhere below it (no smaller crossing)
    below = torch.sigmoid(
        torch.linspace(math.log(p_ref / (1 - p_ref)), math.log(fp / (1 - fp)) if fp < 1 else 36.0, 4001)
    ).to(torch.float64)[:-1]
    below = below[below < fp * (1 - 1e-9)]
    assert (_map(below, p_ref, beta, eps) - below > 0).all()


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), torch.tensor([0.5, 2.0])])
def test_probability_out_of_range_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"^p: .*\[0, 1\]"):
        dyn.tilted_success_probability(bad, 1.0)
    with pytest.raises(ValueError, match=r"^p_ref: "):
        dyn.grpo_success_recursion(bad, 1.0, 3)
    with pytest.raises(ValueError, match=r"^p_ref: "):
        dyn.grpo_fixed_point(bad, 1.0)
    with pytest.raises(ValueError, match=r"^p0: "):
        dyn.grpo_success_recursion(0.2, 1.0, 3, p0=bad)


def test_other_invalid_arguments_name_themselves():
    with pytest.raises(ValueError, match=r"^beta: "):
        dyn.tilted_success_probability(0.2, float("inf"))
    for bad in (0.0, -1.0, float("nan"), float("inf"), torch.tensor([1.0, 0.0])):
        with pytest.raises(ValueError, match=r"^beta: .*> 0"):
            dyn.grpo_success_recursion(0.2, bad, 3)
        with pytest.raises(ValueError, match=r"^beta: .*> 0"):
            dyn.grpo_fixed_point(0.2, bad)
    with pytest.raises(ValueError, match=r"^steps: "):
        dyn.grpo_success_recursion(0.2, 1.0, -1)
    for bad in (2.0, True, "3"):
        with pytest.raises(TypeError, match=r"^steps: "):
            dyn.grpo_success_recursion(0.2, 1.0, bad)
    for bad in (0.0, -1e-6, float("nan")):
        with pytest.raises(ValueError, match=r"^eps: "):
            dyn.grpo_fixed_point(0.2, 1.0, eps=bad)
        with pytest.raises(ValueError, match=r"^eps: "):
            dyn.grpo_success_recursion(0.2, 1.0, 2, eps=bad)
    with pytest.raises(TypeError, match=r"^eps: "):
        dyn.grpo_fixed_point(0.2, 1.0, eps=torch.tensor(1e-6))
    with pytest.raises(TypeError, match=r"^p: "):
        dyn.tilted_success_probability(True, 1.0)
    with pytest.raises(TypeError, match=r"^beta: "):
        dyn.tilted_success_probability(0.5, "1")
    with pytest.raises(TypeError, match=r"^p: "):
        dyn.tilted_success_probability(torch.tensor([True]), 1.0)
    with pytest.raises(ValueError, match=r"^p_ref, beta: shapes do not broadcast"):
        dyn.grpo_fixed_point(torch.full((3,), 0.2), torch.ones(2))


def test_public_module():
    import rlvr_kernels

    assert rlvr_kernels.dynamics is dyn
    assert set(dyn.__all__) == {"tilted_success_probability", "grpo_success_recursion", "grpo_fixed_point"}
