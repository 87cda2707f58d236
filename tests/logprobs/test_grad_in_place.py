"""``logprobs_from_logits_grad_`` (log-probs and the logits' gradient written over the logits)
against ``logprobs_from_logits`` and its autograd backward on the same backend, bit for bit;
the in-place kernels (``logprobs_from_logits_bwd_``) against the out-of-place ones, a MASK
support included; what the in-place entry points refuse."""

import pytest
import torch
from _backends import ALL, DEVICE
from hypothesis import given
from hypothesis import strategies as st

import rlvr_kernels as rk
from rlvr_kernels.contracts.logprobs import LogprobsBwdParams, LogprobsStatsParams, SupportMode
from rlvr_kernels.ops.logprobs import logprobs_from_logits_grad_

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _case(gen, N, V, dtype, device, temperature, ignore):
    logits = (torch.randn(N, V, generator=gen, dtype=torch.float64) * 3).to(dtype).to(device)
    targets = torch.randint(0, V, (N,), generator=gen)
    if ignore and N:
        targets[torch.rand(N, generator=gen) < 0.3] = -100
    if temperature == "rows":
        temperature = (torch.rand(N, generator=gen, dtype=torch.float64) + 0.5).to(device)
    g = torch.randn(N, generator=gen, dtype=torch.float64).to(device)
    h = torch.randn(N, generator=gen, dtype=torch.float64).to(device)
    return logits, targets.to(device), temperature, g, h


def _by_autograd(logits, targets, temperature, entropy, g, h, backend):
    leaf = logits.clone().requires_grad_()
    res = rk.logprobs_from_logits(leaf, targets, temperature, entropy, backend=backend)
    outs, seeds = [], []
    if g is not None:
        outs, seeds = [res.logp], [g.to(res.logp.dtype)]
    if entropy and h is not None:
        outs.append(res.entropy)
        seeds.append(h.to(res.entropy.dtype))
    grad = torch.autograd.grad(outs, [leaf], seeds)[0] if outs else None
    return res.logp.detach(), (res.entropy.detach() if entropy else None), grad


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "N,V,temperature,entropy,which",
    [
        (7, 131, 1.0, False, "g"),
        (33, 2053, 0.7, True, "gh"),
        (5, 600, "rows", True, "h"),
        (9, 64, "rows", True, "g"),
        (4, 97, 1.3, True, "none"),
        (0, 50, 1.0, True, "gh"),
    ],
    ids=["plain", "entropy-grad", "rows-T-entropy-only", "rows-T-logp-only", "no-grad", "empty"],
)
def test_equals_the_autograd_backward(backend, device, dtype, N, V, temperature, entropy, which):
    gen = torch.Generator().manual_seed(N * 1000 + V)
    logits, targets, temperature, g, h = _case(gen, N, V, dtype, device, temperature, ignore=True)
    g_in = g if "g" in which else None
    h_in = h if "h" in which else None
    want_logp, want_ent, want_grad = _by_autograd(logits, targets, temperature, entropy, g_in, h_in, backend)
    seen = {}

    def grad_of(logp, ent):
        seen["logp"], seen["ent"] = logp.clone(), (None if ent is None else ent.clone())
        return g_in, h_in

    buf = logits.clone()
    res, formed = logprobs_from_logits_grad_(buf, targets, grad_of, temperature, entropy, backend=backend)
    assert torch.equal(res.logp, want_logp) and torch.equal(seen["logp"], want_logp)
    if entropy:
        assert torch.equal(res.entropy, want_ent) and torch.equal(seen["ent"], want_ent)
    else:
        assert res.entropy is None and seen["ent"] is None
    if want_grad is None or (not entropy and g_in is None):
        assert not formed and torch.equal(buf, logits)  # left as it was
    else:
        assert formed and buf.dtype == logits.dtype
        assert torch.equal(buf, want_grad), float((buf.double() - want_grad.double()).abs().max())


