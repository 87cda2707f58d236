"""The CPU output-buffer cache of the C++ kernels (csrc/alloc.h)."""

from __future__ import annotations

from typing import Dict

import torch

from .dispatch import load_extension


def cpu_cache_stats() -> Dict[str, int]:
    """Bytes held by the huge-page cache of large CPU outputs, bytes in live outputs,
    the cache limit (``RLVR_KERNELS_CPU_CACHE_MB``) and the number of reuses."""
    if not load_extension():
        return {"cached_bytes": 0, "in_use_bytes": 0, "limit_bytes": 0, "reuses": 0}
    cached, in_use, limit, hits = torch.ops.rlvr_kernels_C.cpu_cache_stats()
    return {"cached_bytes": cached, "in_use_bytes": in_use, "limit_bytes": limit, "reuses": hits}


def empty_cpu_cache() -> None:
    """Return every cached block to the operating system."""
    if load_extension():
        torch.ops.rlvr_kernels_C.empty_cpu_cache()
