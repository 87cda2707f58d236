"""The raw ``group_advantages`` kernels (C++ ``torch.ops.rlvr_kernels_C.group_advantages`` and the
Triton launcher) called directly, without the public function's validation:

- contract: small valid cases of every plan (baseline × scale × whitening), every layout,
  fp32 and fp64 scores, int32/int64 ids, shuffled, sorted and contiguous groups, against the
  fp64 reference (tolerance rule of ``rlvr_kernels.testing``);
- shapes: the registered op is reachable by anyone (and by compiled graphs), so every
  inconsistent shape is an error, never an out-of-bounds access (``make sanitize`` re-runs
  the C++ tests under ASan/UBSan);
- values: garbage ids, offsets and scores stay in bounds; bad rows are excluded and
  non-monotone ``cu_seqlens`` follow the one sanitising rule (disjoint spans);
- determinism: the same bits for any thread count, and the same numbers from the sorted-run,
  fixed-size and partitioned paths of the C++ kernel.
"""

import pytest
import torch
from _backends import DEVICE

from rlvr_kernels import reference
from rlvr_kernels._core.dispatch import load_extension
from rlvr_kernels._core.layout import sanitized_offsets
from rlvr_kernels.contracts import Baseline, GroupAdvantagesParams, Scale, Whiten
from rlvr_kernels.options import AdvantageOptions, GroupAdvantages, Whitening
from rlvr_kernels.testing import compare_advantages
from rlvr_kernels.triton import advantages as triton_advantages

# No skip: a missing build is a failure (`make test` builds it).
assert load_extension(), "the C++ kernels are not built: see `rlvr-kernels info` and `rlvr-kernels build`"

CPP = torch.ops.rlvr_kernels_C.group_advantages
MAX_COUNT = 2**31 - 1
# Both kernels; the C++ one is re-run under the sanitizers.
KERNELS = [pytest.param("cpu", marks=pytest.mark.cpu_kernel), "triton"]

DEFAULTS = dict(
    num_groups=0,
    group_size=0,
    num_tokens=-1,
    baseline=Baseline.MEAN,
    scale=Scale.GROUP,
    std_unbiased=True,
    eps=1e-6,
    eps_in_sqrt=False,
    singleton_raw=False,
    passk_k=0,
    whiten=Whiten.OFF,
    whiten_eps=1e-8,
    whiten_eps_in_sqrt=True,
)


def packed_params(**overrides):
    return GroupAdvantagesParams(**{**DEFAULTS, **overrides}).pack()


def call(kernel, scores, group_index=None, valid=None, lengths=None, mask=None, cu=None, out_dtype=None, **params):
    fparams, iparams = packed_params(**params)
    out_dtype = out_dtype or torch.float32
    return kernel(scores, group_index, valid, lengths, mask, cu, fparams, iparams, out_dtype)


# ------------------------------------------------------------------ contract vs the fp64 reference
# (name, kernel parameters, the reference's options for the same plan)
PLANS = [
    ("grpo", dict(), dict(estimator="grpo")),
    (
        "grpo-batch-population-sqrt",
        dict(scale=Scale.BATCH, std_unbiased=False, eps_in_sqrt=True, eps=1e-4),
        dict(estimator="grpo", scale="batch", std="population", eps_in_sqrt=True, eps=1e-4),
    ),
    ("grpo-verl", dict(singleton_raw=True), dict(estimator="grpo", singleton="raw")),
    ("dr_grpo-raw", dict(scale=Scale.NONE, singleton_raw=True), dict(estimator="dr_grpo", singleton="raw")),
    ("rloo", dict(baseline=Baseline.RLOO, scale=Scale.NONE), dict(estimator="rloo")),
    ("opo", dict(baseline=Baseline.OPO, scale=Scale.NONE), dict(estimator="opo")),
    (
        "gpg-raw",
        dict(baseline=Baseline.GPG, scale=Scale.NONE, singleton_raw=True),
        dict(estimator="gpg", singleton="raw"),
    ),
    ("passk3", dict(baseline=Baseline.PASSK, scale=Scale.NONE, passk_k=3), dict(estimator="passk", k=3)),
    (
        "rpp-tokens",
        dict(scale=Scale.NONE, whiten=Whiten.TOKENS),
        dict(estimator="reinforce_pp_baseline", whitening=Whitening("tokens", 1e-8, True)),
    ),
    (
        "rpp-samples",
        dict(scale=Scale.NONE, whiten=Whiten.SAMPLES, whiten_eps=1e-4, whiten_eps_in_sqrt=False),
        dict(estimator="reinforce_pp_baseline", whitening=Whitening("samples", 1e-4, False)),
    ),
]


