"""The Triton logprobs kernels (rlvr_kernels/triton/logprobs.py) called directly, against a
straightforward torch computation of the kernel contract (rlvr_kernels/ops/logprobs.py)
with materialised logits, under the repository's tolerance rule (rlvr_kernels.testing).

Without a GPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET)
with 16-wide tiles, so that these tiny shapes still cross every tile boundary (N, V and H
are not multiples of the tiles); 16-bit dot operands are upcast to fp32 there (the
interpreter's bf16 dot is broken), and the real bf16 path is covered by the ahead-of-time
compile (tests/common/test_triton_aot.py) and the GPU run, which also runs the default tiles.
"""

import pytest
import torch
from _backends import DEVICE, INTERPRETED

from rlvr_kernels.contracts.logprobs import (
    NUM_STATS,
    LinearLogprobsBwdParams,
    LinearLogprobsStatsParams,
    LogprobsBwdParams,
    LogprobsStatsParams,
)
from rlvr_kernels.testing import compare
from rlvr_kernels.triton import logprobs as lp

SMALL = {
    "linear_fwd": dict(BLOCK_N=16, BLOCK_V=16, BLOCK_H=16, num_warps=4, num_stages=2),
    "linear_fwd_extra": dict(BLOCK_N=16, BLOCK_V=16, BLOCK_H=16, num_warps=4, num_stages=2),
    "linear_bwd": dict(BLOCK_N=16, BLOCK_V=32, BLOCK_H=16, BLOCK_HG=16, num_warps=4, num_stages=2),
    "logits_fwd": dict(BLOCK=32, num_warps=4),
    "logits_bwd": dict(BLOCK=32, num_warps=4),
}
F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
SPECIAL_TARGETS = (-1, 2**40, -(2**40))  # never a column; V and V + 7 are added per case


@pytest.fixture(params=["small"] + (["default"] if DEVICE == "cuda" else []), autouse=True)
def tiles(request, monkeypatch):
    if request.param == "small":
        monkeypatch.setattr(lp, "config", lambda kind, dtype, arch=None: dict(SMALL[kind]))
    return request.param


def stats_params(need_entropy, linear=True, tanh_scale=0.0):
    if not linear:
        fparams, iparams = LogprobsStatsParams(need_entropy=need_entropy).pack()
    else:
        fparams, iparams = LinearLogprobsStatsParams(
            tanh_scale=tanh_scale, need_entropy=need_entropy, need_sum_sq=False, need_sum_z=False, need_argmax=False
        ).pack()
    return dict(support=None, fparams=fparams, iparams=iparams)  # no sampling support (test_support_triton.py)


def bwd_params(need_hidden, need_weight, need_bias, tanh_scale=0.0):
    params = LinearLogprobsBwdParams(
        tanh_scale=tanh_scale, need_hidden=need_hidden, need_weight=need_weight, need_bias=need_bias
    )
    fparams, iparams = params.pack()
    return dict(support=None, fparams=fparams, iparams=iparams)


def logits_bwd_params():
    fparams, iparams = LogprobsBwdParams().pack()
    return dict(support=None, fparams=fparams, iparams=iparams)


def cdt_of(dtype):
    return F64 if dtype == F64 else F32


# ---------------------------------------------------------------------------------------
# inputs and the contract in torch


