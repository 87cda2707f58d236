"""The tolerance rule shared by the test suite and ``rlvr-kernels check``.

The rule (flash-attention's): a fast result passes when
    |fast − ref64| ≤ 2·|torch_same_dtype − ref64| + atol
elementwise, where ref64 is the reference on float64 copies of the inputs and
torch_same_dtype the reference run in the inputs' own dtype. ``atol`` covers the last
few ulps of the output dtype at the result's magnitude, which the reference may happen
to round exactly.

Reductions. A result that is a sum of n fp32 terms t_i (an aggregated loss, a mean
metric) carries two errors the 2·|same − ref64| term cannot stand for, because the
reference makes them independently of the kernel: each term's own rounding (a few ulps
of |t_i|) and the rounding of the partial sums, which depends on the order of the sum
(a tree in Triton, blocks in C++, pairwise in torch). Both scale with the magnitude
S = Σ_i |t_i| of the terms, not with the result: when the terms cancel (a loss of −0.07
from 110 terms whose absolute values sum to 79) the result's own ulps are far below
them. Summing n terms in any order adds at most (n−1)·u·S (u = eps/2, Higham's bound
for recursive summation) and, with rounding errors that behave as independent, about
√n·u·S (Higham and Mary's probabilistic bound); each term adds its few ulps. So for a
reduced output
    atol_sum = (ULPS + √n)·eps·S,
with S the same weighted sum (mean, sum or the loss's aggregation) taken over |t_i|.
The caller passes (S, n) as ``reduction``; elementwise outputs have none.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Tuple

import torch

_ULPS = 8


def default_atol(ref64: torch.Tensor, out_dtype: torch.dtype) -> float:
    """A few ulps at the result's magnitude, of the output dtype or of fp32 (the
    accumulation precision docs/behaviour.md promises), whichever is coarser."""
    scale = max(1.0, float(ref64.abs().max())) if ref64.numel() else 1.0
    eps = max(torch.finfo(out_dtype).eps, torch.finfo(torch.float32).eps)
    return _ULPS * eps * scale


@dataclasses.dataclass
class Comparison:
    field: str
    max_abs: float
    max_rel: float
    ok: bool


def reduction_atol(magnitude: float, num_terms: int) -> float:
    """``(ULPS + √n)·eps·S`` in fp32, the accumulation precision: the error a sum of
    ``num_terms`` fp32 terms of absolute sum ``magnitude`` may carry in any order."""
    return (_ULPS + math.sqrt(max(num_terms, 1))) * torch.finfo(torch.float32).eps * magnitude


def compare(
    field: str,
    fast,
    ref64,
    same,
    out_dtype: torch.dtype,
    atol_scale: float = 1.0,
    reduction: Optional[Tuple[float, int]] = None,
) -> Comparison:
    """Tolerance rule for floating outputs; exact equality for integer and bool outputs.
    ``atol_scale`` widens atol for results derived from intermediates larger than the
    result (the log-probs' logits); ``reduction`` = (S, n) adds :func:`reduction_atol`
    for a result summed from n terms of absolute sum S."""
    if fast is None or ref64 is None:
        ok = fast is None and ref64 is None
        return Comparison(field, 0.0, 0.0, ok)
    if tuple(fast.shape) != tuple(ref64.shape):
        return Comparison(field, float("inf"), float("inf"), False)
    if not ref64.is_floating_point():
        ok = bool(torch.equal(fast.cpu(), ref64.cpu()))
        return Comparison(field, 0.0 if ok else 1.0, 0.0 if ok else 1.0, ok)
    f, r, s = fast.double().cpu(), ref64.double().cpu(), same.double().cpu()
    if f.numel() == 0:
        return Comparison(field, 0.0, 0.0, True)
    err = (f - r).abs()
    bound = 2 * (s - r).abs() + default_atol(r, out_dtype) * atol_scale
    if reduction is not None:
        bound = bound + reduction_atol(*reduction)
    ok = bool(torch.isfinite(f).all()) and bool((err <= bound).all())
    rel = float(err.max()) / max(float(r.abs().max()), 1e-30)  # relative to the result's scale
    return Comparison(field, float(err.max()), rel, ok)


def as_float64(kwargs: Dict) -> Dict:
    """A copy of op arguments with every floating tensor cast to float64."""
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kwargs.items()}
