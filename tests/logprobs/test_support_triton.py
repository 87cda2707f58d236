"""The sampling support of the Triton logprobs kernels (rlvr_kernels/triton/logprobs.py), called
directly: the MASK and THRESHOLD modes of the forward and backward kernels against a torch
oracle on materialised z (a column not kept is z = −inf; an empty row has MAX = −inf and zero
sums; dz = 0 off the support), and the threshold kernels against the reference's sort-based
``sampling_threshold`` (rlvr_kernels/reference/logprobs.py). Contract: the "Sampling support"
section of rlvr_kernels/ops/logprobs.py.

Interpreted on CPU (the conftest sets TRITON_INTERPRET) with small tiles that these small
shapes cross (V odd, never a multiple of 16 or 32). The inputs are integers on a coarse grid
times a power of two, so z is exact in fp32 (every backend forms the same z), values tie
often, and the kept sets can be compared exactly.
"""

import pytest
import torch
from _backends import DEVICE

from rlvr_kernels.contracts.logprobs import (
    NUM_STATS,
    LinearLogprobsBwdParams,
    LinearLogprobsStatsParams,
    LinearLogprobsThresholdParams,
    LogprobsBwdParams,
    LogprobsStat,
    LogprobsStatsParams,
    LogprobsThresholdParams,
    SamplingConvention,
    SupportMode,
)
from rlvr_kernels.reference.logprobs import sampling_threshold
from rlvr_kernels.testing import compare
from rlvr_kernels.triton import logprobs as lp

F32, F64 = torch.float32, torch.float64
SMALL = {
    "linear_fwd": dict(BLOCK_N=16, BLOCK_V=16, BLOCK_H=16, num_warps=4, num_stages=2),
    "linear_fwd_extra": dict(BLOCK_N=16, BLOCK_V=16, BLOCK_H=16, num_warps=4, num_stages=2),
    "linear_bwd": dict(BLOCK_N=16, BLOCK_V=32, BLOCK_H=16, BLOCK_HG=16, num_warps=4, num_stages=2),
    "linear_fwd_mask": dict(BLOCK_N=16, BLOCK_V=16, BLOCK_H=16, num_warps=4, num_stages=2),
    "linear_bwd_mask": dict(BLOCK_N=16, BLOCK_V=32, BLOCK_H=16, BLOCK_HG=16, num_warps=4, num_stages=2),
    "logits_fwd": dict(BLOCK=32, num_warps=4),
    "logits_bwd": dict(BLOCK=32, num_warps=4),
    "threshold_select": dict(BLOCK=64, num_warps=4),
}
CONVENTIONS = {"vllm": SamplingConvention.VLLM, "sglang": SamplingConvention.SGLANG}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    if DEVICE != "cuda":
        monkeypatch.setattr(lp, "config", lambda kind, dtype, arch=None: dict(SMALL[kind]))


def dev(x):
    return x.to(DEVICE) if isinstance(x, torch.Tensor) else x


# ---------------------------------------------------------------------------------------
# inputs


