"""Every fast backend against the fp64 reference on fresh random inputs (hypothesis), plus
determinism and layout/dtype coverage. Rule: |fast − ref64| ≤ 2·|torch_same_dtype − ref64| + atol."""

import pytest
import torch
from _backends import FAST, to
from hypothesis import given, settings
from hypothesis import strategies as st

import rlvr_kernels as rk
from rlvr_kernels.testing import as_float64, compare_advantages

ESTIMATOR_OPTIONS = [
    dict(estimator="grpo"),
    dict(estimator="grpo", preset="verl"),
    dict(estimator="grpo", preset="trl"),
    dict(estimator="grpo", preset="trl", scale="batch"),
    dict(estimator="grpo", preset="trl_async"),
    dict(estimator="grpo", std="population", eps_in_sqrt=True, eps=1e-4),
    dict(estimator="dr_grpo", singleton="raw"),
    dict(estimator="rloo"),
    dict(estimator="rloo", preset="verl"),
    dict(estimator="opo"),
    dict(estimator="gpg", preset="verl"),
    dict(estimator="passk", k=1),
    dict(estimator="passk", k=3),
    dict(estimator="reinforce_pp_baseline", preset="verl"),
    dict(estimator="reinforce_pp_baseline", whitening=rk.Whitening("samples", 1e-4, False)),
    dict(estimator="gdpo", preset="verl"),
    dict(estimator="gdpo", preset="trl"),
    dict(estimator="grpo", preset="openrlhf"),
    dict(estimator="reinforce_pp_baseline", preset="openrlhf"),
    dict(estimator="rloo", preset="openrlhf", whitening=rk.Whitening("samples", 1e-4, False, std="population")),
    dict(estimator="grpo", preset="slime"),
    dict(estimator="grpo", preset="areal"),
    dict(estimator="dr_grpo", preset="areal", whitening=rk.Whitening("samples", 1e-3, True, clamp=True)),
    dict(estimator="grpo", preset="nemo_rl"),
    dict(estimator="grpo", leave_one_out=True, std="population", eps_in_sqrt=True),
    dict(estimator="grpo", leave_one_out=True, scale="none", singleton="raw", batch_whiten=True),
    dict(estimator="grpo", preset="skyrl"),
    dict(estimator="grpo", preset="prime_rl"),
]


