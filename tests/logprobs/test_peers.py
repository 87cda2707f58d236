"""The log-prob drop-ins against the real peer functions on the same inputs: TRL's
``selective_log_softmax`` (one or K ids per position) / ``entropy_from_logits`` /
``selective_log_softmax_and_entropy`` and verl's ``logprobs_from_logits`` /
``entropy_from_logits`` (values and logits gradients), and verl's ``linear_cross_entropy``
signature against verl's own torch path on materialised logits."""

import functools

import pytest
import torch
import trl.trainer.utils as trl_utils
import verl.utils.torch_functional as verl_F
from _backends import FAST

from rlvr_kernels.integrations import trl as ours_trl
from rlvr_kernels.integrations import verl as ours_verl
from rlvr_kernels.testing import compare


def _logits(dtype, shape=(3, 17, 151), seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(shape, generator=gen)).to(dtype)
    index = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    return logits, index, gen


def _value_and_grad(fn, logits, up):
    z = logits.detach().clone().requires_grad_(True)
    out = fn(z)
    (out.float() * up).sum().backward()
    return out.detach(), z.grad


def assert_same_as_peer(ours, theirs, truth, dtype):
    """fp32: equal to rounding. bf16: the peers compute in bf16 and we in fp32, so the
    project's rule applies: |ours − truth| ≤ 2·|peer − truth| + atol, truth = the peer on
    the logits upcast to fp64."""
    for name, a, b, t in zip(("value", "grad"), ours, theirs, truth):
        assert a.dtype == b.dtype, name
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:
            c = compare(name, a, t, b, dtype)
            assert c.ok, c


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_trl_selective_log_softmax(backend, device, dtype, temperature):
    logits, index, gen = _logits(dtype)
    row_mask = torch.rand(index.shape, generator=gen) > 0.2
    up = torch.randn(index.shape, generator=gen)
    logits, index, row_mask, up = logits.to(device), index.to(device), row_mask.to(device), up.to(device)
    for kw in (dict(), dict(row_mask=row_mask)):
        theirs = _value_and_grad(lambda z: trl_utils.selective_log_softmax(z, index, temperature, **kw), logits, up)
        truth = _value_and_grad(
            lambda z: trl_utils.selective_log_softmax(z, index, temperature, **kw), logits.double(), up
        )
        with ours_trl.use_backend(backend):
            ours = _value_and_grad(lambda z: ours_trl.selective_log_softmax(z, index, temperature, **kw), logits, up)
        assert_same_as_peer(ours, theirs, truth, dtype)


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trl_selective_log_softmax_multi_index(backend, device, dtype):
    """K log-probs per position (``index [..., K]``), with and without a row mask, at a
    temperature: values and the logits' gradient as TRL's torch path."""
    logits, _, gen = _logits(dtype, seed=4)
    index = torch.randint(0, logits.shape[-1], (*logits.shape[:-1], 5), generator=gen)
    row_mask = torch.rand(index.shape, generator=gen) > 0.3
    up = torch.randn(index.shape, generator=gen)
    logits, index, row_mask, up = logits.to(device), index.to(device), row_mask.to(device), up.to(device)
    for kw in (dict(), dict(row_mask=row_mask)):
        fn = functools.partial(trl_utils.selective_log_softmax, index=index, temperature=0.7, **kw)
        with ours_trl.use_backend(backend):
            ours = _value_and_grad(
                functools.partial(ours_trl.selective_log_softmax, index=index, temperature=0.7, **kw), logits, up
            )
        assert ours[0].shape == index.shape
        assert_same_as_peer(ours, _value_and_grad(fn, logits, up), _value_and_grad(fn, logits.double(), up), dtype)


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trl_entropy_from_logits(backend, device, dtype):
    logits, index, gen = _logits(dtype, seed=1)
    up = torch.randn(index.shape, generator=gen)
    logits, up = logits.to(device), up.to(device)
    theirs = _value_and_grad(trl_utils.entropy_from_logits, logits, up)
    truth = _value_and_grad(trl_utils.entropy_from_logits, logits.double(), up)
    with ours_trl.use_backend(backend):
        ours = _value_and_grad(ours_trl.entropy_from_logits, logits, up)
    assert_same_as_peer(ours, theirs, truth, dtype)


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy_requires_grad", [True, False])
def test_trl_selective_log_softmax_and_entropy(backend, device, dtype, entropy_requires_grad):
    """Both outputs (values, dtypes, zeros on masked rows) and the logits' gradient of a
    loss using both, against TRL's function called with the same arguments."""
    logits, index, gen = _logits(dtype, seed=5)
    row_mask = torch.rand(index.shape, generator=gen) > 0.25
    up_lp, up_ent = torch.randn(index.shape, generator=gen), torch.randn(index.shape, generator=gen)
    logits, index, row_mask = logits.to(device), index.to(device), row_mask.to(device)
    up_lp, up_ent = up_lp.to(device), up_ent.to(device)

    def run(fn, z0, **kw):
        z = z0.detach().clone().requires_grad_(True)
        lp, ent = fn(z, index, entropy_requires_grad, 0.8, **kw)
        assert ent.requires_grad == entropy_requires_grad
        loss = (lp.float() * up_lp).sum() + ((ent.float() * up_ent).sum() if entropy_requires_grad else 0.0)
        loss.backward()
        return lp.detach(), ent.detach(), z.grad

    for kw in (dict(), dict(row_mask=row_mask)):
        with ours_trl.use_backend(backend):
            ours = run(ours_trl.selective_log_softmax_and_entropy, logits, **kw)
        theirs = run(trl_utils.selective_log_softmax_and_entropy, logits, **kw)
        truth = run(trl_utils.selective_log_softmax_and_entropy, logits.double(), **kw)
        if kw:
            assert not ours[0][~row_mask].any() and not ours[1][~row_mask].any()
        for name, a, b, t in zip(("logp", "entropy", "grad"), ours, theirs, truth):
            assert a.dtype == b.dtype, name
            if dtype == torch.float32:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            else:
                c = compare(name, a, t, b, dtype)
                assert c.ok, c


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verl_logprobs_and_entropy_from_logits(backend, device, dtype):
    logits, index, gen = _logits(dtype, seed=2)
    logits, index = logits.to(device), index.to(device)
    up = torch.randn(index.shape, generator=gen).to(device)
    with ours_verl.use_backend(backend):
        ours_lp = _value_and_grad(lambda z: ours_verl.logprobs_from_logits(z, index), logits, up)
        ours_ent = _value_and_grad(ours_verl.entropy_from_logits, logits, up)
    for ours, fn in (
        (ours_lp, lambda z: verl_F.logprobs_from_logits(z, index)),
        (ours_ent, verl_F.entropy_from_logits),
    ):
        theirs = _value_and_grad(fn, logits, up)
        assert_same_as_peer(ours, theirs, _value_and_grad(fn, logits.double(), up), dtype)


def test_verl_linear_cross_entropy_semantics():
    """verl's fused kernel is CUDA-only; its contract is verl's torch path on the
    materialised logits: (log p of the labels, entropy) of (hidden·Wᵀ)/T."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 9, 16, generator=gen)
    weight = torch.randn(211, 16, generator=gen) / 4
    labels = torch.randint(0, 211, (2, 9), generator=gen)
    logp, ent = ours_verl.linear_cross_entropy(hidden, weight, labels, temperature=0.8)
    logits = (hidden @ weight.T) / 0.8
    # verl's kernel views labels as [N] and returns flat [N] results (verl/utils/kernel/linear_cross_entropy.py).
    torch.testing.assert_close(logp, verl_F.logprobs_from_logits(logits, labels).reshape(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, verl_F.entropy_from_logits(logits).reshape(-1), rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="reduction"):
        ours_verl.linear_cross_entropy(hidden, weight, labels, reduction="mean")
