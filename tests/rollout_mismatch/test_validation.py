"""Each bad input of ``rollout_mismatch`` raises before any kernel runs, naming the argument."""

import pytest
import torch

import rlvr_kernels as rk

X = torch.zeros(2, 3)
CU = torch.tensor([0, 2, 3], dtype=torch.int32)
P = torch.zeros(3)


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((X.numpy(), X), {}, TypeError, "train_logprobs: expected a torch.Tensor"),
        ((X.long(), X), {}, TypeError, "train_logprobs: expected dtype"),
        ((P, P), {}, ValueError, r"train_logprobs: expected a padded 2-D \[B, L\]"),
        ((X, X), dict(cu_seqlens=CU), ValueError, r"train_logprobs: expected a packed 1-D \[T\]"),
        ((X, X[:, :2]), {}, ValueError, r"rollout_logprobs: expected shape \(2, 3\)"),
        ((X, X.int()), {}, TypeError, "rollout_logprobs: expected dtype"),
        ((X, X, X[0]), {}, ValueError, r"response_mask: expected shape \(2, 3\)"),
        ((X, X, X.to(torch.complex64)), {}, TypeError, "response_mask: expected dtype"),
        ((X, X, X.to("meta")), {}, ValueError, "response_mask: expected a tensor on cpu"),
        ((P, P), dict(cu_seqlens=CU.float()), TypeError, "cu_seqlens: expected dtype"),
        ((P, P), dict(cu_seqlens=CU[None]), ValueError, "cu_seqlens: expected a 1-D"),
        ((P, P), dict(cu_seqlens=CU[:0]), ValueError, "cu_seqlens: expected B . 1 >= 1 offsets"),
        ((P, P), dict(cu_seqlens=torch.tensor([1, 2]), validate=True), ValueError, r"cu_seqlens\[0\] == 0"),
        ((P, P), dict(cu_seqlens=torch.tensor([0, 2, 1]), validate=True), ValueError, "non-decreasing"),
        ((P, P), dict(cu_seqlens=torch.tensor([0, 4]), validate=True), ValueError, r"cu_seqlens\[-1\] <= T = 3"),
        ((X, X), dict(ratio_bounds=1.1), TypeError, "ratio_bounds: expected a .low, high. pair"),
        ((X, X), dict(ratio_bounds=(0.5, 1.0, 2.0)), TypeError, "ratio_bounds: expected a .low, high. pair"),
        ((X, X), dict(ratio_bounds=(2.0, 1.0)), ValueError, "ratio_bounds: expected low <= high"),
        ((X, X), dict(ratio_bounds=(-1.0, 1.0)), ValueError, r"ratio_bounds\[0\]: expected a finite number"),
        ((X, X), dict(ratio_bounds=(0.5, float("inf"))), ValueError, r"ratio_bounds\[1\]: expected a finite"),
        ((X, X), dict(ratio_bounds=("a", 1.0)), TypeError, r"ratio_bounds\[0\]: expected a number"),
        ((X, X), dict(backend="gpu"), ValueError, "backend: expected one of"),
    ],
)
def test_bad_input(args, kwargs, error, match, monkeypatch):
    from rlvr_kernels._core import dispatch

    def no_kernel(*a, **k):
        raise AssertionError("a kernel ran")

    monkeypatch.setattr(dispatch, "run", no_kernel)
    with pytest.raises(error, match=match):
        rk.rollout_mismatch(*args, **kwargs)


def test_garbage_offsets_without_validate_stay_in_bounds():
    """validate=False (the default, no host sync) on bad offsets: sanitised, never out of bounds."""
    x = torch.arange(4.0)
    out = rk.rollout_mismatch(x, 2 * x, cu_seqlens=torch.tensor([-3, 9, 1, 2]), backend="reference")
    cpu = rk.rollout_mismatch(x, 2 * x, cu_seqlens=torch.tensor([-3, 9, 1, 2]), backend="cpu")
    assert int(out.num_tokens) == int(cpu.num_tokens) == 4
    assert float(cpu.abs_diff_mean) == pytest.approx(1.5)