@st.composite
def advantage_inputs(draw, max_b):
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    opts = dict(draw(st.sampled_from(ESTIMATOR_OPTIONS)))
    B = draw(st.integers(1, max_b))
    grouping = draw(st.sampled_from(["shuffled", "contiguous"]))
    if grouping == "contiguous":
        G = draw(st.integers(1, 64))
        B = max(G, B - B % G)
        kw = dict(group_size=G)
        group_index = torch.arange(B) // G
    else:
        num_groups = draw(st.integers(1, B + 3))  # some groups may stay empty
        group_index = torch.randint(0, num_groups, (B,), generator=gen)
        kw = dict(group_index=group_index, num_groups=num_groups)
    reward = draw(st.sampled_from(["binary", "int", "normal", "constant"]))
    K = draw(st.sampled_from([1, 1, 3])) if opts["estimator"] == "gdpo" or draw(st.booleans()) else 1
    shape = (B, K) if K > 1 else (B,)
    if reward == "binary":
        scores = torch.randint(0, 2, shape, generator=gen).float()
    elif reward == "int":
        scores = torch.randint(-3, 4, shape, generator=gen).float()
    elif reward == "normal":
        scores = torch.randn(shape, generator=gen)
    else:  # every group's rewards equal: degenerate groups
        scores = torch.randint(0, 2, (int(group_index.max()) + 1,) + shape[1:], generator=gen).float()[group_index]
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
    kw["scores"] = scores.to(dtype)
    if K > 1 and draw(st.booleans()):
        kw["reward_weights"] = torch.rand(K, generator=gen) + 0.5
    if draw(st.booleans()):
        kw["sample_mask"] = torch.rand(B, generator=gen) > draw(st.sampled_from([0.1, 0.5, 1.0]))
    if opts.get("preset") in ("trl", "trl_async") and draw(st.booleans()):
        nan_rows = torch.rand(B, generator=gen) < 0.15
        kw["scores"] = kw["scores"].masked_fill(nan_rows[:, None] if K > 1 else nan_rows, float("nan"))
    layout = draw(st.sampled_from(["none", "padded", "packed", "packed_nomask"]))
    if opts["estimator"] == "opo" and layout == "none":
        layout = "padded"
    L = draw(st.integers(1, 40))
    lengths = torch.randint(0, L + 1, (B,), generator=gen)
    if layout == "padded":
        mask_dtype = draw(st.sampled_from([torch.float32, torch.bool, torch.uint8, torch.bfloat16]))
        kw["response_mask"] = (torch.arange(L)[None, :] < lengths[:, None]).to(mask_dtype)
    elif layout.startswith("packed"):
        cu = torch.zeros(B + 1, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
        cu[1:] = torch.cumsum(lengths, 0)
        kw["cu_seqlens"] = cu
        if layout == "packed":
            kw["response_mask"] = torch.rand(int(cu[-1]), generator=gen) > 0.2
    if draw(st.booleans()) and layout != "none":
        kw["lengths"] = lengths
    return kw, opts


def check_against_reference(backend, device, kw, opts, out_dtype=None):
    # fp64 scores: fp64 results, held to the fp64 reference (the kernels compute in fp64).
    out_dtype = out_dtype or (torch.float64 if kw["scores"].dtype == torch.float64 else torch.float32)
    ref64 = rk.group_advantages(**as_float64(kw), **opts, backend="reference", out_dtype=torch.float64)
    same = rk.group_advantages(**kw, **opts, backend="reference", out_dtype=kw["scores"].dtype)
    fast = rk.group_advantages(**to(kw, device), **opts, backend=backend, out_dtype=out_dtype)
    bad = [c for c in compare_advantages(fast, ref64, same, out_dtype) if not c.ok]
    assert not bad, f"{backend} {opts}: {bad}"


@pytest.mark.cpu_kernel
@given(advantage_inputs(max_b=3000))
@settings(max_examples=60)
def test_cpu_matches_reference(args):
    kw, opts = args
    check_against_reference("cpu", "cpu", kw, opts)


@given(advantage_inputs(max_b=300))
@settings(max_examples=30)
def test_triton_matches_reference(args):
    from _backends import DEVICE

    kw, opts = args
    check_against_reference("triton", DEVICE, kw, opts)


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize(
    "opts",
    [
        dict(estimator="grpo", preset="trl", scale="batch"),
        dict(estimator="gpg", preset="trl"),
        dict(estimator="reinforce_pp_baseline", preset="trl"),
        dict(
            estimator="reinforce_pp_baseline", whitening=rk.Whitening("samples", 1e-4, False), nan_policy="unscorable"
        ),
    ],
)
def test_unscorable_samples_stay_out_of_the_batch_moments(backend, device, opts):
    """A NaN score excluded as unscorable must not reach the batch-wide sums (batch σ, GPG's
    α, whitening): a weight of 0 times NaN is NaN (found by hypothesis on the Triton path)."""
    nan = float("nan")
    for scores in ([0.3643, nan, 0.1642], [nan, 1.0, 0.0, 2.0, nan, 0.5]):
        n = len(scores)
        kw = dict(scores=torch.tensor(scores), group_index=torch.arange(n) % 2, num_groups=2)
        check_against_reference(backend, device, kw, opts)


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_out_dtypes(backend, device, out_dtype):
    gen = torch.Generator().manual_seed(3)
    kw = dict(
        scores=torch.randn(97, generator=gen),
        group_index=torch.randint(0, 11, (97,), generator=gen),
        num_groups=11,
        response_mask=torch.rand(97, 13, generator=gen) > 0.3,
    )
    check_against_reference(backend, device, kw, dict(estimator="grpo"), out_dtype=out_dtype)


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize(
    "opts",
    [
        dict(estimator="grpo"),
        dict(estimator="grpo", scale="batch"),
        dict(estimator="rloo"),
        dict(estimator="reinforce_pp_baseline", preset="verl"),
        dict(estimator="gdpo", preset="trl"),
    ],
)
def test_fp64_scores_below_fp32_resolution(backend, device, opts):
    # Rewards 1e4 apart by ~1e-4: fp32 cannot resolve them (its spacing there is ~1e-3), so
    # only an fp64 computation meets the fp64 reference (for fp64 inputs "torch in the same
    # dtype" is the reference itself: the bound is the few-ulp atol).
    gen = torch.Generator().manual_seed(12)
    B = 203
    scores = 1e4 + 1e-4 * torch.randn(B, 2 if opts["estimator"] == "gdpo" else 1, generator=gen, dtype=torch.float64)
    kw = dict(
        scores=scores.squeeze(1) if scores.shape[1] == 1 else scores,
        group_index=torch.randint(0, 17, (B,), generator=gen),
        num_groups=17,
        response_mask=torch.rand(B, 11, generator=gen) > 0.3,
    )
    check_against_reference(backend, device, kw, opts)


@pytest.mark.parametrize("backend,device", FAST)
def test_non_contiguous_and_int32_inputs(backend, device):
    gen = torch.Generator().manual_seed(4)
    B, L = 61, 24
    scores = torch.randn(B, 2, generator=gen)[:, 1]  # strided
    mask = (torch.rand(L, B, generator=gen) > 0.4).float().t()  # transposed view
    gi = torch.randint(0, 9, (B,), generator=gen).to(torch.int32)
    kw = dict(
        scores=scores, group_index=gi, num_groups=9, response_mask=mask, sample_mask=torch.rand(B, generator=gen) > 0.2
    )
    check_against_reference(backend, device, kw, dict(estimator="reinforce_pp_baseline"))


@pytest.mark.cpu_kernel
def test_cpu_large_batch_many_groups():
    gen = torch.Generator().manual_seed(5)
    # several kChunk (4096) partial sums; the reference loops over groups in Python: keep its
    # O(B·G) work small
    B, G = 20_001, 1_000
    kw = dict(scores=torch.randn(B, generator=gen), group_index=torch.randint(0, G, (B,), generator=gen), num_groups=G)
    for opts in (dict(estimator="grpo", scale="batch"), dict(estimator="gpg"), dict(estimator="reinforce_pp_baseline")):
        check_against_reference("cpu", "cpu", kw, opts)


@pytest.mark.cpu_kernel
def test_cpu_bitwise_identical_across_thread_counts():
    gen = torch.Generator().manual_seed(6)
    B = 100_000
    kw = dict(
        scores=torch.randn(B, generator=gen),
        group_index=torch.randint(0, 5000, (B,), generator=gen),
        num_groups=5000,
        response_mask=torch.rand(B, 9, generator=gen) > 0.5,
    )
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, max(2, threads), 3):
            torch.set_num_threads(n)
            for opts in (
                dict(estimator="grpo", scale="batch"),
                dict(estimator="reinforce_pp_baseline"),
                dict(estimator="opo"),
            ):
                results.append((n, rk.group_advantages(**kw, **opts, backend="cpu")))
    finally:
        torch.set_num_threads(threads)
    per_opts = {}
    for i, (_, out) in enumerate(results):
        per_opts.setdefault(i % 3, []).append(out)
    for outs in per_opts.values():
        for other in outs[1:]:
            for a, b in zip(outs[0], other):
                assert torch.equal(a, b)


