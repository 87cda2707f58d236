"""pytest-benchmark entry point for prefix-tree packing (the same workloads as
`rlvr-kernels bench`, which prints the side-by-side table with ratios).

    .venv/bin/python -m pytest benchmarks/bench_packing.py --benchmark-enable
"""

import pytest
import torch

from rlvr_kernels.bench.packing import _forward_step, _ours, _trl, build_inputs, forward_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_CACHE = {}


def _get(kind):
    if kind not in _CACHE:
        _CACHE[kind] = build_inputs() if kind == "build" else forward_inputs(DEVICE)
    return _CACHE[kind]


@pytest.mark.parametrize("method", ["ours", "trl"])
def test_build(benchmark, method):
    fn = (_ours if method == "ours" else _trl)(_get("build"))
    benchmark.pedantic(fn, rounds=5 if method == "ours" else 1, warmup_rounds=1 if method == "ours" else 0)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_forward(benchmark, packed):
    benchmark.pedantic(_forward_step(_get("forward"), packed), rounds=3, warmup_rounds=1)
