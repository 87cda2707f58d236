"""The LM head with the loss's gradient formed in the forward (``integrations/_head_grad.py``),
against the head and the loss written out in fp64 torch (the ``[N, V]`` logits materialised):
log-probs, entropies and the gradients of the hidden rows and the head, for a loss separable over
tokens (no row run again), losses that are not (a sequence-level ratio, a scaled backward, a
loss reading only the entropies: rows run again, the same gradients), any chunking, per-row
temperatures, ignored labels, a frozen head or frozen rows, no rows, low precision (the tolerance
rule against torch in the same dtype), the logits held one chunk at a time, and bad arguments.
"""

from __future__ import annotations

import pytest
import torch
from _memory import allocations, largest_allocation
from hypothesis import given
from hypothesis import strategies as st

import rlvr_kernels as rk
from rlvr_kernels.integrations import _head_grad as hg
from rlvr_kernels.testing._compare import compare

IGNORE = -100


def _reference(h, w, labels, temperature, dtype=torch.float64):
    """(logp, entropy) through the materialised logits, in ``dtype`` (autograd through them)."""
    z = h.to(dtype) @ w.to(dtype).t()
    t = temperature[:, None] if isinstance(temperature, torch.Tensor) else temperature
    lsm = torch.log_softmax(z.float() / t if dtype != torch.float64 else z / t, dim=-1)
    valid = labels != IGNORE
    logp = lsm.gather(1, labels.clamp(min=0)[:, None])[:, 0] * valid
    entropy = -(lsm.exp() * lsm).sum(-1)
    return logp, entropy


def _problem(n, h=12, v=40, dtype=torch.float64, seed=0, ignore=False):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    if ignore and n:
        labels[::3] = IGNORE
    old = torch.randn(n, generator=g, dtype=torch.float64) - 2.5
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return rows, weight, labels, old, adv


def _ppo(old, adv, entropy_coef=0.01):
    """A clipped PPO loss (token mean) minus an entropy bonus: separable over tokens."""

    def loss(logp, entropy):
        ratio = torch.exp(logp.double() - old)
        pg = -torch.minimum(adv * ratio, adv * ratio.clamp(0.8, 1.2))
        out = pg.mean()
        if entropy is not None:
            out = out - entropy_coef * entropy.double().mean()
        return out

    return loss


def _probe_of(loss):
    return lambda logp, entropy: hg.loss_gradient(logp, entropy, loss)


def _run(rows, weight, labels, loss, *, entropy, temperature=1.0, probe_loss=None, chunk_rows=None, backend="cpu"):
    """(logp, entropy, ∂rows, ∂weight, rows run again) of ``head_logprobs`` with ``loss``
    backpropagated (``probe_loss``: what the probe evaluates, default ``loss``)."""
    before = hg.STATS["rerun_rows"]
    logp, ent = hg.head_logprobs(
        rows,
        weight,
        labels,
        temperature=temperature,
        entropy=entropy,
        probe=_probe_of(probe_loss or loss),
        chunk_rows=chunk_rows,
        backend=backend,
    )
    value = loss(logp, ent)
    inputs = [x for x in (rows, weight) if x.requires_grad]
    grads = torch.autograd.grad(value, inputs, allow_unused=True) if value.requires_grad else [None] * len(inputs)
    return logp, ent, grads, hg.STATS["rerun_rows"] - before


def _expected(rows, weight, labels, loss, *, entropy, temperature=1.0):
    logp, ent = _reference(rows, weight, labels, temperature)
    value = loss(logp, ent if entropy else None)
    inputs = [x for x in (rows, weight) if x.requires_grad]
    return logp, ent, torch.autograd.grad(value, inputs)


@pytest.mark.parametrize("chunk_rows", [1, 7, 37, None])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7, "rows"])
def test_separable_loss_fp64(chunk_rows, entropy, temperature):
    rows, weight, labels, old, adv = _problem(37, ignore=True)
    if temperature == "rows":
        temperature = torch.rand(37, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) + 0.5
    loss = _ppo(old, adv)
    logp, ent, grads, rerun = _run(
        rows, weight, labels, loss, entropy=entropy, temperature=temperature, chunk_rows=chunk_rows
    )
    ref_logp, ref_ent, ref_grads = _expected(rows, weight, labels, loss, entropy=entropy, temperature=temperature)
    assert rerun == 0
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-12)
    assert torch.all(logp[labels == IGNORE] == 0)
    if entropy:
        torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    else:
        assert ent is None
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


