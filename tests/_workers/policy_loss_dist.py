"""Workers of tests/policy_loss/test_distributed.py: ``policy_loss(process_group=...)`` and
``rlvr_kernels.distributed.global_counts`` on gloo CPU processes, against one process on the
full batch. (Here, not in the test file: a spawned process unpickles the worker by module name.)"""

from __future__ import annotations

import itertools
from typing import Dict, List, Tuple

import torch

from rlvr_kernels.testing.dist import gloo_process
from rlvr_kernels.testing.policy_loss import random_policy_case

AGGS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LOSS_TYPES = ("ppo", "gspo", "cispo")
_KEYS = ("logprobs", "old_logprobs", "ref_logprobs", "rollout_logprobs", "entropy", "mask")


def _bounds(B: int, world: int) -> List[int]:
    """Uneven sequence ranges per rank; with 4 ranks, rank 2 holds one sequence with no valid
    token (the case builds it so)."""
    if world == 2:
        return [0, 7, B]
    return [0, 4, 6, 7, B]


def _case(layout: str, dtype: torch.dtype, world: int, seed: int) -> Dict:
    gen = torch.Generator().manual_seed(seed)  # every rank builds the same full batch
    B = 11
    inputs = random_policy_case(gen, B=B, L=13, layout=layout, dtype=dtype, masked_rows=1)
    inputs["advantages"] = inputs["advantages"].to(dtype)
    if world == 4:  # rank 2's one sequence has no valid token
        if layout == "padded":
            inputs["mask"][6] = False
        else:
            cu = inputs["cu_seqlens"]
            inputs["mask"][cu[6] : cu[7]] = False
    return inputs


def _slice(inputs: Dict, lo: int, hi: int) -> Dict:
    """Sequences [lo, hi) of a case (padded rows, or packed spans with rebased offsets)."""
    out = {k: v for k, v in inputs.items() if k not in _KEYS + ("advantages", "cu_seqlens")}
    out["advantages"] = inputs["advantages"][lo:hi]
    if "cu_seqlens" not in inputs:
        out.update({k: inputs[k][lo:hi] for k in _KEYS})
        return out
    cu = inputs["cu_seqlens"]
    a, b = int(cu[lo]), int(cu[hi])
    out.update({k: inputs[k][a:b] for k in _KEYS})
    out["cu_seqlens"] = cu[lo : hi + 1] - cu[lo]
    return out


def _token_range(inputs: Dict, lo: int, hi: int) -> Tuple[slice, ...]:
    if "cu_seqlens" not in inputs:
        return (slice(lo, hi),)
    cu = inputs["cu_seqlens"]
    return (slice(int(cu[lo]), int(cu[hi])),)


def _run(inputs: Dict, options: Dict, **kw):
    """(loss, d loss / d logprobs, metrics) of one call on a fresh leaf."""
    from rlvr_kernels import policy_loss

    args = dict(inputs)
    lp = args.pop("logprobs").detach().clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, **args, **options, **kw)
    loss.backward()
    return loss.detach(), lp.grad if lp.grad is not None else torch.zeros_like(lp), metrics


def _close(a, b, dtype, what: str) -> None:
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{what}: {m}")