def make_case(gen, B, G, grouping, layout, dtype, masked, with_lengths, id_dtype=torch.int64):
    """Inputs of one kernel call, plus the reference's view of them (int64 ids, always)."""
    if grouping == "fixed":
        group_index, ids, num_groups, group_size = torch.arange(B) // G, None, B // G, G
    else:
        ids = torch.randint(0, G, (B,), generator=gen)
        if grouping == "sorted":
            ids = ids.sort().values
        group_index, num_groups, group_size = ids, G, 0
        ids = ids.to(id_dtype)
    scores = torch.randint(-2, 3, (B,), generator=gen).double() + 0.25 * torch.randn(
        B, generator=gen, dtype=torch.float64
    )
    scores[torch.rand(B, generator=gen) < 0.2] = 1.0  # ties: some groups constant
    valid = torch.rand(B, generator=gen) > 0.2 if masked else None
    L = 9
    n_tok = torch.randint(0, L + 1, (B,), generator=gen)
    lengths = n_tok.double() if with_lengths else None
    mask = cu = None
    num_tokens = -1
    if layout == "padded":
        mask = (torch.arange(L)[None] < n_tok[:, None]).float()
    elif layout.startswith("packed"):
        cu = torch.cat([torch.zeros(1, dtype=torch.long), n_tok.cumsum(0)]).to(torch.int32)
        if layout == "packed":
            mask = torch.rand(int(cu[-1]), generator=gen) > 0.3
        else:
            num_tokens = int(cu[-1])
    kernel_args = dict(
        scores=scores.to(dtype),
        group_index=ids,
        valid=valid,
        lengths=lengths,
        mask=mask,
        cu=cu,
        num_groups=num_groups,
        group_size=group_size,
        num_tokens=num_tokens,
    )
    ref_args = dict(group_index=group_index, num_groups=num_groups, sample_mask=valid, response_mask=mask)
    ref_args.update(cu_seqlens=cu, lengths=lengths)
    return kernel_args, ref_args


def check_contract(kernel, kernel_args, ref_args, params, opts, out_dtype, device="cpu"):
    scores = kernel_args["scores"]
    kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kernel_args.items()}
    out = call(kernel, **kw, out_dtype=out_dtype, **params)
    out = [o.cpu() for o in out]
    has_layout = kernel_args["mask"] is not None or kernel_args["cu"] is not None
    fast = GroupAdvantages(out[0], out[1] if has_layout else None, *out[2:])
    opts = AdvantageOptions(**opts)
    ref64 = reference.group_advantages(scores.double(), **ref_args, opts=opts, out_dtype=torch.float64)
    same = reference.group_advantages(scores, **ref_args, opts=opts, out_dtype=scores.dtype)
    assert out[1].shape == ((0,) if not has_layout else ref64.token_advantages.shape)
    bad = [c for c in compare_advantages(fast, ref64, same, out_dtype) if not c.ok]
    assert not bad, bad


