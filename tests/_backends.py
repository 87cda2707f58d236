"""Which backends the tests run, and on which device: every concrete backend of the
dispatch table (rlvr_kernels/_core/dispatch.py). A backend that cannot run here fails its
tests rather than disappearing from the list."""

import pytest
import torch

from rlvr_kernels._core.dispatch import BACKENDS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The device each backend's tests run on: the C++ kernels on CPU tensors; Triton on CUDA
# tensors when there is a GPU, else interpreted on CPU tensors.
_DEVICE = {"reference": "cpu", "cpu": "cpu", "triton": DEVICE}
_MARKS = {"cpu": (pytest.mark.cpu_kernel,)}


def _param(backend):
    device = _DEVICE[backend]
    name = f"{backend}-{device}" if backend == "triton" else backend
    return pytest.param(backend, device, id=name, marks=_MARKS.get(backend, ()))


FAST = [_param(b) for b in BACKENDS if b != "reference"]
ALL = [_param(b) for b in BACKENDS]


def to(kwargs, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}


# Tests that call a kernel hundreds of times (gradcheck's finite differences) skip
# interpreted Triton, where one call takes seconds; on a GPU they run on every backend.
# The interpreted Triton kernels are still diffed against the reference value by value.
HEAVY = ALL if DEVICE == "cuda" else [p for p in ALL if p.values[0] != "triton"]
INTERPRETED = DEVICE != "cuda"
