"""The worker of tests/logprobs/test_options_distributed.py: vocab-parallel
``linear_logprobs`` with a soft-cap, a logit scale and every optional output (gloo, uneven
weight shards, an argmax tie across two shards) against the unsharded op. It lives in the
package because a spawned process unpickles it by module name (see test_distributed.py)."""

from __future__ import annotations

import torch

from rlvr_kernels.testing.dist import gloo_process
from rlvr_kernels.testing.logprobs import random_logprobs_case

_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _run(inputs, backend, up, weight, bias, group=None):
    from rlvr_kernels import linear_logprobs

    hidden = inputs["hidden"].clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    b = bias.clone().requires_grad_(True)
    r = linear_logprobs(
        hidden,
        w,
        inputs["targets"],
        row_index=inputs["row_index"],
        bias=b,
        temperature=inputs["temperature"],
        softcap=6.0,
        logit_scale=1.4,
        outputs=_OUTPUTS,
        process_group=group,
        backend=backend,
    )
    ((r.logp * up[0]).sum() + (r.entropy * up[1]).sum()).backward()
    values = tuple(getattr(r, k).detach() for k in r._fields)
    return values + (hidden.grad, w.grad, b.grad)


def vocab_parallel_options_worker(rank: int, world: int, port: int, backends) -> None:
    import torch.distributed as dist

    with gloo_process(rank, world, port):
        for backend, dtype in backends:
            gen = torch.Generator().manual_seed(23)  # every rank builds the same batch
            V = 101 if backend == "triton" else 1031
            inputs = random_logprobs_case(
                gen, N=13, H=24, V=V, dtype=dtype, bias=True, branching=True, ignore_fraction=0.1, temperature="rows"
            )
            # Columns 2 and V - 3 (in the first and the last shard) tie for every row's max.
            inputs["weight"][V - 3] = inputs["weight"][2]
            inputs["bias"][2] = inputs["bias"][V - 3] = 40.0
            inputs["targets"][:4] = 2
            inputs["targets"][4:8] = V - 3
            up = (
                torch.randn(inputs["targets"].shape[0], generator=gen).to(dtype),
                torch.randn(13, generator=gen).to(dtype),
            )
            bounds = [0] + [V * (k + 1) // world + (3 if k + 1 < world else 0) for k in range(world)]
            lo, hi = bounds[rank], bounds[rank + 1]
            full = _run(inputs, backend, up, inputs["weight"], inputs["bias"])
            shard = _run(inputs, backend, up, inputs["weight"][lo:hi], inputs["bias"][lo:hi], dist.group.WORLD)
            want = full[:6] + (full[6][lo:hi], full[7][lo:hi])
            names = ("logp",) + _OUTPUTS + ("grad.hidden", "grad.weight", "grad.bias")
            tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
            for name, a, b in zip(names, shard, want):
                if a.dtype == torch.bool:
                    assert torch.equal(a, b), f"rank {rank} {backend} {name}"
                else:
                    torch.testing.assert_close(a, b, **tol, msg=lambda m: f"rank {rank} {backend} {name}: {m}")
            assert bool(shard[4][:4].all()) and not bool(shard[4][4:8].any()), (rank, backend)
