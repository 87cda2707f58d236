"""pytest-benchmark entry point for group_advantages (the same workloads as
`rlvr-kernels bench`, which prints the side-by-side table with ratios).

    .venv/bin/python -m pytest benchmarks/bench_advantages.py --benchmark-enable
"""

import pytest
import torch

from rlvr_kernels.bench.advantages import group_methods, token_methods

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_CACHE = {}


def _methods(kind):
    if kind not in _CACHE:
        if kind == "tokens":
            methods = token_methods(DEVICE)[1]
        else:
            methods = group_methods(DEVICE, shuffled=kind == "groups_shuffled")[1]
        _CACHE[kind] = dict((key, fn) for _, fn, key in methods)
    return _CACHE[kind]


@pytest.mark.parametrize("key", ["fused", "dropin", "eager", "floor", "floor_out", "verl_vec", "verl_loop"])
def test_tokens(benchmark, key):
    fn = _methods("tokens")[key]
    assert fn is not None, f"{key} is not available here"
    benchmark.pedantic(fn, rounds=3 if key == "verl_loop" else 9, warmup_rounds=1)


@pytest.mark.parametrize("key", ["fused", "eager_lean", "eager", "verl_vec"])
def test_groups_shuffled(benchmark, key):
    benchmark.pedantic(_methods("groups_shuffled")[key], rounds=9, warmup_rounds=1)


@pytest.mark.parametrize("key", ["fused", "fused_group_size", "eager_lean", "eager", "verl_vec"])
def test_groups_contiguous(benchmark, key):
    benchmark.pedantic(_methods("groups_contiguous")[key], rounds=9, warmup_rounds=1)