def linear_case(N, V, H, dtype, bias=True, seed=0, max_count=3, row_ptr=None):
    """Random inputs: per-row inverse temperatures (one row at 50: softmax underflows),
    rows peaked by a +40 margin on their first target, a CSR of 0-3 targets per row with
    empty rows, repeated ids and ids outside [0, V)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=gen)
    w = torch.randn(V, H, generator=gen) * (2.0 / max(H, 1) ** 0.5)
    b = torch.randn(V, generator=gen) if bias else None
    inv_t = torch.rand(N, generator=gen, dtype=torch.float64) * 1.5 + 0.5
    if N >= 2:
        inv_t[1] = 50.0
    if row_ptr is None:
        counts = torch.randint(0, max_count + 1, (N,), generator=gen)
        if N >= 3:
            counts[2] = 0
        row_ptr = torch.zeros(N + 1, dtype=torch.long)
        row_ptr[1:] = torch.cumsum(counts, 0)
    M = int(row_ptr[-1]) if N else 0
    tg = torch.randint(0, V, (M,), generator=gen)
    specials = torch.tensor((*SPECIAL_TARGETS, V, V + 7))
    odd = torch.rand(M, generator=gen) < 0.25
    tg[odd] = specials[torch.randint(0, len(specials), (M,), generator=gen)][odd]
    peak = int(torch.randint(0, V, (1,), generator=gen))
    if H >= 2:  # column 0 of W is one-hot at `peak`: hidden[n, 0] adds to z[n, peak] only
        w[:, 0] = (torch.arange(V) == peak).float()
    for n in range(N):
        lo, hi = min(max(int(row_ptr[n]), 0), M), min(max(int(row_ptr[n + 1]), 0), M)
        if H >= 2 and n % 3 == 0:  # peaked row: +40 (before inv_T) on its first target
            x[n, 0] = 40.0
            if hi > lo:
                tg[lo] = peak
        if hi - lo >= 2 and n % 2:
            tg[lo + 1] = tg[lo]  # a repeated id
    x, w = x.to(dtype), w.to(dtype)
    b = b.to(dtype) if b is not None else None
    return dict(hidden=x, weight=w, bias=b, inv_temperature=inv_t.to(cdt_of(dtype)), row_ptr=row_ptr, sorted_targets=tg)


def csr_rows(row_ptr, M):
    """(row, k) of every target, with the kernels' clamping of row_ptr into [0, M]."""
    out = []
    for n in range(row_ptr.shape[0] - 1):
        beg = min(max(int(row_ptr[n]), 0), M)
        end = min(max(int(row_ptr[n + 1]), beg), M)
        out += [(n, k) for k in range(beg, end)]
    return out


def ref_z(c, rdt):
    z = c["hidden"].to(rdt) @ c["weight"].to(rdt).T
    if c["bias"] is not None:
        z = z + c["bias"].to(rdt)
    return z * c["inv_temperature"].to(rdt)[:, None]


def ref_stats(z, need_entropy=True):
    mx = z.max(1).values
    d = z - mx[:, None]
    e = d.exp()
    t = (e * d).sum(1) if need_entropy else torch.zeros_like(mx)
    zero = torch.zeros_like(mx)  # the linear head's optional columns, not requested here
    return torch.stack([mx, e.sum(1), t, zero, zero, zero], 1)


def ref_target_logits(z, row_ptr, tg):
    V = z.shape[1]
    out = torch.zeros(tg.shape[0], dtype=z.dtype)
    for n, k in csr_rows(row_ptr, tg.shape[0]):
        if 0 <= int(tg[k]) < V:
            out[k] = z[n, int(tg[k])]
    return out


def ref_dz(z, row_ptr, tg, g, lse, ent, gent, inv_t):
    """The contract's dz (rdt = z's dtype)."""
    N, V = z.shape
    rdt = z.dtype
    g, lse, ent, inv_t = g.to(rdt), lse.to(rdt), ent.to(rdt), inv_t.to(rdt)
    S = torch.zeros(N, V, dtype=rdt)
    G = torch.zeros(N, dtype=rdt)
    for n, k in csr_rows(row_ptr, tg.shape[0]):
        G[n] += g[k]
        if 0 <= int(tg[k]) < V:
            S[n, int(tg[k])] += g[k]
    p = (z - lse[:, None]).exp()
    inner = S - G[:, None] * p
    if gent is not None:
        inner = inner - gent.to(rdt)[:, None] * p * (z - lse[:, None] + ent[:, None])
    return inv_t[:, None] * inner


def global_stats(z64):
    """lse and entropy of fp64 logits (the wrapper's combine of the statistics)."""
    lse = torch.logsumexp(z64, 1)
    p = (z64 - lse[:, None]).exp()
    return lse, lse - (p * z64).sum(1)


def check(field, fast, ref64, same, out_dtype):
    """The repository's rule, plus a tight bound for fp64 (fp64 must compute in fp64)."""
    fast = fast.cpu()
    assert fast.dtype == out_dtype, (field, fast.dtype, out_dtype)
    c = compare(field, fast, ref64, same, out_dtype)
    assert c.ok, c
    if out_dtype == F64 and ref64.numel():
        scale = max(1.0, float(ref64.abs().max()))
        assert float((fast - ref64).abs().max()) <= 1e-12 * scale, field


