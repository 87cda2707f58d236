"""Workers of tests/policy_loss/test_cp.py: ``policy_loss(cp_group=...)`` on gloo CPU processes,
each rank holding a slice of every sequence, against one process holding the whole sequences.
(Here, not in the test file: a spawned process unpickles the worker by module name.)"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from rlvr_kernels import RolloutCorrection
from rlvr_kernels.testing.dist import gloo_process
from rlvr_kernels.testing.policy_loss import random_policy_case

from .policy_loss_dist import _expect

_KEYS = ("logprobs", "old_logprobs", "ref_logprobs", "rollout_logprobs", "entropy", "mask")
_METRICS_EXACT = ("num_tokens", "num_seqs")


def _case(layout: str, dtype: torch.dtype, seed: int, token_adv: bool) -> Dict:
    gen = torch.Generator().manual_seed(seed)  # every rank builds the same full batch
    inputs = random_policy_case(gen, B=7, L=12, layout=layout, dtype=dtype, masked_rows=1, token_adv=token_adv)
    inputs["advantages"] = inputs["advantages"].to(dtype)
    return inputs


def _split(inputs: Dict, world: int, seed: int) -> List[Tuple[Dict, torch.Tensor]]:
    """Each rank's slice of every sequence, cut at random points (the same on every rank):
    (local inputs, the flat indices of its tokens in the full batch). Padded: a column range
    per rank (with 4 ranks, rank 1's is empty: a [B, 0] slice); packed: a range per sequence,
    so some rank holds no token of some sequence."""
    gen = torch.Generator().manual_seed(1000 + seed)
    token_adv = inputs["advantages"].shape == inputs["logprobs"].shape
    out = []
    if "cu_seqlens" not in inputs:
        B, L = inputs["logprobs"].shape
        cuts = sorted(torch.randint(0, L + 1, (world - 1,), generator=gen).tolist())
        if world == 4:
            cuts[1] = cuts[0]
        cuts = [0, *cuts, L]
        cols = torch.arange(B * L).view(B, L)
        for r in range(world):
            a, b = cuts[r], cuts[r + 1]
            local = {k: inputs[k][:, a:b] for k in _KEYS}
            local["advantages"] = inputs["advantages"][:, a:b] if token_adv else inputs["advantages"]
            out.append((local, cols[:, a:b].reshape(-1)))
        return out
    cu = inputs["cu_seqlens"].tolist()
    B = len(cu) - 1
    per_seq = []
    for i in range(B):
        n = cu[i + 1] - cu[i]
        cuts = sorted(torch.randint(0, n + 1, (world - 1,), generator=gen).tolist())
        per_seq.append([0, *cuts, n])
    for r in range(world):
        idx = [torch.arange(cu[i] + c[r], cu[i] + c[r + 1]) for i, c in enumerate(per_seq)]
        lens = torch.tensor([len(t) for t in idx], dtype=torch.int64)
        flat = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)
        local = {k: inputs[k][flat] for k in _KEYS}
        local["advantages"] = inputs["advantages"][flat] if token_adv else inputs["advantages"]
        if not token_adv and len(flat) == B:  # ([T] with T == B reads as token-level: give it so)
            local["advantages"] = inputs["advantages"][torch.repeat_interleave(torch.arange(B), lens)]
        local["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)])
        out.append((local, flat))
    return out


def _run(inputs: Dict, options: Dict, **kw):
    """(loss, d loss / d logprobs, d loss / d entropy, metrics) of one call on fresh leaves."""
    from rlvr_kernels import policy_loss

    args = dict(inputs)
    lp = args.pop("logprobs").detach().clone().requires_grad_(True)
    ent = args.pop("entropy").detach().clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, entropy=ent, **args, **options, **kw)
    loss.sum().backward()  # (agg="none": the sum of the per-token losses)
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (lp, ent)]
    return loss.detach(), grads[0], grads[1], metrics


def _close(a, b, dtype, what: str) -> None:
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{what}: {m}")


def cp_options(backend: str) -> List[Dict]:
    """The loss configurations each (backend, layout, dtype) runs: every loss type with a
    sequence-level term, the three aggregations, the KL and entropy terms, sequence IS weights,
    the rejection chain's seq_mean and token options, the sequence-level gate and the token IS
    batch normalisation (interpreted Triton: a subset, each option once)."""
    seq_is = RolloutCorrection(is_level="sequence", is_threshold=2.0)
    rs = RolloutCorrection(is_level="sequence", rs="token_k2,seq_mean_k1", rs_threshold="0.5,0.8_1.25")
    gate = RolloutCorrection.from_openrlhf("seq", "mask", "tv", (0.1,))
    norm = RolloutCorrection(is_level="token", is_batch_normalize=True)
    cases = [
        dict(loss_type="ppo", agg="token-mean", kl="k3", kl_coef=0.1, entropy_coef=0.01),
        dict(loss_type="gspo", agg="seq-mean-token-mean", entropy_coef=0.01),
        dict(loss_type="geo_mean", agg="seq-mean-token-sum"),
        dict(loss_type="cispo", agg="seq-mean-token-mean", rollout_correction=seq_is),
        dict(loss_type="gspo", agg="token-mean", rollout_correction=rs),
        dict(loss_type="ppo", agg="seq-mean-token-mean", rollout_correction=gate),
        dict(
            loss_type="ppo",
            agg="seq-mean-token-sum-norm",
            loss_scale_factor=16.0,
            rollout_correction=norm,
            kl="k1",
            kl_coef=0.1,
        ),
    ]
    if backend != "triton":
        cases.append(dict(loss_type="gspo", agg="none", kl="k2", kl_coef=0.1))
    return [dict(preset="verl", backend=backend, **c) for c in cases]


def cp_equivalence_worker(rank: int, world: int, port: int, combos, dp: bool = False) -> None:
    """For each (backend, layout, dtype, token_adv) of ``combos`` and each ``cp_options``: this
    rank's slice with ``cp_group`` gives the one-process gradients of its tokens (logprobs and
    entropy), the ranks' losses sum to the one-process loss, and every rank's metrics are
    the one-process metrics. ``dp``: the ranks form 2 data-parallel replicas of a 2-rank
    context-parallel group (each replica a different batch); the DP average of the CP-summed
    gradients and losses is the one process on both batches."""
    import torch.distributed as dist

    with gloo_process(rank, world, port):
        if dp:  # ranks {0, 1} and {2, 3} are CP groups; {0, 2} and {1, 3} DP groups
            cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            cp, pg, cp_world, cp_rank, replica = cp_groups[rank // 2], dp_groups[rank % 2], 2, rank % 2, rank // 2
        else:
            cp, pg, cp_world, cp_rank, replica = dist.group.WORLD, None, world, rank, 0
        for seed, (backend, layout, dtype, token_adv) in enumerate(combos):
            for j, opts in enumerate(cp_options(backend)):
                what = f"rank {rank}/{world} {backend} {layout} {dtype} token_adv={token_adv} {opts}"
                s = 100 * seed + j
                rc = opts.get("rollout_correction")
                # (the IS batch is each replica's call; agg="none" is refused with process_group)
                if dp and not (rc is not None and rc.is_batch_normalize) and opts["agg"] != "none":
                    _check_dp(rank, cp, pg, cp_rank, replica, layout, dtype, token_adv, opts, s, what)
                if dp:
                    continue
                inputs = _case(layout, dtype, s, token_adv)
                local, idx = _split(inputs, cp_world, s)[cp_rank]
                full_loss, full_g, full_ge, full_m = _run(inputs, opts)
                loss, g, ge, m = _run(local, opts, cp_group=cp)
                if opts["agg"] == "none":  # per-token losses: this rank's tokens' one-process losses
                    _close(loss.reshape(-1), full_loss.reshape(-1)[idx], dtype, what + " per-token loss")
                else:
                    total = loss.double().clone()
                    dist.all_reduce(total, group=cp)
                    _close(total.to(full_loss.dtype), full_loss, dtype, what + " loss (sum over ranks)")
                _close(g.reshape(-1), full_g.reshape(-1)[idx], dtype, what + " logprobs grad")
                _close(ge.reshape(-1), full_ge.reshape(-1)[idx], dtype, what + " entropy grad")
                for name in type(m)._fields:
                    a, b = getattr(m, name), getattr(full_m, name)
                    if name in _METRICS_EXACT:
                        assert float(a) == float(b), f"{what} {name}: {float(a)} != {float(b)}"
                    else:
                        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=lambda e: f"{what} {name}: {e}")


def _check_dp(rank, cp, pg, cp_rank, replica, layout, dtype, token_adv, opts, s, what) -> None:
    """DP × CP (padded): replica k holds batch k, sliced over its CP group; the one process
    holds both batches. DP convention: the mean over the replicas of the CP-summed losses is
    the one-process loss, and a rank's token gradients are dp_size × the one-process ones."""
    import torch.distributed as dist

    assert layout == "padded"
    batches = [_case(layout, dtype, s + 17 * k, token_adv) for k in (0, 1)]
    union = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    full_loss, full_g, full_ge, _ = _run(union, opts)
    local, idx = _split(batches[replica], 2, s)[cp_rank]
    loss, g, ge, m = _run(local, opts, cp_group=cp, process_group=pg)
    total = loss.double().clone()
    dist.all_reduce(total)  # Σ over both replicas and both CP ranks
    _close((total / 2).to(full_loss.dtype), full_loss, dtype, what + " DP x CP loss")
    offset = replica * batches[0]["logprobs"].numel()
    _close(g.reshape(-1), 2 * full_g.reshape(-1)[idx + offset], dtype, what + " DP x CP logprobs grad")
    _close(ge.reshape(-1), 2 * full_ge.reshape(-1)[idx + offset], dtype, what + " DP x CP entropy grad")
    own = _run(batches[replica], opts)[3]
    assert float(m.num_tokens) == float(own.num_tokens), what


