"""Worker of tests/integrations/test_slime_megatron.py: megatron-core's tensor-parallel state
and vocab-parallel cross entropy on CPU processes (gloo), the pieces slime's loss reads its
log-probs through, against :func:`rlvr_kernels.logprobs_from_logits` on the whole vocabulary.
Here (not in the test file) so that a spawned process can unpickle it."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from rlvr_kernels import logprobs_from_logits
from rlvr_kernels.integrations import slime
from rlvr_kernels.testing.dist import gloo_process


def slime_megatron_worker(rank: int, world: int, port: int) -> None:
    with gloo_process(rank, world, port):
        with warnings.catch_warnings():  # megatron warns that Transformer Engine / Apex are absent
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state as mpu
            from megatron.core import tensor_parallel
        mpu.initialize_model_parallel(tensor_model_parallel_size=world)
        try:
            assert mpu.get_tensor_model_parallel_world_size() == world
            assert mpu.get_context_parallel_world_size() == 1
            assert mpu.get_tensor_model_parallel_rank() == rank
            g = torch.Generator().manual_seed(0)
            T, V = 9, 11 * world  # shards of equal size, Megatron's layout
            full = 3 * torch.randn(T, V, generator=g)
            targets = torch.randint(0, V, (T,), generator=g)
            up = torch.randn(T, generator=g)  # an upstream gradient

            ours_logits = full.clone().requires_grad_()
            logp = logprobs_from_logits(ours_logits, targets).logp
            (logp * up).sum().backward()

            # this rank's vocabulary shard, Megatron's [s, b, V / tp] layout
            V_r = V // world
            shard = full[:, rank * V_r : (rank + 1) * V_r].clone()[:, None, :].requires_grad_()
            ce = tensor_parallel.vocab_parallel_cross_entropy(shard, targets[:, None])
            torch.testing.assert_close(-ce[:, 0], logp, rtol=1e-5, atol=1e-5)
            (-ce[:, 0] * up).sum().backward()
            torch.testing.assert_close(
                shard.grad[:, 0], ours_logits.grad[:, rank * V_r : (rank + 1) * V_r], rtol=1e-5, atol=1e-6
            )

            # slime's loss hook reads the vocabulary whole: a tensor-parallel run is refused
            args = types.SimpleNamespace(tensor_model_parallel_size=mpu.get_tensor_model_parallel_world_size())
            if world > 1:
                with pytest.raises(ValueError, match="args.tensor_model_parallel_size"):
                    slime.policy_loss_function(args, {}, shard[None, :, 0], None)
        finally:
            mpu.destroy_model_parallel()