def grid_linear(N, V, H, dtype=F32, seed=0, bias=True):
    """hidden, weight, bias of small integers and inv_T in {1/2, 1, 2}: z is exact and ties."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (N, H), generator=gen).to(dtype)
    w = torch.randint(-1, 2, (V, H), generator=gen).to(dtype)
    b = torch.randint(-2, 3, (V,), generator=gen).to(dtype) if bias else None
    inv_t = torch.tensor([0.5, 1.0, 2.0], dtype=dtype)[torch.randint(0, 3, (N,), generator=gen)]
    return x, w, b, inv_t


def z_linear(x, w, b, inv_t):
    y = x.double() @ w.double().T
    if b is not None:
        y = y + b.double()
    return y * inv_t.double()[:, None]


def grid_logits(N, V, dtype=F32, seed=0):
    """Logits on a grid of 1/2 (row stride V + 3: a column slice) and inv_T in {1/2, 1, 2}."""
    gen = torch.Generator().manual_seed(seed)
    wide = (torch.randint(-12, 13, (N, V + 3), generator=gen) * 0.5).to(dtype)
    inv_t = torch.tensor([0.5, 1.0, 2.0], dtype=dtype)[torch.randint(0, 3, (N,), generator=gen)]
    return wide[:, 1 : 1 + V], inv_t


def filters(N, V, seed=0):
    """Per-row (top_k, top_p, min_p) covering each filter off, at its edges and combined:
    top_k in {0, 1, 3, V − 1, V, V + 5, −2}, top_p in {1, 1.5, 0.01, 0.3, 0.9}, min_p in
    {0, −1, 0.05, 0.4, 1}; the first rows are each filter alone."""
    gen = torch.Generator().manual_seed(seed)
    ks = torch.tensor([0, 1, 3, V - 1, V, V + 5, -2])
    ps = torch.tensor([1.0, 1.5, 0.01, 0.3, 0.9], dtype=F64)
    mps = torch.tensor([0.0, -1.0, 0.05, 0.4, 1.0], dtype=F64)
    k = ks[torch.randint(0, len(ks), (N,), generator=gen)]
    p = ps[torch.randint(0, len(ps), (N,), generator=gen)]
    mp = mps[torch.randint(0, len(mps), (N,), generator=gen)]
    alone = [(0, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.3, 0.0), (0, 1.0, 0.4), (V, 1.0, 1.0), (V - 1, 0.9, 0.05)]
    for n, (kk, pp, mm) in enumerate(alone[:N]):
        k[n], p[n], mp[n] = kk, pp, mm
    return k, p, mp


def check_threshold(thr, z64, k, p, mp, convention):
    """The kernel's threshold keeps exactly the reference's set, and lies in (lo, t]: t the
    reference's least kept value, lo the largest value below it."""
    t = sampling_threshold(z64, k, p, mp, convention)
    thr = thr.cpu().double()
    assert torch.equal(z64 >= thr[:, None], z64 >= t[:, None]), (thr, t)
    lo = torch.where(z64 < t[:, None], z64, torch.full_like(z64, float("-inf"))).amax(1)
    assert bool(((thr <= t) & ((thr > lo) | (lo == float("-inf")))).all())
    assert not thr.isnan().any()


# ---------------------------------------------------------------------------------------
# threshold kernels


@pytest.mark.parametrize("convention", ["vllm", "sglang"])
def test_logits_threshold(convention):
    N, V = 14, 77
    logits, inv_t = grid_logits(N, V, seed=1)
    k, p, mp = filters(N, V, seed=2)
    f, i = LogprobsThresholdParams(convention=CONVENTIONS[convention]).pack()
    thr = lp.logprobs_from_logits_threshold(dev(logits), dev(inv_t), dev(k), dev(p.float()), dev(mp.float()), f, i)
    assert thr.dtype == F32 and thr.shape == (N,)
    check_threshold(
        thr, logits.double() * inv_t.double()[:, None], k, p.float().double(), mp.float().double(), convention
    )


