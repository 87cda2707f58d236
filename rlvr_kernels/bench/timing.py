"""Timing and bandwidth helpers for the benchmarks (never used by tests)."""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Sequence, Tuple

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


def _rss() -> Tuple[int, int]:
    """(current RSS, peak RSS since the last reset) of this process in bytes."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _trim_heap() -> None:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim``; elsewhere nothing)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def peak_extra_gb(step: Callable[[], object], device: str) -> float:
    """Peak memory one call of ``step`` adds, in GB: CUDA's max_memory_allocated above what
    was allocated before; on CPU the peak RSS above the RSS before, the C++ kernels' block cache
    emptied and the heap's free pages given back first (run it in a fresh process: a warm
    allocator would hide the first call's peak)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 1e9
    # the C++ kernels' output blocks kept from an earlier call, and the heap's pages glibc keeps
    # after frees, are this step's memory too: given back first, so that the step's own
    # allocations show in its peak (else a step reusing an earlier step's freed heap looks free)
    from .. import empty_cpu_cache

    empty_cpu_cache()
    _trim_heap()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak RSS, to the current RSS
    base, _ = _rss()
    step()
    _, peak = _rss()
    return (peak - base) / 1e9


def in_fresh_processes(module: str, fn: str, calls: Sequence[tuple], quick: bool) -> List[Dict]:
    """``module.fn(*args)`` (a dict that JSON can carry) for each ``args`` of ``calls``, each
    in a fresh process: a warm allocator would hide a first call's peak. ``quick`` (a smoke
    test, not for reporting) runs every call in one process: the same path, one start-up.
    A call that fails gives ``{"error": its last stderr line}``."""
    groups = [list(calls)] if quick else [[c] for c in calls]
    out: List[Dict] = []
    for group in groups:
        code = (
            f"import json; from {module} import {fn}; "
            f"print(json.dumps([{fn}(*a) for a in {[tuple(a) for a in group]!r}]))"
        )
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
        try:
            got = json.loads(res.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            got = [{"error": (res.stderr.strip().splitlines() or ["no output"])[-1][:120]}] * len(group)
        out += got
    return out
