"""The tolerance rule shared by the test suite and ``rlvr-kernels check``.

The rule (flash-attention's, SPEC "Standards"): a fast result passes when
    |fast − ref64| ≤ 2·|torch_same_dtype − ref64| + atol
elementwise, where ref64 is the reference on float64 copies of the inputs and
torch_same_dtype the reference run in the inputs' own dtype. ``atol`` covers the last
few ulps of the output dtype at the result's magnitude, which the reference may happen
to round exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Dict

import torch

_ULPS = 8


def default_atol(ref64: torch.Tensor, out_dtype: torch.dtype) -> float:
    """A few ulps at the result's magnitude, of the output dtype or of fp32 (the
    accumulation precision SPEC §0 promises), whichever is coarser."""
    scale = max(1.0, float(ref64.abs().max())) if ref64.numel() else 1.0
    eps = max(torch.finfo(out_dtype).eps, torch.finfo(torch.float32).eps)
    return _ULPS * eps * scale


@dataclasses.dataclass
class Comparison:
    field: str
    max_abs: float
    max_rel: float
    ok: bool


def compare(field: str, fast, ref64, same, out_dtype: torch.dtype, atol_scale: float = 1.0) -> Comparison:
    """Tolerance rule for floating outputs; exact equality for integer and bool outputs.
    ``atol_scale`` widens atol for results derived from larger intermediates."""
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
    ok = bool(torch.isfinite(f).all()) and bool((err <= bound).all())
    rel = float(err.max()) / max(float(r.abs().max()), 1e-30)  # relative to the result's scale
    return Comparison(field, float(err.max()), rel, ok)


def as_float64(kwargs: Dict) -> Dict:
    """A copy of op arguments with every floating tensor cast to float64."""
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kwargs.items()}