def dp_equivalence_worker(rank: int, world: int, port: int, combos: List[Tuple[str, str, torch.dtype]]) -> None:
    """Every aggregation mode × ppo/gspo/cispo × KL on/off, for each (backend, layout, dtype)
    of ``combos``:
    (1) the mean over ranks of the ranks' gradients (scattered into the full batch) and of
    their losses equals one process on the full batch; (2) micro-batches of the rank with the
    step's counts (``global_counts``) accumulate to the rank's whole-batch gradient and loss."""
    import torch.distributed as dist

    from rlvr_kernels.distributed import global_counts

    with gloo_process(rank, world, port):
        bounds = _bounds(11, world)
        lo, hi = bounds[rank], bounds[rank + 1]
        mid = (lo + hi) // 2
        for seed, (backend, layout, dtype) in enumerate(combos):
            inputs = _case(layout, dtype, world, seed)
            local = _slice(inputs, lo, hi)
            (tok,) = _token_range(inputs, lo, hi)
            for loss_type, kl, agg in itertools.product(LOSS_TYPES, (None, "k3"), AGGS):
                opts = dict(preset="verl", loss_type=loss_type, kl=kl, kl_coef=0.1, agg=agg, backend=backend)
                if layout == "packed" and agg == "seq-mean-token-sum-norm":
                    opts["loss_scale_factor"] = 64.0
                what = f"rank {rank}/{world} {backend} {layout} {dtype} {loss_type} kl={kl} {agg}"
                full_loss, full_grad, _ = _run(inputs, opts)
                loss, grad, _ = _run(local, opts, process_group=dist.group.WORLD)
                # (1) DDP's average: scatter into the full batch, sum over ranks, / world.
                both = torch.zeros((1 + full_grad.numel(),), dtype=full_grad.dtype)
                both[0] = loss
                both[1:].view_as(full_grad)[tok] = grad
                dist.all_reduce(both)
                both /= world
                _close(both[0], full_loss, dtype, what + " loss (mean over ranks)")
                _close(both[1:].view_as(full_grad), full_grad, dtype, what + " grad (mean over ranks)")
                # (2) Gradient accumulation: the step's counts over the rank's whole batch.
                n_tok, n_seq = global_counts(local["mask"], cu_seqlens=local.get("cu_seqlens"), process_group=None)
                g_tok, g_seq = global_counts(
                    local["mask"], cu_seqlens=local.get("cu_seqlens"), process_group=dist.group.WORLD
                )
                counts = dict(global_num_tokens=g_tok, global_num_seqs=g_seq)
                for extra in (dict(process_group=dist.group.WORLD), dict(dp_size=world)):
                    parts = [_run(_slice(inputs, a, b), opts, **counts, **extra) for a, b in ((lo, mid), (mid, hi))]
                    _close(parts[0][0] + parts[1][0], loss, dtype, what + f" micro-batch loss {list(extra)}")
                    _close(
                        torch.cat([parts[0][1], parts[1][1]]), grad, dtype, what + f" micro-batch grad {list(extra)}"
                    )
                # The counts are the kernel's: this process's without a group, the sum with one.
                m = _run(local, opts)[2]
                assert (int(n_tok), int(n_seq)) == (int(m.num_tokens), int(m.num_seqs)), what
                sums = torch.stack([m.num_tokens, m.num_seqs]).double()
                dist.all_reduce(sums)
                assert (int(g_tok), int(g_seq)) == (int(sums[0]), int(sums[1])), what


def _expect(fn, exc, text: str, what: str) -> None:
    try:
        fn()
    except exc as e:
        assert text in str(e), f"{what}: expected {text!r} in {e!r}"
        return
    raise AssertionError(f"{what}: no {exc.__name__} raised")


def dp_errors_worker(rank: int, world: int, port: int) -> None:
    """Inconsistent calls across ranks: every rank raises a clear error (no hang), and the
    ranks stay in step for the next call."""

    with gloo_process(rank, world, port) as pg:
        inputs = _case("padded", torch.float64, world, 123)
        bounds = _bounds(11, world)
        local = _slice(inputs, bounds[rank], bounds[rank + 1])
        base = dict(preset="verl", agg="token-mean", process_group=pg)

        def call(**kw):
            return _run(local, dict(base, **kw))

        # Different options on one rank.
        agg = "seq-mean-token-mean" if rank == 1 else "token-mean"
        _expect(lambda: call(agg=agg), ValueError, "differ between rank 0 and rank 1", f"rank {rank} options")
        # A rank whose own checks fail (dp_size conflicting with the group size) still joins.
        if rank == 1:
            _expect(lambda: call(dp_size=world + 1), ValueError, "conflicts with the process group", "rank 1 dp_size")
        else:
            _expect(lambda: call(), RuntimeError, "rank(s) [1]", f"rank {rank} sees rank 1 fail")
        # A wrong shape on one rank (a local validation error) likewise.
        if rank == world - 1:
            bad = dict(local, mask=local["mask"][:, :-1])
            _expect(lambda: _run(bad, base), ValueError, "mask", "bad mask")
        else:
            _expect(lambda: call(), RuntimeError, f"rank(s) [{world - 1}]", f"rank {rank} sees a bad shape")
        # Given global counts that differ across ranks, or are below the group's count.
        n = 1000 + rank
        _expect(lambda: call(global_num_tokens=n), ValueError, "global_num_tokens: differs", f"rank {rank} counts")
        _expect(lambda: call(global_num_tokens=1), ValueError, "is less than", f"rank {rank} small count")
        # The padded default loss_scale_factor (L) differs across ranks.
        short = dict(local, **{k: local[k][:, : 13 - rank] for k in _KEYS})
        _expect(
            lambda: _run(short, dict(base, agg="seq-mean-token-sum-norm")),
            ValueError,
            "loss_scale_factor: differs",
            f"rank {rank} L",
        )
        # agg="none" cannot be reduced by the op.
        _expect(lambda: call(agg="none"), ValueError, "agg='none'", f"rank {rank} none")
        # Still in step: a consistent call works on every rank.
        call()
