"""The fast backends (C++, Triton) against the fp64 reference: loss, metrics and
gradients with random per-token upstream gradients, every option, fp32/bf16/fp16,
ragged, packed, empty sequences; plus determinism, batch and micro-batch invariance."""

import zlib

import pytest
import torch
from _backends import FAST, INTERPRETED
from hypothesis import example, given
from hypothesis import strategies as st

import rlvr_kernels as rk
from rlvr_kernels import TokenShaping
from rlvr_kernels.testing import random_policy_case, run_policy_loss
from rlvr_kernels.testing.policy_loss import assert_matches_reference, check_cases

CASES = check_cases()


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_check_cases(backend, device, case):
    _, case_kw, opts = case
    gen = torch.Generator().manual_seed(zlib.crc32(case[0].encode()))  # str hash() varies per process
    inputs = random_policy_case(gen, B=11, L=47, device=device, **case_kw)
    assert_matches_reference(inputs, opts, backend, gen)


SHAPINGS = st.builds(
    TokenShaping,
    w_pos=st.sampled_from([1.0, 0.1]),
    w_neg=st.sampled_from([1.0, 0.7]),
    probability=st.sampled_from([0.0, 0.3, 1.0]),
    a3po_metric=st.sampled_from(["prob", "entropy"]),
    a3po_pos_high=st.sampled_from([(0.0, 1.0), (0.2, 2.0)]),
    a3po_pos_low=st.sampled_from([(0.0, 1.0), (0.1, 0.5)]),
    a3po_neg_high=st.sampled_from([(0.0, 1.0), (0.3, 0.25)]),
    a3po_neg_low=st.sampled_from([(0.0, 1.0), (0.05, 3.0)]),
    entropy_quantile=st.sampled_from([None, 0.2, 1.0]),
)
OPTIONS = st.fixed_dictionaries(
    {
        "loss_type": st.sampled_from(
            ["ppo", "gspo", "cispo", "sapo", "reinforce", "dppo_tv", "dppo_kl", "geo_mean", "dro"]
        ),
        "clip_low": st.sampled_from([0.2, 0.1]),
        "clip_high": st.sampled_from([0.2, 0.28]),
        "kl": st.sampled_from([None, "k1", "k2", "k3", "k3+"]),
        "rollout_correction": st.sampled_from([None, "token_tis", "seq_tis", "token_mis", "seq_mis", "decoupled"]),
        "agg": st.sampled_from(
            ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "none"]
        ),
        "shaping": SHAPINGS,
        "entropy_coef": st.sampled_from([0.0, 0.01]),
        "preset": st.sampled_from([None, "verl", "trl"]),
    }
)


