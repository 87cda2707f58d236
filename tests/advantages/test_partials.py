"""The data-parallel kernels of ``group_advantages`` (``group_partials``, ``group_apply``; the
C++ ops and the Triton launchers called directly) against their fp64 reference rows:

- partials: every column of ``PartialColumn`` per group, for every plan, layout, grouping,
  fp32/fp64 scores and int32/int64 ids, odd sizes, an empty batch, no groups, all masked;
- apply: the batch split over W = 1..3 "ranks" (the partials of each shard, stacked in rank
  order) gives the reference's outputs; W = 1 agrees with the one-process kernel; zeros,
  never NaN, when nothing is valid;
- shapes: every inconsistent shape is an error (the registered ops are reachable directly).
"""

import pytest
import torch
from _backends import DEVICE

from rlvr_kernels import reference
from rlvr_kernels._core.dispatch import load_extension
from rlvr_kernels.contracts import NUM_PARTIAL_COLUMNS, Baseline, GroupAdvantagesParams, PartialColumn, Scale, Whiten
from rlvr_kernels.triton import advantages as triton_advantages

assert load_extension(), "the C++ kernels are not built: see `rlvr-kernels info` and `rlvr-kernels build`"

KERNELS = {
    "cpu": (torch.ops.rlvr_kernels_C.group_partials, torch.ops.rlvr_kernels_C.group_apply, "cpu"),
    "triton": (triton_advantages.group_partials, triton_advantages.group_apply, DEVICE),
}
BACKENDS = [pytest.param("cpu", marks=pytest.mark.cpu_kernel), "triton"]

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
PLANS = {
    "grpo": dict(),
    "grpo-batch-population-sqrt": dict(scale=Scale.BATCH, std_unbiased=False, eps_in_sqrt=True, eps=1e-4),
    "grpo-raw": dict(singleton_raw=True),
    "dr_grpo": dict(scale=Scale.NONE),
    "rloo-raw": dict(baseline=Baseline.RLOO, scale=Scale.NONE, singleton_raw=True),
    "opo": dict(baseline=Baseline.OPO, scale=Scale.NONE),
    "gpg-raw": dict(baseline=Baseline.GPG, scale=Scale.NONE, singleton_raw=True),
    "passk2": dict(baseline=Baseline.PASSK, scale=Scale.NONE, passk_k=2),
    "none": dict(baseline=Baseline.NONE, scale=Scale.NONE),
}


def params(**overrides):
    return GroupAdvantagesParams(**{**DEFAULTS, **overrides}).pack()


def make_case(gen, B, G, grouping, layout, dtype, id_dtype, masked=True):
    """Schema arguments (scores, group_index, valid, lengths, response_mask, cu_seqlens) and
    the group parameters of one batch."""
    if grouping == "fixed":
        ids, group_size = None, B // G
    else:
        ids = torch.randint(0, max(G, 1), (B,), generator=gen).to(id_dtype)
        group_size = 0
    scores = torch.randint(-2, 3, (B,), generator=gen).double() + 0.25 * torch.randn(
        B, generator=gen, dtype=torch.float64
    )
    scores[torch.rand(B, generator=gen) < 0.2] = 1.0  # ties: some groups constant
    scores[torch.rand(B, generator=gen) < 0.05] = float("nan")  # unscorable: excluded
    valid = torch.rand(B, generator=gen) > 0.2 if masked else None
    L = 7
    n_tok = torch.randint(0, L + 1, (B,), generator=gen)
    lengths = mask = cu = None
    num_tokens = -1
    if layout == "lengths":
        lengths = n_tok.double()
    elif layout == "padded":
        mask = (torch.arange(L)[None] < n_tok[:, None]).float()
    elif layout == "packed":
        cu = torch.cat([torch.zeros(1, dtype=torch.long), n_tok.cumsum(0)])
        mask = torch.rand(int(cu[-1]), generator=gen) > 0.3
    elif layout == "packed_nomask":
        cu = torch.cat([torch.zeros(1, dtype=torch.long), n_tok.cumsum(0)]).to(torch.int32)
        num_tokens = int(cu[-1])
    args = (scores.to(dtype), ids, valid, lengths, mask, cu)
    return args, dict(num_groups=G, group_size=group_size, num_tokens=num_tokens)


def to(args, device):
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def shard(args, lo, hi, group_size):
    """Rows [lo, hi) of a batch (packed tokens re-based); contiguous groups become ids."""
    scores, ids, valid, lengths, mask, cu = args
    if ids is None:
        ids = torch.arange(scores.shape[0]) // group_size
    rows = lambda t: None if t is None else t[lo:hi]  # noqa: E731
    if cu is not None:
        t0, t1 = int(cu[lo]), int(cu[hi])
        cu_s = cu[lo : hi + 1] - cu[lo]
        return (scores[lo:hi], ids[lo:hi], rows(valid), rows(lengths), None if mask is None else mask[t0:t1], cu_s)
    return (scores[lo:hi], ids[lo:hi], rows(valid), rows(lengths), rows(mask), None)