def on_device(c):
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in c.items()}


# ---------------------------------------------------------------------------------------
# linear_logprobs

FWD_CASES = [  # dtype, N, V, H, bias, need_entropy
    (F32, 37, 131, 33, True, True),
    (F64, 37, 131, 33, True, True),
    (BF16, 37, 131, 33, False, True),
    (F16, 7, 131, 5, True, True),
    (F32, 7, 7, 5, False, False),
    (F32, 1, 1, 1, True, True),
    (F64, 7, 1, 33, True, True),
    (BF16, 1, 131, 5, True, False),
]


@pytest.mark.parametrize("dtype,N,V,H,bias,need_entropy", FWD_CASES)
def test_linear_fwd(dtype, N, V, H, bias, need_entropy):
    c = linear_case(N, V, H, dtype, bias)
    stats, tlog = lp.linear_logprobs_stats(**on_device(c), **stats_params(need_entropy))
    cdt = cdt_of(dtype)
    z64 = ref_z(c, F64)
    zs = ref_z(c, cdt)
    check("stats", stats, ref_stats(z64, need_entropy), ref_stats(zs, need_entropy).to(F64), cdt)
    check(
        "target_logits",
        tlog,
        ref_target_logits(z64, c["row_ptr"], c["sorted_targets"]),
        ref_target_logits(zs, c["row_ptr"], c["sorted_targets"]).to(F64),
        cdt,
    )
    if not need_entropy:
        assert not stats[:, 2].any()
    # Unmatched targets (−1, other shards' ids) read exactly 0; log p = z_t − lse ≤ 0.
    tg = c["sorted_targets"]
    assert not tlog.cpu()[(tg < 0) | (tg >= V)].any()
    lse = stats[:, 0].cpu() + stats[:, 1].cpu().log()
    for n, k in csr_rows(c["row_ptr"], tg.shape[0]):
        if 0 <= int(tg[k]) < V:
            assert float(tlog[k]) - float(lse[n]) <= 0.0


BWD_CASES = [  # dtype, N, V, H, bias, grad_entropy, (need_hidden, need_weight, need_bias)
    (F32, 37, 131, 33, True, True, (True, True, True)),
    (F64, 37, 131, 33, True, True, (True, True, True)),
    (BF16, 37, 131, 33, False, False, (True, True, False)),
    (F32, 7, 7, 5, True, True, (True, False, False)),
    (F32, 7, 7, 5, True, False, (False, True, False)),
    (F32, 7, 131, 5, True, True, (False, False, True)),
    (F32, 1, 1, 1, True, True, (True, True, True)),
    (F64, 7, 1, 33, False, True, (True, True, False)),
]


def bwd_inputs(c, grad_entropy, seed=1):
    gen = torch.Generator().manual_seed(seed)
    cdt = cdt_of(c["hidden"].dtype)
    N, M = c["hidden"].shape[0], c["sorted_targets"].shape[0]
    lse, ent = global_stats(ref_z(c, F64))
    return dict(
        sorted_grad=torch.randn(M, generator=gen, dtype=F64).to(cdt),
        lse=lse.to(cdt),
        entropy=ent.to(cdt),
        grad_entropy=torch.randn(N, generator=gen, dtype=F64).to(cdt) if grad_entropy else None,
    )


def ref_linear_bwd(c, gi, rdt):
    dz = ref_dz(
        ref_z(c, rdt),
        c["row_ptr"],
        c["sorted_targets"],
        gi["sorted_grad"],
        gi["lse"],
        gi["entropy"],
        gi["grad_entropy"],
        c["inv_temperature"],
    )
    return dz @ c["weight"].to(rdt), dz.T @ c["hidden"].to(rdt), dz.sum(0)


@pytest.mark.parametrize("dtype,N,V,H,bias,grad_entropy,needs", BWD_CASES)
def test_linear_bwd(dtype, N, V, H, bias, grad_entropy, needs):
    c = linear_case(N, V, H, dtype, bias)
    gi = bwd_inputs(c, grad_entropy)
    out = lp.linear_logprobs_bwd(**on_device(c), **on_device(gi), **bwd_params(*needs))
    r64 = ref_linear_bwd(c, gi, F64)
    rs = ref_linear_bwd(c, gi, cdt_of(dtype))
    for name, fast, ref64, same, need in zip(
        ("grad_hidden", "grad_weight", "grad_bias"), out, r64, rs, needs, strict=True
    ):
        if not need:
            assert fast.shape == (0,), name
            continue
        check(name, fast, ref64, same.to(dtype).to(F64), dtype)


