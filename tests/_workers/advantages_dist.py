"""Workers of tests/advantages/test_distributed.py: ``group_advantages(..., process_group=pg)``
on 2 and 4 CPU processes (gloo), groups split over the ranks, against one process on the
whole batch. Here (not in the test file) so that a spawned process can unpickle them."""

from __future__ import annotations

from typing import List

import torch

from rlvr_kernels import group_advantages
from rlvr_kernels.testing.dist import gloo_process

# (name, options, scores kind, layout). Exact kinds (dyadic values of bounded range) make the
# float64 group sums exact: the data-parallel result then equals one process bitwise.
CASES: List[tuple] = [
    ("grpo", dict(estimator="grpo"), "binary", "none"),
    ("grpo_dyadic_tokens", dict(estimator="grpo"), "dyadic", "padded"),
    ("grpo_population_sqrt", dict(estimator="grpo", std="population", eps_in_sqrt=True), "dyadic", "none"),
    ("grpo_raw_singletons", dict(estimator="grpo", singleton="raw"), "dyadic", "packed"),
    ("grpo_scale_none", dict(estimator="grpo", scale="none"), "dyadic", "none"),
    ("verl_preset", dict(preset="verl"), "binary", "padded"),
    ("trl_terms", dict(preset="trl", nan_policy="unscorable"), "terms", "none"),
    ("dr_grpo", dict(estimator="dr_grpo"), "dyadic", "none"),
    ("rloo", dict(estimator="rloo"), "binary", "none"),
    ("rloo_raw", dict(estimator="rloo", singleton="raw"), "dyadic", "none"),
    ("opo_lengths", dict(estimator="opo"), "dyadic", "lengths"),
    ("opo_padded", dict(estimator="opo"), "binary", "padded"),
    ("opo_packed", dict(estimator="opo"), "dyadic", "packed"),
    ("gpg", dict(estimator="gpg"), "dyadic", "none"),
    ("passk2", dict(estimator="passk", k=2), "binary", "none"),
    ("passk3", dict(estimator="passk", k=3), "dyadic", "padded"),
    # Inexact sums: equal to float64 rounding; scale="batch" always (Chan's formula).
    ("grpo_normal64", dict(estimator="grpo"), "normal", "none"),
    ("rloo_normal64", dict(estimator="rloo"), "normal", "padded"),
    ("grpo_batch", dict(estimator="grpo", scale="batch"), "dyadic", "none"),
    ("grpo_batch_normal", dict(estimator="grpo", scale="batch"), "normal", "none"),
]
EXACT = ("binary", "dyadic", "terms")


