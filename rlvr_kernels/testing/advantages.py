"""``group_advantages``: random cases, comparisons and the ``rlvr-kernels check`` suite."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from ..options import GroupAdvantages
from ._checks import CheckRow, CheckSuite, check_row
from ._compare import Comparison, as_float64, compare


def compare_advantages(
    fast: GroupAdvantages, ref64: GroupAdvantages, same: GroupAdvantages, out_dtype: torch.dtype
) -> List[Comparison]:
    return [
        compare(name, getattr(fast, name), getattr(ref64, name), getattr(same, name), out_dtype)
        for name in GroupAdvantages._fields
    ]


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
    grouping: str = "shuffled",
    device: str = "cpu",
) -> Dict:
    """Fresh random inputs for ``group_advantages``: shuffled group ids (uneven sizes,
    some groups possibly empty; ``grouping="sorted"``: the same, group by group as verl and
    TRL lay out a batch), rewards of the named kind, an optional sample mask and a padded
    (``"padded"``) or packed (``"packed"``) token layout with ragged lengths."""
    group_index = (
        torch.randint(0, max(num_groups, 1), (B,), generator=gen) if num_groups else torch.zeros(B, dtype=torch.long)
    )
    if grouping == "sorted":
        group_index = group_index.sort().values
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


# (name, inputs, options): the cases `rlvr-kernels check` runs on every backend.
def check_cases() -> List[tuple]:
    cases = []
    for est, extra in [
        ("grpo", {}),
        ("grpo", dict(preset="verl")),
        ("grpo", dict(preset="trl", scale="batch")),
        ("grpo", dict(eps_in_sqrt=True, std="population")),
        ("dr_grpo", {}),
        ("rloo", dict(preset="verl")),
        ("opo", {}),
        ("gpg", {}),
        ("passk", dict(k=4)),
        ("reinforce_pp_baseline", dict(preset="verl")),
        ("gdpo", dict(preset="verl")),
        ("gdpo", dict(preset="trl")),
    ]:
        for layout in ("padded", "packed"):
            cases.append(
                (f"{est} {extra or ''} {layout}".replace("  ", " "), dict(layout=layout), dict(estimator=est, **extra))
            )
    cases.append(
        (
            "grpo bf16 scores, 30% masked",
            dict(layout="padded", dtype=torch.bfloat16, mask_fraction=0.3),
            dict(estimator="grpo"),
        )
    )
    cases.append(
        ("grpo group-only B=4097", dict(layout="none", B=4097, num_groups=300, reward="normal"), dict(estimator="grpo"))
    )
    cases.append(
        (
            "grpo group-only B=4097, sorted ids",
            dict(layout="none", B=4097, num_groups=300, reward="normal", grouping="sorted"),
            dict(estimator="grpo", preset="verl"),
        )
    )
    cases.append(
        ("grpo fp64 scores", dict(layout="packed", dtype=torch.float64, reward="normal"), dict(estimator="grpo"))
    )
    cases.append(
        (
            "reinforce_pp_baseline fp64 scores",
            dict(layout="padded", dtype=torch.float64, mask_fraction=0.2),
            dict(estimator="reinforce_pp_baseline", preset="verl"),
        )
    )
    return cases


def check_group_advantages(
    backends: List[str], device: str = "cpu", seed: int = 0, progress: Optional[Callable] = None
) -> List[CheckRow]:
    """Every backend on fresh random inputs, diffed against the fp64 reference."""
    from .. import group_advantages

    rows = []
    gen = torch.Generator().manual_seed(seed)
    for name, case_kw, opts in check_cases():
        base = dict(B=211, num_groups=23, L=37, reward="int")
        base.update(case_kw)
        inputs = random_advantage_case(gen, device=device, **base)
        ref64 = group_advantages(**as_float64(inputs), **opts, backend="reference", out_dtype=torch.float64)
        same = group_advantages(**inputs, **opts, backend="reference", out_dtype=inputs["scores"].dtype)
        for backend in backends:
            rows.append(
                check_row(
                    "group_advantages",
                    backend,
                    name,
                    lambda: compare_advantages(
                        group_advantages(**inputs, **opts, backend=backend), ref64, same, torch.float32
                    ),
                )
            )
            if progress:
                progress()
    return rows


SUITE = CheckSuite("group_advantages", check_cases, check_group_advantages)