@pytest.mark.cpu_kernel
@pytest.mark.parametrize("name,params,opts", PLANS, ids=[p[0] for p in PLANS])
@pytest.mark.parametrize("grouping", ["shuffled", "sorted", "fixed"])
@pytest.mark.parametrize("layout", ["none", "padded", "packed", "packed_nomask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpp_matches_fp64_reference(name, params, opts, grouping, layout, dtype):
    gen = torch.Generator().manual_seed(len(name) * 1000 + len(grouping) * 10 + len(layout))
    # OPO's token weights come from lengths when there is no token layout (the op requires one).
    need_lengths = layout == "none" and params.get("baseline") == Baseline.OPO
    for B, G in ((1, 1), (7, 7), (130, 13), (2000, 20)):
        with_lengths = B % 2 == 0 or need_lengths
        kernel_args, ref_args = make_case(
            gen, B, G, grouping, layout, dtype, masked=B > 1, with_lengths=with_lengths, id_dtype=torch.int32
        )
        out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        check_contract(CPP, kernel_args, ref_args, params, opts, out_dtype)


@pytest.mark.parametrize("name,params,opts", PLANS, ids=[p[0] for p in PLANS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_triton_matches_fp64_reference(name, params, opts, dtype):
    gen = torch.Generator().manual_seed(len(name))
    for grouping, layout, B, G in (
        ("shuffled", "padded", 61, 9),
        ("fixed", "packed", 24, 4),
        ("sorted", "packed_nomask", 5, 2),
    ):
        kernel_args, ref_args = make_case(gen, B, G, grouping, layout, dtype, masked=True, with_lengths=B % 2 == 0)
        out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        check_contract(triton_advantages.group_advantages, kernel_args, ref_args, params, opts, out_dtype, DEVICE)


@pytest.mark.parametrize("kernel", KERNELS)
def test_fp64_scores_computed_in_fp64(kernel):
    # Scores 1e4 apart from each other by ~1e-4: below fp32's resolution there (~1e-3), so a
    # float32 computation gives O(1) errors; float64 is good to ~1e-7.
    gen = torch.Generator().manual_seed(11)
    B, G = 48, 6
    scores = 1e4 + 1e-4 * torch.randn(B, generator=gen, dtype=torch.float64)
    gi = torch.arange(B) // G
    device = "cpu" if kernel == "cpu" else DEVICE
    fn = CPP if kernel == "cpu" else triton_advantages.group_advantages
    for params in (dict(), dict(scale=Scale.BATCH), dict(scale=Scale.NONE, whiten=Whiten.SAMPLES)):
        out = call(fn, scores.to(device), gi.to(device), num_groups=G, out_dtype=torch.float64, **params)
        opts = dict(estimator="grpo")
        if params.get("scale") == Scale.BATCH:
            opts["scale"] = "batch"
        if params.get("whiten") == Whiten.SAMPLES:
            opts = dict(estimator="reinforce_pp_baseline", whitening=Whitening("samples", 1e-8, True))
        ref = reference.group_advantages(scores, gi, G, AdvantageOptions(**opts), out_dtype=torch.float64)
        torch.testing.assert_close(out[0].cpu(), ref.advantages, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out[2].cpu(), ref.group_mean, rtol=1e-14, atol=0)
        torch.testing.assert_close(out[3].cpu(), ref.group_std, rtol=1e-6, atol=0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_none_baseline_with_whitening_by_hand(kernel):
    # NONE + whitening over samples: (r − mean)/sqrt(var + eps), unbiased var over valid rows.
    r = torch.tensor([1.0, 2.0, 4.0, 9.0])
    fn, device = (CPP, "cpu") if kernel == "cpu" else (triton_advantages.group_advantages, DEVICE)
    out = call(
        fn,
        r.to(device),
        group_index=None,
        num_groups=2,
        group_size=2,
        baseline=Baseline.NONE,
        scale=Scale.NONE,
        whiten=Whiten.SAMPLES,
        whiten_eps=0.0,
        out_dtype=torch.float64,
    )
    expected = (r.double() - 4.0) / torch.tensor(38 / 3, dtype=torch.float64).sqrt()
    torch.testing.assert_close(out[0].cpu(), expected)


# ------------------------------------------------------------------ inconsistent shapes
def bad_shape_cases():
    """(name, kernel args, parameter overrides): each must be refused by both kernels."""
    r4 = torch.randn(4)
    gi4 = torch.tensor([0, 1, 0, 1])
    cu4 = torch.tensor([0, 1, 2, 3, 4])
    return [
        # The fuzzer's repro: 3 groups of 2 rows over B = 4 samples.
        ("groups past B", dict(scores=r4), dict(num_groups=3, group_size=2, whiten=Whiten.SAMPLES)),
        ("groups short of B", dict(scores=r4), dict(num_groups=1, group_size=2)),
        ("ids with group_size", dict(scores=r4, group_index=gi4), dict(num_groups=2, group_size=2)),
        ("no ids, no group_size", dict(scores=r4), dict(num_groups=2)),
        ("ids shorter than B", dict(scores=r4, group_index=gi4[:3]), dict(num_groups=2)),
        ("ids longer than B", dict(scores=r4, group_index=torch.zeros(9, dtype=torch.long)), dict(num_groups=2)),
        ("2-D ids", dict(scores=r4, group_index=gi4[:, None]), dict(num_groups=2)),
        ("float ids", dict(scores=r4, group_index=gi4.float()), dict(num_groups=2)),
        ("2-D scores", dict(scores=r4[:, None], group_index=gi4), dict(num_groups=2)),
        ("int scores", dict(scores=gi4, group_index=gi4), dict(num_groups=2)),
        (
            "valid shorter than B",
            dict(scores=r4, group_index=gi4, valid=torch.ones(3, dtype=torch.bool)),
            dict(num_groups=2),
        ),
        (
            "lengths shorter than B",
            dict(scores=r4, group_index=gi4, lengths=torch.ones(2)),
            dict(num_groups=2, baseline=Baseline.OPO),
        ),
        (
            "lengths 2-D",
            dict(scores=r4, group_index=gi4, lengths=torch.ones(4, 1)),
            dict(num_groups=2, whiten=Whiten.TOKENS),
        ),
        ("padded mask short of B", dict(scores=r4, group_index=gi4, mask=torch.ones(3, 5)), dict(num_groups=2)),
        (
            "padded mask past B",
            dict(scores=r4, group_index=gi4, mask=torch.ones(6, 5)),
            dict(num_groups=2, whiten=Whiten.TOKENS),
        ),
        ("1-D mask, no offsets", dict(scores=r4, group_index=gi4, mask=torch.ones(4)), dict(num_groups=2)),
        ("2-D mask with offsets", dict(scores=r4, group_index=gi4, mask=torch.ones(4, 1), cu=cu4), dict(num_groups=2)),
        (
            "offsets short of B + 1",
            dict(scores=r4, group_index=gi4, mask=torch.ones(4), cu=cu4[:4]),
            dict(num_groups=2),
        ),
        ("offsets past B + 1", dict(scores=r4, group_index=gi4, cu=torch.arange(7)), dict(num_groups=2, num_tokens=6)),
        ("2-D offsets", dict(scores=r4, group_index=gi4, cu=cu4[:, None]), dict(num_groups=2, num_tokens=4)),
        ("float offsets", dict(scores=r4, group_index=gi4, cu=cu4.float()), dict(num_groups=2, num_tokens=4)),
        ("no T without a mask", dict(scores=r4, group_index=gi4, cu=cu4), dict(num_groups=2, num_tokens=-1)),
        ("T past MAX_COUNT", dict(scores=r4, group_index=gi4, cu=cu4), dict(num_groups=2, num_tokens=2**40)),
        ("negative num_groups", dict(scores=r4, group_index=gi4), dict(num_groups=-1)),
        ("num_groups past MAX_COUNT", dict(scores=r4, group_index=gi4), dict(num_groups=2**40)),
        ("negative group_size", dict(scores=r4), dict(num_groups=2, group_size=-2)),
        ("group_size past MAX_COUNT", dict(scores=r4), dict(num_groups=0, group_size=2**62)),
        ("passk without k", dict(scores=r4, group_index=gi4), dict(num_groups=2, baseline=Baseline.PASSK)),
    ]


BAD_SHAPES = bad_shape_cases()


@pytest.mark.cpu_kernel
@pytest.mark.parametrize("name,args,params", BAD_SHAPES, ids=[c[0] for c in BAD_SHAPES])
def test_cpp_refuses_inconsistent_shapes(name, args, params):
    with pytest.raises(RuntimeError, match="group_advantages"):
        call(CPP, **args, **params)


@pytest.mark.parametrize("name,args,params", BAD_SHAPES, ids=[c[0] for c in BAD_SHAPES])
def test_triton_refuses_inconsistent_shapes(name, args, params):
    args = {k: v.to(DEVICE) for k, v in args.items()}
    with pytest.raises(ValueError, match="group_advantages"):
        call(triton_advantages.group_advantages, **args, **params)


@pytest.mark.cpu_kernel
def test_cpp_refuses_bad_codes_and_parameter_lists():
    r, gi = torch.randn(4), torch.tensor([0, 1, 0, 1])
    fparams, iparams = packed_params(num_groups=2)
    for field, code in (("baseline", 6), ("scale", -1), ("whiten", 3)):
        bad = list(iparams)
        bad[GroupAdvantagesParams.int_fields().index(field)] = code
        with pytest.raises(RuntimeError, match=f"unknown {field} code"):
            CPP(r, gi, None, None, None, None, fparams, bad, torch.float32)
    with pytest.raises(RuntimeError, match="GroupAdvantagesParams: expected 2 fparams"):
        CPP(r, gi, None, None, None, None, fparams + [0.0], iparams, torch.float32)
    with pytest.raises(RuntimeError, match="GroupAdvantagesParams: expected"):
        CPP(r, gi, None, None, None, None, fparams, iparams[:-1], torch.float32)
    with pytest.raises(RuntimeError, match="out_dtype"):
        CPP(r, gi, None, None, None, None, fparams, iparams, torch.int32)


def test_triton_checks_parameter_list_lengths():
    r, gi = torch.randn(4, device=DEVICE), torch.tensor([0, 1, 0, 1], device=DEVICE)
    fparams, iparams = packed_params(num_groups=2)
    with pytest.raises(ValueError, match="GroupAdvantagesParams: expected 2 fparams"):
        triton_advantages.group_advantages(r, gi, None, None, None, None, fparams[:1], iparams, torch.float32)
    with pytest.raises(ValueError, match="iparams"):
        triton_advantages.group_advantages(r, gi, None, None, None, None, fparams, iparams + [1], torch.float32)


# ------------------------------------------------------------------ garbage values stay in bounds
def garbage_cases():
    gen = torch.Generator().manual_seed(5)
    B = 37
    r = torch.randn(B, generator=gen)
    r[3] = float("nan")
    r[4] = float("inf")
    ids = torch.randint(-3, 12, (B,), generator=gen)
    ids[0], ids[1] = 2**40, -(2**40)
    cu = torch.randint(-50, 300, (B + 1,), generator=gen)  # not monotone, negative, past T
    cu[5] = 2**40
    return r, ids, cu


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout", ["padded", "packed", "packed_nomask"])
@pytest.mark.parametrize("baseline", [Baseline.MEAN, Baseline.OPO, Baseline.PASSK])
def test_garbage_values_stay_in_bounds(kernel, layout, baseline):
    r, ids, cu = garbage_cases()
    B, G, T = r.shape[0], 8, 200
    fn = CPP if kernel == "cpu" else triton_advantages.group_advantages
    device = "cpu" if kernel == "cpu" else DEVICE
    valid = torch.arange(B) % 5 != 0
    kw = dict(num_groups=G, baseline=baseline, passk_k=2, whiten=Whiten.TOKENS, out_dtype=torch.float32)
    if layout == "padded":
        kw.update(mask=torch.ones(B, 6))
    else:
        kw.update(cu=cu, mask=torch.rand(T) > 0.5 if layout == "packed" else None, num_tokens=T)
    kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    out = call(fn, r.to(device), ids.to(device), valid.to(device), **kw)
    adv, tok, mean, sd, count, deg, keep = (o.cpu() for o in out)
    bad = ~(torch.isfinite(r) & (ids >= 0) & (ids < G) & valid)
    assert (adv[bad] == 0).all() and not keep[bad].any()
    assert torch.isfinite(adv).all() and torch.isfinite(tok).all()
    assert int(count.sum()) == int((~bad).sum()) and count.shape == (G,) and deg.shape == (G,)
    if layout != "padded":
        # Non-monotone offsets: the sanitised spans (disjoint, in bounds), nothing else.
        c = sanitized_offsets(cu, T)
        lens = c[1:] - c[:-1]
        spans = torch.repeat_interleave(adv.double(), lens)
        expected = torch.zeros(T, dtype=torch.float64)
        expected[int(c[0]) : int(c[-1])] = spans
        if layout == "packed":
            expected = expected * kw["mask"].cpu().double()
        torch.testing.assert_close(tok.double(), expected, rtol=1e-6, atol=1e-6)
        same = call(fn, r.to(device), ids.to(device), valid.to(device), **{**kw, "cu": c.to(device)})
        for a, b in zip(out, same):
            assert torch.equal(a, b)


@pytest.mark.cpu_kernel
def test_cpp_empty_batches():
    for grouping in ("ids", "fixed"):
        gi = torch.empty(0, dtype=torch.long) if grouping == "ids" else None
        G = 3 if grouping == "ids" else 0
        out = call(CPP, torch.empty(0), gi, num_groups=G, group_size=0 if gi is not None else 4, mask=torch.zeros(0, 5))
        assert out[0].shape == (0,) and out[1].shape == (0, 5) and out[4].tolist() == [0] * G
        assert out[5].all()
        out = call(
            CPP,
            torch.empty(0),
            gi,
            num_groups=G,
            group_size=0 if gi is not None else 4,
            cu=torch.zeros(1, dtype=torch.long),
            num_tokens=6,
        )
        assert out[1].shape == (6,) and (out[1] == 0).all()


# ------------------------------------------------------------------ determinism and path agreement
@pytest.mark.cpu_kernel
@pytest.mark.parametrize(
    "B, G, path",
    [
        (16 * 5000, 16, "direct tables, one range"),
        (2**19, 2, "partition"),
        (2**18, 16, "direct tables, two ranges"),
    ],
)
def test_cpp_paths_agree(B, G, path):
    # Groups of G rows side by side: as contiguous groups (group_size), as sorted ids and as
    # the same groups under shuffled labels (direct tables or the partition, by the size of
    # the id range). Every path sums a group's samples in sample order, so the numbers are the
    # same bits; except that the direct tables of a large batch sum two halves of it
    # separately and merge them (the same numbers to rounding).
    gen = torch.Generator().manual_seed(9)
    Gn = B // G
    scores = (
        torch.randint(0, 4, (B,), generator=gen).double() + torch.randn(B, generator=gen, dtype=torch.float64) * 0.1
    )
    scores = scores.float()
    valid = torch.rand(B, generator=gen) > 0.1
    lengths = torch.randint(0, 9, (B,), generator=gen)
    label = torch.randperm(Gn, generator=gen)
    sorted_ids = torch.arange(B) // G
    for params in (
        dict(),
        dict(baseline=Baseline.RLOO, scale=Scale.NONE),
        dict(baseline=Baseline.PASSK, passk_k=2),
        dict(baseline=Baseline.OPO, scale=Scale.NONE),
    ):
        kw = dict(valid=valid, lengths=lengths, num_groups=Gn, out_dtype=torch.float64, **params)
        fixed = call(CPP, scores, None, group_size=G, **kw)
        by_sorted = call(CPP, scores, sorted_ids, **kw)
        by_label = call(CPP, scores, label[sorted_ids], **kw)
        for a, b in zip(fixed, by_sorted):
            assert torch.equal(a, b)
        relabelled = [by_label[0], by_label[1]] + [by_label[j][label] for j in (2, 3, 4, 5)] + [by_label[6]]
        for j, (a, b) in enumerate(zip(relabelled, fixed)):
            if path == "direct tables, two ranges" and a.is_floating_point():
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"output {j} {params}")
            else:
                assert torch.equal(a, b), (j, params)


@pytest.mark.cpu_kernel
def test_cpp_bitwise_identical_across_thread_counts():
    gen = torch.Generator().manual_seed(10)
    B = 200_003
    scores = torch.randn(B, generator=gen)
    shuffled = torch.randint(0, 7000, (B,), generator=gen)
    cases = [
        dict(group_index=shuffled, num_groups=7000),
        dict(group_index=shuffled.sort().values, num_groups=7000),
        dict(group_index=torch.randint(0, 3, (B,), generator=gen), num_groups=3),
        dict(group_index=torch.randint(0, 2**20, (B,), generator=gen), num_groups=2**20 + 5),
    ]
    threads = torch.get_num_threads()
    results = {}
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for c, case in enumerate(cases):
                for params in (dict(scale=Scale.BATCH), dict(baseline=Baseline.OPO, whiten=Whiten.TOKENS)):
                    out = call(
                        CPP,
                        scores,
                        case["group_index"],
                        lengths=torch.rand(B, generator=torch.Generator().manual_seed(1)),
                        num_groups=case["num_groups"],
                        **params,
                    )
                    results.setdefault((c, str(params)), []).append(out)
    finally:
        torch.set_num_threads(threads)
    for outs in results.values():
        for other in outs[1:]:
            for a, b in zip(outs[0], other):
                assert torch.equal(a, b)