def _case(gen: torch.Generator, kind: str, layout: str, B: int, G: int) -> dict:
    """A global batch: shuffled group ids of uneven sizes (some groups empty, one singleton),
    a sample mask, NaN rewards for the TRL case; every rank builds the same one."""
    sizes = torch.randint(0, 7, (G,), generator=gen)
    sizes[1] = 1
    sizes[2] = 0
    ids = torch.repeat_interleave(torch.arange(G), sizes)
    ids = ids[torch.randperm(ids.numel(), generator=gen)][:B]
    B = ids.numel()
    if kind == "binary":
        scores = (torch.rand(B, generator=gen) < 0.5).float()
    elif kind == "dyadic":
        scores = torch.randint(-8, 9, (B,), generator=gen).float() / 4
    elif kind == "terms":
        scores = torch.randint(-4, 5, (B, 3), generator=gen).float() / 2
        scores[torch.rand(B, 3, generator=gen) < 0.1] = float("nan")
    else:
        scores = torch.randn(B, generator=gen, dtype=torch.float64) * 3 + 1
    c = dict(scores=scores, group_index=ids, num_groups=G, sample_mask=torch.rand(B, generator=gen) < 0.85)
    if kind == "terms":
        c["reward_weights"] = torch.tensor([1.0, 0.5, 0.25])
    if layout == "padded":
        c["response_mask"] = torch.rand(B, 9, generator=gen) < 0.7
    elif layout == "lengths":
        c["lengths"] = torch.randint(0, 20, (B,), generator=gen)
    elif layout == "packed":
        seq = torch.randint(0, 6, (B,), generator=gen)
        c["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.int64), seq.cumsum(0)])
        c["response_mask"] = torch.rand(int(seq.sum()), generator=gen) < 0.8
    return c


def _shard(c: dict, lo: int, hi: int) -> dict:
    """Rows [lo, hi) of a case (tokens of the packed layout re-based)."""
    s = {k: v[lo:hi] if torch.is_tensor(v) and k not in ("reward_weights", "cu_seqlens") else v for k, v in c.items()}
    if "cu_seqlens" in c:
        cu = c["cu_seqlens"]
        s["cu_seqlens"] = cu[lo : hi + 1] - cu[lo]
        s["response_mask"] = c["response_mask"][int(cu[lo]) : int(cu[hi])]
    return s


def _token_slice(c: dict, tok, lo: int, hi: int):
    if tok is None or "cu_seqlens" not in c:
        return None if tok is None else tok[lo:hi]
    cu = c["cu_seqlens"]
    return tok[int(cu[lo]) : int(cu[hi])]


def _bounds(gen: torch.Generator, B: int, world: int, i: int) -> List[int]:
    """Uneven contiguous shards; rank (i mod world) holds no sample."""
    cuts = sorted(torch.randint(0, B + 1, (world - 1,), generator=gen).tolist())
    b = [0] + cuts + [B]
    empty = i % world
    if empty == world - 1:
        b[empty] = B  # the previous rank takes the last rank's rows
    else:
        b[empty + 1] = b[empty]  # the next rank takes the empty rank's rows
    return b


def _same_everywhere(t: torch.Tensor, world: int) -> bool:
    import torch.distributed as dist

    bits = t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    out = [torch.empty_like(bits) for _ in range(world)]
    dist.all_gather(out, bits)
    return all(torch.equal(o, out[0]) for o in out)


def _check_cases(rank: int, world: int) -> None:
    import torch.distributed as dist

    group = dist.group.WORLD
    for i, (name, opts, kind, layout) in enumerate(CASES):
        for out_dtype in (torch.float32, torch.float64):
            gen = torch.Generator().manual_seed(1000 + i)  # every rank builds the same batch
            c = _case(gen, kind, layout, B=60, G=17)
            B = c["scores"].shape[0]
            bounds = _bounds(gen, B, world, i)
            lo, hi = bounds[rank], bounds[rank + 1]
            want = group_advantages(**c, **opts, out_dtype=out_dtype, backend="cpu")
            got = group_advantages(**_shard(c, lo, hi), **opts, out_dtype=out_dtype, process_group=group)
            where = f"rank {rank}/{world} case {name} {out_dtype}"
            for field in ("group_mean", "group_std", "group_count", "group_degenerate"):
                assert _same_everywhere(getattr(got, field), world), f"{where}: {field} differs between ranks"
            pairs = [
                ("advantages", got.advantages, want.advantages[lo:hi]),
                ("token_advantages", got.token_advantages, _token_slice(c, want.token_advantages, lo, hi)),
                ("sample_keep", got.sample_keep, want.sample_keep[lo:hi]),
                ("group_mean", got.group_mean, want.group_mean),
                ("group_std", got.group_std, want.group_std),
                ("group_count", got.group_count, want.group_count),
                ("group_degenerate", got.group_degenerate, want.group_degenerate),
            ]
            exact = kind in EXACT and "batch" not in name
            for field, a, b in pairs:
                if (a is None) != (b is None):
                    raise AssertionError(f"{where}: {field} present in one result only")
                if a is None:
                    continue
                if exact or a.dtype in (torch.bool, torch.int64):
                    assert torch.equal(a, b), f"{where}: {field} not bitwise equal:\n{a}\n{b}"
                else:
                    tol = dict(rtol=1e-12, atol=1e-12) if a.dtype == torch.float64 else {}
                    torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{where}: {field}: {m}")


def _check_backends(rank: int, world: int) -> None:
    """The reference rows (the spec of group_partials / group_apply) and the Triton kernels
    (interpreted on CPU tensors) through the same data-parallel path: statistics equal on
    every rank, results equal to one process to float64 rounding."""
    import torch.distributed as dist

    from rlvr_kernels._core.dispatch import triton_interpreted

    backends = ["reference"] + (["triton"] if triton_interpreted() else [])
    names = ("grpo_dyadic_tokens", "opo_packed", "gpg", "passk3", "grpo_batch_normal")
    for backend in backends:
        for i, (name, opts, kind, layout) in enumerate(CASES):
            if name not in names:
                continue
            gen = torch.Generator().manual_seed(1000 + i)
            c = _case(gen, kind, layout, B=40, G=11)
            bounds = _bounds(gen, c["scores"].shape[0], world, i)
            lo, hi = bounds[rank], bounds[rank + 1]
            want = group_advantages(**c, **opts, out_dtype=torch.float64, backend="cpu")
            got = group_advantages(
                **_shard(c, lo, hi), **opts, out_dtype=torch.float64, backend=backend, process_group=dist.group.WORLD
            )
            where = f"rank {rank}/{world} {backend} case {name}"
            for field in ("group_mean", "group_std", "group_count", "group_degenerate"):
                assert _same_everywhere(getattr(got, field), world), f"{where}: {field} differs between ranks"
                torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got.advantages, want.advantages[lo:hi], rtol=1e-12, atol=1e-12)
            tok = _token_slice(c, want.token_advantages, lo, hi)
            if tok is not None:
                torch.testing.assert_close(got.token_advantages, tok, rtol=1e-12, atol=1e-12)
            assert torch.equal(got.sample_keep, want.sample_keep[lo:hi]), where


