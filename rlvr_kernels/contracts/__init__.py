"""Kernel contracts: one frozen parameter dataclass per op, shared by the op layer, the
Triton launchers, the tests and (through X-macro lists in ``csrc/<op>.h``) the C++ kernels.
See :mod:`rlvr_kernels.contracts._base` for how the lists are packed."""

from ._base import KernelParams
from .advantages import CPP_CODES as _ADVANTAGES_CODES
from .advantages import NUM_PARTIAL_COLUMNS, Baseline, GroupAdvantagesParams, PartialColumn, Scale, Whiten
from .logprobs import CPP_CODES as _LOGPROBS_CODES
from .logprobs import LinearLogprobsBwdParams, LinearLogprobsStatsParams, LogprobsStat, LogprobsStatsParams
from .policy_loss import CPP_CODES as _POLICY_LOSS_CODES
from .policy_loss import PolicyLossParams
from .rollout_mismatch import CPP_CODES as _ROLLOUT_MISMATCH_CODES
from .rollout_mismatch import MismatchOut, MismatchSeq, RolloutMismatch, RolloutMismatchParams

__all__ = ["KernelParams"]
__all__ += ["Baseline", "GroupAdvantagesParams", "NUM_PARTIAL_COLUMNS", "PartialColumn", "Scale", "Whiten"]
__all__ += ["LinearLogprobsBwdParams", "LinearLogprobsStatsParams", "LogprobsStatsParams", "LogprobsStat"]
__all__ += ["PolicyLossParams"]
__all__ += ["MismatchOut", "MismatchSeq", "RolloutMismatch", "RolloutMismatchParams"]

# Branch-code enums and the C++ X-macro list each one mirrors ("RLVR_<NAME>_CODES"); the
# contract test compares names and values. Each op's contract module adds its own.
CPP_CODES: dict = {}
CPP_CODES.update(_ADVANTAGES_CODES)
CPP_CODES.update(_LOGPROBS_CODES)
CPP_CODES.update(_POLICY_LOSS_CODES)
CPP_CODES.update(_ROLLOUT_MISMATCH_CODES)