@given(
    n=st.integers(0, 24),
    v=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    temperature=st.sampled_from([1.0, 0.6, "rows"]),
    entropy=st.booleans(),
    which=st.sampled_from(["g", "h", "gh", "none"]),
    seed=st.integers(0, 2**16),
)
def test_random_sizes_on_the_cpu_kernels(n, v, dtype, temperature, entropy, which, seed):
    """Random shapes, dtypes, temperatures and gradients: the C++ kernels' in-place gradient is
    the autograd backward's, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    logits, targets, temperature, g, h = _case(gen, n, v, dtype, "cpu", temperature, ignore=True)
    g_in = g if "g" in which else None
    h_in = h if "h" in which else None
    _, _, want = _by_autograd(logits, targets, temperature, entropy, g_in, h_in, "cpu")
    buf = logits.clone()
    res, formed = logprobs_from_logits_grad_(buf, targets, lambda lp, e: (g_in, h_in), temperature, entropy)
    assert formed == (want is not None and (g_in is not None or entropy))
    assert torch.equal(buf, want if formed else logits)


def test_refuses_what_it_cannot_write_over():
    logits = torch.randn(4, 10)
    targets = torch.zeros(4, dtype=torch.long)
    grad_of = lambda lp, e: (torch.ones_like(lp), None)  # noqa: E731
    with pytest.raises(ValueError, match="logits"):
        logprobs_from_logits_grad_(torch.randn(10, 4).t(), targets, grad_of)
    with pytest.raises(ValueError, match="logits"):
        logprobs_from_logits_grad_(torch.randn(2, 2, 10), torch.zeros(2, 2, dtype=torch.long), grad_of)
    with pytest.raises(TypeError, match="grad_of"):
        logprobs_from_logits_grad_(logits, targets, None)
    with pytest.raises(ValueError, match="targets"):
        logprobs_from_logits_grad_(logits, torch.full((4,), 10), grad_of)
    with pytest.raises(ValueError, match="backend"):
        logprobs_from_logits_grad_(logits, targets, grad_of, backend="gpu")


# ------------------------------------------------------------------ the kernels themselves


def _kernel_args(gen, N, V, mode, device):
    logits = (torch.randn(N, V, generator=gen) * 2).to(device)
    targets = torch.randint(0, V, (N,), generator=gen).to(device)
    inv_t = (torch.rand(N, generator=gen) + 0.5).to(device)
    support = None
    if mode == SupportMode.MASK:
        words = (V + 31) // 32
        support = torch.randint(-(2**31), 2**31 - 1, (N, words), generator=gen, dtype=torch.int64)
        support = support.to(torch.int32).to(device)
        support[:, 0] |= 1  # column 0 kept in every row: no empty row
        targets = torch.zeros_like(targets)
    stats_p = LogprobsStatsParams(need_entropy=True, support_mode=mode)
    return logits, targets, inv_t, support, stats_p


def _kernels(backend):
    if backend == "cpu":
        from rlvr_kernels._core.dispatch import load_extension

        assert load_extension()
        K = torch.ops.rlvr_kernels_C
        return K.logprobs_from_logits_stats, K.logprobs_from_logits_bwd, K.logprobs_from_logits_bwd_
    from rlvr_kernels.triton import logprobs as lp

    return lp.logprobs_from_logits_stats, lp.logprobs_from_logits_bwd, lp.logprobs_from_logits_bwd_


@pytest.mark.parametrize(
    "backend,device", [pytest.param("cpu", "cpu", marks=pytest.mark.cpu_kernel), ("triton", DEVICE)]
)
@pytest.mark.parametrize("mode", [SupportMode.NONE, SupportMode.MASK])
@pytest.mark.parametrize("grad_entropy", [False, True])
def test_kernel_in_place_equals_out_of_place(backend, device, mode, grad_entropy):
    stats_fn, bwd, bwd_ = _kernels(backend)
    gen = torch.Generator().manual_seed(int(mode) * 2 + grad_entropy)
    N, V = 13, 1031
    logits, targets, inv_t, support, stats_p = _kernel_args(gen, N, V, mode, device)
    stats, _ = stats_fn(logits, targets, inv_t, support, *stats_p.pack())
    lse = (stats[:, 0] + stats[:, 1].log()).contiguous()
    ent = torch.rand(N, generator=gen).to(device)
    g = torch.randn(N, generator=gen).to(device)
    h = torch.randn(N, generator=gen).to(device) if grad_entropy else None
    params = LogprobsBwdParams(support_mode=mode).pack()
    want = bwd(logits, targets, inv_t, g, lse, ent, h, support, *params)
    got = logits.clone()
    assert bwd_(got, targets, inv_t, g, lse, ent, h, support, *params) is None
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "backend,device", [pytest.param("cpu", "cpu", marks=pytest.mark.cpu_kernel), ("triton", DEVICE)]
)
def test_kernel_in_place_refusals(backend, device):
    _, _, bwd_ = _kernels(backend)
    error = RuntimeError if backend == "cpu" else ValueError
    N, V = 4, 40
    v = torch.zeros(N, device=device)
    t = torch.zeros(N, dtype=torch.long, device=device)
    with pytest.raises(error, match="contiguous"):
        bwd_(torch.zeros(V, N, device=device).t(), t, v + 1, v, v, v, None, None, *LogprobsBwdParams().pack())
    params = LogprobsBwdParams(support_mode=SupportMode.THRESHOLD).pack()
    with pytest.raises(error, match="THRESHOLD"):
        bwd_(torch.zeros(N, V, device=device), t, v + 1, v, v, v, None, v, *params)
    if backend == "cpu":  # the C++ checks its shapes too
        with pytest.raises(RuntimeError, match="grad_logp"):
            bwd_(torch.zeros(N, V), t, v + 1, torch.zeros(N + 1), v, v, None, None, *LogprobsBwdParams().pack())


def test_op_refuses_threshold():
    op = torch.ops.rlvr_kernels.logprobs_from_logits_bwd_
    v = torch.zeros(3)
    t = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="support_mode"):
        op(torch.zeros(3, 8), t, v + 1, v, v, v, None, v, int(SupportMode.THRESHOLD), "cpu")
    with pytest.raises(ValueError, match="logits"):
        op(torch.zeros(8, 3).t(), t, v + 1, v, v, v, None, None, int(SupportMode.NONE), "cpu")
