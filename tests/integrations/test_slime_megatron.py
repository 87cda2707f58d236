"""megatron-core (installed without its dependencies; it imports and runs on CPU) under
slime's hooks: its tensor-parallel state and vocab-parallel cross entropy on 2 gloo processes
give the log-probs and logit gradients of rlvr_kernels.logprobs_from_logits on the whole
vocabulary, and slime's loss hook refuses the sharded logits."""

import torch.multiprocessing as mp
from _workers.slime_megatron import slime_megatron_worker

from rlvr_kernels.testing.dist import free_port


def test_megatron_vocab_parallel_cross_entropy_on_cpu():
    mp.spawn(slime_megatron_worker, args=(2, free_port()), nprocs=2, join=True)
