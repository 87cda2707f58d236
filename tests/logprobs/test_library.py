"""The torch.library contract of the log-prob ops: opcheck (schema, fake kernels,
registered autograd), torch.compile(fullgraph=True) forward + backward, and gradcheck in
fp64 against finite differences (hidden, weight, bias, logits; entropy gradient included)."""

import importlib

import pytest
import torch
import torch.multiprocessing as mp
from _backends import ALL, FAST, HEAVY
from _workers.logprobs_dist import vocab_parallel_opcheck_worker

import rlvr_kernels as rk
from rlvr_kernels.testing import random_logprobs_case
from rlvr_kernels.testing.dist import free_port

ops = importlib.import_module("rlvr_kernels.ops.logprobs")  # (the package re-exports functions of its names)


def linear_op_args(device, backend, branching, dtype=torch.float32, extras=False, support=None, keep_targets=False):
    """The positional inputs of ``rlvr_kernels::linear_logprobs``; ``support``: None, "mask"
    (an explicit support's bitmap) or "threshold" (top-p 0.8's thresholds, from the kernel);
    ``keep_targets``: the targets outside it join it."""
    gen = torch.Generator().manual_seed(0)
    x = random_logprobs_case(
        gen,
        N=9,
        H=8,
        V=37,
        bias=True,
        branching=branching,
        ignore_fraction=0.2,
        dtype=dtype,
        temperature="rows",
        device=device,
    )
    n = x["hidden"].shape[0]
    row_ptr, order = ops._csr(x["row_index"], n, x["hidden"].device)
    inv_t = ops._inv_temperature(x["temperature"], n, x["hidden"].device, torch.float32)
    rows = None if x["row_index"] is None else x["row_index"].long()
    return (
        x["hidden"].requires_grad_(True),
        x["weight"].requires_grad_(True),
        x["bias"].requires_grad_(True),
        x["targets"],
        rows,
        row_ptr,
        order,
        inv_t,
        -100,
        True,
        0.37 if extras else 0.0,  # tanh_scale: a soft-cap
        extras,  # need_sum_sq
        extras,  # need_sum_z
        extras,  # need_top1
        2 if extras else 0,  # logits_precision: LogitsPrecision.BF16 with the extras
        *_support_args(x, inv_t, support, backend),
        keep_targets,
        backend,
    )


def _support_args(x, inv_t, support, backend):
    """(support, support_mode) of the op's schema for ``linear_op_args``."""
    n, v = x["hidden"].shape[0], x["weight"].shape[0]
    device = x["hidden"].device
    if support is None:
        return None, 0
    if support == "mask":
        ids = torch.arange(0, v, 2, device=device).repeat(n)
        offsets = torch.arange(n + 1, device=device) * ((v + 1) // 2)
        return ops._support_bits_op(ids, offsets, v, backend), 1
    filters = (
        torch.zeros(n, dtype=torch.int64, device=device),
        torch.full((n,), 0.8, device=device),
        torch.zeros(n, device=device),
    )
    h, w, b = x["hidden"].detach(), x["weight"].detach(), x["bias"].detach()
    return ops._linear_threshold(h, w, b, inv_t, *filters, 0.0, 0, 0, backend), 2


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("branching", [False, True])
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "softcap+outputs"])
def test_opcheck_linear(backend, device, branching, extras):
    torch.library.opcheck(ops._linear_logprobs, linear_op_args(device, backend, branching, extras=extras))


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("support", ["mask", "threshold"])
@pytest.mark.parametrize("keep_targets", [False, True], ids=["outside -inf", "keep_targets"])
def test_opcheck_linear_with_support(backend, device, support, keep_targets):
    args = linear_op_args(device, backend, True, support=support, keep_targets=keep_targets)
    torch.library.opcheck(ops._linear_logprobs, args)


