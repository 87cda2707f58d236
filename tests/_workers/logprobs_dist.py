"""The ranks of tests/logprobs/test_distributed.py: vocab-parallel ``linear_logprobs``
(gloo, uneven weight shards) against the unsharded op."""

from __future__ import annotations

import torch

from rlvr_kernels.testing.dist import gloo_process
from rlvr_kernels.testing.logprobs import random_logprobs_case


def _run(inputs, backend, up, weight, bias, group=None):
    from rlvr_kernels import linear_logprobs

    hidden = inputs["hidden"].clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    b = bias.clone().requires_grad_(True)
    logp, ent = linear_logprobs(
        hidden,
        w,
        inputs["targets"],
        row_index=inputs["row_index"],
        bias=b,
        temperature=inputs["temperature"],
        return_entropy=True,
        process_group=group,
        backend=backend,
    )[:2]
    ((logp * up[0]).sum() + (ent * up[1]).sum()).backward()
    return logp.detach(), ent.detach(), hidden.grad, w.grad, b.grad


def vocab_parallel_worker(rank: int, world: int, port: int, backends) -> None:
    """One rank of tests/logprobs/test_distributed.py: vocab-parallel ``linear_logprobs`` (gloo,
    uneven weight shards) against the unsharded op, log-probs, entropies and gradients."""
    import torch.distributed as dist

    with gloo_process(rank, world, port):
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
        _check_errors(rank, world, dist.group.WORLD)


def _expect(fn, exc, text: str, what: str) -> None:
    try:
        fn()
    except exc as e:
        assert text in str(e), f"{what}: expected {text!r} in {e!r}"
        return
    raise AssertionError(f"{what}: no {exc.__name__} raised")


def _check_errors(rank: int, world: int, group) -> None:
    """The handshake: one rank's bad input, or shapes or options that differ between the
    ranks, raise on every rank (no hang), and the group stays in step."""
    gen = torch.Generator().manual_seed(3)
    inputs = random_logprobs_case(gen, N=6, H=8, V=40, dtype=torch.float64, bias=False)
    lo, hi = rank * 40 // world, (rank + 1) * 40 // world
    from rlvr_kernels import linear_logprobs

    def call(**kw):
        args = dict(hidden=inputs["hidden"], weight=inputs["weight"][lo:hi], targets=inputs["targets"])
        args.update(kw)
        return linear_logprobs(**args, process_group=group, backend="cpu").logp

    last = world - 1
    if rank == last:  # a local validation error (a weight of another dtype)
        _expect(lambda: call(weight=inputs["weight"][lo:hi].float()), TypeError, "weight", "bad weight")
    else:
        _expect(call, RuntimeError, f"rank(s) [{last}]", f"rank {rank} sees rank {last} fail")
    rows = 5 if rank == 1 else 6
    _expect(
        lambda: call(hidden=inputs["hidden"][:rows], targets=inputs["targets"][:rows]),
        ValueError,
        "hidden.shape[0]: differs between rank 0 (6) and rank 1 (5)",
        f"rank {rank} rows",
    )
    scale = 2.0 if rank == 1 else 1.0
    _expect(lambda: call(logit_scale=scale), ValueError, "differ between rank 0 and rank 1", f"rank {rank} options")
    precision = "bf16" if rank == 1 else "fp32"
    _expect(
        lambda: call(logits_precision=precision),
        ValueError,
        "differ between rank 0 and rank 1",
        f"rank {rank} precision",
    )
    # The bf16 logits of each shard's columns are the unsharded op's.
    want = linear_logprobs(
        inputs["hidden"], inputs["weight"], inputs["targets"], logits_precision="bf16", backend="cpu"
    ).logp
    torch.testing.assert_close(call(logits_precision="bf16"), want, rtol=1e-12, atol=1e-12)
    want = linear_logprobs(inputs["hidden"], inputs["weight"], inputs["targets"], backend="cpu").logp
    torch.testing.assert_close(call(), want, rtol=1e-12, atol=1e-12)


# opcheck's test_aot_dispatch_dynamic traces the backward, whose all-reduce is eager only.
_OPCHECK_EAGER = ("test_schema", "test_autograd_registration", "test_faketensor")


def vocab_parallel_opcheck_worker(rank: int, world: int, port: int, cases) -> None:
    """One rank of tests/logprobs/test_library.py's check of
    ``rlvr_kernels::linear_logprobs_vocab_parallel``: ``cases`` are inputs of
    ``rlvr_kernels::linear_logprobs``; this rank takes its shard of the weight and bias, the
    op passes opcheck and its forward and gradients equal the unsharded op's."""
    import importlib

    ops = importlib.import_module("rlvr_kernels.ops.logprobs")
    with gloo_process(rank, world, port) as group:
        for case in cases:
            full = ops._LinearArgs(*case)
            vocab = full.weight.shape[0]
            lo, hi = rank * vocab // world, (rank + 1) * vocab // world
            mine = full._replace(
                hidden=full.hidden.detach().clone().requires_grad_(True),
                weight=full.weight.detach()[lo:hi].clone().requires_grad_(True),
                bias=full.bias.detach()[lo:hi].clone().requires_grad_(True),
            )
            args = (*mine, group.group_name, lo, vocab)
            torch.library.opcheck(ops._linear_logprobs_vocab_parallel, args, test_utils=_OPCHECK_EAGER)
            want, got = ops._linear_logprobs(*full), ops._linear_logprobs_vocab_parallel(*args)
            for name, a, b in zip(("logp", "entropy", "lse", "log_sum_sq", "mean_logits", "is_top1"), got, want):
                torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=lambda m: f"rank {rank} {name}: {m}")
            up = torch.randn(want[0].shape, generator=torch.Generator().manual_seed(8))
            want_grads = torch.autograd.grad(
                (want[0] * up).sum() + want[1].sum(), (full.hidden, full.weight, full.bias)
            )
            got_grads = torch.autograd.grad((got[0] * up).sum() + got[1].sum(), (mine.hidden, mine.weight, mine.bias))
            want_grads = (want_grads[0], want_grads[1][lo:hi], want_grads[2][lo:hi])
            for name, a, b in zip(("hidden", "weight", "bias"), got_grads, want_grads):
                torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=lambda m: f"rank {rank} grad.{name}: {m}")
