"""Kernel contract of ``rollout_mismatch``: the parameters, the indices of the two output
vectors, and the result type every backend returns.

Mirrored in ``csrc/rollout_mismatch.h`` (``RLVR_ROLLOUT_MISMATCH_FPARAMS`` / ``_IPARAMS``,
``RLVR_MISMATCH_OUT_CODES``, ``RLVR_MISMATCH_SEQ_CODES``); ``tests/common/test_contracts.py``
compares the two. What the kernels compute is described in :mod:`rlvr_kernels.ops.rollout_mismatch`
and docs/rollout-mismatch.md.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar, NamedTuple

import torch

from ._base import KernelParams

# verl 0.9.1's SAFETY_BOUND (trainer/ppo/rollout_corr_helper.py): the log-ratios of the χ²
# metrics are clamped to ±20 before exp.
LOG_RATIO_BOUND = 20.0


@dataclasses.dataclass(frozen=True)
class RolloutMismatchParams(KernelParams):
    """Scalar parameters of ``rollout_mismatch_stats`` (both kernels read them by name)."""

    CPP_NAME: ClassVar[str] = "ROLLOUT_MISMATCH"

    ratio_low: float  # a token ratio exp(Δ) < ratio_low counts in ratio_frac_low
    ratio_high: float  # exp(Δ) > ratio_high counts in ratio_frac_high
    log_ratio_bound: float  # clamp of Δ (token χ²) and of Σ Δ (sequence χ²) before exp


class MismatchOut(enum.IntEnum):
    """Entries of the kernel's batch vector ``out [NUM_MISMATCH_OUT]`` (Δ = train − rollout on
    the valid tokens; N valid tokens; B sequences). Token entries average over the N tokens,
    sequence entries over all B sequences (an empty sequence counts with Σ Δ = 0, as verl and
    slime count it); every entry is 0 when N = 0."""

    ABS_DIFF_MEAN = 0  # Σ|Δ| / N
    ABS_DIFF_MAX = 1  # max |Δ|
    K1 = 2  # Σ(−Δ) / N: log π_rollout − log π_train (verl's "kl")
    K2 = 3  # Σ ½Δ² / N
    K3 = 4  # Σ (exp(Δ) − Δ − 1) / N (verl's "k3_kl")
    RATIO_MEAN = 5  # token ratio ρ = exp(Δ) = π_train / π_rollout: Σρ / N
    RATIO_MIN = 6
    RATIO_MAX = 7
    RATIO_FRAC_LOW = 8  # #{ρ < ratio_low} / N
    RATIO_FRAC_HIGH = 9  # #{ρ > ratio_high} / N
    RATIO_FRAC_OUTSIDE = 10  # the two together
    CHI2_TOKEN = 11  # Σ exp(2·clamp(Δ, ±bound)) / N − 1
    SEQ_ABS_DIFF_MEAN = 12  # mean over sequences of the sequence's mean |Δ| (slime)
    LOG_PPL_DIFF = 13  # mean over sequences of d_b = mean(rollout) − mean(train) = −mean Δ
    LOG_PPL_ABS_DIFF = 14  # mean |d_b|
    LOG_PPL_DIFF_MAX = 15  # max d_b
    LOG_PPL_DIFF_MIN = 16  # min d_b
    PPL_RATIO = 17  # mean exp(d_b)
    CHI2_SEQ = 18  # mean exp(2·clamp(Σ_b Δ, ±bound)) − 1
    TRAINING_PPL = 19  # mean exp(−mean_b(train))
    TRAINING_LOG_PPL = 20  # mean (−mean_b(train))
    ROLLOUT_PPL = 21
    ROLLOUT_LOG_PPL = 22
    SEQ_RATIO_MEAN = 23  # sequence ratio exp(Σ_b Δ) (TRL's sequence modes): mean, min, max
    SEQ_RATIO_MIN = 24
    SEQ_RATIO_MAX = 25


NUM_MISMATCH_OUT = len(MismatchOut)


class MismatchSeq(enum.IntEnum):
    """Columns of the kernel's per-sequence output ``seq [B, NUM_MISMATCH_SEQ]`` (0 for a
    sequence without a valid token)."""

    ABS_DIFF_MEAN = 0  # mean |Δ| over the sequence's valid tokens
    ABS_DIFF_MAX = 1  # max |Δ|
    LOG_RATIO = 2  # Σ Δ: log of the sequence's ratio Π π_train / π_rollout


NUM_MISMATCH_SEQ = len(MismatchSeq)

CPP_CODES = {
    "RLVR_MISMATCH_OUT_CODES": MismatchOut,
    "RLVR_MISMATCH_SEQ_CODES": MismatchSeq,
}


class RolloutMismatch(NamedTuple):
    """What ``rollout_mismatch`` returns (docs/rollout-mismatch.md): detached device tensors in
    the compute dtype (float32; float64 when an input is float64), 0-d unless marked [B];
    ``num_tokens`` is 0-d int64. Δ = train − rollout; ρ = exp(Δ). The fields after
    ``num_tokens`` follow :class:`MismatchOut` (token means over the N valid tokens, sequence
    means over all B sequences), then the [B] columns of :class:`MismatchSeq`."""

    num_tokens: torch.Tensor
    abs_diff_mean: torch.Tensor
    abs_diff_max: torch.Tensor
    k1: torch.Tensor
    k2: torch.Tensor
    k3: torch.Tensor
    ratio_mean: torch.Tensor
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor
    ratio_frac_low: torch.Tensor
    ratio_frac_high: torch.Tensor
    ratio_frac_outside: torch.Tensor
    chi2_token: torch.Tensor
    seq_abs_diff_mean: torch.Tensor
    log_ppl_diff: torch.Tensor
    log_ppl_abs_diff: torch.Tensor
    log_ppl_diff_max: torch.Tensor
    log_ppl_diff_min: torch.Tensor
    ppl_ratio: torch.Tensor
    chi2_seq: torch.Tensor
    training_ppl: torch.Tensor
    training_log_ppl: torch.Tensor
    rollout_ppl: torch.Tensor
    rollout_log_ppl: torch.Tensor
    seq_ratio_mean: torch.Tensor
    seq_ratio_min: torch.Tensor
    seq_ratio_max: torch.Tensor
    per_seq_abs_diff_mean: torch.Tensor  # [B]
    per_seq_abs_diff_max: torch.Tensor  # [B]
    per_seq_log_ratio: torch.Tensor  # [B]

    @classmethod
    def from_kernel(cls, out: torch.Tensor, seq: torch.Tensor, num_tokens: torch.Tensor) -> "RolloutMismatch":
        """The result from the kernel's three outputs (``out [NUM_MISMATCH_OUT]``,
        ``seq [B, NUM_MISMATCH_SEQ]``, ``num_tokens []`` int64)."""
        return cls(num_tokens, *out.unbind(0), *seq.unbind(1))

    def to_dict(self, prefix: str = "") -> dict:
        """``{prefix + field: tensor}``, still on the device (no host sync): what a trainer's
        metric logger takes after one ``.item()`` / ``.tolist()`` of its own."""
        return {prefix + k: v for k, v in self._asdict().items()}


# The result's field order is the kernel's: num_tokens, the out vector, the seq columns.
assert RolloutMismatch._fields[1 : 1 + NUM_MISMATCH_OUT] == tuple(m.name.lower() for m in MismatchOut)
assert RolloutMismatch._fields[1 + NUM_MISMATCH_OUT :] == tuple("per_seq_" + m.name.lower() for m in MismatchSeq)
