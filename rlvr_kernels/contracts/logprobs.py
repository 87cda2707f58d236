"""Kernel contract of ``linear_logprobs`` / ``logprobs_from_logits``: the scalar parameters of
their four kernels and the columns of the per-row statistics they return.

Mirrored in ``csrc/logprobs.h`` (``RLVR_LOGPROBS_STATS_FPARAMS`` / ``_IPARAMS``,
``RLVR_LINEAR_LOGPROBS_BWD_FPARAMS`` / ``_IPARAMS``, ``RLVR_LOGPROBS_STAT_CODES`` and
``RLVR_LOGITS_PRECISION_CODES``);
``tests/common/test_contracts.py`` compares the two. The tensors and what the kernels
compute from them are described in :mod:`rlvr_kernels.ops.logprobs`.

- ``logprobs_from_logits_stats`` takes :class:`LogprobsStatsParams`;
- ``linear_logprobs_stats`` takes :class:`LinearLogprobsStatsParams` (the entropy flag, the
  optional statistics and the soft-cap);
- ``linear_logprobs_bwd`` takes :class:`LinearLogprobsBwdParams`;
- ``logprobs_from_logits_bwd`` takes :class:`LogprobsBwdParams` (whether the entropy
  carries a gradient is whether ``grad_entropy`` is given);
- ``linear_logprobs_threshold`` takes :class:`LinearLogprobsThresholdParams` and
  ``logprobs_from_logits_threshold`` :class:`LogprobsThresholdParams`: the per-row threshold
  of a computed sampling support (top-k / top-p / min-p, docs/logprobs.md "Sampling support").
"""

from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar

from ._base import KernelParams


class LogprobsStat(enum.IntEnum):
    """Columns of the ``stats [N, NUM_STATS]`` output of the forward kernels (``NUM_STATS`` columns): over a row's
    (local) vocabulary, max z, Σ exp(z − max), Σ exp(z − max)·(z − max), and the optional statistics of the
    linear head (0 unless requested; the logits kernels never compute them)."""

    MAX = 0
    SUM_EXP = 1
    SUM_EXP_SHIFT = 2  # 0 when the entropy is not needed
    SUM_EXP_SQ = 3  # Σ exp(2·(z − max)) (log Σ p²); 0 unless need_sum_sq
    SUM_Z = 4  # Σ z (the mean logit); 0 unless need_sum_z
    ARGMAX = 5  # the first column holding max z, as a number in the compute dtype; 0 unless need_argmax


NUM_STATS = len(LogprobsStat)


class LogitsPrecision(enum.IntEnum):
    """How the linear head's kernels form y = hidden·Wᵀ + b (docs/logprobs.md, "Logits precision"):
    the arithmetic of the GEMM a rollout engine's LM head runs, emulated exactly."""

    FP32 = 0  # operands as given, accumulated in the compute dtype (the default)
    TF32 = 1  # hidden and weight rounded to tf32 (10-bit mantissa, to nearest, ties away from 0); y in fp32
    BF16 = 2  # hidden, weight and bias rounded to bf16 (to nearest even); y = bf16(acc + b)


class SupportMode(enum.IntEnum):
    """Which columns of a row the forward and backward kernels keep (the sampling support, the
    set the rollout engine sampled from); the others count as z = −inf. The ``support``
    tensor the kernels take says which (``ops/logprobs.py``, kernel contract)."""

    NONE = 0  # every column (support is None)
    MASK = 1  # support: int32 [N, ceil(V / 32)], column v kept iff bit v % 32 of word v // 32 is set
    THRESHOLD = 2  # support: [N] compute dtype, column v kept iff z_v >= support[n]


class SamplingConvention(enum.IntEnum):
    """Whose definition of top-k / top-p / min-p a computed support follows (docs/logprobs.md,
    "Sampling support"); both filter after the temperature and keep ties whole."""

    VLLM = 0  # min-p, then top-k, then top-p over the renormalised survivors; kept iff mass above < p
    SGLANG = 1  # top-k, top-p and min-p each on the full distribution; kept iff mass above <= p


