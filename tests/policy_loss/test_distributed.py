"""Data-parallel ``policy_loss(process_group=...)`` and ``rlvr_kernels.distributed.global_counts``:
2 and 4 CPU processes (gloo, started by the test, 60 s collective timeout so a hang fails)
with uneven batches (with 4 ranks one rank has no valid token). The mean over ranks of the
ranks' gradients and losses equals one process on the full batch for every aggregation mode,
ppo/gspo/cispo, with and without KL, padded and packed, fp64 and fp32; micro-batches with
the step's counts accumulate to the rank's whole batch; inconsistent calls raise on every
rank."""

import itertools

import pytest
import torch
import torch.multiprocessing as mp
from _workers.policy_loss_dist import dp_equivalence_worker, dp_errors_worker

import rlvr_kernels
from rlvr_kernels.testing.dist import free_port


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_equals_full_batch(world):
    if world == 2:  # every layout and dtype, the C++ kernel and the reference
        combos = list(itertools.product(["cpu", "reference"], ["padded", "packed"], [torch.float64, torch.float32]))
    else:  # (4 processes on a few cores: each layout once, each dtype once)
        combos = [("cpu", "padded", torch.float64), ("cpu", "packed", torch.float32)]
    mp.spawn(dp_equivalence_worker, args=(world, free_port(), combos), nprocs=world, join=True)


def test_inconsistent_calls_raise_on_every_rank():
    mp.spawn(dp_errors_worker, args=(2, free_port()), nprocs=2, join=True)


def test_process_group_is_eager_only(monkeypatch):
    lp = torch.zeros(2, 3)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match="eager only"):
        rlvr_kernels.policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), process_group=object())
    with pytest.raises(RuntimeError, match="eager only"):
        rlvr_kernels.distributed.global_counts(torch.ones(2, 3, dtype=torch.bool), process_group=object())


def test_global_counts_single_process():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    assert [int(c) for c in rlvr_kernels.distributed.global_counts(mask)] == [3, 2]
    cu = torch.tensor([0, 2, 2, 5])
    packed = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool)  # the last token is outside every span
    assert [int(c) for c in rlvr_kernels.distributed.global_counts(packed, cu_seqlens=cu)] == [3, 2]
    assert [int(c) for c in rlvr_kernels.distributed.global_counts(None, cu_seqlens=cu)] == [5, 2]