def test_linear_bwd_deterministic():
    c = linear_case(37, 131, 33, F32, True, seed=3)
    gi = on_device(bwd_inputs(c, True))
    c = on_device(c)
    a = lp.linear_logprobs_bwd(**c, **gi, **bwd_params(True, True, True))
    b = lp.linear_logprobs_bwd(**c, **gi, **bwd_params(True, True, True))
    for u, v in zip(a, b, strict=True):
        assert torch.equal(u, v)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_linear_fwd_batch_invariant(dtype, tiles):
    """A row's statistics and target logits are bitwise the same whatever else is in the
    batch (another size, other rows) and wherever the row sits in it. The interpreter's
    dot is numpy's matmul, whose result for a row depends on the row's position inside
    the block (BLAS micro-kernel edges), so there the rows keep their offset in the
    16-row block; the GPU's MMA does not care, and the GPU moves them anywhere."""
    big = linear_case(37, 131, 33, dtype, True, seed=5)
    if INTERPRETED and tiles == "small":
        keep = list(range(16, 32))  # rows 16..31 at 0..15, then other rows
        pick = [*keep, 0, 5, 36]
    else:
        keep = pick = [20, 3, 36, 17, 0, 9, 31]
    counts = big["row_ptr"][1:] - big["row_ptr"][:-1]
    small = dict(big, hidden=big["hidden"][pick], inv_temperature=big["inv_temperature"][pick])
    small["row_ptr"] = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts[pick], 0)])
    small["sorted_targets"] = torch.cat(
        [big["sorted_targets"][big["row_ptr"][n] : big["row_ptr"][n + 1]] for n in pick]
    )
    s_big, t_big = lp.linear_logprobs_stats(**on_device(big), **stats_params(True))
    s_small, t_small = lp.linear_logprobs_stats(**on_device(small), **stats_params(True))
    assert torch.equal(s_big[keep], s_small[: len(keep)])
    t_keep = torch.cat([t_big[big["row_ptr"][n] : big["row_ptr"][n + 1]] for n in keep])
    assert torch.equal(t_keep, t_small[: t_keep.shape[0]])


def test_linear_empty():
    # N = 0 (so M = 0): empty outputs; the weight / bias gradients are sums over no rows.
    c = linear_case(0, 7, 5, F32, True)
    stats, tlog = lp.linear_logprobs_stats(**on_device(c), **stats_params(True))
    assert stats.shape == (0, NUM_STATS) and tlog.shape == (0,)
    gi = dict(sorted_grad=torch.zeros(0), lse=torch.zeros(0), entropy=torch.zeros(0), grad_entropy=torch.zeros(0))
    gh, gw, gb = lp.linear_logprobs_bwd(**on_device(c), **on_device(gi), **bwd_params(True, True, True))
    assert gh.shape == (0, 5) and gh.dtype == F32
    assert gw.shape == (7, 5) and not gw.any() and gb.shape == (7,) and not gb.any()
    # M = 0, N > 0: no targets; the statistics and the entropy gradient still flow.
    c = linear_case(7, 7, 5, F32, True, row_ptr=torch.zeros(8, dtype=torch.long))
    stats, tlog = lp.linear_logprobs_stats(**on_device(c), **stats_params(True))
    assert tlog.shape == (0,)
    check("stats", stats, ref_stats(ref_z(c, F64)), ref_stats(ref_z(c, F32)).to(F64), F32)
    gi = bwd_inputs(c, True)
    out = lp.linear_logprobs_bwd(**on_device(c), **on_device(gi), **bwd_params(True, True, True))
    for name, fast, ref64, same in zip(
        ("gh", "gw", "gb"), out, ref_linear_bwd(c, gi, F64), ref_linear_bwd(c, gi, F32), strict=True
    ):
        check(name, fast, ref64, same.to(F64), F32)