def test_logits_threshold_fp64_and_edges():
    """fp64 (int64 keys), V = 1 (every filter keeps the one column), negative values and
    zeros of both signs (one key), an all-equal row (a tie kept whole)."""
    N, V = 5, 37
    logits, inv_t = grid_logits(N, V, F64, seed=3)
    logits = logits.clone()
    logits[0] = -logits[0].abs() - 1e-3  # all negative
    logits[1, ::2] = -0.0
    logits[1, 1::2] = 0.0
    logits[2] = 1.25  # all equal
    k = torch.tensor([2, 5, 3, 1, 4])
    p = torch.tensor([0.5, 0.2, 0.1, 1.0, 0.6], dtype=F64)
    mp = torch.tensor([0.1, 0.0, 0.5, 0.0, 1e-300], dtype=F64)
    f, i = LogprobsThresholdParams(convention=SamplingConvention.SGLANG).pack()
    thr = lp.logprobs_from_logits_threshold(dev(logits), dev(inv_t), dev(k), dev(p), dev(mp), f, i)
    assert thr.dtype == F64
    check_threshold(thr, logits * inv_t[:, None], k, p, mp, "sglang")
    one = torch.full((3, 1), 2.0)
    f, i = LogprobsThresholdParams(convention=SamplingConvention.VLLM).pack()
    thr = lp.logprobs_from_logits_threshold(
        dev(one),
        dev(torch.ones(3)),
        dev(torch.tensor([1, 0, 5])),
        dev(torch.tensor([0.1, 1.0, 0.5])),
        dev(torch.tensor([1.0, 0.5, 0.0])),
        f,
        i,
    )
    assert bool((thr.cpu() <= 2.0).all())
    empty = lp.logprobs_from_logits_threshold(
        dev(torch.zeros(0, 5)),
        dev(torch.ones(0)),
        dev(torch.zeros(0, dtype=torch.long)),
        dev(torch.ones(0)),
        dev(torch.zeros(0)),
        f,
        i,
    )
    assert empty.shape == (0,)


def test_linear_threshold(monkeypatch):
    """z written a chunk of rows at a time (the scratch shrunk to one 16-row block: 2 chunks)."""
    monkeypatch.setattr(lp, "THRESHOLD_SCRATCH_BYTES", 16 * 53 * 4)
    convention = "vllm"
    N, V, H = 20, 53, 20
    x, w, b, inv_t = grid_linear(N, V, H, seed=4)
    k, p, mp = filters(N, V, seed=5)
    params = LinearLogprobsThresholdParams(
        tanh_scale=0.0, logits_precision=lp.LogitsPrecision.FP32, convention=CONVENTIONS[convention]
    )
    thr = lp.linear_logprobs_threshold(
        dev(x), dev(w), dev(b), dev(inv_t), dev(k), dev(p.float()), dev(mp.float()), *params.pack()
    )
    assert thr.dtype == F32 and thr.shape == (N,)
    check_threshold(thr, z_linear(x, w, b, inv_t), k, p.float().double(), mp.float().double(), convention)
    assert lp.threshold_chunk_rows(N, V, 16, 4) == 16
    # Chunks smaller than a row block (the row blocks then start inside the forward's).
    monkeypatch.setattr(lp, "THRESHOLD_SCRATCH_BYTES", 7 * 53 * 4)
    assert lp.threshold_chunk_rows(N, V, 16, 4) == 7
    again = lp.linear_logprobs_threshold(
        dev(x), dev(w), dev(b), dev(inv_t), dev(k), dev(p.float()), dev(mp.float()), *params.pack()
    )
    assert torch.equal(again, thr)


def test_threshold_chunk_rows_bounded():
    assert lp.threshold_chunk_rows(10**6, 150_000, 64, 4) * 150_000 * 4 <= lp.THRESHOLD_SCRATCH_BYTES
    assert lp.threshold_chunk_rows(10**6, 150_000, 64, 4) % 64 == 0
    assert lp.threshold_chunk_rows(10**6, 10**6, 64, 4) == 16  # fewer rows than a block
    assert lp.threshold_chunk_rows(10**6, 10**8, 64, 4) == 1  # one row even when it is larger
    assert lp.threshold_chunk_rows(5, 100, 64, 4) == 64  # never more than the batch needs


# ---------------------------------------------------------------------------------------
# MASK / THRESHOLD in the forward and backward kernels


def make_support(mode, z64, seed=0):
    """(kept [N, V] bool, support tensor): a random bitmap with an empty row (MASK), or per-row
    thresholds with a row keeping nothing (NaN) and one keeping all (−inf) (THRESHOLD)."""
    N, V = z64.shape
    gen = torch.Generator().manual_seed(seed)
    if mode == SupportMode.MASK:
        kept = torch.rand(N, V, generator=gen) < 0.4
        kept[0] = False
        kept[1] = True
        return make_mask(kept)
    pos = torch.randint(0, V, (N, 1), generator=gen)
    thr = z64.sort(1).values.gather(1, pos)[:, 0] + 0.25  # between grid values, or past the max
    thr[0] = float("nan")
    thr[1] = float("-inf")
    thr = thr.float().double()
    return z64 >= thr[:, None], thr


