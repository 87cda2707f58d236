"""The raw C++ log-prob kernels (csrc/logprobs.cpp) against a straightforward fp64 computation
of their contract (rlvr_kernels/ops/logprobs.py): materialised logits, small sizes. Also
thread-count determinism, batch invariance, empty inputs, the baseline (non-AVX2) build and
garbage CSR / target values (no crash; results unspecified)."""

import os
import subprocess
import sys

import pytest
import torch

from rlvr_kernels._core.dispatch import load_extension
from rlvr_kernels._core.layout import compute_dtype
from rlvr_kernels.contracts.logprobs import (
    NUM_STATS,
    LinearLogprobsBwdParams,
    LinearLogprobsStatsParams,
    LogprobsBwdParams,
    LogprobsStatsParams,
)

pytestmark = pytest.mark.cpu_kernel

# No skip: a missing build is a failure (`make test` builds it).
assert load_extension(), "the C++ kernels are not built: see `rlvr-kernels info` and `rlvr-kernels build`"

K = torch.ops.rlvr_kernels_C

# (rtol, atol scale) of the fp32-accumulated statistics against fp64.
STATS_TOL = {
    torch.float32: 2e-5,
    torch.bfloat16: 2e-5,
    torch.float16: 2e-5,
    torch.float64: 1e-12,
}
# Gradients are also rounded to their own dtype.
GRAD_TOL = {
    torch.float32: 2e-5,
    torch.bfloat16: 2**-7,
    torch.float16: 2**-10,
    torch.float64: 1e-12,
}


# ------------------------------------------------------------------ fp64 contract
def csr_rows(row_ptr):
    return torch.repeat_interleave(torch.arange(row_ptr.numel() - 1), row_ptr.diff())


def ref_z(hidden, weight, bias, inv_t):
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    return z * inv_t.double()[:, None]


def ref_stats(z, need_entropy):
    m = z.max(-1).values
    d = z - m[:, None]
    ex = d.exp()
    e = (ex * d).sum(-1) if need_entropy else torch.zeros_like(m)
    zero = torch.zeros_like(m)  # the linear head's optional columns, not requested here
    return torch.stack([m, ex.sum(-1), e, zero, zero, zero], -1)


def ref_target_logits(z, rows, targets):
    ok = (targets >= 0) & (targets < z.shape[1])
    return torch.where(ok, z[rows, targets.clamp(0, z.shape[1] - 1)], 0.0)


def ref_dz(z, rows, targets, g, lse, ent, h, inv_t):
    """dz = inv_T·(Σ_{t_k = v} g_k − G·p − h·p·(z − lse + entropy)), all in fp64."""
    N, V = z.shape
    g, lse, ent, inv_t = g.double(), lse.double(), ent.double(), inv_t.double()
    p = (z - lse[:, None]).exp()
    G = torch.zeros(N, dtype=torch.float64).index_add_(0, rows, g)
    dz = -G[:, None] * p
    if h is not None:
        dz = dz - h.double()[:, None] * p * (z - lse[:, None] + ent[:, None])
    ok = (targets >= 0) & (targets < V)
    dz.index_put_((rows[ok], targets[ok]), g[ok], accumulate=True)
    return dz * inv_t[:, None]


def assert_close(actual, expected, tol, what):
    expected = expected.double()
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.double(),
        expected,
        rtol=tol,
        atol=tol * scale,
        msg=lambda m: f"{what}: {m}",
    )


# ------------------------------------------------------------------ cases
def make_csr(N, M, V, gen):
    """A CSR of M targets over N rows (repeats, empty rows), ids with −1 and out-of-range ones."""
    rows = torch.randint(0, N, (M,), generator=gen).sort().values if N else torch.zeros(0, dtype=torch.int64)
    row_ptr = torch.zeros(N + 1, dtype=torch.int64)
    row_ptr[1:] = torch.bincount(rows, minlength=N).cumsum(0)
    targets = torch.randint(-2, V + 2, (M,), generator=gen)
    if M > 2:
        targets[1] = targets[2] = targets[0].clamp(0, V - 1)  # repeated target (maybe in one row)
        targets[-1] = -1
    return row_ptr, targets


