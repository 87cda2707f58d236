"""Success-probability dynamics of RL with binary verifiable rewards (docs/dynamics.md).

Plain torch helpers (no custom ops, no kernels): every function takes Python numbers or
tensors, broadcasts ``p``/``p_ref``/``beta`` against each other and returns a tensor of the
inputs' floating dtype (float64 when every argument is a Python number).

Exponential tilt (the seed note's teaching model: reward 1 for success, 0 for failure,
reference probability reweighted by exp(β · reward) and renormalised)::

    p' = p·e^β / (1 − p + p·e^β) = sigmoid(logit(p) + β)

p = 0.2, β = ln 4 gives 0.5; p = 0 stays 0 and p = 1 stays 1 for every finite β (a tilt
reweights existing success paths, it cannot create one).

GRPO success recursion (Mroueh, "Reinforcement Learning with Verifiable Rewards: GRPO's
Loss, Dynamics, and Success Amplification", ICML 2026): binary rewards, advantages
normalised by the group mean and std, KL of strength β to a fixed reference with success
probability p_ref::

    p_n = 1 / (1 + ((1 − p_ref)/p_ref) · exp(−(1/β) / sqrt(p_{n−1}(1 − p_{n−1}) + ε)))

A success's advantage is (1 − p)/σ and a failure's −p/σ with σ = sqrt(p(1 − p) + ε); the
KL-regularised optimum π_ref·exp(A/β) therefore tilts the reference's success odds by
exp(1/(β·σ)): p_n is the tilt of p_ref with strength 1/(β·σ(p_{n−1})).

Fixed points p = F(p) of that map all lie above p_ref (the tilt strength is positive), but
they are not unique. Because σ → sqrt(ε) as p → 1, F(p) climbs back towards 1 near p = 1:
depending on (p_ref, β, ε) there is either one fixed point or three (two at a tangency),

- p*, the smallest (the "success amplification" fixed point; ε = 1e-6, β = 1: p_ref = 0.2
  gives 0.681, p_ref = 0.05 gives 0.313), present when β is large enough for F to cross
  the diagonal below 1;
- an unstable one between p* and 1;
- one within about ((1 − p_ref)/p_ref)·exp(−1/(β·sqrt(ε))) of 1, which rounds to 1.0 in
  float64 for ε = 1e-6 unless β is very large.

:func:`grpo_fixed_point` returns the smallest fixed point: p* when it exists, else the one
next to 1. The recursion from p_0 = p_ref reaches p* only when its first steps stay below
the unstable fixed point (for a small p_ref with a small β, the first step lands near 1 and
the sequence stays there) and when |F'(p*)| < 1.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Optional, Tuple, Union

import torch

__all__ = ["grpo_fixed_point", "grpo_success_recursion", "tilted_success_probability"]

Real = Union[float, int, torch.Tensor]

# Bisection stops when the midpoint equals an end, i.e. at the dtype's resolution. From any
# finite float64 bracket that takes at most ~2100 halvings (the exponent range plus the
# mantissa); the cap only guards against a bracket that never collapses.
_MAX_BISECTIONS = 2200


def tilted_success_probability(p: Real, beta: Real) -> torch.Tensor:
    """p' = p·e^β / (1 − p + p·e^β), elementwise over the broadcast of ``p`` and ``beta``.

    Args:
        p: success probability of the reference, in [0, 1].
        beta: reward weight of the tilt, any finite real (β < 0 tilts towards failure).

    Computed as p/(p + (1 − p)·e^{−β}) for β ≥ 0 and its mirror for β < 0: no overflow for
    large |β|, a few ulps of error, and p = 0 and p = 1 map to exactly 0 and 1.
    """
    p, beta = _tensors(p=p, beta=beta)
    _check_probability("p", p)
    _check_finite("beta", beta)
    return _tilt(p, beta)


def grpo_success_recursion(
    p_ref: Real, beta: Real, steps: int, p0: Optional[Real] = None, eps: float = 1e-6
) -> torch.Tensor:
    """The sequence p_0, p_1, …, p_steps of the GRPO success recursion (module docstring).

    Args:
        p_ref: success probability of the fixed KL reference, in [0, 1]. p_ref = 0 or 1 is
            allowed: the tilt of 0 or 1 is itself, so p_1, p_2, … all equal p_ref.
        beta: KL coefficient, > 0 and finite (1/β is the step's strength).
        steps: number of updates, an int ≥ 0.
        p0: the starting success probability in [0, 1]; defaults to ``p_ref`` (training
            starts from the reference policy).
        eps: ε > 0 inside the std, sqrt(p(1 − p) + ε).

    Returns:
        A tensor of shape ``broadcast(p_ref, beta, p0) + (steps + 1,)``: p_n along the last dim.
    """
    steps = _check_steps(steps)
    eps = _check_eps(eps)
    if p0 is None:
        p_ref, beta = _tensors(p_ref=p_ref, beta=beta)
        p = p_ref
    else:
        p_ref, beta, p = _tensors(p_ref=p_ref, beta=beta, p0=p0)
        _check_probability("p0", p)
    _check_probability("p_ref", p_ref)
    _check_positive("beta", beta)
    inv_beta = 1.0 / beta
    out = [p]
    for _ in range(steps):
        p = _tilt(p_ref, inv_beta / torch.sqrt(p * (1 - p) + eps))
        out.append(p)
    return torch.stack(out, dim=-1)


def grpo_fixed_point(p_ref: Real, beta: Real, eps: float = 1e-6) -> torch.Tensor:
    """The smallest fixed point p* = F(p*) of the GRPO success recursion, elementwise over
    the broadcast of ``p_ref`` and ``beta`` (arguments as :func:`grpo_success_recursion`).

    The fixed points are not unique (module docstring); this is the smallest one, which is
    always > p_ref for p_ref in (0, 1); p_ref = 0 or 1 is its own fixed point. Solved to the
    dtype's resolution by bisection on the logit scale, where the three possible fixed
    points are well separated (they crowd against 1.0 on the probability scale). The
    bracket is chosen from the map's shape, which is known in closed form, so that it holds
    exactly one sign change: no grid scan, no starting guess.
    """
    eps = _check_eps(eps)
    p_ref, beta = _tensors(p_ref=p_ref, beta=beta)
    _check_probability("p_ref", p_ref)
    _check_positive("beta", beta)
    interior = (p_ref > 0) & (p_ref < 1)
    logit_ref = torch.logit(torch.where(interior, p_ref, torch.full_like(p_ref, 0.5)))
    u = _smallest_root(logit_ref, 1.0 / beta, eps)
    return torch.where(interior, torch.sigmoid(u), p_ref)


# ------------------------------------------------------------------ helpers
def _tilt(p: torch.Tensor, strength: torch.Tensor) -> torch.Tensor:
    # Divide through by the larger of the two weights so that only t = e^{−|β|} ≤ 1 appears:
    # no overflow for any β, and every term is positive (no cancellation, unlike
    # sigmoid(logit(p) + β), which loses ~1e-14 relative even at β = 0).
    t = torch.exp(-strength.abs())
    q = 1 - p
    up = p / (p + q * t)
    down = p * t / (q + p * t)
    out = torch.where(strength >= 0, up, down)
    # Pin the endpoints: 0/0 appears once t underflows (p = 0 with β ≫ 0, p = 1 with β ≪ 0).
    return torch.where(p == 0, p, torch.where(q == 0, torch.ones_like(p), out))


def _smallest_root(logit_ref: torch.Tensor, c: torch.Tensor, eps: float) -> torch.Tensor:
    """Smallest root u of Q(u) = u − L − R(u), L = logit(p_ref), on the logit scale u = logit(p).

    Q(u) = 0 is p = F(p) (sigmoid is monotone), with R(u) = c / sqrt(w + ε), c = 1/β,
    w = p(1 − p) = sigmoid(u)·sigmoid(−u). Its shape is known in closed form: with k = 4ε,

        R'(u) = c·sinh(u/2) / (1 + k·cosh²(u/2))^{3/2},

    which is ≤ 0 for u ≤ 0 and, as a function of s = sinh(u/2) ≥ 0, equals c·s/(1 + k + k·s²)^{3/2}:
    increasing up to s_i = sqrt((1 + k)/(2k)), then decreasing to 0. So Q' = 1 − R' is
    positive except on one interval (u_a, u_b) ⊂ (0, ∞), present when max R' > 1: Q rises
    on (−∞, u_a], falls on [u_a, u_b], rises on [u_b, ∞). Q(L) = −R(L) < 0 and
    Q(L + c/sqrt(ε)) ≥ 0 (R ≤ c/sqrt(ε)). The bracket below has exactly one sign change:
    [L, u_a] when L < u_a and Q(u_a) ≥ 0 (Q rises there), else [max(L, u_a), L + c/sqrt(ε)]
    (Q < 0 until u_b, then rises; without a dip Q rises throughout). u_a itself is bisected
    on [0, u_i], where R' rises from 0 past 1.
    """
    logit_ref, c = torch.broadcast_tensors(logit_ref, c)
    k = 4.0 * eps
    s_i = math.sqrt((1.0 + k) / (2.0 * k))
    u_i = 2.0 * math.asinh(s_i)
    slope_max = c * (s_i / (1.5 * (1.0 + k)) ** 1.5)

    def slope(u):  # R'(u), written with w so that it stays finite where cosh(u/2) overflows
        w = torch.sigmoid(u) * torch.sigmoid(-u)
        return c * w * torch.tanh(u / 2) / (2 * (w + eps) ** 1.5)

    def q(u):
        w = torch.sigmoid(u) * torch.sigmoid(-u)
        return u - logit_ref - c / torch.sqrt(w + eps)

    zeros = torch.zeros_like(logit_ref)
    u_a = _bisect(lambda u: slope(u) >= 1, zeros, torch.full_like(zeros, u_i))
    top = logit_ref + c / math.sqrt(eps)
    below_dip = (slope_max > 1) & (logit_ref < u_a)
    q_a = q(u_a)
    lo = torch.where(below_dip & (q_a < 0), u_a, logit_ref)
    hi = torch.where(below_dip & (q_a >= 0), u_a, top)
    lo, hi = _bisect(lambda u: q(u) >= 0, lo, hi, both=True)
    return torch.where(q(lo).abs() < q(hi).abs(), lo, hi)


def _bisect(pred, lo: torch.Tensor, hi: torch.Tensor, both: bool = False):
    """Elementwise bisection for where ``pred`` switches from False (at ``lo``) to True (at
    ``hi``), down to adjacent floats. Returns ``hi`` (or ``(lo, hi)`` with ``both``)."""
    for _ in range(_MAX_BISECTIONS):
        mid = lo + (hi - lo) / 2
        open_ = (mid > lo) & (mid < hi)
        if not bool(open_.any()):
            break
        t = pred(mid)
        hi = torch.where(open_ & t, mid, hi)
        lo = torch.where(open_ & ~t, mid, lo)
    return (lo, hi) if both else hi


def _tensors(**values) -> Tuple[torch.Tensor, ...]:
    """The arguments as broadcast tensors of one floating dtype: the promotion of the floating
    tensors among them, float64 when there is none (Python numbers, integer tensors)."""
    dtypes = []
    for name, v in values.items():
        if isinstance(v, torch.Tensor):
            if v.dtype == torch.bool or v.is_complex():
                raise TypeError(f"{name}: expected a real tensor, got dtype {str(v.dtype).replace('torch.', '')}")
            if v.is_floating_point():
                dtypes.append(v.dtype)
        elif isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name}: expected a real number or a tensor, got {type(v).__name__}")
    dtype = functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float64
    device = next((v.device for v in values.values() if isinstance(v, torch.Tensor)), None)
    # Tensors keep their device (a mismatch then fails in torch); numbers join the first tensor's.
    out = [
        v.to(dtype) if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=dtype, device=device)
        for v in values.values()
    ]
    try:
        return tuple(torch.broadcast_tensors(*out))
    except RuntimeError as e:
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(values, out))
        raise ValueError(f"{', '.join(values)}: shapes do not broadcast ({shapes})") from e


def _check_probability(name: str, x: torch.Tensor) -> None:
    bad = ~((x >= 0) & (x <= 1))  # NaN fails both comparisons
    if bool(bad.any()):
        raise ValueError(f"{name}: expected probabilities in [0, 1], got {_first(x, bad)}")


def _check_finite(name: str, x: torch.Tensor) -> None:
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        raise ValueError(f"{name}: expected finite values, got {_first(x, bad)}")


def _check_positive(name: str, x: torch.Tensor) -> None:
    bad = ~(torch.isfinite(x) & (x > 0))
    if bool(bad.any()):
        raise ValueError(f"{name}: expected finite values > 0, got {_first(x, bad)}")


def _first(x: torch.Tensor, bad: torch.Tensor) -> str:
    return f"{float(x[bad].flatten()[0])}" + (" (and others)" if int(bad.sum()) > 1 else "")


def _check_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
        raise TypeError(f"steps: expected an int, got {type(steps).__name__}")
    if steps < 0:
        raise ValueError(f"steps: expected an int >= 0, got {steps}")
    return int(steps)


def _check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps: expected a real number, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps: expected a finite number > 0, got {eps}")
    return float(eps)
