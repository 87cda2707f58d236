"""The policy-loss benchmark measures the kernel or fails: a missing or broken kernel is
an error, never a run of a stand-in backend (which would let the CLI's quick bench pass
with a broken build). And its verl drop-in workload runs every pair (no timing asserts)."""

from __future__ import annotations

import pytest
import torch

import rlvr_kernels.bench.policy_loss as bench
from rlvr_kernels._core import dispatch as _dispatch


def test_broken_kernel_fails_the_benchmark(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(bench, "policy_loss", broken)
    with pytest.raises(RuntimeError, match="kernel exploded"):
        bench.workload("cpu", quick=True)


def test_kernel_returning_garbage_fails_the_benchmark(monkeypatch):
    monkeypatch.setattr(bench, "policy_loss", lambda *a, **k: (torch.tensor(float("nan")), None))
    with pytest.raises(RuntimeError, match="fused op returned nan"):
        bench.workload("cpu", quick=True)


def test_missing_extension_fails_the_benchmark(monkeypatch):
    """As if the C++ kernels could not be built: the dispatch raises, and so does the benchmark."""
    monkeypatch.setattr(_dispatch, "load_extension", lambda: False)
    with pytest.raises(RuntimeError, match="needs the C\\+\\+ kernels"):
        bench.workload("cpu", quick=True)


def test_verl_dropin_workload_times_every_pair():
    res = bench.dropin_workload("cpu", quick=True)
    keys = [r["key"] for r in res["rows"]]
    pairs = len(bench.DROPIN_LOSS_MODES) + 6  # + kl_penalty, 2 agg_loss, the KL term, the actor, rollout_corr_helper
    assert keys == [k for i in range(pairs) for k in (f"dropin_{i}", f"verl_{i}")]
    assert all(r["ms"] > 0 for r in res["rows"])
    assert len(res["targets"]) == pairs and all(t["measured"] > 0 for t in res["targets"])


def test_chained_correction_workload_agrees_and_rejects():
    """The chained-correction workload times both sides, agrees with verl (check_agreement
    raises otherwise) and its chain rejects some sequences but not all."""
    res = bench.chained_correction("cpu", quick=True)
    assert [r["key"] for r in res["rows"]] == ["fused", "verl"]
    assert all(r["ms"] > 0 for r in res["rows"])
    rejected, total = (int(s) for s in res["notes"][0].split("; ")[1].split(" sequences")[0].split(" of "))
    assert 0 < rejected < total
