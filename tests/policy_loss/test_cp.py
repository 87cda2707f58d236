"""Context-parallel ``policy_loss(cp_group=...)``: 2 and 4 CPU processes (gloo, 60 s collective
timeout so a hang fails), each holding a slice of every sequence cut at random points (some rank
holds no token of some sequence; with 4 ranks and the padded layout one rank's slice is empty),
against one process holding the whole sequences: the ranks' losses sum to the one-process loss,
each rank's logprobs and entropy gradients are the one-process gradients of its tokens, and the
metrics are the one-process metrics; for ppo / gspo / geo_mean / cispo, token-mean,
seq-mean-token-mean and seq-mean-token-sum, KL and entropy terms, sequence IS weights, the
rejection chain (token and seq_mean options), the IS batch normalisation, seq-mean-token-sum-norm
the sequence-level gate and agg="none" (per-token losses), on the reference, cpu and Triton
(interpreter) backends; DP × CP; and what cp_group cannot reduce raises."""

import pytest
import torch
import torch.multiprocessing as mp
from _workers.policy_loss_cp import cp_equivalence_worker, cp_errors_worker

import rlvr_kernels
from rlvr_kernels.testing.dist import free_port

F32, F64 = torch.float32, torch.float64


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_equals_one_process(world):
    if world == 2:
        combos = [
            ("cpu", "padded", F64, False),
            ("cpu", "packed", F32, True),
            ("reference", "packed", F64, False),
            ("reference", "padded", F32, True),
            ("triton", "packed", F32, False),
        ]
    else:  # (4 processes on a few cores: each layout once)
        combos = [("cpu", "packed", F64, False), ("cpu", "padded", F32, False)]
    mp.spawn(cp_equivalence_worker, args=(world, free_port(), combos), nprocs=world, join=True)


def test_data_and_context_parallel_equal_one_process():
    combos = [("cpu", "padded", F64, False), ("reference", "padded", F32, True)]
    mp.spawn(cp_equivalence_worker, args=(4, free_port(), combos, True), nprocs=4, join=True)


def test_what_cp_cannot_reduce_raises_on_every_rank():
    mp.spawn(cp_errors_worker, args=(2, free_port()), nprocs=2, join=True)


def test_cp_group_is_eager_only(monkeypatch):
    lp = torch.zeros(2, 3)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match="eager only"):
        rlvr_kernels.policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), cp_group=object())


# (interpreted Triton: the packed layout only, each call seconds)
@pytest.mark.parametrize("backend,layout", [("cpu", "padded"), ("cpu", "packed"), ("triton", "packed")])
def test_own_seq_stats_change_nothing(backend, layout):
    """The kernels given the call's own statistics (what a one-rank group passes) return the
    same sums and per-token derivatives as their own per-sequence pass."""
    from _workers.policy_loss_cp import _case, cp_options

    from rlvr_kernels.ops import policy_loss as op
    from rlvr_kernels.reference.policy_loss import seq_rejection, seq_statistics

    inputs = _case(layout, F64, 3, False)
    # (interpreted Triton: the sequence IS weight, GSPO with the rejection chain and the
    # sequence-level gate; the 2-rank test runs every option)
    for kw in cp_options(backend)[3:6] if backend == "triton" else cp_options(backend):
        kw = {k: v for k, v in kw.items() if k not in ("backend", "loss_scale_factor")}
        opts = op._resolve(kw.pop("preset"), None, **kw)
        x = op._validate(
            inputs["logprobs"],
            inputs["old_logprobs"],
            inputs["advantages"],
            inputs["mask"],
            inputs["ref_logprobs"],
            inputs["rollout_logprobs"],
            inputs["entropy"],
            inputs.get("cu_seqlens"),
            opts,
            True,
        )
        stats = seq_rejection(
            opts,
            seq_statistics(
                opts,
                x.logprobs,
                x.old_logprobs,
                x.advantages,
                x.mask,
                rollout_logprobs=x.rollout_logprobs,
                cu_seqlens=x.cu_seqlens,
            ),
        )
        want = op._run_fwd(x, opts, rlvr_kernels.contracts.policy_loss.TokenOut.NONE, True, backend)
        got = op._run_fwd(x, opts, rlvr_kernels.contracts.policy_loss.TokenOut.NONE, True, backend, stats)
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12, msg=lambda m: f"{kw}: {m}")
        for a, b in zip(got[1:3], want[1:3]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"{kw}: {m}")


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_kernel_checks_seq_stats(backend):
    from rlvr_kernels._core import dispatch as _dispatch
    from rlvr_kernels.contracts.policy_loss import NUM_SEQ_STATS
    from rlvr_kernels.ops import policy_loss as op

    lp = torch.zeros(2, 3, dtype=F64)
    mask = torch.ones(2, 3, dtype=torch.bool)

    fparams, iparams = op._packed_params(rlvr_kernels.PolicyLossOptions(), True, op.TokenOut.NONE)
    bad = torch.zeros(3, NUM_SEQ_STATS, dtype=F64)
    with pytest.raises(RuntimeError, match="seq_stats must be float64"):
        _dispatch.kernel("policy_loss_fwd", "cpu")(
            lp, lp, torch.zeros(2, dtype=F64), mask, None, None, None, None, None, fparams, iparams, False, None, bad
        )
    with pytest.raises(RuntimeError, match="seq_stats must be float64"):
        _dispatch.kernel("policy_loss_fwd", backend)(
            lp,
            lp,
            torch.zeros(2, dtype=F64),
            mask,
            None,
            None,
            None,
            None,
            None,
            fparams,
            iparams,
            False,
            None,
            bad[:2].float(),
        )
