"""Kernel contracts: one frozen parameter dataclass per op, shared by the op layer, the
Triton launchers, the tests and (through X-macro lists in ``csrc/<op>.h``) the C++ kernels.
See :mod:`rlvr_kernels.contracts._base` for how the lists are packed."""

from ._base import KernelParams, sanitized_offsets
from .logprobs import CPP_CODES as _LOGPROBS_CODES
from .logprobs import LinearLogprobsBwdParams, LogprobsStat, LogprobsStatsParams

__all__ = ["KernelParams", "sanitized_offsets"]
__all__ += ["LinearLogprobsBwdParams", "LogprobsStatsParams", "LogprobsStat"]

# Branch-code enums and the C++ X-macro list each one mirrors ("RLVR_<NAME>_CODES"); the
# contract test compares names and values. Each op's contract module adds its own.
CPP_CODES: dict = {}
CPP_CODES.update(_LOGPROBS_CODES)
