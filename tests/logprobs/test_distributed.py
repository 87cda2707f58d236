"""Vocab-parallel ``linear_logprobs`` (``process_group``): each of 2 and 4 CPU processes
(gloo, started by the test) holds a shard of the LM head of a different size; the
log-probs, entropies and gradients equal the unsharded op's."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _backends import DEVICE, INTERPRETED

import rlvr_kernels as rk
from rlvr_kernels.testing import random_logprobs_case


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(inputs, backend, up, weight, bias, group=None):
    hidden = inputs["hidden"].clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    b = bias.clone().requires_grad_(True)
    logp, ent = rk.linear_logprobs(
        hidden,
        w,
        inputs["targets"],
        row_index=inputs["row_index"],
        bias=b,
        temperature=inputs["temperature"],
        return_entropy=True,
        process_group=group,
        backend=backend,
    )
    ((logp * up[0]).sum() + (ent * up[1]).sum()).backward()
    return logp.detach(), ent.detach(), hidden.grad, w.grad, b.grad


def _worker(rank, world, port, backends):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        for backend, dtype in backends:
            gen = torch.Generator().manual_seed(17)  # every rank builds the same batch
            V = 101 if backend == "triton" else 1031
            inputs = random_logprobs_case(
                gen, N=13, H=24, V=V, dtype=dtype, bias=True, branching=True, ignore_fraction=0.1, temperature="rows"
            )
            up = (
                torch.randn(inputs["targets"].shape[0], generator=gen).to(dtype),
                torch.randn(13, generator=gen).to(dtype),
            )
            # Uneven shards: rank r holds rows [bounds[r], bounds[r+1]).
            bounds = [0] + [V * (k + 1) // world + (3 if k + 1 < world else 0) for k in range(world)]
            lo, hi = bounds[rank], bounds[rank + 1]
            full = _run(inputs, backend, up, inputs["weight"], inputs["bias"])
            shard = _run(inputs, backend, up, inputs["weight"][lo:hi], inputs["bias"][lo:hi], dist.group.WORLD)
            want = full[:3] + (full[3][lo:hi], full[4][lo:hi])
            tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
            for name, a, b in zip(("logp", "entropy", "grad.hidden", "grad.weight", "grad.bias"), shard, want):
                torch.testing.assert_close(a, b, **tol, msg=lambda m: f"rank {rank} {backend} {name}: {m}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_equals_unsharded(world):
    # fp64: equal to rounding; fp32: within fp32 rounding of a different summation order.
    backends = [("cpu", torch.float64), ("cpu", torch.float32)]
    if world == 2 and DEVICE == "cpu" and INTERPRETED:
        backends.append(("triton", torch.float64))  # the interpreter on CPU tensors; tiny vocabulary
    mp.spawn(_worker, args=(world, _free_port(), backends), nprocs=world, join=True)
