"""The registered C++ op and the Triton launcher called directly: every shape relation is
checked, and garbage offsets stay in bounds (the one cu_seqlens rule of csrc/spans.h)."""

import pytest
import torch

from rlvr_kernels._core import dispatch
from rlvr_kernels.contracts import RolloutMismatchParams

F, I = RolloutMismatchParams(0.9, 1.1, 20.0).pack()


def _cpp():
    assert dispatch.load_extension()
    return torch.ops.rlvr_kernels_C.rollout_mismatch_stats


def _triton():
    return dispatch.kernel("rollout_mismatch_stats", "triton")


@pytest.mark.cpu_kernel
@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.zeros(2, 3), torch.zeros(2, 4), None, None, F, I), "shape of train_logprobs"),
        ((torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), None, F, I), "response_mask must have the shape"),
        ((torch.zeros(6), torch.zeros(6), None, None, F, I), r"must be \[B, L\] without cu_seqlens"),
        ((torch.zeros(2, 3), torch.zeros(2, 3), None, torch.tensor([0, 6]), F, I), r"must be \[T\] with cu_seqlens"),
        ((torch.zeros(6), torch.zeros(6), None, torch.zeros(2, 2, dtype=torch.long), F, I), "1-D tensor"),
        ((torch.zeros(2, 3).long(), torch.zeros(2, 3), None, None, F, I), "must be floating"),
        ((torch.zeros(2, 3), torch.zeros(2, 3), None, None, F[:2], I), "expected 3 fparams"),
    ],
)
def test_cpp_checks_shapes(args, match):
    with pytest.raises(RuntimeError, match=match):
        _cpp()(*args)


def test_triton_checks_shapes():
    with pytest.raises(ValueError, match="of one shape"):
        _triton()(torch.zeros(2, 3), torch.zeros(2, 4), None, None, F, I)
    with pytest.raises(ValueError, match="response_mask must have shape"):
        _triton()(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), None, F, I)
    with pytest.raises(ValueError, match="expected 3 fparams"):
        _triton()(torch.zeros(2, 3), torch.zeros(2, 3), None, None, F[:1], I)


@pytest.mark.parametrize("which", [pytest.param("cpu", marks=pytest.mark.cpu_kernel), "triton"])
def test_garbage_offsets_are_sanitised(which):
    fn = _cpp() if which == "cpu" else _triton()
    x = torch.arange(6.0)
    cu = torch.tensor([-7, 4, 2, 100, 3], dtype=torch.int64)  # sanitised: [0, 4, 4, 6, 6]
    out, seq, n = fn(x, torch.zeros(6), None, cu, F, I)
    assert int(n) == 6
    assert seq[:, 2].tolist() == [6.0, 0.0, 9.0, 0.0]  # Σ Δ per span
