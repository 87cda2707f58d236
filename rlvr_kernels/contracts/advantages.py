"""Kernel contract of ``group_advantages``: the parameters of one score column's plan.

Mirrored in ``csrc/advantages.h`` (``RLVR_GROUP_ADVANTAGES_FPARAMS`` / ``_IPARAMS`` and the
``RLVR_<ENUM>_CODES`` lists); ``tests/common/test_contracts.py`` compares the two. The
tensors and what the kernels compute from them are described in
:mod:`rlvr_kernels.ops.advantages`.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar

from ._base import KernelParams


class Baseline(enum.IntEnum):
    """What is subtracted from a score, or how its advantage is formed (docs/advantages.md)."""

    NONE = 0  # A = r (gdpo's final whitening plan over the weighted sum)
    MEAN = 1  # A = (r − μ_g)·f, f from ``Scale``
    RLOO = 2  # A = n/(n − 1)·(r − μ_g)
    OPO = 3  # A = r − Σ w·r / Σ w over the group (w: token counts)
    GPG = 4  # A = α·(r − μ_g), α = B_valid / #{valid r ≠ 0}
    PASSK = 5  # analytic pass@k values of correct (r > 0) and incorrect samples


class Scale(enum.IntEnum):
    """The σ that divides a ``MEAN`` baseline's advantage."""

    NONE = 0
    GROUP = 1  # the group's σ
    BATCH = 2  # one σ over all valid scores


class Whiten(enum.IntEnum):
    """Batch whitening after the baseline: A ← (A − mean_w)/σ_w."""

    OFF = 0
    TOKENS = 1  # weights w_i = token counts
    SAMPLES = 2  # weights 1


@dataclasses.dataclass(frozen=True)
class GroupAdvantagesParams(KernelParams):
    """Scalar parameters of ``group_advantages`` (both kernels read them by name)."""

    CPP_NAME: ClassVar[str] = "GROUP_ADVANTAGES"

    num_groups: int  # Gn: group ids live in [0, Gn)
    group_size: int  # > 0: group k is rows [k·G, (k+1)·G), Gn·G == B, no ids; 0: ids given
    num_tokens: int  # T of a packed layout without response_mask; -1 otherwise (not read)
    baseline: Baseline
    scale: Scale
    std_unbiased: bool  # σ with Bessel's correction
    eps: float
    eps_in_sqrt: bool  # x/sqrt(σ² + eps) instead of x/(σ + eps)
    singleton_raw: bool  # a lone valid sample: mean 0, std 1 (verl's loop rule) instead of A = 0
    passk_k: int  # k of PASSK (>= 1)
    whiten: Whiten
    whiten_eps: float
    whiten_eps_in_sqrt: bool
    whiten_std_unbiased: bool = True  # whitening variance ÷(Σw − 1), else ÷Σw
    whiten_eps_clamp: bool = False  # whiten_eps is a floor: sqrt(max(v, eps)) / max(sqrt(v), eps)


class PartialColumn(enum.IntEnum):
    """Columns of one rank's per-group partials (``group_partials`` → ``[num_groups, 9]``
    float64, what ``group_apply`` merges): the C++ accumulators ``Acc`` of the group's valid
    samples on that rank, in sample order, shifted by the first of them (x₁). Counts are
    float64 integers."""

    N = 0  # n, valid samples
    FIRST = 1  # x₁ (0 when n = 0)
    S = 2  # Σ (x − x₁)
    S2 = 3  # Σ (x − x₁)²
    DIFFERS = 4  # 1 when some valid score differs from x₁, else 0
    WX = 5  # Σ w·x (w: token weights; Baseline.OPO only, else 0)
    W = 6  # Σ w (Baseline.OPO only, else 0)
    INCORRECT = 7  # #{x <= 0} (pass@k)
    NONZERO = 8  # #{x != 0} (GPG's α)


NUM_PARTIAL_COLUMNS = len(PartialColumn)

# The C++ X-macro list each branch-code enum mirrors.
CPP_CODES = {
    "RLVR_BASELINE_CODES": Baseline,
    "RLVR_SCALE_CODES": Scale,
    "RLVR_WHITEN_CODES": Whiten,
    "RLVR_PARTIAL_COLUMN_CODES": PartialColumn,
}
