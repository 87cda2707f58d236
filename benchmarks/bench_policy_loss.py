"""pytest-benchmark entry point for policy_loss, forward + backward (the same workloads
as `rlvr-kernels bench`, which prints the side-by-side tables with ratios, targets and
the bandwidth fraction): the fused op and its peers, and every function-level verl
drop-in next to verl's own function.

    .venv/bin/python -m pytest benchmarks/bench_policy_loss.py --benchmark-enable

The fused op must run: a missing or broken kernel fails the first benchmark (no
stand-in backend).
"""

import pytest
import torch

from rlvr_kernels.bench.policy_loss import (
    DROPIN_LOSS_MODES,
    check_agreement,
    copy_step,
    dropin_pairs,
    make_inputs,
    methods,
    moved_bytes,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_CACHE = {}


def _methods():
    if not _CACHE:
        x, steps = methods(DEVICE)  # compiles the torch.compile method once, here
        check_agreement(steps)
        _CACHE.update(x=x, fns={key: fn for _, fn, key in steps})
        _CACHE["fns"]["copy"] = copy_step(moved_bytes(x), DEVICE)
    return _CACHE


@pytest.mark.parametrize("key", ["fused", "fused_novalidate", "verl_actor", "verl", "eager", "compiled", "copy"])
def test_policy_loss(benchmark, key):
    fn = _methods()["fns"][key]
    assert fn is not None, f"{key} is not available here"
    benchmark.pedantic(fn, rounds=21, warmup_rounds=3)


_PAIRS = {}
DROPINS = [f"compute_policy_loss_{m}" for m in DROPIN_LOSS_MODES] + [
    "kl_penalty (low_var_kl)",
    "agg_loss (token-mean)",
    "agg_loss (seq-mean-token-mean)",
    "agg_loss(kl_penalty(...)) (the KL term)",
    "policy_loss_verl vs ppo_loss (pg + kl_penalty + agg_loss)",
]


@pytest.mark.parametrize("side", ["dropin", "verl"])
@pytest.mark.parametrize("name", DROPINS)
def test_verl_dropin(benchmark, name, side):
    if not _PAIRS:
        pairs = dropin_pairs(make_inputs(DEVICE))
        assert pairs is not None, "verl is not importable"
        _PAIRS.update({label: (ours, theirs) for label, ours, theirs in pairs})
    ours, theirs = _PAIRS[name]
    benchmark.pedantic(ours if side == "dropin" else theirs, rounds=21, warmup_rounds=3)
