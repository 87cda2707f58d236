"""Which backends the tests run, and on which device."""

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (backend, device): the C++ kernel on CPU tensors; Triton on CUDA tensors when there is
# a GPU, else interpreted on CPU tensors.
FAST = [
    pytest.param("cpu", "cpu", id="cpu", marks=pytest.mark.cpu_kernel),
    pytest.param("triton", DEVICE, id=f"triton-{DEVICE}"),
]
ALL = [pytest.param("reference", "cpu", id="reference")] + FAST


def to(kwargs, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}

# Tests that call a kernel hundreds of times (gradcheck's finite differences) skip
# interpreted Triton, where one call takes seconds; on a GPU they run on every backend.
# The interpreted Triton kernels are still diffed against the reference value by value.
HEAVY = ALL if DEVICE == "cuda" else [pytest.param("reference", "cpu", id="reference"), FAST[0]]
INTERPRETED = DEVICE != "cuda"