def make_linear(N, H, V, dtype, bias, gen, shape="normal"):
    ct = compute_dtype(dtype)
    hidden = torch.randn(N, H, generator=gen, dtype=torch.float64) / max(H, 1) ** 0.5 * 2
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64)
    b = torch.randn(V, generator=gen, dtype=torch.float64) if bias else None
    if shape == "peaked":  # one logit +40 above the rest in every row
        b = torch.zeros(V, dtype=torch.float64) if b is None else b
        b[V // 2] += 40
    elif shape == "negative":
        b = (torch.zeros(V, dtype=torch.float64) if b is None else b) - 60
    inv_t = (torch.rand(N, generator=gen, dtype=torch.float64) * 1.5 + 0.5).to(ct)
    return hidden.to(dtype), weight.to(dtype), None if b is None else b.to(dtype), inv_t


def linear_fwd(hidden, weight, bias, inv_t, row_ptr, targets, need_entropy=True, tanh_scale=0.0):
    params = LinearLogprobsStatsParams(
        tanh_scale=tanh_scale, need_entropy=need_entropy, need_sum_sq=False, need_sum_z=False, need_argmax=False
    )
    return K.linear_logprobs_stats(hidden, weight, bias, inv_t, row_ptr, targets, None, *params.pack())


def linear_bwd(*args, need_hidden=True, need_weight=True, need_bias=True, tanh_scale=0.0):
    params = LinearLogprobsBwdParams(
        tanh_scale=tanh_scale, need_hidden=need_hidden, need_weight=need_weight, need_bias=need_bias
    )
    return K.linear_logprobs_bwd(*args, None, *params.pack())


def logits_fwd(logits, targets, inv_t, need_entropy=True):
    params = LogprobsStatsParams(need_entropy=need_entropy)
    return K.logprobs_from_logits_stats(logits, targets, inv_t, None, *params.pack())


def logits_bwd(logits, targets, inv_t, grad_logp, lse, entropy, grad_entropy):
    return K.logprobs_from_logits_bwd(
        logits, targets, inv_t, grad_logp, lse, entropy, grad_entropy, None, *LogprobsBwdParams().pack()
    )


def grad_inputs(stats, M, N, ct, gen, grad_entropy=True):
    """Upstream gradients and the 'global' lse / entropy (shifted, as if other shards added mass)."""
    lse = (stats[:, 0].double() + stats[:, 1].double().log() + 0.25).to(ct)
    ent = (torch.rand(N, generator=gen, dtype=torch.float64) * 3).to(ct)
    g = torch.randn(M, generator=gen, dtype=torch.float64).to(ct)
    h = torch.randn(N, generator=gen, dtype=torch.float64).to(ct) if grad_entropy else None
    return g, lse, ent, h


SHAPES = [(1, 1, 1), (7, 5, 7), (33, 64, 2053), (7, 64, 4100), (130, 5, 600)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
@pytest.mark.parametrize("N,H,V", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_fwd_matches_fp64(dtype, N, H, V, bias):
    gen = torch.Generator().manual_seed(N * 1000 + V + bias)
    hidden, weight, b, inv_t = make_linear(N, H, V, dtype, bias, gen)
    row_ptr, targets = make_csr(N, 2 * N + 1, V, gen)
    for need_entropy in (True, False):
        stats, tl = linear_fwd(hidden, weight, b, inv_t, row_ptr, targets, need_entropy)
        ct = compute_dtype(dtype)
        assert stats.dtype == ct and tl.dtype == ct and stats.shape == (N, NUM_STATS) and tl.shape == targets.shape
        z = ref_z(hidden, weight, b, inv_t)
        assert_close(stats, ref_stats(z, need_entropy), STATS_TOL[dtype], "stats")
        assert_close(
            tl,
            ref_target_logits(z, csr_rows(row_ptr), targets),
            STATS_TOL[dtype],
            "target logits",
        )
        if need_entropy:
            # The target logit is the tile's z: log p = z_t − lse never exceeds 0.
            lse = stats[:, 0] + stats[:, 1].log()
            rows, ok = csr_rows(row_ptr), (targets >= 0) & (targets < V)
            assert bool((tl[ok] - lse[rows[ok]] <= 0).all())


@pytest.mark.parametrize("shape", ["peaked", "negative"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_fwd_extreme_rows(shape, dtype):
    gen = torch.Generator().manual_seed(7)
    N, H, V = 9, 16, 1100
    hidden, weight, b, inv_t = make_linear(N, H, V, dtype, True, gen, shape)
    row_ptr, targets = make_csr(N, 20, V, gen)
    targets[:3] = V // 2
    stats, tl = linear_fwd(hidden, weight, b, inv_t, row_ptr, targets)
    z = ref_z(hidden, weight, b, inv_t)
    ref = ref_stats(z, True)
    torch.testing.assert_close(stats[:, 0].double(), ref[:, 0], rtol=2e-5, atol=2e-5 * z.abs().max().item())
    torch.testing.assert_close(stats[:, 1:].double(), ref[:, 1:], rtol=2e-4, atol=1e-6)
    assert_close(tl, ref_target_logits(z, csr_rows(row_ptr), targets), 2e-5, "target logits")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("N,H,V", SHAPES + [(300, 16, 700)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_bwd_matches_fp64(dtype, N, H, V, bias):
    gen = torch.Generator().manual_seed(N * 1000 + V + 2 * bias + 1)
    ct = compute_dtype(dtype)
    hidden, weight, b, inv_t = make_linear(N, H, V, dtype, bias, gen)
    row_ptr, targets = make_csr(N, 2 * N + 1, V, gen)
    stats, _ = linear_fwd(hidden, weight, b, inv_t, row_ptr, targets)
    z = ref_z(hidden, weight, b, inv_t)
    rows = csr_rows(row_ptr)
    for with_h in (True, False):
        g, lse, ent, h = grad_inputs(stats, targets.numel(), N, ct, gen, with_h)
        dz = ref_dz(z, rows, targets, g, lse, ent, h, inv_t)
        gh, gw, gb = linear_bwd(
            hidden,
            weight,
            b,
            inv_t,
            row_ptr,
            targets,
            g,
            lse,
            ent,
            h,
            need_hidden=True,
            need_weight=True,
            need_bias=bias,
        )
        assert gh.dtype == gw.dtype == dtype and gh.shape == hidden.shape and gw.shape == weight.shape
        assert_close(gh, dz @ weight.double(), GRAD_TOL[dtype], "grad_hidden")
        assert_close(gw, dz.T @ hidden.double(), GRAD_TOL[dtype], "grad_weight")
        if bias:
            assert gb.dtype == dtype and gb.shape == (V,)
            assert_close(gb, dz.sum(0), GRAD_TOL[dtype], "grad_bias")
        else:
            assert gb.numel() == 0


@pytest.mark.parametrize(
    "flags",
    [(True, False, False), (False, True, False), (False, False, True), (False,) * 3],
)
def test_linear_bwd_need_flags(flags):
    gen = torch.Generator().manual_seed(3)
    N, H, V = 40, 8, 900
    hidden, weight, b, inv_t = make_linear(N, H, V, torch.float32, True, gen)
    row_ptr, targets = make_csr(N, 50, V, gen)
    stats, _ = linear_fwd(hidden, weight, b, inv_t, row_ptr, targets)
    g, lse, ent, h = grad_inputs(stats, 50, N, torch.float32, gen)
    args = (hidden, weight, b, inv_t, row_ptr, targets, g, lse, ent, h)
    full = linear_bwd(*args)
    part = linear_bwd(*args, need_hidden=flags[0], need_weight=flags[1], need_bias=flags[2])
    for need, f, p in zip(flags, full, part):
        if need:
            assert torch.equal(f, p)  # the same computation whichever other outputs are asked for
        else:
            assert p.numel() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
@pytest.mark.parametrize("N,V", [(1, 1), (7, 7), (33, 2053)])
def test_logits_kernels_match_fp64(dtype, N, V):
    gen = torch.Generator().manual_seed(N + V)
    ct = compute_dtype(dtype)
    wide = (torch.randn(N, V + 3, generator=gen, dtype=torch.float64) * 3).to(dtype)
    logits = wide[:, 1 : V + 1]  # rows contiguous, row stride V + 3
    if N > 1:
        logits[1, V // 2] += 40  # peaked row
    if N > 2:
        logits[2] -= 80  # all negative
    targets = torch.randint(-2, V + 2, (N,), generator=gen)
    targets[0] = -1
    inv_t = (torch.rand(N, generator=gen, dtype=torch.float64) + 0.5).to(ct)
    z = logits.double() * inv_t.double()[:, None]
    rows = torch.arange(N)
    for need_entropy in (True, False):
        stats, tl = logits_fwd(logits, targets, inv_t, need_entropy)
        assert stats.dtype == tl.dtype == ct
        ref = ref_stats(z, need_entropy)
        torch.testing.assert_close(stats[:, 0].double(), ref[:, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stats[:, 1:].double(), ref[:, 1:], rtol=STATS_TOL[dtype] * 10, atol=1e-6)
        assert_close(tl, ref_target_logits(z, rows, targets), STATS_TOL[dtype], "target logits")
    for with_h in (True, False):
        g, lse, ent, h = grad_inputs(stats, N, N, ct, gen, with_h)
        grad = logits_bwd(logits, targets, inv_t, g, lse, ent, h)
        assert grad.dtype == dtype and grad.shape == (N, V) and grad.is_contiguous()
        assert_close(
            grad,
            ref_dz(z, rows, targets, g, lse, ent, h, inv_t),
            GRAD_TOL[dtype],
            "grad_logits",
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [9, 300])
def test_backward_recomputes_forward_z_exactly(dtype, N):
    """Peaked rows: lse = z_t in fp32, so p_t = 1 and the target's dz is exactly 0 only if the
    backward's z_t is the forward's to the bit (any other rounding is a 100% error in 1 − p_t)."""
    gen = torch.Generator().manual_seed(N)
    H, V, t = 64, 1500, 1234
    hidden, weight, b, inv_t = make_linear(N, H, V, dtype, True, gen)
    b[t] += 60
    row_ptr, targets = torch.arange(N + 1), torch.full((N,), t)
    stats, tl = linear_fwd(hidden, weight, b, inv_t, row_ptr, targets)
    lse = stats[:, 0] + stats[:, 1].log()
    assert torch.equal(lse, tl)
    g = torch.randn(N, generator=gen)
    e = torch.zeros(N)
    _, _, gb = linear_bwd(
        hidden,
        weight,
        b,
        inv_t,
        row_ptr,
        targets,
        g,
        lse,
        e,
        None,
        need_hidden=False,
        need_weight=False,
        need_bias=True,
    )
    assert gb[t].item() == 0
    logits = (torch.randn(N, V, generator=gen) * 3).to(dtype)
    logits[:, t] = 60
    stats, tl = logits_fwd(logits, targets, inv_t, True)
    lse = stats[:, 0] + stats[:, 1].log()
    grad = logits_bwd(logits, targets, inv_t, g, lse, e, None)
    assert bool((grad[:, t] == 0).all())


# ------------------------------------------------------------------ determinism, invariance
def all_outputs(hidden, weight, b, inv_t, row_ptr, targets, logits):
    gen = torch.Generator().manual_seed(0)
    N = hidden.shape[0]
    stats, tl = linear_fwd(hidden, weight, b, inv_t, row_ptr, targets)
    g, lse, ent, h = grad_inputs(stats, targets.numel(), N, torch.float32, gen)
    grads = linear_bwd(hidden, weight, b, inv_t, row_ptr, targets, g, lse, ent, h)
    lstats, ltl = logits_fwd(logits, targets[:N].contiguous(), inv_t, True)
    lgrad = logits_bwd(logits, targets[:N].contiguous(), inv_t, g[:N].contiguous(), lse, ent, h)
    return (stats, tl, *grads, lstats, ltl, lgrad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,H,V", [(300, 64, 5000), (7, 32, 100)])
def test_thread_count_determinism(dtype, N, H, V):
    gen = torch.Generator().manual_seed(11)
    hidden, weight, b, inv_t = make_linear(N, H, V, dtype, True, gen)
    row_ptr, targets = make_csr(N, 2 * N, V, gen)
    logits = torch.randn(N, V, generator=gen).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = all_outputs(hidden, weight, b, inv_t, row_ptr, targets, logits)
        torch.set_num_threads(2)
        two = all_outputs(hidden, weight, b, inv_t, row_ptr, targets, logits)
    finally:
        torch.set_num_threads(before)
    for i, (a, c) in enumerate(zip(one, two)):
        assert torch.equal(a, c), f"output {i} differs between 1 and 2 threads"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_batch_invariance(dtype):
    """A row's forward result does not depend on the other rows nor on its position."""
    gen = torch.Generator().manual_seed(5)
    H, V = 64, 5000
    big, weight, b, inv_t = make_linear(300, H, V, dtype, True, gen)
    small = torch.randn(7, H, generator=gen).to(dtype)
    small_t = inv_t[:7].clone()
    small[5], small_t[5] = big[123], inv_t[123]  # row 5 of 7 is row 123 of 300
    # Row 123 and row 5 each get the same 3 targets.
    tg = torch.tensor([3, V - 1, 4097])

    def csr(N, row):
        row_ptr = torch.zeros(N + 1, dtype=torch.int64)
        row_ptr[row + 1 :] = 3
        return row_ptr, tg

    s_big, t_big = linear_fwd(big, weight, b, inv_t, *csr(300, 123))
    s_small, t_small = linear_fwd(small, weight, b, small_t, *csr(7, 5))
    assert torch.equal(s_big[123], s_small[5]) and torch.equal(t_big, t_small)
    # Every position of a block, and a block padded or not: rows of a batch vs the rows alone.
    for n in (0, 1, 127, 128, 200, 299):
        s1, _ = linear_fwd(big[n : n + 1], weight, b, inv_t[n : n + 1], *csr(1, 0))
        assert torch.equal(s1[0], s_big[n]), n
    s_rows, _ = linear_fwd(big[120:140], weight, b, inv_t[120:140], *csr(20, 3))
    assert torch.equal(s_rows, s_big[120:140])
    # The logits kernel, likewise.
    logits = torch.randn(300, V, generator=gen).to(dtype)
    lt = torch.randint(0, V, (300,), generator=gen)
    ls, ltl = logits_fwd(logits, lt, inv_t, True)
    ls1, ltl1 = logits_fwd(logits[123:124], lt[123:124], inv_t[123:124], True)
    assert torch.equal(ls[123], ls1[0]) and torch.equal(ltl[123], ltl1[0])


def test_empty_inputs():
    H, V = 4, 9
    f = torch.float32
    hidden, weight, bias = torch.zeros(0, H), torch.randn(V, H), torch.randn(V)
    row_ptr, targets, e = (
        torch.zeros(1, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0),
    )
    stats, tl = linear_fwd(hidden, weight, bias, e, row_ptr, targets)
    assert stats.shape == (0, NUM_STATS) and tl.shape == (0,)
    gh, gw, gb = linear_bwd(hidden, weight, bias, e, row_ptr, targets, e, e, e, None)
    assert gh.shape == (0, H) and torch.equal(gw, torch.zeros(V, H)) and torch.equal(gb, torch.zeros(V))
    # M = 0: rows without targets.
    gen = torch.Generator().manual_seed(0)
    hidden, weight, b, inv_t = make_linear(5, H, V, f, True, gen)
    row_ptr = torch.zeros(6, dtype=torch.int64)
    stats, tl = linear_fwd(hidden, weight, b, inv_t, row_ptr, targets)
    assert tl.shape == (0,)
    assert_close(stats, ref_stats(ref_z(hidden, weight, b, inv_t), True), 2e-5, "stats")
    g, lse, ent, h = grad_inputs(stats, 0, 5, f, gen)
    gh, gw, gb = linear_bwd(hidden, weight, b, inv_t, row_ptr, targets, g, lse, ent, h)
    dz = ref_dz(
        ref_z(hidden, weight, b, inv_t),
        csr_rows(row_ptr),
        targets,
        g,
        lse,
        ent,
        h,
        inv_t,
    )
    assert_close(gw, dz.T @ hidden.double(), 2e-5, "grad_weight")
    # Logits with N = 0.
    stats, tl = logits_fwd(torch.zeros(0, V), targets, e, True)
    assert stats.shape == (0, NUM_STATS) and tl.shape == (0,)
    assert logits_bwd(torch.zeros(0, V), targets, e, e, e, e, None).shape == (0, V)


def test_garbage_row_ptr_and_targets_do_not_crash():
    gen = torch.Generator().manual_seed(1)
    N, H, V, M = 20, 8, 300, 40
    hidden, weight, b, inv_t = make_linear(N, H, V, torch.float32, True, gen)
    big = 2**62
    for trial in range(6):
        row_ptr = torch.randint(-3 * M, 3 * M, (N + 1,), generator=gen)
        if trial % 2:
            row_ptr[torch.randint(0, N + 1, (4,), generator=gen)] = torch.tensor([big, -big, 2**63 - 1, -(2**63)])
        targets = torch.randint(-(2**40), 2**40, (M,), generator=gen)
        targets[::3] = torch.randint(0, V, targets[::3].shape, generator=gen)
        targets[0], targets[1] = 2**63 - 1, -(2**63)
        stats, tl = linear_fwd(hidden, weight, b, inv_t, row_ptr, targets)
        g, lse, ent, h = grad_inputs(stats, M, N, torch.float32, gen)
        linear_bwd(hidden, weight, b, inv_t, row_ptr, targets, g, lse, ent, h)
    logits = torch.randn(N, V, generator=gen)
    lt = torch.tensor([2**63 - 1, -(2**63), V, -1] * (N // 4))
    stats, tl = logits_fwd(logits, lt, inv_t, True)
    assert torch.equal(tl, torch.zeros(N))
    logits_bwd(logits, lt, inv_t, inv_t, inv_t, inv_t, inv_t)


# ------------------------------------------------------------------ argument checks
# Each registered op is reachable directly (and from compiled graphs), so every entry point
# checks every shape relation it relies on: each case below must raise, never read or write out
# of bounds (the sanitizer run of this file checks the latter).
def _good_linear(N=6, H=4, V=9, M=8):
    gen = torch.Generator().manual_seed(0)
    hidden, weight, b, inv_t = make_linear(N, H, V, torch.float32, True, gen)
    row_ptr, targets = make_csr(N, M, V, gen)
    stats, _ = linear_fwd(hidden, weight, b, inv_t, row_ptr, targets)
    g, lse, ent, h = grad_inputs(stats, M, N, torch.float32, gen)
    return dict(
        hidden=hidden,
        weight=weight,
        bias=b,
        inv_temperature=inv_t,
        row_ptr=row_ptr,
        sorted_targets=targets,
        sorted_grad=g,
        lse=lse,
        entropy=ent,
        grad_entropy=h,
    )


FWD_ARGS = ("hidden", "weight", "bias", "inv_temperature", "row_ptr", "sorted_targets")
BWD_ARGS = FWD_ARGS + ("sorted_grad", "lse", "entropy", "grad_entropy")

# (argument, replacement given the good arguments, message): a shape or dtype relation broken.
LINEAR_BAD = [
    ("hidden", lambda a: a["hidden"][:, :-1].contiguous(), "weight"),
    ("hidden", lambda a: a["hidden"][None], "hidden"),
    ("hidden", lambda a: a["hidden"].T.contiguous().T, "hidden must be contiguous"),
    ("hidden", lambda a: a["hidden"].long(), "hidden must be float"),
    ("weight", lambda a: a["weight"][:, :-1].contiguous(), "weight"),
    ("weight", lambda a: a["weight"][:0], "weight must have at least one row"),
    ("weight", lambda a: a["weight"].double(), "weight must have hidden's dtype"),
    ("bias", lambda a: a["bias"][:-1], "bias must have shape"),
    ("bias", lambda a: torch.cat([a["bias"], a["bias"]]), "bias must have shape"),
    ("bias", lambda a: a["bias"].double(), "bias must be"),
    ("inv_temperature", lambda a: a["inv_temperature"][:-1], "inv_temperature must have shape"),
    ("inv_temperature", lambda a: torch.cat([a["inv_temperature"]] * 2), "inv_temperature must have shape"),
    ("inv_temperature", lambda a: a["inv_temperature"].double(), "inv_temperature must be"),
    ("inv_temperature", lambda a: a["inv_temperature"][:, None], "inv_temperature must have shape"),
    ("row_ptr", lambda a: a["row_ptr"][:-1], "row_ptr must have shape"),
    ("row_ptr", lambda a: torch.cat([a["row_ptr"], a["row_ptr"]]), "row_ptr must have shape"),
    ("row_ptr", lambda a: a["row_ptr"].int(), "row_ptr must be"),
    ("sorted_targets", lambda a: a["sorted_targets"][:, None], "sorted_targets must be a 1-D int64"),
    ("sorted_targets", lambda a: a["sorted_targets"].int(), "sorted_targets must be a 1-D int64"),
    ("sorted_targets", lambda a: a["sorted_targets"][::2], "sorted_targets must be contiguous"),
]
LINEAR_BWD_BAD = [
    ("sorted_grad", lambda a: a["sorted_grad"][:-1], "sorted_grad must have shape"),
    ("sorted_grad", lambda a: torch.cat([a["sorted_grad"]] * 2), "sorted_grad must have shape"),
    ("sorted_grad", lambda a: a["sorted_grad"].double(), "sorted_grad must be"),
    ("lse", lambda a: a["lse"][:-1], "lse must have shape"),
    ("lse", lambda a: torch.cat([a["lse"]] * 2), "lse must have shape"),
    ("entropy", lambda a: a["entropy"][:-1], "entropy must have shape"),
    ("entropy", lambda a: a["entropy"].double(), "entropy must be"),
    ("grad_entropy", lambda a: a["grad_entropy"][:-1], "grad_entropy must have shape"),
    ("grad_entropy", lambda a: torch.cat([a["grad_entropy"]] * 2), "grad_entropy must have shape"),
]


@pytest.mark.parametrize("arg, bad, match", LINEAR_BAD, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(LINEAR_BAD)])
def test_linear_stats_refuses_inconsistent_shapes(arg, bad, match):
    a = _good_linear()
    a[arg] = bad(a)
    with pytest.raises(RuntimeError, match=match):
        linear_fwd(*(a[k] for k in FWD_ARGS))


@pytest.mark.parametrize(
    "arg, bad, match",
    LINEAR_BAD + LINEAR_BWD_BAD,
    ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(LINEAR_BAD + LINEAR_BWD_BAD)],
)
def test_linear_bwd_refuses_inconsistent_shapes(arg, bad, match):
    a = _good_linear()
    a[arg] = bad(a)
    with pytest.raises(RuntimeError, match=match):
        linear_bwd(*(a[k] for k in BWD_ARGS))


def test_linear_kernels_check_their_parameter_lists():
    a = _good_linear()
    fwd, bwd = [a[k] for k in FWD_ARGS], [a[k] for k in BWD_ARGS]
    with pytest.raises(RuntimeError, match="LinearLogprobsStatsParams: expected 1 fparams and 6 iparams"):
        K.linear_logprobs_stats(*fwd, None, [], [1, 1])
    with pytest.raises(RuntimeError, match="LinearLogprobsStatsParams: expected 1 fparams and 6 iparams"):
        K.linear_logprobs_stats(*fwd, None, [1.0], [1])
    with pytest.raises(RuntimeError, match="LinearLogprobsBwdParams: expected 1 fparams and 5 iparams"):
        K.linear_logprobs_bwd(*bwd, None, [], [1, 1])
    with pytest.raises(RuntimeError, match="logits_precision must be a LogitsPrecision code, got 7"):
        K.linear_logprobs_stats(*fwd, None, [0.0], [1, 0, 0, 0, 7, 0])
    with pytest.raises(RuntimeError, match="logits_precision must be a LogitsPrecision code, got -1"):
        K.linear_logprobs_bwd(*bwd, None, [0.0], [1, 1, 1, -1, 0])
    with pytest.raises(RuntimeError, match="LogprobsStatsParams"):
        K.logprobs_from_logits_stats(torch.randn(3, 5), torch.zeros(3, dtype=torch.int64), torch.ones(3), None, [], [])
    # need_bias without a bias.
    a["bias"] = None
    with pytest.raises(RuntimeError, match="need_bias without a bias"):
        linear_bwd(*(a[k] for k in BWD_ARGS))


def _good_logits(N=5, V=11):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(N, V, generator=gen)
    targets = torch.randint(0, V, (N,), generator=gen)
    inv_t = torch.ones(N)
    stats, _ = logits_fwd(logits, targets, inv_t)
    g, lse, ent, h = grad_inputs(stats, N, N, torch.float32, gen)
    return dict(
        logits=logits, targets=targets, inv_temperature=inv_t, grad_logp=g, lse=lse, entropy=ent, grad_entropy=h
    )


LOGITS_FWD_ARGS = ("logits", "targets", "inv_temperature")
LOGITS_BWD_ARGS = LOGITS_FWD_ARGS + ("grad_logp", "lse", "entropy", "grad_entropy")
LOGITS_BAD = [
    ("logits", lambda a: a["logits"].T, "logits rows must be contiguous"),
    ("logits", lambda a: a["logits"][:, :0], "logits must be \\[N, V\\] with V >= 1"),
    ("logits", lambda a: a["logits"][None], "logits must be \\[N, V\\]"),
    ("logits", lambda a: a["logits"][:-1], "targets must have shape"),
    ("logits", lambda a: a["logits"].long(), "logits must be float"),
    ("targets", lambda a: a["targets"][:-1], "targets must have shape"),
    ("targets", lambda a: torch.cat([a["targets"]] * 2), "targets must have shape"),
    ("targets", lambda a: a["targets"].int(), "targets must be"),
    ("inv_temperature", lambda a: a["inv_temperature"][:-1], "inv_temperature must have shape"),
    ("inv_temperature", lambda a: a["inv_temperature"].double(), "inv_temperature must be"),
]
LOGITS_BWD_BAD = [
    ("grad_logp", lambda a: a["grad_logp"][:-1], "grad_logp must have shape"),
    ("grad_logp", lambda a: torch.cat([a["grad_logp"]] * 2), "grad_logp must have shape"),
    ("lse", lambda a: a["lse"][:-1], "lse must have shape"),
    ("entropy", lambda a: torch.cat([a["entropy"]] * 2), "entropy must have shape"),
    ("grad_entropy", lambda a: a["grad_entropy"][:-1], "grad_entropy must have shape"),
    ("grad_entropy", lambda a: a["grad_entropy"].double(), "grad_entropy must be"),
]


@pytest.mark.parametrize("arg, bad, match", LOGITS_BAD, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(LOGITS_BAD)])
def test_logits_stats_refuses_inconsistent_shapes(arg, bad, match):
    a = _good_logits()
    a[arg] = bad(a)
    with pytest.raises(RuntimeError, match=match):
        logits_fwd(*(a[k] for k in LOGITS_FWD_ARGS))


@pytest.mark.parametrize(
    "arg, bad, match",
    LOGITS_BAD + LOGITS_BWD_BAD,
    ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(LOGITS_BAD + LOGITS_BWD_BAD)],
)
def test_logits_bwd_refuses_inconsistent_shapes(arg, bad, match):
    a = _good_logits()
    a[arg] = bad(a)
    with pytest.raises(RuntimeError, match=match):
        logits_bwd(*(a[k] for k in LOGITS_BWD_ARGS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_logits_rows_at_any_stride(dtype):
    """Rows are only read: a row stride of 0 (an expanded view) or one smaller than V (rows that
    overlap) is a legal layout, with the results of the same rows laid out contiguously and a
    fresh contiguous gradient."""
    gen = torch.Generator().manual_seed(9)
    N, V = 6, 700
    ct = compute_dtype(dtype)
    base = torch.randn(N * V + V, generator=gen).to(dtype)
    targets = torch.randint(0, V, (N,), generator=gen)
    inv_t = (torch.rand(N, generator=gen, dtype=torch.float64) + 0.5).to(ct)
    for stride in (0, 1, 37, V):
        logits = base.as_strided((N, V), (stride, 1))
        dense = logits.contiguous()
        stats, tl = logits_fwd(logits, targets, inv_t)
        want_stats, want_tl = logits_fwd(dense, targets, inv_t)
        assert torch.equal(stats, want_stats) and torch.equal(tl, want_tl), stride
        g, lse, ent, h = grad_inputs(stats, N, N, ct, gen)
        grad = logits_bwd(logits, targets, inv_t, g, lse, ent, h)
        assert grad.is_contiguous() and grad.shape == (N, V)
        assert torch.equal(grad, logits_bwd(dense, targets, inv_t, g, lse, ent, h)), stride


def test_baseline_isa_build():
    """The 16-byte-vector build (what runs without AVX2), in a subprocess: the choice is made once."""
    code = (
        "import torch, sys\n"
        f"sys.path[:0] = [{os.path.dirname(__file__)!r}, {os.path.dirname(os.path.dirname(__file__))!r}]\n"
        "import test_kernel_cpu as t\n"
        "t.test_linear_fwd_matches_fp64(torch.float32, 33, 64, 2053, True)\n"
        "t.test_linear_bwd_matches_fp64(torch.bfloat16, 33, 64, 2053, True)\n"
        "t.test_logits_kernels_match_fp64(torch.float64, 33, 2053)\n"
        "t.test_logits_kernels_match_fp64(torch.float32, 7, 7)\n"
    )
    env = dict(os.environ, RLVR_KERNELS_CPU_NO_AVX2="1")
    res = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