def oracle(z64, kept, row_ptr, tg):
    """Stats [N, NUM_STATS] and target logits over the kept columns (z = −inf elsewhere)."""
    zk = torch.where(kept, z64, torch.full_like(z64, float("-inf")))
    mx = zk.amax(1)
    empty = ~kept.any(1)
    d = torch.where(kept, zk - torch.where(empty, 0.0, mx)[:, None], 0.0)
    e = torch.where(kept, d.exp(), 0.0)
    V = z64.shape[1]
    arg = torch.where(zk == mx[:, None], torch.arange(V, dtype=F64), float(V)).amin(1)
    stats = torch.stack(
        [
            mx,
            e.sum(1),
            (e * d).sum(1),
            (e * e).sum(1),
            torch.where(kept, z64, 0.0).sum(1),
            torch.where(empty, 0.0, arg),
        ],
        1,
    )
    tl = torch.zeros(tg.shape[0], dtype=F64)
    for n in range(z64.shape[0]):
        for j in range(int(row_ptr[n]), int(row_ptr[n + 1])):
            if 0 <= int(tg[j]) < V:
                tl[j] = zk[n, int(tg[j])]
    return stats, tl


def check_stats(stats, tlog, ref_stats, ref_tl, empty):
    stats, tlog = stats.cpu().double(), tlog.cpu().double()
    assert torch.equal(stats[empty, LogprobsStat.MAX], torch.full((int(empty.sum()),), float("-inf"), dtype=F64))
    assert not stats[empty, 1:].any()
    assert torch.equal(torch.isinf(tlog), torch.isinf(ref_tl)) and not tlog.isnan().any()
    fin = ~empty
    # z is exact, so the fp64 oracle is the same-dtype computation up to the sums' rounding.
    c = compare("stats", stats[fin], ref_stats[fin], ref_stats[fin], F32, atol_scale=4.0)
    assert c.ok, c
    ok = torch.isfinite(ref_tl)
    assert torch.equal(tlog[ok], ref_tl[ok])


