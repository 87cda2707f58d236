"""The allocation probe of the logit-free engine tests (verl's and AReaL's): what the CPU
allocator hands out while a step runs, as the profiler records it."""

from __future__ import annotations

from torch.profiler import ProfilerActivity, profile


def allocations(fn) -> list:
    """The sizes (bytes) of ATen's CPU allocations while ``fn()`` runs, in order: its raw
    allocation events as the profiler records them (each one, wherever it is made)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0]
    assert sizes, "the profiler recorded no allocation"
    return sizes


def largest_allocation(fn) -> int:
    """The largest single allocation (bytes) of ATen's CPU allocator while ``fn()`` runs."""
    return max(allocations(fn))