@pytest.mark.parametrize("backend,device", FAST)
def test_repeated_calls_bitwise_identical(backend, device):
    gen = torch.Generator().manual_seed(7)
    kw = to(
        dict(
            scores=torch.randn(300, generator=gen),
            group_index=torch.randint(0, 40, (300,), generator=gen),
            num_groups=40,
            response_mask=torch.rand(300, 17, generator=gen) > 0.5,
        ),
        device,
    )
    a = rk.group_advantages(**kw, estimator="gdpo", backend=backend)
    b = rk.group_advantages(**kw, estimator="gdpo", backend=backend)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("backend,device", FAST)
def test_unvalidated_bad_input_stays_in_bounds(backend, device):
    # validate=False with out-of-range group ids and disordered offsets: no crash, no
    # out-of-bounds access (the sanitizer run checks the C++ side), bad rows excluded.
    gi = torch.tensor([0, 5, -1, 1, 1])
    cu = torch.tensor([0, 4, 2, 9, 3, 1], dtype=torch.int64)
    out = rk.group_advantages(
        **to(
            dict(
                scores=torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]),
                group_index=gi,
                cu_seqlens=cu,
                response_mask=torch.ones(6),
            ),
            device,
        ),
        num_groups=2,
        validate=False,
        backend=backend,
    )
    assert out.advantages[1].item() == 0 and out.advantages[2].item() == 0
    assert not out.sample_keep[1] and not out.sample_keep[2]
    assert torch.isfinite(out.token_advantages).all()


@pytest.mark.parametrize("backend,device", FAST)
def test_gdpo_single_term_with_unscorable_rows(backend, device):
    # Regression: NaN rows of 1-D scores must stay out of gdpo's whitening and counts.
    scores = torch.tensor([1.0, float("nan"), 0.0, 1.0, 0.0, float("nan"), 1.0, 1.0])
    kw = dict(scores=scores, group_size=4, response_mask=torch.ones(8, 3))
    check_against_reference(backend, device, kw, dict(estimator="gdpo", preset="trl"))
    out = rk.group_advantages(**to(kw, device), estimator="gdpo", preset="trl", backend=backend)
    assert out.group_count.tolist() == [3, 3]


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "opo", "passk", "reinforce_pp_baseline", "gdpo"])
def test_group_size_equals_contiguous_group_index(backend, device, estimator):
    # The contiguous-groups fast path (no ids read) gives bitwise the same numbers.
    gen = torch.Generator().manual_seed(8)
    B, G = 96, 8
    kw = to(
        dict(
            scores=torch.randint(-1, 3, (B,), generator=gen).float(),
            response_mask=torch.rand(B, 5, generator=gen) > 0.3,
            sample_mask=torch.rand(B, generator=gen) > 0.2,
        ),
        device,
    )
    extra = dict(k=2) if estimator == "passk" else {}
    a = rk.group_advantages(**kw, group_size=G, estimator=estimator, backend=backend, **extra)
    b = rk.group_advantages(
        **kw,
        group_index=torch.arange(B, device=device) // G,
        num_groups=B // G,
        estimator=estimator,
        backend=backend,
        **extra,
    )
    for x, y in zip(a, b):
        assert torch.equal(x, y)
