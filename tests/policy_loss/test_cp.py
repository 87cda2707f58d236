"""Context-parallel ``policy_loss(cp_group=...)``: 2 and 4 CPU processes (gloo, 60 s collective
timeout so a hang fails), each holding a slice of every sequence cut at random points (some rank
holds no token of some sequence; with 4 ranks and the padded layout one rank's slice is empty),
against one process holding the whole sequences: the ranks' losses sum to the one-process loss,
each rank's logprobs and entropy gradients are the one-process gradients of its tokens, and the
metrics are the one-process metrics; for ppo / gspo / geo_mean / cispo, token-mean,
seq-mean-token-mean and seq-mean-token-sum, KL and entropy terms, sequence IS weights, the
rejection chain (token and seq_mean options) and the IS batch normalisation, on the reference,
cpu and Triton (interpreter) backends; DP × CP; and what cp_group cannot reduce raises."""

import pytest
import torch
import torch.multiprocessing as mp
from _workers.policy_loss_cp import cp_equivalence_worker, cp_errors_worker

import rlvr_kernels
from rlvr_kernels.testing.dist import free_port

F32, F64 = torch.float32, torch.float64


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_equals_one_process(world):
    if world == 2:
        combos = [
            ("cpu", "padded", F64, False),
            ("cpu", "packed", F32, True),
            ("reference", "packed", F64, False),
            ("reference", "padded", F32, True),
        ]
    else:  # (4 processes on a few cores: each layout once)
        combos = [("cpu", "packed", F64, False), ("cpu", "padded", F32, False)]
    mp.spawn(cp_equivalence_worker, args=(world, free_port(), combos), nprocs=world, join=True)


def test_context_parallel_triton_equals_one_process():
    combos = [("triton", "packed", F32, False), ("triton", "padded", F64, True)]
    mp.spawn(cp_equivalence_worker, args=(2, free_port(), combos), nprocs=2, join=True)


def test_data_and_context_parallel_equal_one_process():
    combos = [("cpu", "padded", F64, False), ("reference", "padded", F32, True)]
    mp.spawn(cp_equivalence_worker, args=(4, free_port(), combos, True), nprocs=4, join=True)


def test_what_cp_cannot_reduce_raises_on_every_rank():
    mp.spawn(cp_errors_worker, args=(2, free_port()), nprocs=2, join=True)


def test_cp_group_is_eager_only(monkeypatch):
    lp = torch.zeros(2, 3)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match="eager only"):
        rlvr_kernels.policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), cp_group=object())