@dataclasses.dataclass(frozen=True)
class LogprobsStatsParams(KernelParams):
    """Scalar parameters of the forward kernels (linear head and logits alike)."""

    CPP_NAME: ClassVar[str] = "LOGPROBS_STATS"

    need_entropy: bool  # compute LogprobsStat.SUM_EXP_SHIFT (else it is 0)
    support_mode: SupportMode = SupportMode.NONE  # which columns count (the support tensor)


@dataclasses.dataclass(frozen=True)
class LogprobsBwdParams(KernelParams):
    """Scalar parameters of ``logprobs_from_logits_bwd``."""

    CPP_NAME: ClassVar[str] = "LOGPROBS_BWD"

    support_mode: SupportMode = SupportMode.NONE  # the forward's


@dataclasses.dataclass(frozen=True)
class LinearLogprobsStatsParams(KernelParams):
    """Scalar parameters of the linear head's forward. ``tanh_scale`` > 0 soft-caps the logits:
    z = inv_T·tanh(tanh_scale·y) instead of z = inv_T·y (y = hidden·Wᵀ + b; the op folds
    ``logit_scale``, the cap and the temperature into tanh_scale and the per-row inv_T)."""

    CPP_NAME: ClassVar[str] = "LINEAR_LOGPROBS_STATS"

    tanh_scale: float  # 0: no soft-cap
    need_entropy: bool  # compute LogprobsStat.SUM_EXP_SHIFT (else it is 0)
    need_sum_sq: bool  # compute LogprobsStat.SUM_EXP_SQ
    need_sum_z: bool  # compute LogprobsStat.SUM_Z
    need_argmax: bool  # compute LogprobsStat.ARGMAX
    logits_precision: LogitsPrecision = LogitsPrecision.FP32  # how y is formed
    support_mode: SupportMode = SupportMode.NONE  # which columns count (the support tensor)


@dataclasses.dataclass(frozen=True)
class LinearLogprobsBwdParams(KernelParams):
    """Scalar parameters of the linear head's backward: the soft-cap of the forward
    (:class:`LinearLogprobsStatsParams`) and which gradients to form (an output that is not
    needed is an empty ``[0]`` tensor)."""

    CPP_NAME: ClassVar[str] = "LINEAR_LOGPROBS_BWD"

    tanh_scale: float  # 0: no soft-cap; else dz gains the factor tanh_scale·(1 − tanh²)
    need_hidden: bool
    need_weight: bool
    need_bias: bool  # only with a bias
    logits_precision: LogitsPrecision = LogitsPrecision.FP32  # the forward's (z is recomputed from it)
    support_mode: SupportMode = SupportMode.NONE  # the forward's


@dataclasses.dataclass(frozen=True)
class LinearLogprobsThresholdParams(KernelParams):
    """Scalar parameters of ``linear_logprobs_threshold``: z formed as the forward forms it
    (soft-cap, precision), the filters' definition."""

    CPP_NAME: ClassVar[str] = "LINEAR_LOGPROBS_THRESHOLD"

    tanh_scale: float  # as in LinearLogprobsStatsParams
    logits_precision: LogitsPrecision
    convention: SamplingConvention


@dataclasses.dataclass(frozen=True)
class LogprobsThresholdParams(KernelParams):
    """Scalar parameters of ``logprobs_from_logits_threshold``."""

    CPP_NAME: ClassVar[str] = "LOGPROBS_THRESHOLD"

    convention: SamplingConvention


# The C++ X-macro list each enum mirrors.
CPP_CODES = {
    "RLVR_LOGPROBS_STAT_CODES": LogprobsStat,
    "RLVR_LOGITS_PRECISION_CODES": LogitsPrecision,
    "RLVR_SUPPORT_MODE_CODES": SupportMode,
    "RLVR_SAMPLING_CONVENTION_CODES": SamplingConvention,
}