def cp_errors_worker(rank: int, world: int, port: int) -> None:
    """What cp_group cannot reduce raises naming the option; a rank whose own checks fail
    still joins, so every rank raises instead of hanging; a different B raises on every rank."""
    from rlvr_kernels import TokenShaping

    with gloo_process(rank, world, port) as group:
        inputs = _case("padded", torch.float64, 5, False)
        local, _ = _split(inputs, world, 5)[rank]
        base = dict(preset="verl", backend="cpu", cp_group=group)
        _expect(
            lambda: _run(local, dict(base, shaping=TokenShaping(a3po_pos_high=(0.2, 0.5)))),
            NotImplementedError,
            "A3PO",
            f"rank {rank} a3po",
        )
        _expect(
            lambda: _run(local, dict(base, shaping=TokenShaping(entropy_quantile=0.5))),
            NotImplementedError,
            "entropy_threshold",
            f"rank {rank} entropy quantile",
        )
        _expect(
            lambda: _run(local, dict(base, loss_type="clip_cov")),
            NotImplementedError,
            "cov_selection",
            f"rank {rank} clip_cov",
        )
        _expect(
            lambda: _run(local, dict(base, agg="seq-mean-token-sum-norm")),
            ValueError,
            "loss_scale_factor",
            f"rank {rank} sum-norm",
        )
        if rank == 1:  # one rank alone passes options cp cannot reduce
            _expect(lambda: _run(local, dict(base, loss_type="kl_cov")), NotImplementedError, "kl_cov", "rank 1 kl_cov")
        else:
            _expect(lambda: _run(local, base), RuntimeError, "rank(s) [1]", f"rank {rank} sees rank 1 fail")
        short = {k: (v[:-1] if k != "advantages" else v[:-1]) for k, v in local.items()} if rank == 0 else local
        _expect(lambda: _run(short, base), ValueError, "the number of sequences B", f"rank {rank} B")
        _run(local, base)  # still in step
