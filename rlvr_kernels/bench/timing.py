"""Timing and bandwidth helpers for the benchmarks (never used by tests)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict

import torch


def time_fn(fn: Callable[[], object], device: str, *, repeats: int = 7, warmup: int = 1) -> Dict:
    """Median wall time of ``fn`` in milliseconds (CUDA: events around each call). Each
    call's output is dropped before the next call, as a training loop would."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": statistics.median(times), "min_ms": min(times), "runs": len(times)}


def copy_bandwidth(device: str, nbytes: int = 1 << 28) -> float:
    """Measured device copy rate in GB/s, counting bytes read plus bytes written, into a
    preallocated destination (the ceiling for a streaming op)."""
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device, repeats=9, warmup=2)
    return 2 * nbytes / (t["ms"] * 1e-3) / 1e9
