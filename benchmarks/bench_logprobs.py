"""pytest-benchmark entry point for linear_logprobs, forward + backward with entropy (the
same workload and methods as `rlvr-kernels bench`, which prints the side-by-side table with
ratios, the peak-memory column measured in fresh processes, and the targets).

    .venv/bin/python -m pytest benchmarks/bench_logprobs.py --benchmark-enable
"""

import pytest
import torch

from rlvr_kernels.bench.logprobs import CPU_METHODS, GPU_METHODS, make_inputs, step_fn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_CACHE = {}


@pytest.mark.parametrize("key", CPU_METHODS if DEVICE == "cpu" else GPU_METHODS)
def test_linear_logprobs(benchmark, key):
    if "x" not in _CACHE:
        _CACHE["x"] = make_inputs(DEVICE)
    step = step_fn(key, _CACHE["x"])
    benchmark.pedantic(step, rounds=3, warmup_rounds=1)