@pytest.mark.parametrize("backend,device", FAST)
def test_opcheck_support_kernels(backend, device):
    """The threshold ops and the CSR -> bitmap op (no autograd: their outputs are constants)."""
    gen = torch.Generator().manual_seed(7)
    h, w = torch.randn(6, 5, generator=gen).to(device), torch.randn(23, 5, generator=gen).to(device)
    inv_t = torch.full((6,), 1.25, device=device)
    filters = (
        torch.tensor([0, 3, 30, 5, 0, 1], device=device),
        torch.tensor([0.9, 1.0, 0.5, 0.7, 1.0, 0.3], device=device),
        torch.tensor([0.0, 0.1, 0.0, 0.0, 0.05, 0.0], device=device),
    )
    torch.library.opcheck(ops._linear_threshold, (h, w, None, inv_t, *filters, 0.0, 2, 1, backend))
    torch.library.opcheck(ops._logits_threshold, (h @ w.T, inv_t, *filters, 0, backend))
    ids = torch.randint(0, 23, (40,), generator=gen).to(device)
    torch.library.opcheck(
        ops._support_bits_op, (ids, torch.tensor([0, 5, 5, 20, 33, 40, 40], device=device), 23, backend)
    )


def test_opcheck_linear_vocab_parallel():
    """``rlvr_kernels::linear_logprobs_vocab_parallel`` on 2 gloo processes (each a shard of
    the vocabulary): opcheck's schema, autograd-registration and fake-kernel checks (not its
    AOT trace: the backward's all-reduce is eager only), and the unsharded op's outputs and
    gradients."""
    cases = [
        linear_op_args("cpu", "cpu", branching, extras=extras) for branching, extras in ((False, False), (True, True))
    ]
    mp.spawn(vocab_parallel_opcheck_worker, args=(2, free_port(), cases), nprocs=2, join=True)


@pytest.mark.parametrize("backend,device", FAST)
def test_opcheck_from_logits(backend, device):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(11, 29, generator=gen).to(device).requires_grad_(True)
    targets = torch.randint(0, 29, (11,), generator=gen).to(device)
    targets[3] = -100
    inv_t = torch.full((11,), 1 / 0.7, device=device)
    torch.library.opcheck(ops._from_logits, (logits, targets, inv_t, -100, True, None, 0, False, backend))
    filters = (torch.zeros(11, dtype=torch.int64, device=device), torch.full((11,), 0.6, device=device))
    threshold = ops._logits_threshold(logits.detach(), inv_t, *filters, torch.zeros(11, device=device), 0, backend)
    for keep in (False, True):
        torch.library.opcheck(ops._from_logits, (logits, targets, inv_t, -100, True, threshold, 2, keep, backend))


@pytest.mark.parametrize("backend,device", FAST)
def test_opcheck_from_logits_expanded(backend, device):
    """Rows of stride 0 (an expanded view) go to the kernels as they are."""
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(1, 29, generator=gen).to(device).requires_grad_(True)
    logits = base.expand(7, 29)
    targets = torch.randint(0, 29, (7,), generator=gen).to(device)
    inv_t = torch.full((7,), 1 / 0.7, device=device)
    torch.library.opcheck(ops._from_logits, (logits, targets, inv_t, -100, True, None, 0, False, backend))


def test_autograd_reads_inputs_by_schema_name():
    """The NamedTuples through which the autograd formulas read the ops' inputs (and return
    their gradients) list the schema's arguments, in order."""
    for op, names in (
        (torch.ops.rlvr_kernels.linear_logprobs, ops._LinearArgs._fields),
        (torch.ops.rlvr_kernels.linear_logprobs_vocab_parallel, ops._LinearArgs._fields + ops._VocabShard._fields),
        (torch.ops.rlvr_kernels.logprobs_from_logits, ops._LogitsArgs._fields),
    ):
        assert [a.name for a in op.default._schema.arguments] == list(names)


