"""The torch.library contract: opcheck (schema, fake kernel, autograd registration) and
torch.compile(fullgraph=True) over code that calls the public function."""

import dataclasses

import pytest
import torch
from _backends import FAST, to

import rlvr_kernels as rk
from rlvr_kernels.contracts import Baseline, GroupAdvantagesParams, Scale, Whiten
from rlvr_kernels.ops.advantages import _group_advantages_op, _group_apply_op, _group_partials_op


def op_args(device, backend, layout):
    gen = torch.Generator().manual_seed(0)
    B, L = 23, 9
    scores = torch.randn(B, generator=gen)
    gi = torch.randint(0, 5, (B,), generator=gen)
    lengths = torch.randint(0, L + 1, (B,), generator=gen)
    mask = cu = None
    num_tokens = -1
    if layout == "padded":
        mask = (torch.arange(L)[None] < lengths[:, None]).float()
    elif layout == "packed":
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        mask = torch.rand(int(cu[-1]), generator=gen) > 0.3
    elif layout == "packed_nomask":
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        num_tokens = int(cu[-1])
    valid = torch.rand(B, generator=gen) > 0.2
    params = GroupAdvantagesParams(
        num_groups=5,
        group_size=0,
        num_tokens=num_tokens,
        baseline=Baseline.MEAN,
        scale=Scale.GROUP,
        std_unbiased=True,
        eps=1e-6,
        eps_in_sqrt=False,
        singleton_raw=False,
        passk_k=0,
        whiten=Whiten.TOKENS,
        whiten_eps=1e-8,
        whiten_eps_in_sqrt=True,
    )
    fparams, iparams = params.pack()
    args = (scores, gi, valid, None, mask, cu, fparams, iparams, torch.float32, backend)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("layout", ["none", "padded", "packed", "packed_nomask"])
def test_opcheck(backend, device, layout):
    torch.library.opcheck(_group_advantages_op, op_args(device, backend, layout))


def dist_op_args(device, backend, layout):
    """(group_partials args, group_apply args) of one plan without whitening, W = 2 ranks."""
    scores, gi, valid, lengths, mask, cu, fparams, iparams, out_dtype, _ = op_args("cpu", backend, layout)
    p = GroupAdvantagesParams.unpack(fparams, iparams)
    fparams, iparams = dataclasses.replace(p, whiten=Whiten.OFF).pack()
    tensors = (scores, gi, valid, lengths, mask, cu)
    partials = _group_partials_op(*tensors, fparams, iparams, "reference")
    table = torch.stack([partials, partials.flip(0)])
    partial_args = (*tensors, fparams, iparams, backend)
    apply_args = (*tensors, table, fparams, iparams, out_dtype, backend)
    move = lambda args: tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)  # noqa: E731
    return move(partial_args), move(apply_args)


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("layout", ["none", "padded", "packed", "packed_nomask"])
def test_opcheck_data_parallel_ops(backend, device, layout):
    partial_args, apply_args = dist_op_args(device, backend, layout)
    torch.library.opcheck(_group_partials_op, partial_args)
    torch.library.opcheck(_group_apply_op, apply_args)


def test_fake_kernel_shapes_match_real_outputs():
    args = op_args("cpu", "cpu", "padded")
    real = _group_advantages_op(*args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fake = _group_advantages_op(*fake_args)
    for r, f in zip(real, fake):
        assert r.shape == f.shape and r.dtype == f.dtype


@pytest.mark.parametrize("backend,device", FAST)
def test_torch_compile_fullgraph(backend, device):
    gen = torch.Generator().manual_seed(1)
    B, L = 32, 12
    kw = to(
        dict(scores=torch.randint(0, 2, (B,), generator=gen).float(), mask=torch.rand(B, L, generator=gen) > 0.3),
        device,
    )

    def step(scores, mask):
        out = rk.group_advantages(scores, group_size=8, response_mask=mask, preset="verl", backend=backend)
        return out.token_advantages * 2.0, out.sample_keep

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    tok, keep = compiled(kw["scores"], kw["mask"])
    ref_tok, ref_keep = step(kw["scores"], kw["mask"])
    torch.testing.assert_close(tok, ref_tok)
    assert torch.equal(keep, ref_keep)


def test_torch_compile_inductor_cpu():
    # Inductor on CPU compiles the code around the op with a C++ compiler: the full path.
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(40, generator=gen)
    gi = torch.randint(0, 6, (40,), generator=gen)

    def step(scores, gi):
        out = rk.group_advantages(scores, gi, num_groups=6, estimator="rloo")
        return out.advantages.abs().sum() + out.group_mean.sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled(scores, gi), step(scores, gi))


def test_no_gradient_flows_through_advantages():
    scores = torch.randn(8, requires_grad=True)
    out = rk.group_advantages(scores, group_size=4)
    assert not out.advantages.requires_grad
