"""Vocab-parallel ``linear_logprobs`` (``process_group``): each of 2 and 4 CPU processes
(gloo, started by the test) holds a shard of the LM head of a different size; the
log-probs, entropies and gradients equal the unsharded op's."""

import pytest
import torch
import torch.multiprocessing as mp
from _backends import DEVICE, INTERPRETED
from _workers.logprobs_dist import vocab_parallel_worker

from rlvr_kernels.testing.dist import free_port


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_equals_unsharded(world):
    # fp64: equal to rounding; fp32: within fp32 rounding of a different summation order.
    backends = [("cpu", torch.float64), ("cpu", torch.float32)]
    if world == 2 and DEVICE == "cpu" and INTERPRETED:
        backends.append(("triton", torch.float64))  # the interpreter on CPU tensors; tiny vocabulary
    # The worker lives in tests/_workers: a spawned process unpickles it by module name.
    mp.spawn(vocab_parallel_worker, args=(world, free_port(), backends), nprocs=world, join=True)
