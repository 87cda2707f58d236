"""The C++ log-prob kernels with a sampling support (csrc/logprobs.cpp; the contract is the
"Sampling support" part of rlvr_kernels/ops/logprobs.py's docstring), called directly, against
torch on materialised z: the MASK and THRESHOLD modes of the forward and backward kernels (an fp64
oracle of the statistics over the kept columns and its autograd), and the threshold kernels
against a sort-based fp64 definition of top-k / top-p / min-p on the kernels' own z. Small sizes,
odd V (not a multiple of 32, V = 1), ties (values on a bf16 grid), empty and all-kept rows."""

import math

import pytest
import torch

from rlvr_kernels._core.dispatch import load_extension
from rlvr_kernels._core.layout import compute_dtype
from rlvr_kernels.contracts.logprobs import (
    LinearLogprobsBwdParams,
    LinearLogprobsStatsParams,
    LinearLogprobsThresholdParams,
    LogitsPrecision,
    LogprobsBwdParams,
    LogprobsStat,
    LogprobsStatsParams,
    LogprobsThresholdParams,
    SamplingConvention,
    SupportMode,
)

pytestmark = pytest.mark.cpu_kernel

assert load_extension(), "the C++ kernels are not built: see `rlvr-kernels info` and `rlvr-kernels build`"

K = torch.ops.rlvr_kernels_C
INF = math.inf
# Tolerance of the compute dtype's statistics and gradients against fp64 (relative to the scale).
TOL = {torch.float32: 2e-5, torch.float64: 1e-12}
ALL_STATS = dict(need_entropy=True, need_sum_sq=True, need_sum_z=True, need_argmax=True)