def _gspo(old, adv):
    """A sequence-level ratio over all rows (not separable)."""

    def loss(logp, entropy):
        return -(adv * torch.exp((logp.double() - old).mean())).mean()

    return loss


@pytest.mark.parametrize(
    "case", ["not separable", "scaled backward", "entropy only", "no gradient from the probe", "probe wrong"]
)
def test_exact_whatever_the_probe(case):
    """The backward runs the rows whose gradient differs from the probe's through the head again:
    the gradients are the reference's in every case (a loss of the entropies alone is separable:
    no row runs again)."""
    rows, weight, labels, old, adv = _problem(29, seed=1)
    loss, probe_loss, entropy = _ppo(old, adv), None, True
    if case == "not separable":
        loss = _gspo(old, adv)
    elif case == "scaled backward":
        base = _ppo(old, adv)
        probe_loss = base

        def loss(logp, ent):
            return 3.0 * base(logp, ent)

    elif case == "entropy only":

        def loss(logp, ent):
            return ent.double().sum() + 0.0 * logp.double().sum()

    elif case == "no gradient from the probe":

        def probe_loss(logp, ent):
            return torch.zeros((), dtype=torch.float64, requires_grad=True)

    elif case == "probe wrong":
        probe_loss = _ppo(old + 0.5, -adv)
    logp, ent, grads, rerun = _run(rows, weight, labels, loss, entropy=entropy, probe_loss=probe_loss, chunk_rows=8)
    _, _, ref_grads = _expected(rows, weight, labels, loss, entropy=entropy)
    assert (rerun == 0) if case == "entropy only" else (rerun > 0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


@pytest.mark.parametrize("frozen", ["weight", "rows"])
def test_one_input_frozen(frozen):
    rows, weight, labels, old, adv = _problem(21, seed=2)
    (weight if frozen == "weight" else rows).requires_grad_(False)
    loss = _ppo(old, adv)
    _, _, grads, rerun = _run(rows, weight, labels, loss, entropy=True, chunk_rows=5)
    _, _, ref_grads = _expected(rows, weight, labels, loss, entropy=True)
    assert rerun == 0 and len(grads) == 1
    torch.testing.assert_close(grads[0], ref_grads[0], rtol=0, atol=1e-13)


def test_no_rows():
    rows, weight, labels, old, adv = _problem(0)
    logp, ent = hg.head_logprobs(rows, weight, labels, entropy=True, probe=_probe_of(_ppo(old, adv)), backend="cpu")
    assert logp.shape == (0,) and ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()
    assert rows.grad.shape == rows.shape and weight.grad.shape == weight.shape
    assert torch.all(weight.grad == 0)


def test_all_rows_ignored():
    rows, weight, labels, old, adv = _problem(9, seed=4)
    labels[:] = IGNORE
    logp, _, grads, rerun = _run(rows, weight, labels, _ppo(old, adv), entropy=False, chunk_rows=4)
    assert torch.all(logp == 0) and rerun == 0
    for g in grads:
        assert torch.all(g == 0) and not torch.isnan(g).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_tolerance_rule(dtype):
    """The tolerance rule (``rlvr_kernels.testing._compare``) against torch in the same dtype for
    the log-probs (derived from logits larger than them) and both gradients (sums: over the rows
    for the head's, summed chunk by chunk in fp32 and rounded once; over the vocabulary for the
    rows')."""
    rows64, weight64, labels, old, adv = _problem(300, h=32, v=96, seed=5)
    loss = _ppo(old, adv)
    rows = rows64.detach().to(dtype).requires_grad_()
    weight = weight64.detach().to(dtype).requires_grad_()
    logp, _, grads, rerun = _run(rows, weight, labels, loss, entropy=True, chunk_rows=64)
    assert rerun == 0
    r64 = rows.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    z64 = (r64 @ w64.t()).detach().requires_grad_()
    lsm = torch.log_softmax(z64, -1)
    ref_logp, ref_ent = lsm.gather(1, labels[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)
    (d_z,) = torch.autograd.grad(loss(ref_logp, ref_ent), [z64])
    ref_grads = (d_z @ w64.detach(), d_z.t() @ r64.detach())
    torch_logp, torch_ent = _reference(rows, weight, labels, 1.0, dtype=dtype)
    torch_grads = torch.autograd.grad(loss(torch_logp, torch_ent), [rows, weight])
    checks = [
        compare("logp", logp, ref_logp, torch_logp, torch.float32, atol_scale=float(z64.abs().max())),
        compare(
            "d_rows", grads[0], ref_grads[0], torch_grads[0], dtype,
            reduction=(float((d_z.abs() @ w64.detach().abs()).max()), weight.shape[0]),
        ),
        compare(
            "d_weight", grads[1], ref_grads[1], torch_grads[1], dtype,
            reduction=(float((d_z.abs().t() @ r64.detach().abs()).max()), rows.shape[0]),
        ),
    ]  # fmt: skip
    assert all(c.ok for c in checks), checks


def test_logits_one_chunk_at_a_time(monkeypatch):
    """The largest allocation of a step is one chunk of logits (CHUNK_ELEMENTS), never the
    ``[N, V]`` logits."""
    n, v = 512, 2048
    rows, weight, labels, old, adv = _problem(n, h=8, v=v, dtype=torch.float32, seed=6)
    monkeypatch.setattr(hg, "CHUNK_ELEMENTS", 64 * v)
    loss = _ppo(old, adv)

    def step():
        _run(rows, weight, labels, loss, entropy=True)

    largest = largest_allocation(step)
    assert largest <= 64 * v * 4, (largest, 64 * v * 4)
    assert largest < n * v * 4 // 4


def test_one_logits_buffer_for_every_chunk(monkeypatch):
    """Without head options the chunks share one ``[chunk, V]`` buffer and the logits' gradient
    is written over it: no other allocation of that size, none from the kernels' output cache
    (which holds a kernel output's block after the tensor dies)."""
    n, v = 300, 2048
    chunk = 64
    rows, weight, labels, old, adv = _problem(n, h=8, v=v, dtype=torch.float32, seed=7)
    monkeypatch.setattr(hg, "CHUNK_ELEMENTS", chunk * v)
    loss = _ppo(old, adv)
    rk.empty_cpu_cache()
    before = rk.cpu_cache_stats()

    def step():
        _run(rows, weight, labels, loss, entropy=True)

    big = [b for b in allocations(step) if b >= chunk * v * 4 // 2]
    # five chunks of 60 rows: the buffer, once (the first chunk's size)
    assert big == [60 * v * 4], big
    after = rk.cpu_cache_stats()
    assert after["cached_bytes"] + after["in_use_bytes"] - before["cached_bytes"] - before["in_use_bytes"] < chunk * v


def test_bad_arguments():
    rows, weight, labels, old, adv = _problem(5)
    probe = _probe_of(_ppo(old, adv))
    with pytest.raises(ValueError, match="rows, weight"):
        hg.head_logprobs(rows[:, :3], weight, labels, probe=probe)
    with pytest.raises(ValueError, match="labels"):
        hg.head_logprobs(rows, weight, labels[:3], probe=probe)
    with pytest.raises(TypeError, match="probe"):
        hg.head_logprobs(rows, weight, labels, probe=None)


@given(
    n=st.integers(0, 40),
    v=st.integers(2, 50),
    chunk=st.one_of(st.none(), st.integers(1, 45)),
    entropy=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_sizes(n, v, chunk, entropy, seed):
    rows, weight, labels, old, adv = _problem(n, h=6, v=v, seed=seed, ignore=True)
    loss = _ppo(old, adv)
    logp, ent, grads, rerun = _run(rows, weight, labels, loss, entropy=entropy, chunk_rows=chunk)
    ref_logp, ref_ent, ref_grads = _expected(rows, weight, labels, loss, entropy=entropy)
    assert rerun == 0
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "case,formed",
    [
        ("formed", True),
        ("no probe", False),
        ("off", False),
        ("no grad", False),
        ("frozen", False),
        ("auto small", False),
    ],
)
def test_step_head_routes(monkeypatch, case, formed):
    """step_head forms the gradient in the forward only with a probe, a gradient wanted and the
    setting (True, or None on CPU rows of at least MIN_MACS per GEMM); else linear_logprobs. The
    log-probs and gradients are the same either way."""
    rows, weight, labels, old, adv = _problem(19, seed=8)
    loss = _ppo(old, adv)
    probe = None if case == "no probe" else _probe_of(loss)
    setting = {"off": False, "auto small": None}.get(case, True)
    if case == "frozen":
        rows.requires_grad_(False)
        weight.requires_grad_(False)
    steps = hg.STATS["steps"]
    with torch.set_grad_enabled(case != "no grad"):
        logp, ent = hg.step_head(
            rows, weight, labels, temperature=1.0, entropy=True, probe=probe, setting=setting,
            head={}, backend="cpu", counted_as="test.step_head",
        )  # fmt: skip
    assert hg.STATS["steps"] - steps == int(formed)
    ref_logp, ref_ent = _reference(rows, weight, labels, 1.0)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    if case in ("formed", "no probe", "off", "auto small"):
        grads = torch.autograd.grad(loss(logp, ent), [rows, weight])
        _, _, ref_grads = _expected(rows, weight, labels, loss, entropy=True)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_chosen_auto(monkeypatch):
    rows, weight = torch.zeros(4, 8), torch.zeros(16, 8)
    assert hg.chosen(True, rows, weight) and not hg.chosen(False, rows, weight)
    monkeypatch.setattr(hg, "MIN_MACS", 4 * 8 * 16)
    assert hg.chosen(None, rows, weight)
    monkeypatch.setattr(hg, "MIN_MACS", 4 * 8 * 16 + 1)
    assert not hg.chosen(None, rows, weight)
    with pytest.raises(TypeError, match="grad_in_forward"):
        hg.check_setting("auto")
    assert hg.check_setting(None) is None and hg.check_setting(True) is True


def test_bf16_head_routes_agree():
    """A bf16 head: the chunks multiply in fp32 and accumulate there, as linear_logprobs does, so
    the log-probs do not depend on the route (a step's old log-probs come from linear_logprobs'
    forward, its update's from the chunks); the gradients agree to fp32 summation order, rounded
    once to bf16."""
    rows, weight, labels, old, adv = _problem(70, h=24, v=300, dtype=torch.bfloat16, seed=9)
    loss = _ppo(old, adv)
    out = {}
    for setting in (True, False):
        r = rows.detach().clone().requires_grad_()
        w = weight.detach().clone().requires_grad_()
        logp, ent = hg.step_head(
            r, w, labels, temperature=0.9, entropy=True, probe=_probe_of(loss), setting=setting,
            head={}, backend="cpu", counted_as="test.bf16",
        )  # fmt: skip
        out[setting] = (logp, ent, *torch.autograd.grad(loss(logp, ent), [r, w]))
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=2e-5)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=0, atol=2e-5)
    for a, b in zip(out[True][2:], out[False][2:]):
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("head", [dict(logits_precision="tf32"), dict(top_k=torch.tensor([3] * 11))])
def test_head_keywords_the_chunks_do_not_reproduce(head):
    """tf32 operands and per-row tensors among the head keywords: linear_logprobs and its
    backward (no chunks)."""
    rows, weight, labels, old, adv = _problem(11, dtype=torch.float32, seed=10)
    steps = hg.STATS["steps"]
    hg.step_head(
        rows, weight, labels, temperature=1.0, entropy=False, probe=_probe_of(_ppo(old, adv)), setting=True,
        head=head, backend="cpu", counted_as="test.head",
    )  # fmt: skip
    assert hg.STATS["steps"] == steps


def test_one_backward_then_released():
    """The forward's gradients leave the graph's node with its backward; a second backward through
    it (retain_graph=True) raises instead of adding the reruns twice."""
    rows, weight, labels, old, adv = _problem(13, seed=11)
    loss = _gspo(old, adv)  # not separable: the backward reruns rows
    logp, _ = hg.head_logprobs(rows, weight, labels, probe=_probe_of(loss), chunk_rows=5, backend="cpu")
    value = loss(logp, None)
    value.backward(retain_graph=True)
    node = logp.grad_fn
    assert node.grads is None and node.predicted is None
    _, _, ref_grads = _expected(rows, weight, labels, loss, entropy=False)
    torch.testing.assert_close(rows.grad, ref_grads[0], rtol=0, atol=1e-13)
    with pytest.raises(RuntimeError, match="second backward"):
        value.backward()
