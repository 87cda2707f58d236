"""A tiny transformer (Qwen2 from a config, fp32) trained for 3 SGD steps with the fused ops
(``group_advantages`` and ``policy_loss`` with ``process_group``, ``linear_logprobs`` on the
LM head) on 2 CPU processes (gloo, started by the test, 60 s collective timeout so a hang
fails), wrapped in DDP and in FSDP2 (``torch.distributed.fsdp.fully_shard``), every group
split over the two ranks: after each step every parameter equals the single-process run on
the full batch (≤ 1e-6 relative), for PPO with token-mean, seq-mean-token-mean and
seq-mean-token-sum-norm and GSPO (the clip active), and every parameter moves by far more
than the tolerance. FSDP2 runs on CPU with gloo (torch 2.13): every parameter is a sharded
DTensor, gathered with ``full_tensor()`` for the comparison. Workers:
``tests/_workers/train_dist.py``."""

import pytest
import torch.multiprocessing as mp
from _workers.train_dist import train_worker

from rlvr_kernels.testing.dist import free_port


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_training_equals_single_process(wrapper):
    mp.spawn(train_worker, args=(2, free_port(), wrapper), nprocs=2, join=True)