# A loss of −0.07 summed from 110 bf16-derived terms whose absolute values sum to 79: the
# kernel's sum order differs from the reference's by 0.25 ulp of that magnitude, far
# above the result's own ulps (the reduction allowance of the tolerance rule).
@example(
    opts={
        "agg": "token-sum",
        "clip_high": 0.2,
        "clip_low": 0.2,
        "loss_type": "reinforce",
        "kl": "k3",
        "rollout_correction": "seq_tis",
        "entropy_coef": 0.01,
        "preset": "trl",
        "shaping": TokenShaping(
            w_pos=1.0,
            w_neg=0.7,
            probability=0.3,
            a3po_metric="entropy",
            a3po_pos_high=(0.2, 2.0),
            a3po_pos_low=(0.0, 1.0),
            a3po_neg_high=(0.3, 0.25),
            a3po_neg_low=(0.05, 3.0),
            entropy_quantile=1.0,
        ),
    },
    layout="padded",
    dtype=torch.bfloat16,
    B=7,
    L=27,
    token_adv=True,
    seed=832,
)
@pytest.mark.parametrize("backend,device", FAST)
@given(
    opts=OPTIONS,
    layout=st.sampled_from(["padded", "packed"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    B=st.integers(0, 9),
    L=st.integers(1, 40),
    token_adv=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_options(backend, device, opts, layout, dtype, B, L, token_adv, seed):
    if backend == "triton" and INTERPRETED and seed % 4:
        return  # a quarter of the examples under the interpreter (seconds per call)
    opts = {k: v for k, v in opts.items() if v is not None}
    if opts.get("kl"):
        opts["kl_coef"] = 0.1
    if opts["loss_type"] == "dro":
        opts["dro_beta"] = 0.5
    # (geo_mean takes sequence-level corrections only)
    if opts["loss_type"] == "geo_mean" and opts.get("rollout_correction") in ("token_tis", "token_mis", "decoupled"):
        opts.pop("rollout_correction")
    # (the verl preset's c = 3.0 is dppo's truncation cap too)
    if opts.get("preset") == "verl" and opts.get("loss_type") not in (None, "ppo", "dppo_tv", "dppo_kl"):
        opts.pop("preset")
    if layout == "packed" and opts["agg"] == "seq-mean-token-sum-norm":
        opts["loss_scale_factor"] = 33.0
    gen = torch.Generator().manual_seed(seed)
    inputs = random_policy_case(gen, B=B, L=L, layout=layout, dtype=dtype, token_adv=token_adv, device=device)
    assert_matches_reference(inputs, opts, backend, gen)


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_other_dtypes(backend, device, dtype):
    gen = torch.Generator().manual_seed(3)
    inputs = random_policy_case(gen, B=7, L=33, dtype=dtype, device=device)
    assert_matches_reference(
        inputs, dict(preset="verl", kl="k3", kl_coef=0.1, rollout_correction="token_tis"), backend, gen
    )


@pytest.mark.parametrize("backend,device", FAST)
def test_long_rows_and_many_sequences(backend, device):
    # Rows longer than any block size, and an odd B.
    gen = torch.Generator().manual_seed(4)
    for B, L in ((3, 4099), (33 if INTERPRETED else 129, 7)):
        inputs = random_policy_case(gen, B=B, L=L, device=device)
        for opts in (
            dict(preset="verl", kl="k3", kl_coef=0.1, rollout_correction="token_tis"),
            dict(loss_type="gspo", agg="seq-mean-token-mean", rollout_correction="seq_tis"),
            dict(shaping=TokenShaping(a3po_pos_high=(0.2, 2.0), a3po_neg_low=(0.1, 0.5)), agg="none"),
        ):
            assert_matches_reference(inputs, opts, backend, gen)


@pytest.mark.parametrize("backend,device", FAST)
def test_non_contiguous_inputs(backend, device):
    gen = torch.Generator().manual_seed(5)
    inputs = random_policy_case(gen, B=6, L=40, device=device)
    nc = {k: (v.t().contiguous().t() if isinstance(v, torch.Tensor) and v.dim() == 2 else v) for k, v in inputs.items()}
    assert not nc["logprobs"].is_contiguous()
    opts = dict(kl="k3", kl_coef=0.1, rollout_correction="token_tis", agg="seq-mean-token-mean")
    a = run_policy_loss(inputs, opts, backend)
    b = run_policy_loss(nc, opts, backend)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("backend,device", FAST)
def test_packed_equals_padded(backend, device):
    gen = torch.Generator().manual_seed(6)
    pad = random_policy_case(gen, B=9, L=30, device=device)
    m = pad["mask"]
    lengths = m.sum(1)
    cu = torch.zeros(10, dtype=torch.int64, device=device)
    cu[1:] = lengths.cumsum(0)
    packed = {k: (v[m] if isinstance(v, torch.Tensor) and v.dim() == 2 else v) for k, v in pad.items()}
    packed["cu_seqlens"] = cu
    packed.pop("mask")
    opts = dict(loss_type="gspo", kl="k3", kl_coef=0.1, rollout_correction="seq_tis", agg="seq-mean-token-mean")
    a = run_policy_loss(pad, opts, backend)
    b = run_policy_loss(packed, opts, backend)
    torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a["grad.logprobs"][m], b["grad.logprobs"], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("backend,device", FAST)
def test_deterministic_and_batch_invariant(backend, device):
    gen = torch.Generator().manual_seed(7)
    inputs = random_policy_case(gen, B=12, L=50, device=device)
    opts = dict(
        preset="verl",
        kl="k3",
        kl_coef=0.1,
        rollout_correction="seq_tis",
        agg="none",
        shaping=TokenShaping(probability=0.5, a3po_pos_high=(0.2, 2.0)),
    )
    up = torch.randn(inputs["logprobs"].shape, generator=gen).to(device)
    a = run_policy_loss(inputs, opts, backend, up)
    b = run_policy_loss(inputs, opts, backend, up)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # Rows 3..7 alone give bitwise the same per-token losses and gradients.
    sub = {k: (v[3:8] if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    c = run_policy_loss(sub, opts, backend, up[3:8])
    assert torch.equal(c["loss"], a["loss"][3:8])
    assert torch.equal(c["grad.logprobs"], a["grad.logprobs"][3:8])


@pytest.mark.cpu_kernel
def test_cpu_thread_count_does_not_change_results():
    gen = torch.Generator().manual_seed(8)
    inputs = random_policy_case(gen, B=64, L=300)
    opts = dict(preset="verl", kl="k3", kl_coef=0.1, rollout_correction="token_tis", agg="seq-mean-token-mean")
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = run_policy_loss(inputs, opts, "cpu")
        torch.set_num_threads(max(2, n))
        b = run_policy_loss(inputs, opts, "cpu")
    finally:
        torch.set_num_threads(n)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("backend,device", [pytest.param("reference", "cpu", id="reference")] + FAST)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batches_with_global_counts_sum_to_full_batch(backend, device, agg):
    gen = torch.Generator().manual_seed(9)
    inputs = random_policy_case(gen, B=10, L=20, device=device, masked_rows=2)
    opts = dict(preset="verl", kl="k3", kl_coef=0.1, agg=agg)
    full = run_policy_loss(inputs, opts, backend)
    m = inputs["mask"]
    counts = dict(global_num_tokens=m.sum(), global_num_seqs=(m.sum(1) > 0).sum())
    grads, total = [], 0.0
    for lo, hi in ((0, 3), (3, 4), (4, 10)):
        part = {k: (v[lo:hi] if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        out = run_policy_loss(part, dict(opts, **counts), backend)
        grads.append(out["grad.logprobs"])
        total = total + out["loss"]
    torch.testing.assert_close(total, full["loss"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.cat(grads), full["grad.logprobs"], rtol=1e-5, atol=1e-9)
    # Data parallel: 2 ranks, dp_size = 2; the average of their gradients is the full one.
    rank_grads = []
    for lo, hi in ((0, 5), (5, 10)):
        part = {k: (v[lo:hi] if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        rank_grads.append(run_policy_loss(part, dict(opts, dp_size=2, **counts), backend)["grad.logprobs"] / 2)
    torch.testing.assert_close(torch.cat(rank_grads), full["grad.logprobs"], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("backend,device", FAST)
def test_shape_token_advantages_matches_reference(backend, device):
    gen = torch.Generator().manual_seed(10)
    for layout in ("padded", "packed"):
        inputs = random_policy_case(gen, B=9, L=37, layout=layout, device=device)
        sh = TokenShaping(
            w_pos=0.5,
            probability=0.7,
            a3po_metric="entropy",
            a3po_pos_high=(0.2, 2.0),
            a3po_neg_low=(0.3, 0.5),
            entropy_quantile=0.5,
        )
        kw = dict(entropy=inputs["entropy"], cu_seqlens=inputs.get("cu_seqlens"))
        ref = rk.shape_token_advantages(
            inputs["advantages"].double(),
            inputs["old_logprobs"].double(),
            inputs["mask"],
            sh,
            backend="reference",
            **kw,
        )
        fast = rk.shape_token_advantages(
            inputs["advantages"], inputs["old_logprobs"], inputs["mask"], sh, backend=backend, **kw
        )
        assert fast.dtype == torch.float32
        torch.testing.assert_close(fast.double().cpu(), ref.cpu(), rtol=1e-5, atol=1e-6)


# RolloutCorrection beyond the shorthands (every backend fuses it): the rejection chain's
# token and sequence options, IcePop, mask, the batch normalisation and log_ratio="current",
# one case per family, odd sizes.
RC = rk.RolloutCorrection
RC_CASES = [
    (
        "rs token+seq, token_tis, norm",
        dict(
            rollout_correction=RC(
                "token", 2.0, rs="token_k1,seq_sum_k2", rs_threshold="0.6_1.6,0.5", is_batch_normalize=True
            )
        ),
    ),
    (
        "seq icepop, norm, rs seq_max_k3, seq-mean",
        dict(
            agg="seq-mean-token-mean",
            rollout_correction=RC(
                "sequence", 3.0, 0.4, "icepop", rs="seq_max_k3", rs_threshold=0.1, is_batch_normalize=True
            ),
        ),
    ),
    (
        "gspo, token icepop, current, norm",
        dict(
            loss_type="gspo",
            kl="k3",
            kl_coef=0.1,
            rollout_correction=RC("token", 1.5, 0.7, "icepop", is_batch_normalize=True, log_ratio="current"),
        ),
    ),
    (
        "geo_mean, rejection only (geo_mean bounds), seq_mis",
        dict(
            loss_type="geo_mean",
            agg="seq-mean-token-sum",
            rollout_correction=RC("sequence", 4.0, 0.25, "mask", geo_mean=(0.8, 1.25)),
        ),
    ),
    (
        "rs token_k3 + seq_mean_k2, current",
        dict(
            agg="seq-mean-token-mean",
            rollout_correction=RC(rs="token_k3,seq_mean_k2", rs_threshold="0.08,0.05", log_ratio="current"),
        ),
    ),
]


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("case", RC_CASES, ids=[c[0] for c in RC_CASES])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_rollout_correction_matches_reference(backend, device, case, layout):
    gen = torch.Generator().manual_seed(zlib.crc32(case[0].encode()))
    inputs = random_policy_case(gen, B=7, L=13, layout=layout, device=device)
    fast = assert_matches_reference(inputs, case[1], backend, gen)
    # (the cases reject part of the batch, not all of it)
    assert 0.0 < float(fast["metric.rs_masked_frac"]) < 1.0 or "rs" not in case[0]


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("what", ["all_rejected", "all_masked"])
def test_rollout_correction_without_kept_tokens_gives_zeros(backend, device, what):
    gen = torch.Generator().manual_seed(31)
    inputs = random_policy_case(gen, B=5, L=11, device=device)
    if what == "all_masked":
        inputs["mask"] = torch.zeros_like(inputs["mask"])
    rc = RC("sequence", 2.0, 0.5, "icepop", rs="token_k2,seq_max_k2", rs_threshold="1e-12,0.3", is_batch_normalize=True)
    for agg in ("token-mean", "seq-mean-token-mean"):
        out = assert_matches_reference(inputs, dict(agg=agg, kl="k3", kl_coef=0.1, rollout_correction=rc), backend, gen)
        assert all(bool(torch.isfinite(v).all()) for v in out.values())
        assert float(out["loss"]) == 0.0 and float(out["grad.logprobs"].abs().sum()) == 0.0
        assert float(out["metric.num_tokens"]) == 0.0
        assert float(out["metric.rs_masked_frac"]) == (1.0 if what == "all_rejected" else 0.0)
