"""``rlvr-kernels check`` rows and the registry of check suites it iterates (one per op)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional

from ._compare import Comparison


@dataclasses.dataclass
class CheckRow:
    op: str
    backend: str
    case: str
    max_abs: float
    max_rel: float
    ok: bool
    note: str = ""


def check_row(op: str, backend: str, case: str, compute: Callable[[], List[Comparison]]) -> CheckRow:
    """One ``rlvr-kernels check`` row: the worst of the comparisons ``compute`` returns; a
    crash is a failed check, reported, not raised."""
    try:
        comps = compute()
    except Exception as e:
        return CheckRow(op, backend, case, float("nan"), float("nan"), False, repr(e)[:80])
    bad = [c.field for c in comps if not c.ok]
    worst = max(comps, key=lambda c: (not c.ok, c.max_abs))
    return CheckRow(
        op,
        backend,
        case,
        max(c.max_abs for c in comps),
        max(c.max_rel for c in comps),
        not bad,
        ", ".join(bad) or worst.field,
    )


@dataclasses.dataclass(frozen=True)
class CheckSuite:
    """One op family's ``rlvr-kernels check`` cases: ``cases()`` lists them (each row runs
    on every backend), ``run(backends, device=, seed=, progress=)`` returns the rows."""

    name: str
    cases: Callable[[], List[tuple]]
    run: Callable[..., List[CheckRow]]

    def count(self) -> int:
        return len(self.cases())


def run_checks(
    suites: Dict[str, CheckSuite],
    backends: List[str],
    device: str = "cpu",
    seed: int = 0,
    progress: Optional[Callable] = None,
) -> List[CheckRow]:
    rows: List[CheckRow] = []
    for suite in suites.values():
        rows += suite.run(backends, device=device, seed=seed, progress=progress)
    return rows