def _expect_error(kind, match: str, fn) -> None:
    try:
        fn()
    except kind as exc:
        assert match in str(exc), f"expected {match!r} in {exc!r}"
        return
    raise AssertionError(f"expected {kind.__name__} ({match!r}), nothing raised")


def _check_errors(rank: int, world: int) -> None:
    import torch.distributed as dist

    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(5)
    c = _case(gen, "binary", "none", B=40, G=30)
    lo, hi = rank * 10, rank * 10 + 10
    mine = _shard(c, lo, hi)
    last = world - 1
    run = lambda **kw: group_advantages(**{**mine, **kw}, process_group=group)  # noqa: E731
    # A rank with another global group count: every rank gets the same clear error.
    _expect_error(ValueError, "num_groups: differs between rank 0", lambda: run(num_groups=31 if rank == last else 30))
    # Other options on one rank.
    _expect_error(ValueError, "estimator options", lambda: run(eps=1e-3 if rank == 1 else 1e-6))
    # One rank's own bad input: its own error there, a pointer to it everywhere else.
    bad_ids = mine["group_index"].clone()
    bad_ids[0] = 99
    if rank == 0:
        _expect_error(ValueError, "group_index: expected ids", lambda: run(group_index=bad_ids))
    else:
        _expect_error(RuntimeError, "rank(s) [0]", lambda: run())
    if rank == 1:
        _expect_error(ValueError, "group_index", lambda: run(group_index=mine["group_index"][:-1]))
    else:
        _expect_error(RuntimeError, "rank(s) [1]", lambda: run())
    if rank == last:
        _expect_error(ValueError, "num_groups: required", lambda: run(num_groups=None))
    else:
        _expect_error(RuntimeError, f"rank(s) [{last}]", lambda: run())
    for est in ("gdpo", "reinforce_pp_baseline"):
        _expect_error(NotImplementedError, f"estimator={est!r}", lambda: run(estimator=est))
    # The group is still in step after the errors.
    got = run()
    assert _same_everywhere(got.group_std, world)


def advantages_dist_worker(rank: int, world: int, port: int) -> None:
    """One rank of tests/advantages/test_distributed.py (gloo, bounded collective timeout)."""

    with gloo_process(rank, world, port):
        _check_cases(rank, world)
        _check_backends(rank, world)
        _check_errors(rank, world)