def test_linear_malformed_csr_stays_in_bounds():
    """row_ptr outside [0, M] is clamped (the kernels' documented behaviour), and the
    targets are read only inside [0, M): they are a slice of a buffer whose neighbours
    would match column 0 with a huge gradient if they were read."""
    N, V, H = 3, 7, 5
    row_ptr = torch.tensor([-3, 2, 2, 9])  # clamped: rows [0, 2), [2, 2), [2, 4)
    c = linear_case(N, V, H, F32, True, row_ptr=row_ptr)
    M = 4
    buf = torch.zeros(M + 8, dtype=torch.long)
    buf[4 : 4 + M] = torch.tensor([1, 3, -1, 6])
    c["sorted_targets"] = buf[4 : 4 + M]
    gbuf = torch.full((M + 8,), 1e30)
    gbuf[4 : 4 + M] = torch.tensor([0.5, -1.0, 2.0, 0.25])
    _, tlog = lp.linear_logprobs_stats(**on_device(c), **stats_params(True))
    z64 = ref_z(c, F64)
    check(
        "target_logits",
        tlog,
        ref_target_logits(z64, row_ptr, c["sorted_targets"]),
        ref_target_logits(ref_z(c, F32), row_ptr, c["sorted_targets"]).to(F64),
        F32,
    )
    lse, ent = global_stats(z64)
    gi = dict(sorted_grad=gbuf[4 : 4 + M], lse=lse.float(), entropy=ent.float(), grad_entropy=None)
    out = lp.linear_logprobs_bwd(**on_device(c), **on_device(gi), **bwd_params(True, True, True))
    for name, fast, ref64, same in zip(
        ("gh", "gw", "gb"), out, ref_linear_bwd(c, gi, F64), ref_linear_bwd(c, gi, F32), strict=True
    ):
        check(name, fast, ref64, same.to(F64), F32)


# ---------------------------------------------------------------------------------------
# logprobs_from_logits

LOGITS_CASES = [  # dtype, N, V, need_entropy / grad_entropy
    (F32, 37, 131, True),
    (F64, 37, 131, True),
    (BF16, 7, 131, True),
    (F16, 7, 7, False),
    (F32, 7, 1, True),
    (F32, 1, 7, False),
]


