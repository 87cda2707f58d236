"""The fast backends (C++, Triton) of ``linear_logprobs`` and ``logprobs_from_logits``
against the fp64 reference: log-probs, entropies and every gradient under random
per-token upstream gradients, on odd sizes (V not a multiple of any tile, V > 65536),
peaked / flat / all-negative rows, temperatures, ignored targets, row_index with repeats,
fp32 / bf16; plus the invariants (log p ≤ 0, 0 ≤ entropy ≤ log V), batch invariance,
determinism, non-contiguous inputs and empty inputs."""

import math
import zlib

import pytest
import torch
from _backends import ALL, FAST, INTERPRETED

import rlvr_kernels as rk
from rlvr_kernels.testing import (
    as_float64,
    logits_case_from,
    logprobs_upstream,
    random_logprobs_case,
    run_logprobs,
)
from rlvr_kernels.testing.logprobs import assert_matches_reference, check_cases

CASES = check_cases()


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_check_cases(backend, device, case):
    name, kw, via_logits, extra = case
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # str hash() varies per process
    inputs = random_logprobs_case(gen, device=device, **kw)
    if via_logits:
        inputs = logits_case_from(inputs)
    inputs.update(extra)
    assert_matches_reference(inputs, backend, gen)


# Large vocabularies: the C++ kernel always; Triton on a GPU (the interpreter needs minutes).
BIG = [FAST[0]] if INTERPRETED else FAST


@pytest.mark.parametrize("backend,device", BIG)
@pytest.mark.parametrize(
    "N,H,V,kw",
    [
        (131, 96, 2053, dict(bias=True, temperature="rows")),
        (67, 64, 2053, dict(dtype=torch.bfloat16, branching=True, ignore_fraction=0.1)),
        (23, 48, 32003, dict(rows="peaked")),
        (9, 16, 70001, dict(bias=True)),
        (5, 8, 70001, dict(rows="negative", dtype=torch.bfloat16)),
    ],
    ids=["V2053-rows-T", "V2053-bf16-tree", "V32003-peaked", "V70001", "V70001-negative-bf16"],
)
def test_large_vocab(backend, device, N, H, V, kw):
    gen = torch.Generator().manual_seed(N * V)
    inputs = random_logprobs_case(gen, N=N, H=H, V=V, device=device, **kw)
    assert_matches_reference(inputs, backend, gen)


@pytest.mark.parametrize("backend,device", BIG)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_from_logits_large_vocab(backend, device, dtype):
    gen = torch.Generator().manual_seed(7)
    inputs = logits_case_from(random_logprobs_case(gen, N=24, H=32, V=70001, dtype=dtype, device=device))
    assert_matches_reference(inputs, backend, gen)


@pytest.mark.parametrize("backend,device", FAST)
def test_peaked_rows_exact(backend, device):
    """A target that beats every other logit by > 30 has log p within fp32 rounding of 0
    (never positive) and the row's entropy and gradient are ~0."""
    gen = torch.Generator().manual_seed(3)
    inputs = random_logprobs_case(gen, N=7, H=33, V=131, rows="peaked", temperature=None, device=device)
    z = inputs["hidden"].double() @ inputs["weight"].double().T
    top2 = z.topk(2, dim=-1).values
    assert bool((top2[:, 0] - top2[:, 1] > 30).all())
    logp, entropy = rk.linear_logprobs(**inputs, backend=backend)[:2]
    assert bool((logp <= 0).all()) and float(logp.min()) > -1e-6
    assert float(entropy.max()) < 1e-6


@pytest.mark.parametrize("backend,device", FAST)
def test_flat_rows_entropy_is_log_v(backend, device):
    V = 131
    inputs = dict(
        hidden=torch.zeros(5, 8, device=device),
        weight=torch.randn(V, 8, device=device),
        targets=torch.arange(5, device=device),
        return_entropy=True,
    )
    logp, entropy = rk.linear_logprobs(**inputs, backend=backend)[:2]
    torch.testing.assert_close(logp, torch.full_like(logp, -math.log(V)), rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, torch.full_like(entropy, math.log(V)), rtol=0, atol=1e-6)


def _row_results(backend, hidden, weight, targets, rows):
    out = rk.linear_logprobs(hidden, weight, targets, temperature=0.7, return_entropy=True, backend=backend)
    return out.logp[rows], out.entropy[rows]


@pytest.mark.parametrize("backend,device", FAST)
def test_batch_invariance(backend, device):
    """The same rows inside batches of other sizes, at other positions: bitwise equal."""
    gen = torch.Generator().manual_seed(11)
    H, V = 40, 301
    weight = torch.randn(V, H, generator=gen).to(device)
    rows = torch.randn(3, H, generator=gen)
    t = torch.randint(0, V, (3,), generator=gen)
    alone = _row_results(backend, rows.to(device), weight, t.to(device), slice(0, 3))
    for n, at in ((5, 1), (70 if INTERPRETED else 300, 37)):
        hidden = torch.randn(n, H, generator=gen)
        targets = torch.randint(0, V, (n,), generator=gen)
        hidden[at : at + 3], targets[at : at + 3] = rows, t
        got = _row_results(backend, hidden.to(device), weight, targets.to(device), slice(at, at + 3))
        for a, b in zip(alone, got):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend,device", FAST)
