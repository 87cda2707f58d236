"""Vocab-parallel ``linear_logprobs`` (``process_group``) with a soft-cap, a logit scale and
every optional output: 2 and 3 CPU processes (gloo) with uneven shards give the unsharded
op's values and gradients, an argmax tie across shards included (the first column wins)."""

import pytest
import torch
import torch.multiprocessing as mp
from _backends import DEVICE, INTERPRETED
from _workers.logprobs_options import vocab_parallel_options_worker

from rlvr_kernels.testing.dist import free_port


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_options_equal_unsharded(world):
    backends = [("cpu", torch.float64), ("cpu", torch.float32)]
    if world == 2 and DEVICE == "cpu" and INTERPRETED:
        backends.append(("triton", torch.float64))
    mp.spawn(vocab_parallel_options_worker, args=(world, free_port(), backends), nprocs=world, join=True)
