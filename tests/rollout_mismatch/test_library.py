"""The ``rlvr_kernels::rollout_mismatch`` custom op: ``opcheck``, the fake kernel on meta
tensors, ``torch.compile(fullgraph=True)``, and detached outputs (the op has no autograd:
the metrics carry no gradient)."""

import pytest
import torch

import rlvr_kernels as rk
from rlvr_kernels.contracts import RolloutMismatchParams
from rlvr_kernels.contracts.rollout_mismatch import LOG_RATIO_BOUND
from rlvr_kernels.ops.rollout_mismatch import _rollout_mismatch_op
from tests._backends import FAST


def _args(packed, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    if packed:
        x = -torch.rand(11, generator=gen)
        extra = (torch.rand(11, generator=gen) > 0.2, torch.tensor([0, 4, 4, 9], dtype=torch.int32))
    else:
        x = -torch.rand(3, 5, generator=gen)
        extra = (torch.rand(3, 5, generator=gen) > 0.2, None)
    y = x + 0.1 * torch.randn(x.shape, generator=gen)
    f, i = RolloutMismatchParams(0.9, 1.1, LOG_RATIO_BOUND).pack()
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in (x, y, *extra)) + (f, i)


@pytest.mark.cpu_kernel
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_opcheck(packed):
    torch.library.opcheck(_rollout_mismatch_op, (*_args(packed), "cpu"))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_meta_shapes(packed):
    out = rk.rollout_mismatch(
        *(t.to("meta") if isinstance(t, torch.Tensor) else t for t in _args(packed)[:2]),
        cu_seqlens=_args(packed)[3].to("meta") if packed else None,
    )
    assert out.k1.device.type == "meta" and out.k1.shape == ()
    assert out.per_seq_log_ratio.shape == (3,)
    assert out.num_tokens.dtype == torch.int64


@pytest.mark.parametrize("backend, device", FAST)
def test_torch_compile_fullgraph(backend, device):
    x, y, m, _, _, _ = _args(False, device)

    def metrics(a, b, mask):
        out = rk.rollout_mismatch(a, b, mask, backend=backend)
        return out.k3 + out.abs_diff_max, out.per_seq_abs_diff_mean

    torch._dynamo.reset()
    got = torch.compile(metrics, fullgraph=True, backend="eager")(x, y, m)
    want = metrics(x, y, m)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("backend, device", FAST)
def test_outputs_are_detached(backend, device):
    x, y, m, _, _, _ = _args(False, device)
    x.requires_grad_(True)
    out = rk.rollout_mismatch(x, y, m, backend=backend)
    assert not any(v.requires_grad for v in out)
    assert set(out.to_dict("rollout/")) == {"rollout/" + f for f in out._fields}