def logits_case(N, V, dtype, seed=0):
    """Logits as a column slice of a wider tensor (row stride V + 5), a peaked row (+40),
    a row at inverse temperature 50, targets inside and outside [0, V)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(N, V + 5, generator=gen, dtype=F64) * 3
    tg = torch.randint(0, V, (N,), generator=gen)
    specials = torch.tensor((*SPECIAL_TARGETS, V, V + 2))
    odd = torch.rand(N, generator=gen) < 0.3
    tg[odd] = specials[torch.randint(0, len(specials), (N,), generator=gen)][odd]
    if N >= 1 and 0 <= int(tg[0]) < V:
        wide[0, int(tg[0])] += 40.0
    inv_t = torch.rand(N, generator=gen, dtype=F64) * 1.5 + 0.5
    if N >= 2:
        inv_t[1] = 50.0
    logits = wide.to(dtype)[:, 2 : 2 + V]
    assert logits.stride() == (V + 5, 1)
    return dict(logits=logits, targets=tg, inv_temperature=inv_t.to(cdt_of(dtype)))


@pytest.mark.parametrize("dtype,N,V,flag", LOGITS_CASES)
def test_logits_fwd_bwd(dtype, N, V, flag):
    c = logits_case(N, V, dtype)
    cdt = cdt_of(dtype)
    stats, tlog = lp.logprobs_from_logits_stats(**on_device(c), **stats_params(flag, linear=False))

    def z_of(rdt):
        return c["logits"].to(rdt) * c["inv_temperature"].to(rdt)[:, None]

    rows = torch.arange(N + 1)
    tg = c["targets"]
    check("stats", stats, ref_stats(z_of(F64), flag), ref_stats(z_of(cdt), flag).to(F64), cdt)
    check(
        "target_logits",
        tlog,
        ref_target_logits(z_of(F64), rows, tg),
        ref_target_logits(z_of(cdt), rows, tg).to(F64),
        cdt,
    )
    if not flag:
        assert not stats[:, 2].any()

    gen = torch.Generator().manual_seed(7)
    lse, ent = global_stats(z_of(F64))
    g = torch.randn(N, generator=gen, dtype=F64).to(cdt)
    h = torch.randn(N, generator=gen, dtype=F64).to(cdt) if flag else None
    gi = on_device(dict(grad_logp=g, lse=lse.to(cdt), entropy=ent.to(cdt), grad_entropy=h))
    grad = lp.logprobs_from_logits_bwd(**on_device(c), **gi, **logits_bwd_params())
    assert grad.is_contiguous() and grad.shape == (N, V)
    ref64 = ref_dz(z_of(F64), rows, tg, g, lse, ent, h, c["inv_temperature"])
    same = ref_dz(z_of(cdt), rows, tg, g, lse, ent, h, c["inv_temperature"]).to(dtype).to(F64)
    check("grad_logits", grad, ref64, same, dtype)


def test_logits_empty_and_batch_invariant():
    c = logits_case(0, 7, F32)
    stats, tlog = lp.logprobs_from_logits_stats(**on_device(c), **stats_params(True, linear=False))
    assert stats.shape == (0, NUM_STATS) and tlog.shape == (0,)
    z = torch.zeros(0)
    assert lp.logprobs_from_logits_bwd(
        **on_device(c), grad_logp=z, lse=z, entropy=z, grad_entropy=None, **logits_bwd_params()
    ).shape == (0, 7)
    big = logits_case(37, 131, BF16, seed=2)
    pick = [20, 3, 36, 0]
    small = dict(logits=big["logits"][pick], targets=big["targets"][pick], inv_temperature=big["inv_temperature"][pick])
    s_big, t_big = lp.logprobs_from_logits_stats(**on_device(big), **stats_params(True, linear=False))
    s_small, t_small = lp.logprobs_from_logits_stats(**on_device(small), **stats_params(True, linear=False))
    assert torch.equal(s_big[pick], s_small) and torch.equal(t_big[pick], t_small)


@pytest.mark.parametrize("stride", [0, 1])
def test_logits_rows_at_any_stride(stride):
    """Rows are only read: an expanded view (row stride 0) and overlapping rows give the
    results of the same rows laid out contiguously; the gradient is fresh and contiguous."""
    gen = torch.Generator().manual_seed(4)
    N, V = 5, 37
    base = torch.randn(N * V + V, generator=gen, dtype=F64).float()
    logits = base.as_strided((N, V), (stride, 1))
    c = dict(logits=logits, targets=torch.randint(0, V, (N,), generator=gen), inv_temperature=torch.full((N,), 1.3))
    dense = dict(c, logits=logits.contiguous())
    stats, tlog = lp.logprobs_from_logits_stats(**on_device(c), **stats_params(True, linear=False))
    want_stats, want_tlog = lp.logprobs_from_logits_stats(**on_device(dense), **stats_params(True, linear=False))
    assert torch.equal(stats, want_stats) and torch.equal(tlog, want_tlog)
    lse, ent = global_stats((logits.double() * 1.3))
    gi = on_device(
        dict(grad_logp=torch.randn(N, generator=gen), lse=lse.float(), entropy=ent.float(), grad_entropy=None)
    )
    grad = lp.logprobs_from_logits_bwd(**on_device(c), **gi, **logits_bwd_params())
    want = lp.logprobs_from_logits_bwd(**on_device(dense), **gi, **logits_bwd_params())
    assert grad.is_contiguous() and torch.equal(grad, want)


def test_launchers_check_their_parameter_lists():
    c = on_device(linear_case(3, 7, 5, F32, True))
    with pytest.raises(ValueError, match="LinearLogprobsStatsParams: expected 1 fparams and 6 iparams"):
        lp.linear_logprobs_stats(**c, support=None, fparams=[], iparams=[1, 1])
    gi = on_device(bwd_inputs(linear_case(3, 7, 5, F32, True), True))
    with pytest.raises(ValueError, match="LinearLogprobsBwdParams: expected 1 fparams and 5 iparams"):
        lp.linear_logprobs_bwd(**c, **gi, support=None, fparams=[], iparams=[1])
    lc = on_device(logits_case(3, 7, F32))
    with pytest.raises(ValueError, match="LogprobsStatsParams"):
        lp.logprobs_from_logits_stats(**lc, support=None, fparams=[1.0], iparams=[1])