def linear_targets(N, V, seed=0):
    """A CSR of 0-3 targets a row: ids in range (kept or not) and outside it (−1, V, 2^40)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (N,), generator=gen)
    row_ptr = torch.zeros(N + 1, dtype=torch.long)
    row_ptr[1:] = counts.cumsum(0)
    M = int(row_ptr[-1])
    tg = torch.randint(0, V, (M,), generator=gen)
    odd = torch.rand(M, generator=gen) < 0.2
    tg[odd] = torch.tensor([-1, V, 2**40])[torch.randint(0, 3, (M,), generator=gen)][odd]
    return row_ptr, tg


@pytest.mark.parametrize("mode", [SupportMode.MASK, SupportMode.THRESHOLD])
def test_linear_support_fwd_bwd(mode):
    N, V, H = 21, 67, 18
    x, w, b, inv_t = grid_linear(N, V, H, seed=6)
    z64 = z_linear(x, w, b, inv_t)
    kept, support = make_support(mode, z64, seed=7)
    empty = ~kept.any(1)
    row_ptr, tg = linear_targets(N, V, seed=8)
    sup = support.float() if mode == SupportMode.THRESHOLD else support
    params = LinearLogprobsStatsParams(
        tanh_scale=0.0,
        need_entropy=True,
        need_sum_sq=True,
        need_sum_z=True,
        need_argmax=True,
        support_mode=mode,
    )
    stats, tlog = lp.linear_logprobs_stats(
        dev(x), dev(w), dev(b), dev(inv_t), dev(row_ptr), dev(tg), dev(sup), *params.pack()
    )
    assert stats.shape == (N, NUM_STATS)
    ref_stats, ref_tl = oracle(z64, kept, row_ptr, tg)
    check_stats(stats, tlog, ref_stats, ref_tl, empty)

    # Backward against autograd of the oracle's loss, Σ g·log p + Σ h·entropy over the
    # non-empty rows (g = 0 for a target off the support, as the op passes it).
    gen = torch.Generator().manual_seed(9)
    g = torch.randn(tg.shape[0], generator=gen, dtype=F64)
    rows = torch.repeat_interleave(torch.arange(N), row_ptr[1:] - row_ptr[:-1])
    in_range = (tg >= 0) & (tg < V)
    g = torch.where(in_range & ~kept[rows, tg.clamp(0, V - 1)], 0.0, g).float().double()
    h = torch.randn(N, generator=gen, dtype=F64).float().double()
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    zk = torch.where(kept, z_linear(xr, wr, br, inv_t), float("-inf"))
    zk = torch.where(empty[:, None], 0.0, zk)  # no NaN from an empty row; its gradient is 0
    logp = zk.log_softmax(1)
    p = logp.exp()
    ent = -(p * torch.where(kept, logp, 0.0)).sum(1)  # no 0·(−inf) in the backward
    tlp = logp[rows, tg.clamp(0, V - 1)]
    loss = (torch.where(in_range & ~empty[rows], tlp, 0.0) * g).sum() + (torch.where(empty, 0.0, ent) * h).sum()
    loss.backward()
    # The G·p term also pulls a row down for targets outside [0, V): add their g to that row.
    lse = torch.where(empty, float("-inf"), torch.logsumexp(torch.where(kept, z64, float("-inf")), 1))
    ent64 = torch.where(empty, 0.0, ent.detach())
    out_of_range = torch.zeros(N, dtype=F64).index_add_(0, rows, torch.where(in_range, 0.0, g))
    pk = torch.where(kept, (z64 - torch.where(empty, 0.0, lse)[:, None]).exp(), 0.0)
    dz_extra = -(out_of_range[:, None] * pk) * inv_t.double()[:, None]
    want = (xr.grad + dz_extra @ w.double(), wr.grad + dz_extra.T @ x.double(), br.grad + dz_extra.sum(0))
    bparams = LinearLogprobsBwdParams(
        tanh_scale=0.0, need_hidden=True, need_weight=True, need_bias=True, support_mode=mode
    )
    out = lp.linear_logprobs_bwd(
        dev(x),
        dev(w),
        dev(b),
        dev(inv_t),
        dev(row_ptr),
        dev(tg),
        dev(g.float()),
        dev(lse.float()),
        dev(ent64.float()),
        dev(h.float()),
        dev(sup),
        *bparams.pack(),
    )
    for name, fast, ref in zip(("grad_hidden", "grad_weight", "grad_bias"), out, want, strict=True):
        fast = fast.cpu().double()
        assert not fast.isnan().any(), name
        c = compare(name, fast, ref, ref, F32, atol_scale=8.0)
        assert c.ok, c


@pytest.mark.parametrize("mode", [SupportMode.MASK, SupportMode.THRESHOLD])
def test_logits_support_fwd_bwd(mode):
    N, V = 12, 45
    logits, inv_t = grid_logits(N, V, seed=10)
    z64 = logits.double() * inv_t.double()[:, None]
    kept, support = make_support(mode, z64, seed=11)
    empty = ~kept.any(1)
    gen = torch.Generator().manual_seed(12)
    tg = torch.randint(0, V, (N,), generator=gen)
    tg[2], tg[3] = -1, V
    sup = support.float() if mode == SupportMode.THRESHOLD else support
    f, i = LogprobsStatsParams(need_entropy=True, support_mode=mode).pack()
    stats, tlog = lp.logprobs_from_logits_stats(dev(logits), dev(tg), dev(inv_t), dev(sup), f, i)
    ref_stats, ref_tl = oracle(z64, kept, torch.arange(N + 1), tg)
    ref_stats[:, 3:] = 0.0  # the logits kernels compute the first three columns only
    check_stats(stats, tlog, ref_stats, ref_tl, empty)

    g = torch.randn(N, generator=gen, dtype=F64)
    in_range = (tg >= 0) & (tg < V)
    g = torch.where(in_range & ~kept[torch.arange(N), tg.clamp(0, V - 1)], 0.0, g).float().double()
    h = torch.randn(N, generator=gen, dtype=F64).float().double()
    zr = z64.clone().requires_grad_()
    zk = torch.where(empty[:, None], 0.0, torch.where(kept, zr, float("-inf")))
    logp = zk.log_softmax(1)
    ent = -(logp.exp() * torch.where(kept, logp, 0.0)).sum(1)
    tlp = logp[torch.arange(N), tg.clamp(0, V - 1)]
    loss = (torch.where(in_range & ~empty, tlp, 0.0) * g).sum() + (torch.where(empty, 0.0, ent) * h).sum()
    loss.backward()
    lse = torch.where(empty, float("-inf"), torch.logsumexp(torch.where(kept, z64, float("-inf")), 1))
    pk = torch.where(kept, (z64 - torch.where(empty, 0.0, lse)[:, None]).exp(), 0.0)
    want = (zr.grad - torch.where(in_range, 0.0, g)[:, None] * pk) * inv_t.double()[:, None]
    f, i = LogprobsBwdParams(support_mode=mode).pack()
    grad = lp.logprobs_from_logits_bwd(
        dev(logits),
        dev(tg),
        dev(inv_t),
        dev(g.float()),
        dev(lse.float()),
        dev(torch.where(empty, 0.0, ent.detach()).float()),
        dev(h.float()),
        dev(sup),
        f,
        i,
    )
    grad = grad.cpu().double()
    assert not grad.isnan().any() and not grad[~kept].any()
    c = compare("grad_logits", grad, want, want, F32, atol_scale=8.0)
    assert c.ok, c


def make_mask(kept):
    """(kept, its int32 bitmap) with the words past V holding garbage bits (ignored)."""
    N, V = kept.shape
    words = torch.zeros(N, (V + 31) // 32, dtype=torch.int64)
    for v in range(V):
        words[:, v // 32] |= kept[:, v].long() << (v % 32)
    if V % 32:
        words[:, -1] |= 0xFFFFFFFF & ~((1 << (V % 32)) - 1)  # bits past V set
    # bit 31 is the int32's sign
    return kept, torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_support_none_unchanged_and_support_required():
    """SupportMode.NONE ignores the support argument (None); MASK without a tensor is an error."""
    N, V, H = 5, 19, 7
    x, w, b, inv_t = grid_linear(N, V, H, seed=13)
    row_ptr, tg = linear_targets(N, V, seed=14)
    params = LinearLogprobsStatsParams(
        tanh_scale=0.0, need_entropy=True, need_sum_sq=False, need_sum_z=False, need_argmax=False
    )
    stats, _ = lp.linear_logprobs_stats(dev(x), dev(w), dev(b), dev(inv_t), dev(row_ptr), dev(tg), None, *params.pack())
    every = torch.ones(N, V, dtype=torch.bool)
    ref_stats, _ = oracle(z_linear(x, w, b, inv_t), every, row_ptr, tg)
    ref_stats[:, 3:] = 0.0
    assert compare("stats", stats.cpu(), ref_stats, ref_stats, F32).ok
    masked = LinearLogprobsStatsParams(
        tanh_scale=0.0,
        need_entropy=True,
        need_sum_sq=False,
        need_sum_z=False,
        need_argmax=False,
        support_mode=SupportMode.MASK,
    )
    with pytest.raises(ValueError, match="support"):
        lp.linear_logprobs_stats(dev(x), dev(w), dev(b), dev(inv_t), dev(row_ptr), dev(tg), None, *masked.pack())