@pytest.mark.cpu_kernel
def test_fake_kernels_match_real_outputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for branching, extras in ((False, False), (True, False), (True, True)):
        args = linear_op_args("cpu", "cpu", branching, extras=extras)
        real = ops._linear_logprobs(*args)
        with FakeTensorMode() as mode:
            fake = ops._linear_logprobs(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        for r, f in zip(real, fake):
            assert r.shape == f.shape and r.dtype == f.dtype


@pytest.mark.parametrize("backend,device", FAST)
def test_torch_compile_fullgraph(backend, device):
    gen = torch.Generator().manual_seed(2)
    x = random_logprobs_case(gen, N=12, H=16, V=53, bias=True, branching=True, device=device)
    g = torch.randn(x["targets"].shape[0], generator=gen).to(device)
    h = torch.randn(12, generator=gen).to(device)

    def step(hidden, weight, bias, logits):
        logp, ent = rk.linear_logprobs(
            hidden,
            weight,
            x["targets"],
            row_index=x["row_index"],
            bias=bias,
            temperature=0.7,
            return_entropy=True,
            backend=backend,
        )[:2]
        lp2, ent2 = rk.logprobs_from_logits(logits, x["targets"][:12], 0.7, True, backend=backend)
        # Sampling supports: computed in the kernels, and an explicit one (its bitmap kernel).
        lp3, ent3 = rk.linear_logprobs(
            hidden, weight, x["targets"][:12], top_p=0.8, return_entropy=True, backend=backend
        )[:2]
        ids = torch.arange(0, 53, 3, device=device).repeat(12)
        offsets = torch.arange(13, device=device) * 18
        lp4 = rk.logprobs_from_logits(logits, ids[:12], support_ids=ids, support_offsets=offsets, backend=backend)[0]
        extra = torch.where(torch.isneginf(lp3), 0.0, lp3).sum() + ent3.sum() + lp4.sum()
        return (logp * g).sum() + (ent * h).sum() + (lp2 * h).sum() + ent2.sum() + extra

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = [
            x["hidden"].clone().requires_grad_(True),
            x["weight"].clone().requires_grad_(True),
            x["bias"].clone().requires_grad_(True),
            torch.randn(12, 53, generator=torch.Generator().manual_seed(3)).to(device).requires_grad_(True),
        ]
        loss = fn(*leaves)
        loss.backward()
        results.append([loss.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend,device", ALL)
def test_returned_entropy_may_be_modified_in_place(backend, device):
    """The ops save their entropy for the backward; the caller's copy is its own, so masking
    it in place (verl's and TRL's trainers do) leaves the gradient of what was returned."""
    gen = torch.Generator().manual_seed(5)
    x = random_logprobs_case(gen, N=6, H=8, V=19, bias=False, branching=False, device=device)
    logits0 = torch.randn(6, 19, generator=gen).to(device)
    keep = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool, device=device)
    grads = {}
    for inplace in (False, True):
        hidden = x["hidden"].clone().requires_grad_(True)
        logits = logits0.clone().requires_grad_(True)
        ent = rk.linear_logprobs(hidden, x["weight"], x["targets"], return_entropy=True, backend=backend).entropy
        ent2 = rk.logprobs_from_logits(logits, x["targets"], return_entropy=True, backend=backend).entropy
        if inplace:
            ent.masked_fill_(~keep, 0.0)
            ent2.mul_(keep)
        else:
            ent, ent2 = ent.masked_fill(~keep, 0.0), ent2 * keep
        (ent.sum() + ent2.sum()).backward()
        grads[inplace] = (hidden.grad, logits.grad)
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend,device", HEAVY)
@pytest.mark.parametrize("entropy", [False, True])
def test_gradcheck_linear(backend, device, entropy):
    gen = torch.Generator().manual_seed(4)
    x = random_logprobs_case(
        gen,
        N=5,
        H=4,
        V=7,
        bias=True,
        branching=True,
        ignore_fraction=0.2,
        dtype=torch.float64,
        temperature="rows",
        device=device,
    )
    temp = x["temperature"].double()

    def fn(hidden, weight, bias):
        out = rk.linear_logprobs(
            hidden,
            weight,
            x["targets"],
            row_index=x["row_index"],
            bias=bias,
            temperature=temp,
            return_entropy=entropy,
            backend=backend,
        )
        return (out.logp, out.entropy) if entropy else out.logp

    leaves = (x["hidden"].requires_grad_(True), x["weight"].requires_grad_(True), x["bias"].requires_grad_(True))
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend,device", HEAVY)
def test_gradcheck_from_logits(backend, device):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 9, generator=gen, dtype=torch.float64).to(device).requires_grad_(True)
    targets = torch.randint(0, 9, (2, 3), generator=gen).to(device)
    targets[0, 1] = -100
    temp = (0.5 + torch.rand(2, 3, generator=gen, dtype=torch.float64)).to(device)
    assert torch.autograd.gradcheck(
        lambda z: rk.logprobs_from_logits(z, targets, temp, True, backend=backend), (logits,), eps=1e-6, atol=1e-7
    )
