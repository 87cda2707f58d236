"""pytest-benchmark entry point for policy_loss, forward + backward (the same workload
as `rlvr-kernels bench`, which prints the side-by-side table with ratios, targets and
the bandwidth fraction).

    .venv/bin/python -m pytest benchmarks/bench_policy_loss.py --benchmark-enable

Until the C++ / Triton kernel is built, the fused rows run backend="reference" (see
``extra_info["fused_backend"]``).
"""

import pytest
import torch

from rlvr_kernels.bench.policy_loss import check_agreement, copy_step, methods, moved_bytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_CACHE = {}


def _methods():
    if not _CACHE:
        x, steps = methods(DEVICE)  # compiles the torch.compile method once, here
        check_agreement(steps)
        _CACHE.update(x=x, fns={key: fn for _, fn, key in steps})
        _CACHE["fns"]["copy"] = copy_step(moved_bytes(x), DEVICE)
    return _CACHE


@pytest.mark.parametrize("key", ["fused", "fused_novalidate", "verl", "eager", "compiled", "copy"])
def test_policy_loss(benchmark, key):
    c = _methods()
    fn = c["fns"][key]
    assert fn is not None, f"{key} is not available here"
    benchmark.extra_info["fused_backend"] = c["x"]["fused_backend"]
    benchmark.pedantic(fn, rounds=21, warmup_rounds=3)
