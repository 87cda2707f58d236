"""Backend selection shared by every op: which kernel runs for which tensors.

``backend="auto"`` picks the C++ kernel for CPU tensors and Triton for CUDA tensors.
Tests force a backend: ``"reference"`` (the pure-PyTorch spec), ``"cpu"`` (C++) or
``"triton"`` (on CPU tensors only when ``TRITON_INTERPRET=1`` was set before Triton
kernels were first imported).
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "reference", "cpu", "triton")


@functools.lru_cache(maxsize=None)
def load_extension() -> bool:
    """Load the compiled CPU kernels (``rlvr_kernels._C``), or a build named by
    ``RLVR_KERNELS_EXTENSION`` (the sanitizer build of ``make sanitize``)."""
    path = os.environ.get("RLVR_KERNELS_EXTENSION")
    if path:
        torch.ops.load_library(path)
        return True
    try:
        from .. import _C  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend ("cpu" or "triton") for tensors on ``device``."""
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "cpu"
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend: 'cpu' runs on CPU tensors, got tensors on {device}")
        if not load_extension():
            raise RuntimeError(
                "rlvr_kernels._C is not built: reinstall with `pip install --no-build-isolation -e .` "
                "(or pass backend='reference')"
            )
    elif backend == "triton":
        if not triton_available():
            raise RuntimeError("backend: 'triton' needs the triton package")
        if device.type == "cpu" and not triton_interpreted():
            raise ValueError("backend: 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before rlvr_kernels imports")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"backend: 'triton' runs on CUDA tensors, got tensors on {device}")
    else:
        raise ValueError(f"backend: expected 'auto', 'cpu' or 'triton' here, got {backend!r}")
    return backend
