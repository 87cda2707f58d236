"""Correctness harness shared by the test suite and ``rlvr-kernels check``.

The rule (flash-attention's, SPEC "Standards"): a fast result passes when
    |fast − ref64| ≤ 2·|torch_same_dtype − ref64| + atol
elementwise, where ref64 is the reference on float64 copies of the inputs and
torch_same_dtype the reference run in the inputs' own dtype. ``atol`` covers the last
few ulps of the output dtype at the result's magnitude, which the reference may happen
to round exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional

import torch

from .options import GroupAdvantages

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


def compare(field: str, fast, ref64, same, out_dtype: torch.dtype) -> Comparison:
    """Tolerance rule for floating outputs; exact equality for integer and bool outputs."""
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
    bound = 2 * (s - r).abs() + default_atol(r, out_dtype)
    ok = bool(torch.isfinite(f).all()) and bool((err <= bound).all())
    rel = float(err.max()) / max(float(r.abs().max()), 1e-30)  # relative to the result's scale
    return Comparison(field, float(err.max()), rel, ok)


def compare_advantages(fast: GroupAdvantages, ref64: GroupAdvantages, same: GroupAdvantages,
                       out_dtype: torch.dtype) -> List[Comparison]:  # fmt: skip
    return [compare(name, getattr(fast, name), getattr(ref64, name), getattr(same, name), out_dtype)
            for name in GroupAdvantages._fields]  # fmt: skip


def as_float64(kwargs: Dict) -> Dict:
    """A copy of op arguments with every floating tensor cast to float64."""
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kwargs.items()}


def random_advantage_case(
    gen: torch.Generator,
    *,
    B: int,
    num_groups: int,
    layout: str = "none",
    L: int = 16,
    reward: str = "binary",
    dtype: torch.dtype = torch.float32,
    mask_fraction: float = 0.0,
    device: str = "cpu",
) -> Dict:
    """Fresh random inputs for ``group_advantages``: shuffled group ids (uneven sizes,
    some groups possibly empty), rewards of the named kind, an optional sample mask and a
    padded (``"padded"``) or packed (``"packed"``) token layout with ragged lengths."""
    group_index = torch.randint(0, max(num_groups, 1), (B,), generator=gen) if num_groups else torch.zeros(B, dtype=torch.long)
    if reward == "binary":
        scores = torch.randint(0, 2, (B,), generator=gen).to(torch.float32)
    elif reward == "int":
        scores = torch.randint(-2, 3, (B,), generator=gen).to(torch.float32)
    else:
        scores = torch.randn(B, generator=gen)
    kwargs = dict(scores=scores.to(dtype), group_index=group_index, num_groups=num_groups)
    if mask_fraction > 0:
        kwargs["sample_mask"] = torch.rand(B, generator=gen) >= mask_fraction
    lengths = torch.randint(0, L + 1, (B,), generator=gen)
    if layout == "padded":
        kwargs["response_mask"] = (torch.arange(L)[None, :] < lengths[:, None]).to(torch.float32)
    elif layout == "packed":
        cu = torch.zeros(B + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        kwargs["cu_seqlens"] = cu
        kwargs["response_mask"] = torch.rand(int(cu[-1]), generator=gen) > 0.1
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}


@dataclasses.dataclass
class CheckRow:
    op: str
    backend: str
    case: str
    max_abs: float
    max_rel: float
    ok: bool
    note: str = ""


# (name, inputs, options): the cases `rlvr-kernels check` runs on every backend.
def _check_cases() -> List[tuple]:
    cases = []
    for est, extra in [
        ("grpo", {}), ("grpo", dict(preset="verl")), ("grpo", dict(preset="trl", scale="batch")),
        ("grpo", dict(eps_in_sqrt=True, std="population")), ("dr_grpo", {}), ("rloo", dict(preset="verl")),
        ("opo", {}), ("gpg", {}), ("passk", dict(k=4)), ("reinforce_pp_baseline", dict(preset="verl")),
        ("gdpo", dict(preset="verl")), ("gdpo", dict(preset="trl")),
    ]:  # fmt: skip
        for layout in ("padded", "packed"):
            cases.append((f"{est} {extra or ''} {layout}".replace("  ", " "), dict(layout=layout), dict(estimator=est, **extra)))
    cases.append(("grpo bf16 scores, 30% masked", dict(layout="padded", dtype=torch.bfloat16, mask_fraction=0.3), dict(estimator="grpo")))
    cases.append(("grpo group-only B=4097", dict(layout="none", B=4097, num_groups=300, reward="normal"), dict(estimator="grpo")))
    return cases


def check_group_advantages(backends: List[str], device: str = "cpu", seed: int = 0,
                           progress: Optional[Callable] = None) -> List[CheckRow]:  # fmt: skip
    """Every backend on fresh random inputs, diffed against the fp64 reference."""
    from . import group_advantages

    rows = []
    gen = torch.Generator().manual_seed(seed)
    for name, case_kw, opts in _check_cases():
        base = dict(B=211, num_groups=23, L=37, reward="int")
        base.update(case_kw)
        inputs = random_advantage_case(gen, device=device, **base)
        ref64 = group_advantages(**as_float64(inputs), **opts, backend="reference", out_dtype=torch.float64)
        same = group_advantages(**inputs, **opts, backend="reference", out_dtype=inputs["scores"].dtype)
        for backend in backends:
            try:
                fast = group_advantages(**inputs, **opts, backend=backend)
                comps = compare_advantages(fast, ref64, same, torch.float32)
                worst = max(comps, key=lambda c: (not c.ok, c.max_abs))
                bad = [c.field for c in comps if not c.ok]
                rows.append(CheckRow("group_advantages", backend, name, max(c.max_abs for c in comps),
                                     max(c.max_rel for c in comps), not bad, ", ".join(bad) or worst.field))  # fmt: skip
            except Exception as e:  # a crash is a failed check, reported, not raised
                rows.append(CheckRow("group_advantages", backend, name, float("nan"), float("nan"), False, repr(e)[:80]))
            if progress:
                progress()
    return rows


def check_case_count() -> int:
    return len(_check_cases())