# ------------------------------------------------------------------ supports
def pack_mask(kept):
    """kept [N, V] bool -> the MASK support int32 [N, ceil(V / 32)] (bit v % 32 of word v // 32)."""
    N, V = kept.shape
    words = (V + 31) // 32
    bits = torch.zeros(N, words * 32, dtype=torch.int64)
    bits[:, :V] = kept.long()
    value = (bits.view(N, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)


def random_kept(N, V, gen):
    """Random keep masks with an empty row, an all-kept row and rows of one column (N >= 4)."""
    kept = torch.rand(N, V, generator=gen) < torch.rand(N, 1, generator=gen)
    kept[0] = False
    kept[1] = True
    kept[2] = False
    kept[2, V // 2] = True
    return kept


def thresholds_for(z, gen):
    """Per-row THRESHOLD supports over the kernel's z: values of the row (ties kept whole), −inf
    (every column), NaN and +inf (none); returns (support, kept)."""
    N, V = z.shape
    pick = torch.randint(0, V, (N,), generator=gen)
    thr = z[torch.arange(N), pick].clone()
    thr[0] = -INF
    thr[1] = math.nan
    if N > 3:
        thr[3] = INF
    return thr, z >= thr[:, None]


def support_for(mode, z, gen):
    """(support tensor, kept [N, V]) of a mode over the kernel's z."""
    if mode == SupportMode.MASK:
        kept = random_kept(*z.shape, gen)
        return pack_mask(kept), kept
    return thresholds_for(z, gen)


# ------------------------------------------------------------------ kernels
def linear_z(hidden, weight, bias, inv_t, tanh_scale=0.0, prec=LogitsPrecision.FP32):
    """z [N, V] exactly as the linear kernels form it: the target logits of every column."""
    N, V = hidden.shape[0], weight.shape[0]
    row_ptr = torch.arange(N + 1, dtype=torch.int64) * V
    every = torch.arange(V).repeat(N)
    params = LinearLogprobsStatsParams(tanh_scale, False, False, False, False, prec)
    _, tl = K.linear_logprobs_stats(hidden, weight, bias, inv_t, row_ptr, every, None, *params.pack())
    return tl.view(N, V)


def linear_stats(hidden, weight, bias, inv_t, row_ptr, targets, support, mode, tanh_scale=0.0, **flags):
    flags = {**ALL_STATS, **flags}
    params = LinearLogprobsStatsParams(tanh_scale=tanh_scale, support_mode=mode, **flags)
    return K.linear_logprobs_stats(hidden, weight, bias, inv_t, row_ptr, targets, support, *params.pack())


def linear_bwd(hidden, weight, bias, inv_t, row_ptr, targets, g, lse, ent, h, support, mode, tanh_scale=0.0):
    params = LinearLogprobsBwdParams(tanh_scale, True, True, bias is not None, support_mode=mode)
    args = (hidden, weight, bias, inv_t, row_ptr, targets, g, lse, ent, h, support)
    return K.linear_logprobs_bwd(*args, *params.pack())


def logits_stats(logits, targets, inv_t, support, mode):
    return K.logprobs_from_logits_stats(logits, targets, inv_t, support, *LogprobsStatsParams(True, mode).pack())


def logits_bwd(logits, targets, inv_t, g, lse, ent, h, support, mode):
    return K.logprobs_from_logits_bwd(logits, targets, inv_t, g, lse, ent, h, support, *LogprobsBwdParams(mode).pack())


def linear_threshold(hidden, weight, bias, inv_t, top_k, top_p, min_p, conv, tanh_scale=0.0, prec=0):
    params = LinearLogprobsThresholdParams(tanh_scale, LogitsPrecision(prec), conv)
    return K.linear_logprobs_threshold(hidden, weight, bias, inv_t, top_k, top_p, min_p, *params.pack())


def logits_threshold(logits, inv_t, top_k, top_p, min_p, conv):
    return K.logprobs_from_logits_threshold(logits, inv_t, top_k, top_p, min_p, *LogprobsThresholdParams(conv).pack())


# ------------------------------------------------------------------ fp64 oracle
def oracle(z, kept, rows, targets):
    """The statistics over the kept columns of z (fp64, differentiable): (stats [N, 6] as the
    kernels' columns, lse, entropy, logp per target (0 unless in range and kept), whether each
    target is in range and kept). ARGMAX is left 0 (compared apart, on the kernel's own z)."""
    N, V = z.shape
    nonempty = kept.any(1)
    zm = torch.where(kept, z, -INF)
    m = torch.where(nonempty, zm.max(1).values, 0.0).detach()
    d = torch.where(kept, z - m[:, None], 0.0)
    ex = torch.where(kept, d.exp(), 0.0)
    s = ex.sum(1)
    s_safe = torch.where(nonempty, s, 1.0)
    lse_safe = m + s_safe.log()
    p = ex / s_safe[:, None]
    ent = -(p * torch.where(kept, z - lse_safe[:, None], 0.0)).sum(1)
    zero = torch.zeros(N, dtype=z.dtype)
    stats = torch.stack(
        [
            torch.where(nonempty, m, -INF),
            s,
            (ex * d).sum(1),
            (ex * ex).sum(1),
            torch.where(kept, z, 0.0).sum(1),
            zero,
        ],
        -1,
    )
    in_range = (targets >= 0) & (targets < V)
    t = targets.clamp(0, V - 1)
    hit = in_range & kept[rows, t]
    logp = torch.where(hit, z[rows, t] - lse_safe[rows], 0.0)
    return stats, torch.where(nonempty, lse_safe, -INF), ent, logp, hit


def kernel_target_logits(z, kept, rows, targets):
    """The target logits of the contract over the kernel's z: z if in range and kept, −inf if in
    range and not kept, 0 out of range."""
    V = z.shape[1]
    in_range = (targets >= 0) & (targets < V)
    t = targets.clamp(0, V - 1)
    val = torch.where(kept[rows, t], z[rows, t], torch.full_like(z[rows, t], -INF))
    return torch.where(in_range, val, torch.zeros_like(val))


def first_argmax(z, kept):
    zm = torch.where(kept, z, torch.full_like(z, -INF))
    m = zm.max(1, keepdim=True).values
    first = (zm == m).to(torch.int8).argmax(1)
    return torch.where(kept.any(1), first, 0).to(z.dtype)


def assert_close(actual, expected, tol, what):
    expected = expected.double()
    finite = expected[torch.isfinite(expected)]
    scale = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def check_stats(stats, tl, ref_stats, z_kernel, kept, rows, targets, tol, optional=True):
    """The kernel's stats and target logits against the oracle's (MAX exactly −inf for empty rows,
    SUM_EXP / SUM_EXP_SHIFT exactly 0 there, no NaN anywhere)."""
    assert not stats.isnan().any() and not tl.isnan().any()
    empty = ~kept.any(1)
    assert (stats[empty, LogprobsStat.MAX] == -INF).all()
    assert (stats[empty, 1:] == 0).all()
    cols = [0, 1, 2, 3, 4] if optional else [0, 1, 2]
    assert_close(stats[:, cols], ref_stats[:, cols], tol, "stats")
    if optional:
        assert torch.equal(stats[:, LogprobsStat.ARGMAX], first_argmax(z_kernel, kept))
    assert torch.equal(tl, kernel_target_logits(z_kernel, kept, rows, targets))


# ------------------------------------------------------------------ cases
def coarse(x):
    """Values on the bf16 grid (many exact ties), kept in x's dtype."""
    return x.to(torch.bfloat16).to(x.dtype)


def make_head(N, H, V, dtype, gen, bias=True):
    hidden = coarse(torch.randn(N, H, generator=gen, dtype=torch.float64) / H**0.5 * 2).to(dtype)
    weight = coarse(torch.randn(V, H, generator=gen, dtype=torch.float64)).to(dtype)
    if V > 3:
        weight[V - 1] = weight[1]  # two columns with the same z (a tie the GEMM makes exactly)
    b = coarse(torch.randn(V, generator=gen, dtype=torch.float64)).to(dtype) if bias else None
    inv_t = torch.rand(N, generator=gen, dtype=torch.float64).add(0.5).to(dtype)
    return hidden, weight, b, inv_t


def make_csr(N, V, gen):
    """About two targets per row: in range, −1, past V; rows with none."""
    counts = torch.randint(0, 4, (N,), generator=gen)
    row_ptr = torch.zeros(N + 1, dtype=torch.int64)
    row_ptr[1:] = counts.cumsum(0)
    M = int(row_ptr[-1])
    targets = torch.randint(-1, V + 1, (M,), generator=gen)
    return row_ptr, targets, torch.repeat_interleave(torch.arange(N), counts)


def ref_z(hidden, weight, bias, inv_t):
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    return z * inv_t.double()[:, None]


MODES = [SupportMode.MASK, SupportMode.THRESHOLD]
SIZES = [(5, 8, 1), (6, 16, 31), (9, 8, 33), (7, 32, 700), (4, 16, 5003)]


# ------------------------------------------------------------------ forward and backward
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("N,H,V", SIZES)
def test_linear_support_matches_oracle(mode, dtype, N, H, V):
    gen = torch.Generator().manual_seed(N * 1000 + V + int(mode))
    hidden, weight, bias, inv_t = make_head(N, H, V, dtype, gen)
    row_ptr, targets, rows = make_csr(N, V, gen)
    zk = linear_z(hidden, weight, bias, inv_t)
    support, kept = support_for(mode, zk, gen)
    stats, tl = linear_stats(hidden, weight, bias, inv_t, row_ptr, targets, support, mode)

    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    z = ref_z(*leaves, inv_t)
    ref_stats, lse, ent, logp, hit = oracle(z, kept, rows, targets)
    check_stats(stats, tl, ref_stats, zk, kept, rows, targets, TOL[dtype])

    g = torch.where(hit, torch.randn(targets.shape, generator=gen, dtype=torch.float64), 0.0)
    h = torch.randn(N, generator=gen, dtype=torch.float64)
    ((g * logp).sum() + (h * ent).sum()).backward()
    ct = compute_dtype(dtype)
    grads = linear_bwd(
        hidden,
        weight,
        bias,
        inv_t,
        row_ptr,
        targets,
        g.to(ct),
        lse.detach().to(ct),
        ent.detach().to(ct),
        h.to(ct),
        support,
        mode,
    )
    for name, got, leaf in zip(("grad_hidden", "grad_weight", "grad_bias"), grads, leaves):
        assert not got.isnan().any(), name
        assert_close(got, leaf.grad, TOL[dtype], name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("N,V", [(5, 1), (6, 31), (7, 33), (4, 1000), (5, 4099)])
def test_logits_support_matches_oracle(mode, dtype, N, V):
    gen = torch.Generator().manual_seed(N * 1000 + V + int(mode))
    logits = coarse(torch.randn(N, V, generator=gen, dtype=torch.float64) * 3).to(dtype)
    inv_t = torch.rand(N, generator=gen, dtype=torch.float64).add(0.5).to(dtype)
    targets = torch.randint(-1, V + 1, (N,), generator=gen)
    rows = torch.arange(N)
    zk = logits * inv_t[:, None]  # the kernels' z: one rounding of the product
    support, kept = support_for(mode, zk, gen)
    if mode == SupportMode.MASK:  # a target outside the support
        kept[3, targets[3].clamp(0, V - 1)] = False
        support = pack_mask(kept)
    stats, tl = logits_stats(logits, targets, inv_t, support, mode)

    leaf = logits.detach().double().requires_grad_()
    ref_stats, lse, ent, logp, hit = oracle(leaf * inv_t.double()[:, None], kept, rows, targets)
    check_stats(stats, tl, ref_stats, zk, kept, rows, targets, TOL[dtype], optional=False)
    assert (stats[:, 3:] == 0).all()

    g = torch.where(hit, torch.randn(N, generator=gen, dtype=torch.float64), 0.0)
    h = torch.randn(N, generator=gen, dtype=torch.float64)
    ((g * logp).sum() + (h * ent).sum()).backward()
    grad = logits_bwd(
        logits, targets, inv_t, g.to(dtype), lse.detach().to(dtype), ent.detach().to(dtype), h.to(dtype), support, mode
    )
    assert not grad.isnan().any()
    assert (grad[~kept] == 0).all()
    assert_close(grad, leaf.grad, TOL[dtype], "grad_logits")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("V", [1, 37, 1100])
def test_keeping_every_column_is_the_none_path_bitwise(dtype, V):
    """A MASK of all ones and a THRESHOLD of −inf give the NONE path's bits, forward and backward
    (the support only sets columns to −inf), with the soft-cap and the optional statistics too."""
    gen = torch.Generator().manual_seed(V)
    N, H = 9, 16
    hidden, weight, bias, inv_t = make_head(N, H, V, dtype, gen)
    inv_t = inv_t.to(compute_dtype(dtype))
    row_ptr, targets, rows = make_csr(N, V, gen)
    ct = compute_dtype(dtype)
    supports = [
        (pack_mask(torch.ones(N, V, dtype=torch.bool)), SupportMode.MASK),
        (torch.full((N,), -INF, dtype=ct), SupportMode.THRESHOLD),
    ]
    for tanh_scale in (0.0, 0.3):
        base = linear_stats(hidden, weight, bias, inv_t, row_ptr, targets, None, SupportMode.NONE, tanh_scale)
        lse = base[0][:, 0] + base[0][:, 1].log()
        g = torch.randn(targets.shape, generator=gen).to(ct)
        h = torch.randn(N, generator=gen).to(ct)
        ent = torch.rand(N, generator=gen).to(ct)
        gbase = linear_bwd(
            hidden, weight, bias, inv_t, row_ptr, targets, g, lse, ent, h, None, SupportMode.NONE, tanh_scale
        )
        for support, mode in supports:
            out = linear_stats(hidden, weight, bias, inv_t, row_ptr, targets, support, mode, tanh_scale)
            assert all(torch.equal(a, b) for a, b in zip(out, base)), (mode, tanh_scale)
            grads = linear_bwd(hidden, weight, bias, inv_t, row_ptr, targets, g, lse, ent, h, support, mode, tanh_scale)
            assert all(torch.equal(a, b) for a, b in zip(grads, gbase)), (mode, tanh_scale)

    logits = torch.randn(N, V, generator=gen).to(dtype)
    lt = torch.randint(-1, V + 1, (N,), generator=gen)
    base = logits_stats(logits, lt, inv_t, None, SupportMode.NONE)
    lse = base[0][:, 0] + base[0][:, 1].log()
    g, ent, h = torch.randn(N).to(ct), torch.rand(N).to(ct), torch.randn(N).to(ct)
    gbase = logits_bwd(logits, lt, inv_t, g, lse, ent, h, None, SupportMode.NONE)
    for support, mode in supports:
        assert all(torch.equal(a, b) for a, b in zip(logits_stats(logits, lt, inv_t, support, mode), base))
        assert torch.equal(logits_bwd(logits, lt, inv_t, g, lse, ent, h, support, mode), gbase)


def test_backward_zeroes_columns_not_kept_whatever_g():
    """dz = 0 on a column not kept, even for a target there with g != 0 (it still counts in G)."""
    gen = torch.Generator().manual_seed(3)
    N, V = 4, 70
    logits = torch.randn(N, V, generator=gen)
    inv_t = torch.ones(N)
    targets = torch.tensor([5, 6, 7, 8])
    kept = torch.ones(N, V, dtype=torch.bool)
    kept[:, 5:9] = False
    kept[3] = False  # empty row: lse = −inf
    support = pack_mask(kept)
    stats, _ = logits_stats(logits, targets, inv_t, support, SupportMode.MASK)
    lse = stats[:, 0] + stats[:, 1].log()
    assert lse[3] == -INF
    g = torch.ones(N)
    grad = logits_bwd(logits, targets, inv_t, g, lse, torch.zeros(N), torch.ones(N), support, SupportMode.MASK)
    assert not grad.isnan().any() and (grad[~kept] == 0).all()
    # G = 1 still pulls every kept column down: dz = −p there.
    p = (logits - lse[:, None]).exp()
    assert_close(grad[:3][kept[:3]], -(p * (1 + (logits - lse[:, None])))[:3][kept[:3]], 2e-5, "dz")


# ------------------------------------------------------------------ thresholds: the fp64 definition
def ref_threshold(z, top_k, top_p, min_p, conv, rel):
    """(t, ambiguous) for one row z (fp64, the kernel's values): t the least kept value under the
    contract's filters, computed by sorting; ambiguous when some value's mass above lies within
    rel·P of P (the kernel's sums may then decide either way)."""
    V = z.numel()
    m = z.max()
    e = (z - m).exp()
    t1 = torch.tensor(-INF, dtype=torch.float64)
    if min_p > 0:
        t1 = z[e >= min_p].min()
    if 0 < top_k < V:
        t1 = torch.maximum(t1, z.sort(descending=True).values[top_k - 1])
    t, ambiguous = t1, False
    if top_p < 1:
        u = z >= t1
        zu, eu = z[u], e[u]
        asc, order = zu.sort()
        tail = torch.cat([eu[order].flip(0).cumsum(0).flip(0), torch.zeros(1, dtype=torch.float64)])
        above = tail[torch.searchsorted(asc, zu, right=True)]  # B(v): the mass strictly above z_v in U
        P = top_p * (eu.sum() if conv == SamplingConvention.VLLM else e.sum())
        ok = above < P if conv == SamplingConvention.VLLM else above <= P
        t = torch.maximum(t1, zu[ok].min())
        ambiguous = bool(((above - P).abs() <= rel * P).any())
    return t, ambiguous


def check_thresholds(thr, z, top_k, top_p, min_p, conv, rel):
    """Each row's kept set {z >= thr} is the definition's {z >= t}, and thr lies in (lo, t] with
    lo the largest value below t; rows whose top-p is ambiguous are only checked for that form."""
    z64 = z.double()
    checked = 0
    for n in range(z.shape[0]):
        t, ambiguous = ref_threshold(z64[n], int(top_k[n]), float(top_p[n]), float(min_p[n]), conv, rel)
        kept = z[n] >= thr[n]
        assert kept.any(), n  # the max is always kept
        least = z64[n][kept].min()
        below = z64[n][z64[n] < least]
        assert thr[n] <= least and (below.numel() == 0 or thr[n] > below.max()), n
        if not ambiguous:
            assert torch.equal(kept, z64[n] >= t), (n, float(least), float(t))
            checked += 1
    assert checked >= z.shape[0] // 2


def random_filters(N, V, dtype, gen):
    """Per-row filters, each on or off, with the edge values (top_k >= V, top_p = 1, min_p = 1)."""
    top_k = torch.randint(0, max(V // 3, 2), (N,), generator=gen)
    top_p = torch.rand(N, generator=gen, dtype=torch.float64).mul(0.98).add(0.01)
    min_p = torch.rand(N, generator=gen, dtype=torch.float64).pow(3)
    off = torch.rand(N, 3, generator=gen) < 0.4
    top_k[off[:, 0]] = 0
    top_p[off[:, 1]] = 1.0
    min_p[off[:, 2]] = 0.0
    edges = [(V, 1.0, 0.0), (V + 5, 0.5, 0.0), (0, 1.0, 1.0), (1, 1.0, 0.0), (0, 1e-6, 0.0), (-3, 2.0, -1.0)]
    for i, (k, p, mp) in enumerate(edges[:N]):
        top_k[i], top_p[i], min_p[i] = k, p, mp
    return top_k, top_p.to(dtype), min_p.to(dtype)


REL = {torch.float32: 1e-5, torch.float64: 1e-11}
CONVENTIONS = [SamplingConvention.VLLM, SamplingConvention.SGLANG]


@pytest.mark.parametrize("conv", CONVENTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("N,V", [(6, 1), (8, 33), (12, 257), (10, 4999)])
def test_logits_threshold_matches_definition(conv, dtype, N, V):
    gen = torch.Generator().manual_seed(V * 10 + int(conv))
    logits = coarse(torch.randn(N, V, generator=gen, dtype=torch.float64) * 2).to(dtype)
    logits[-1] = logits[-1].round()  # huge ties
    inv_t = torch.rand(N, generator=gen, dtype=torch.float64).add(0.5).to(dtype)
    inv_t[-2] = 1.0
    top_k, top_p, min_p = random_filters(N, V, dtype, gen)
    thr = logits_threshold(logits, inv_t, top_k, top_p, min_p, conv)
    assert thr.dtype == dtype and thr.shape == (N,)
    check_thresholds(thr, logits * inv_t[:, None], top_k, top_p, min_p, conv, REL[dtype])


@pytest.mark.parametrize("conv", CONVENTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("N,H,V", [(6, 8, 1), (9, 16, 100), (131, 8, 600), (5, 32, 4100)])
@pytest.mark.parametrize("variant", ["plain", "softcap_bf16"])
def test_linear_threshold_matches_definition(conv, dtype, N, H, V, variant):
    """On the kernel's own z (the forward's, bitwise), with the soft-cap and logits_precision too."""
    gen = torch.Generator().manual_seed(N * 7 + V + int(conv))
    hidden, weight, bias, inv_t = make_head(N, H, V, dtype, gen)
    ct = compute_dtype(dtype)
    inv_t = inv_t.to(ct)
    tanh_scale, prec = (0.2, LogitsPrecision.BF16) if variant != "plain" else (0.0, LogitsPrecision.FP32)
    top_k, top_p, min_p = random_filters(N, V, ct, gen)
    thr = linear_threshold(hidden, weight, bias, inv_t, top_k, top_p, min_p, conv, tanh_scale, prec)
    assert thr.dtype == ct and thr.shape == (N,)
    z = linear_z(hidden, weight, bias, inv_t, tanh_scale, prec)
    check_thresholds(thr, z, top_k, top_p, min_p, conv, REL[ct])
    # The forward with that support keeps the same columns and the row's max.
    row_ptr, targets, rows = make_csr(N, V, gen)
    stats, tl = linear_stats(
        hidden, weight, bias, inv_t, row_ptr, targets, thr, SupportMode.THRESHOLD, tanh_scale, logits_precision=prec
    )
    full, _ = linear_stats(
        hidden, weight, bias, inv_t, row_ptr, targets, None, SupportMode.NONE, tanh_scale, logits_precision=prec
    )
    assert torch.equal(stats[:, 0], full[:, 0])
    assert torch.equal(tl, kernel_target_logits(z, z >= thr[:, None], rows, targets))


def test_threshold_rows_are_batch_invariant():
    gen = torch.Generator().manual_seed(11)
    N, H, V = 140, 8, 300
    hidden, weight, bias, inv_t = make_head(N, H, V, torch.float32, gen)
    top_k, top_p, min_p = random_filters(N, V, torch.float32, gen)
    conv = SamplingConvention.VLLM
    thr = linear_threshold(hidden, weight, bias, inv_t, top_k, top_p, min_p, conv)
    for n in (0, 77, 139):
        one = linear_threshold(
            hidden[n : n + 1].contiguous(),
            weight,
            bias,
            inv_t[n : n + 1].contiguous(),
            top_k[n : n + 1].contiguous(),
            top_p[n : n + 1].contiguous(),
            min_p[n : n + 1].contiguous(),
            conv,
        )
        assert torch.equal(one, thr[n : n + 1])


def test_threshold_special_rows():
    """A row of equal values, rows with −inf and NaN logits, an all −inf row: no crash, the max kept."""
    V = 40
    logits = torch.randn(4, V)
    logits[0] = 1.5
    logits[1, :10] = -INF
    logits[2, 3] = math.nan
    logits[3] = -INF
    inv_t = torch.ones(4)
    for conv in CONVENTIONS:
        thr = logits_threshold(logits, inv_t, torch.full((4,), 3), torch.full((4,), 0.5), torch.full((4,), 0.1), conv)
        assert thr[0] <= 1.5 and thr[3] == -INF
        for n in (1, 2):
            row = logits[n]
            assert (row >= thr[n]).sum() >= 1 and bool((row >= thr[n])[row.nan_to_num(-INF).argmax()])
            assert not (row[row.isnan()] >= thr[n]).any()


# ------------------------------------------------------------------ argument checks
def test_support_shapes_and_dtypes_are_checked():
    N, H, V = 3, 4, 40
    hidden, weight, inv_t = torch.randn(N, H), torch.randn(V, H), torch.ones(N)
    row_ptr, targets = torch.zeros(N + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    good = torch.zeros(N, 2, dtype=torch.int32)
    bad = [
        (good, SupportMode.NONE, "must be None"),
        (None, SupportMode.MASK, "required"),
        (torch.zeros(N, 1, dtype=torch.int32), SupportMode.MASK, r"shape \[3, 2\]"),
        (torch.zeros(N, 2, dtype=torch.int64), SupportMode.MASK, "int32"),
        (torch.zeros(N, 4, dtype=torch.int32)[:, ::2], SupportMode.MASK, "contiguous"),
        (torch.zeros(N + 1), SupportMode.THRESHOLD, "support"),
        (torch.zeros(N, dtype=torch.float64), SupportMode.THRESHOLD, "support"),
        (None, 7, "support_mode"),
    ]
    for support, mode, match in bad:
        with pytest.raises(RuntimeError, match=match):
            p = LinearLogprobsStatsParams(0.0, True, False, False, False, support_mode=SupportMode.NONE).pack()
            K.linear_logprobs_stats(hidden, weight, None, inv_t, row_ptr, targets, support, p[0], [*p[1][:-1], mode])
        with pytest.raises(RuntimeError, match=match):
            K.linear_logprobs_bwd(
                hidden,
                weight,
                None,
                inv_t,
                row_ptr,
                targets,
                torch.zeros(0),
                inv_t,
                inv_t,
                None,
                support,
                [0.0],
                [1, 1, 0, 0, int(mode)],
            )
        logits, lt = torch.randn(N, V), torch.zeros(N, dtype=torch.int64)
        with pytest.raises(RuntimeError, match=match):
            K.logprobs_from_logits_stats(logits, lt, inv_t, support, [], [1, int(mode)])
        with pytest.raises(RuntimeError, match=match):
            K.logprobs_from_logits_bwd(logits, lt, inv_t, inv_t, inv_t, inv_t, None, support, [], [int(mode)])
    with pytest.raises(RuntimeError, match="LogprobsBwdParams"):
        K.logprobs_from_logits_bwd(
            torch.randn(N, V), torch.zeros(N, dtype=torch.int64), inv_t, inv_t, inv_t, inv_t, None, None, [], []
        )


def test_threshold_arguments_are_checked():
    N, H, V = 3, 4, 10
    hidden, weight, inv_t = torch.randn(N, H), torch.randn(V, H), torch.ones(N)
    good = dict(top_k=torch.zeros(N, dtype=torch.int64), top_p=torch.ones(N), min_p=torch.zeros(N))
    bad = [
        ("top_k", torch.zeros(N), "top_k"),
        ("top_k", torch.zeros(N + 1, dtype=torch.int64), "top_k"),
        ("top_p", torch.ones(N, dtype=torch.float64), "top_p"),
        ("min_p", torch.zeros(N - 1), "min_p"),
        ("min_p", torch.zeros(2 * N)[::2], "min_p"),
    ]
    for name, value, match in bad:
        a = {**good, name: value}
        with pytest.raises(RuntimeError, match=match):
            linear_threshold(hidden, weight, None, inv_t, a["top_k"], a["top_p"], a["min_p"], 0)
        with pytest.raises(RuntimeError, match=match):
            logits_threshold(torch.randn(N, V), inv_t, a["top_k"], a["top_p"], a["min_p"], 0)
    with pytest.raises(RuntimeError, match="convention"):
        K.logprobs_from_logits_threshold(torch.randn(N, V), inv_t, *good.values(), [], [5])
    with pytest.raises(RuntimeError, match="logits_precision"):
        K.linear_logprobs_threshold(hidden, weight, None, inv_t, *good.values(), [0.0], [9, 0])
    with pytest.raises(RuntimeError, match="inv_temperature"):
        logits_threshold(torch.randn(N, V), torch.ones(N + 1), *good.values(), 0)
    assert logits_threshold(torch.randn(0, V), torch.ones(0), *(t[:0] for t in good.values()), 0).shape == (0,)
    assert linear_threshold(hidden[:0], weight, None, inv_t[:0], *(t[:0] for t in good.values()), 0).shape == (0,)