def check_close(got, want, what):
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    if got.dtype in (torch.bool, torch.int64):
        assert torch.equal(got, want), what
    elif got.dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")


CASES = [
    # (grouping, layout, B, G)
    ("shuffled", "none", 37, 5),
    ("shuffled", "lengths", 61, 9),
    ("shuffled", "padded", 23, 4),
    ("fixed", "packed", 24, 4),
    ("shuffled", "packed_nomask", 5, 2),
    ("shuffled", "none", 0, 3),  # an empty batch
    ("shuffled", "none", 0, 0),  # no groups at all
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_partials_and_apply_match_reference(backend, plan, dtype):
    partials_fn, apply_fn, device = KERNELS[backend]
    gen = torch.Generator().manual_seed(len(plan) * 10 + (dtype == torch.float64))
    for c, (grouping, layout, B, G) in enumerate(CASES):
        if PLANS[plan].get("baseline") == Baseline.OPO and layout == "none" and B:
            layout = "lengths"  # the op layer requires OPO's token weights
        id_dtype = torch.int32 if c % 2 else torch.int64
        args, group = make_case(gen, B, G, grouping, layout, dtype, id_dtype)
        fp, ip = params(**PLANS[plan], **group)
        where = f"{backend} {plan} {dtype} {grouping} {layout} B={B} G={G}"
        got = partials_fn(*to(args, device), fp, ip)
        want = reference.advantages.group_partials(*args, fp, ip)
        check_close(got, want, f"{where}: partials")
        # The batch split over W ranks in contiguous shards, partials stacked in rank order.
        for W in (1, 2, 3):
            cuts = [B * r // W for r in range(W + 1)]
            gfp, gip = params(**PLANS[plan], **{**group, "group_size": 0})
            shards = [shard(args, cuts[r], cuts[r + 1], group["group_size"]) for r in range(W)]
            # (a packed layout's token count is the shard's own: num_tokens is not read by the partials)
            table = torch.stack([reference.advantages.group_partials(*s, gfp, gip) for s in shards])
            table_fast = torch.stack([partials_fn(*to(s, device), gfp, gip).cpu() for s in shards])
            check_close(table_fast, table, f"{where} W={W}: shard partials")
            for out_dtype in (torch.float32, torch.float64):
                got = apply_fn(*to(args, device), table.to(device), fp, ip, out_dtype)
                want = reference.advantages.group_apply(*args, table, fp, ip, out_dtype)
                names = ("advantages", "token_advantages", "mean", "std", "count", "degenerate", "keep")
                for name, g, w in zip(names, got, want):
                    assert not (g.is_floating_point() and torch.isnan(g).any()), f"{where}: NaN in {name}"
                    check_close(g, w, f"{where} W={W} {out_dtype}: {name}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_of_one_rank_is_one_process(backend):
    """W = 1: the statistics and advantages of one process (the merge and Chan's batch σ agree
    with the one-process kernel to float64 rounding)."""
    partials_fn, apply_fn, device = KERNELS[backend]
    one_process = torch.ops.rlvr_kernels_C.group_advantages
    gen = torch.Generator().manual_seed(3)
    for plan in ("grpo", "grpo-batch-population-sqrt", "rloo-raw", "opo", "gpg-raw", "passk2"):
        args, group = make_case(gen, 50, 7, "shuffled", "padded", torch.float64, torch.int64)
        fp, ip = params(**PLANS[plan], **group)
        table = partials_fn(*to(args, device), fp, ip)[None]
        got = apply_fn(*to(args, device), table, fp, ip, torch.float64)
        want = one_process(*args, fp, ip, torch.float64)
        for k, (g, w) in enumerate(zip(got, want)):
            check_close(g, w, f"{backend} {plan} output {k}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_masked_gives_zeros(backend):
    partials_fn, apply_fn, device = KERNELS[backend]
    B, G = 9, 3
    scores = torch.randn(B)
    ids = torch.arange(B) % G
    valid = torch.zeros(B, dtype=torch.bool)
    mask = torch.ones(B, 4)
    for plan in PLANS.values():
        fp, ip = params(**plan, num_groups=G)
        args = to((scores, ids, valid, None, mask, None), device)
        table = partials_fn(*args, fp, ip)
        assert torch.equal(table.cpu(), torch.zeros(G, NUM_PARTIAL_COLUMNS, dtype=torch.float64))
        adv, tok, mean, sd, count, deg, keep = apply_fn(*args, torch.stack([table, table]), fp, ip, torch.float32)
        for t in (adv, tok, mean, sd):
            assert torch.equal(t.cpu(), torch.zeros_like(t.cpu())), plan
        assert not count.any() and deg.all() and not keep.any()


def test_partial_columns():
    """Hand-computed partials of one group: x = (1, 3, 0, 3) with weights (2, 1, 1, 0)."""
    scores = torch.tensor([1.0, 3.0, 0.0, 3.0, 5.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 0, 1])
    valid = torch.tensor([True, True, True, True, False])
    lengths = torch.tensor([2.0, 1.0, 1.0, 0.0, 4.0])
    fp, ip = params(baseline=Baseline.OPO, scale=Scale.NONE, num_groups=2)
    C = PartialColumn
    want = torch.zeros(2, NUM_PARTIAL_COLUMNS, dtype=torch.float64)
    want[0, [C.N, C.FIRST, C.S, C.S2, C.DIFFERS, C.WX, C.W, C.INCORRECT, C.NONZERO]] = torch.tensor(
        [4.0, 1.0, 2.0 - 1.0 + 2.0, 4.0 + 1.0 + 4.0, 1.0, 2.0 + 3.0, 4.0, 1.0, 3.0], dtype=torch.float64
    )
    for fn, device in (
        (KERNELS["cpu"][0], "cpu"),
        (KERNELS["triton"][0], DEVICE),
        (reference.advantages.group_partials, "cpu"),
    ):
        got = fn(*to((scores, ids, valid, lengths, None, None), device), fp, ip)
        assert torch.equal(got.cpu(), want), fn


# ------------------------------------------------------------------ shapes
def _apply_args(**change):
    B, G = 6, 2
    base = dict(
        scores=torch.randn(B),
        group_index=torch.arange(B) % G,
        valid=None,
        lengths=None,
        mask=None,
        cu=None,
        partials=torch.zeros(2, G, NUM_PARTIAL_COLUMNS, dtype=torch.float64),
        params=dict(num_groups=G),
    )
    base.update(change)
    return base


BAD_APPLY = [
    ("partials rank", dict(partials=torch.zeros(2, NUM_PARTIAL_COLUMNS, dtype=torch.float64)), "partials"),
    ("partials groups", dict(partials=torch.zeros(2, 3, NUM_PARTIAL_COLUMNS, dtype=torch.float64)), "partials"),
    ("partials columns", dict(partials=torch.zeros(2, 2, 5, dtype=torch.float64)), "partials"),
    ("partials dtype", dict(partials=torch.zeros(2, 2, NUM_PARTIAL_COLUMNS)), "partials"),
    ("whitening", dict(params=dict(num_groups=2, whiten=Whiten.SAMPLES)), "whiten"),
    ("group_index", dict(group_index=torch.zeros(5, dtype=torch.long)), "group_index"),
    ("valid", dict(valid=torch.ones(4, dtype=torch.bool)), "valid"),
    ("mask", dict(mask=torch.ones(5, 3)), "response_mask"),
    ("cu_seqlens", dict(cu=torch.zeros(3, dtype=torch.long), params=dict(num_groups=2, num_tokens=0)), "cu_seqlens"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,change,match", BAD_APPLY, ids=[b[0] for b in BAD_APPLY])
def test_apply_refuses_inconsistent_shapes(backend, name, change, match):
    _, apply_fn, device = KERNELS[backend]
    a = _apply_args(**change)
    fp, ip = params(**a["params"])
    args = to((a["scores"], a["group_index"], a["valid"], a["lengths"], a["mask"], a["cu"], a["partials"]), device)
    with pytest.raises((RuntimeError, ValueError), match=match):
        apply_fn(*args, fp, ip, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_partials_refuse_inconsistent_shapes(backend):
    partials_fn, _, device = KERNELS[backend]
    scores = torch.randn(6)
    fp, ip = params(num_groups=2)
    with pytest.raises((RuntimeError, ValueError), match="group_index"):
        partials_fn(*to((scores, torch.zeros(5, dtype=torch.long), None, None, None, None), device), fp, ip)
    with pytest.raises((RuntimeError, ValueError), match="scores"):
        partials_fn(*to((scores[:, None], torch.zeros(6, dtype=torch.long), None, None, None, None), device), fp, ip)
    fp, ip = params(num_groups=2, group_size=4)
    with pytest.raises((RuntimeError, ValueError), match="cover the batch|num_groups x group_size"):
        partials_fn(*to((scores, None, None, None, None, None), device), fp, ip)


@pytest.mark.cpu_kernel
def test_cpp_apply_refuses_counts_that_are_no_counts():
    a = _apply_args()
    fp, ip = params(**a["params"])
    args = (a["scores"], a["group_index"], None, None, None, None)
    for bad in (-1.0, 0.5, float("nan"), 2.0**31):
        table = torch.zeros(1, 2, NUM_PARTIAL_COLUMNS, dtype=torch.float64)
        table[0, 1, PartialColumn.N] = bad
        with pytest.raises(RuntimeError, match="sample count"):
            torch.ops.rlvr_kernels_C.group_apply(*args, table, fp, ip, torch.float32)
    table = torch.zeros(2, 2, NUM_PARTIAL_COLUMNS, dtype=torch.float64)
    table[:, 0, PartialColumn.N] = 2.0**30 + 1
    with pytest.raises(RuntimeError, match="more than"):
        torch.ops.rlvr_kernels_C.group_apply(*args, table, fp, ip, torch.float32)