def test_deterministic(backend, device):
    """Two runs (and, for the C++ kernel, 1 vs 2 threads) give bitwise-equal outputs and
    gradients: the weight gradient is summed over rows in a fixed order."""
    gen = torch.Generator().manual_seed(5)
    inputs = random_logprobs_case(gen, N=45, H=33, V=257, bias=True, branching=True, device=device)
    up = logprobs_upstream(inputs, gen)
    first = run_logprobs(inputs, backend, up)
    threads = torch.get_num_threads()
    try:
        if backend == "cpu":
            torch.set_num_threads(1 if threads > 1 else 2)
        second = run_logprobs(inputs, backend, up)
    finally:
        torch.set_num_threads(threads)
    for k in first:
        assert torch.equal(first[k], second[k]), k


@pytest.mark.parametrize("backend,device", FAST)
def test_non_contiguous_inputs(backend, device):
    gen = torch.Generator().manual_seed(9)
    inputs = random_logprobs_case(gen, N=21, H=24, V=97, bias=True, device=device)
    up = logprobs_upstream(inputs, gen)
    strided = dict(inputs)
    strided["hidden"] = inputs["hidden"].T.contiguous().T  # column-major
    strided["weight"] = torch.cat([inputs["weight"], inputs["weight"]], dim=1)[:, : inputs["weight"].shape[1]]
    strided["targets"] = torch.stack([inputs["targets"], inputs["targets"]], dim=1)[:, 0]
    a, b = run_logprobs(inputs, backend, up), run_logprobs(strided, backend, up)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-6)
    logits = logits_case_from(inputs)
    wide = torch.cat([logits["logits"], logits["logits"]], dim=-1)[..., : logits["logits"].shape[-1]]
    up = logprobs_upstream(logits, gen)
    a, b = run_logprobs(logits, backend, up), run_logprobs(dict(logits, logits=wide), backend, up)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


@pytest.mark.parametrize("backend,device", FAST)
def test_log_probs_only(backend, device):
    """Without return_entropy: the log-probs and gradients of the log-probs alone."""
    gen = torch.Generator().manual_seed(13)
    inputs = random_logprobs_case(gen, N=19, H=16, V=83, bias=True, device=device)
    inputs["return_entropy"] = False
    g = torch.randn(19, generator=gen, dtype=torch.float64)

    def run(inp, be):
        leaves = {k: inp[k].detach().clone().requires_grad_(True) for k in ("hidden", "weight", "bias")}
        logp = rk.linear_logprobs(**dict(inp, **leaves), backend=be).logp
        (logp * g.to(logp)).sum().backward()
        return [logp.detach()] + [leaves[k].grad for k in ("hidden", "weight", "bias")]

    ref = run(as_float64(inputs), "reference")
    fast = run(inputs, backend)
    for r, f in zip(ref, fast):
        torch.testing.assert_close(f.double(), r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend,device", FAST)
def test_empty_and_all_ignored(backend, device):
    H, V = 8, 13
    w = torch.randn(V, H, device=device, requires_grad=True)
    # N = 0
    h = torch.zeros(0, H, device=device, requires_grad=True)
    logp, ent = rk.linear_logprobs(
        h, w, torch.zeros(0, dtype=torch.int64, device=device), return_entropy=True, backend=backend
    )[:2]
    assert logp.shape == (0,) and ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()
    assert h.grad.shape == (0, H) and bool((w.grad == 0).all())
    # M = 0 (rows predict nothing): entropies only
    h = torch.randn(4, H, device=device, requires_grad=True)
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    logp, ent = rk.linear_logprobs(h, w, empty, row_index=empty, return_entropy=True, backend=backend)[:2]
    ref = rk.linear_logprobs(h.double(), w.double(), empty, row_index=empty, return_entropy=True, backend="reference")
    assert logp.shape == (0,)
    torch.testing.assert_close(ent.double(), ref.entropy, rtol=1e-5, atol=1e-6)
    # every target ignored: log-probs 0 and no gradient from them
    w.grad = None
    t = torch.full((4,), -100, dtype=torch.int64, device=device)
    logp = rk.linear_logprobs(h, w, t, backend=backend).logp
    assert bool((logp == 0).all())
    logp.sum().backward()
    assert bool((w.grad == 0).all())


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("entropy", [False, True])
def test_from_logits_expanded_logits(backend, device, entropy):
    """Expanded (stride-0) logits are accepted and give the numbers of the same logits
    materialised; the gradient reaches the unexpanded tensor summed over the expanded
    dimension. [N, V] rows of stride 0 are read in place; ``x[:, None].expand(N, K, V)`` with
    [N, K] targets (TRL's multi-index ``selective_log_softmax``) too."""
    gen = torch.Generator().manual_seed(21)
    N, K, V = 5, 3, 37
    base = (3 * torch.randn(N, V, generator=gen)).to(device)
    cases = [
        (lambda x: x[:1].expand(N, V), torch.randint(0, V, (N,), generator=gen)),
        (lambda x: x[:, None, :].expand(N, K, V), torch.randint(0, V, (N, K), generator=gen)),
        (lambda x: x[None].expand(2, N, V), torch.randint(0, V, (2, N), generator=gen)),
    ]
    for expand, targets in cases:
        targets = targets.to(device)
        targets.view(-1)[1] = -100
        up = torch.randn(targets.shape, generator=gen, dtype=torch.float64).to(device)

        def run(materialise):
            leaf = base.clone().requires_grad_(True)
            logits = expand(leaf)
            if materialise:
                logits = logits.contiguous()
            logp, ent = rk.logprobs_from_logits(logits, targets, 0.8, entropy, backend=backend)
            ent = torch.zeros_like(logp) if ent is None else ent
            ((logp * up.to(logp)).sum() + (ent * up.flip(-1).to(ent)).sum()).backward()
            return logp.detach(), ent.detach(), leaf.grad

        for a, b in zip(run(False), run(True)):
            assert torch.equal(a, b)
