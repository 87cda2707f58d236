"""Kernel contract of ``linear_logprobs`` / ``logprobs_from_logits``: the scalar parameters of
their four kernels and the columns of the per-row statistics they return.

Mirrored in ``csrc/logprobs.h`` (``RLVR_LOGPROBS_STATS_FPARAMS`` / ``_IPARAMS``,
``RLVR_LINEAR_LOGPROBS_BWD_FPARAMS`` / ``_IPARAMS`` and ``RLVR_LOGPROBS_STAT_CODES``);
``tests/common/test_contracts.py`` compares the two. The tensors and what the kernels
compute from them are described in :mod:`rlvr_kernels.ops.logprobs`.

- ``linear_logprobs_stats`` and ``logprobs_from_logits_stats`` take
  :class:`LogprobsStatsParams`;
- ``linear_logprobs_bwd`` takes :class:`LinearLogprobsBwdParams`;
- ``logprobs_from_logits_bwd`` has no scalar parameter (whether the entropy carries a
  gradient is whether ``grad_entropy`` is given).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar

from ._base import KernelParams


class LogprobsStat(enum.IntEnum):
    """Columns of the ``stats [N, NUM_STATS]`` output of the forward kernels (``NUM_STATS`` columns): over a row's
    (local) vocabulary, max z, Σ exp(z − max) and Σ exp(z − max)·(z − max)."""

    MAX = 0
    SUM_EXP = 1
    SUM_EXP_SHIFT = 2  # 0 when the entropy is not needed


NUM_STATS = len(LogprobsStat)


@dataclasses.dataclass(frozen=True)
class LogprobsStatsParams(KernelParams):
    """Scalar parameters of the forward kernels (linear head and logits alike)."""

    CPP_NAME: ClassVar[str] = "LOGPROBS_STATS"

    need_entropy: bool  # compute LogprobsStat.SUM_EXP_SHIFT (else it is 0)


@dataclasses.dataclass(frozen=True)
class LinearLogprobsBwdParams(KernelParams):
    """Scalar parameters of the linear head's backward: which gradients to form (an output
    that is not needed is an empty ``[0]`` tensor)."""

    CPP_NAME: ClassVar[str] = "LINEAR_LOGPROBS_BWD"

    need_hidden: bool
    need_weight: bool
    need_bias: bool  # only with a bias


# The C++ X-macro list each enum mirrors.
CPP_CODES = {"RLVR_LOGPROBS_STAT_CODES": LogprobsStat}
