"""The dispatch table: which function runs each kernel on each backend.

One row per (kernel, backend), imported lazily on first use (a CPU-only install never
imports Triton; the fast path never imports the reference). The kernel names are the
``torch.library`` schema names of ``csrc/ops.cpp``; the C++ op and the Triton launcher of
a row carry the same name, so the op layer calls ``kernel(name, backend)(*args)`` with
the same arguments whichever backend runs. ``reference`` rows are the public functions of
``rlvr_kernels.reference`` (the spec), used when a caller asks for ``backend="reference"``.

``backend="auto"`` picks the C++ kernel for CPU tensors and Triton for CUDA tensors.
``"triton"`` runs on CPU tensors only in Triton's interpreter (``TRITON_INTERPRET=1`` set
before Triton kernels were first imported). Nothing falls back: a row that cannot run
here is an error naming what is missing.

Adding a backend is one row per kernel here plus its entry in ``BACKENDS``
(``docs/adding-an-op.md``).
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Callable, Dict, List, Tuple

import torch

# Concrete backends, in the order the tests and the CLI list them.
BACKENDS = ("reference", "cpu", "triton")
# What callers may pass as ``backend=``.
BACKEND_CHOICES = ("auto",) + BACKENDS

# (kernel, backend) -> provider: "torch.ops.rlvr_kernels_C:<op>" (a C++ op of the
# compiled extension) or "<module>:<function>".
KERNELS: Dict[Tuple[str, str], str] = {
    # group_advantages
    ("group_advantages", "reference"): "rlvr_kernels.reference.advantages:group_advantages",
    ("group_advantages", "cpu"): "torch.ops.rlvr_kernels_C:group_advantages",
    ("group_advantages", "triton"): "rlvr_kernels.triton.advantages:group_advantages",
    # the data-parallel path of group_advantages: a rank's partials, then the merged result
    ("group_partials", "reference"): "rlvr_kernels.reference.advantages:group_partials",
    ("group_partials", "cpu"): "torch.ops.rlvr_kernels_C:group_partials",
    ("group_partials", "triton"): "rlvr_kernels.triton.advantages:group_partials",
    ("group_apply", "reference"): "rlvr_kernels.reference.advantages:group_apply",
    ("group_apply", "cpu"): "torch.ops.rlvr_kernels_C:group_apply",
    ("group_apply", "triton"): "rlvr_kernels.triton.advantages:group_apply",
    # policy_loss and shape_token_advantages
    ("policy_loss", "reference"): "rlvr_kernels.reference.policy_loss:policy_loss",
    ("shape_token_advantages", "reference"): "rlvr_kernels.reference.policy_loss:shape_token_advantages",
    ("rollout_correction", "reference"): "rlvr_kernels.reference.policy_loss:rollout_correction",
    ("policy_loss_fwd", "cpu"): "torch.ops.rlvr_kernels_C:policy_loss_fwd",
    ("policy_loss_fwd", "triton"): "rlvr_kernels.triton.policy_loss:policy_loss_fwd",
    ("policy_loss_grad", "cpu"): "torch.ops.rlvr_kernels_C:policy_loss_grad",
    ("policy_loss_grad", "triton"): "rlvr_kernels.triton.policy_loss:policy_loss_grad",
    # linear_logprobs and logprobs_from_logits
    ("linear_logprobs", "reference"): "rlvr_kernels.reference.logprobs:linear_logprobs",
    ("logprobs_from_logits", "reference"): "rlvr_kernels.reference.logprobs:logprobs_from_logits",
    ("linear_logprobs_stats", "cpu"): "torch.ops.rlvr_kernels_C:linear_logprobs_stats",
    ("linear_logprobs_stats", "triton"): "rlvr_kernels.triton.logprobs:linear_logprobs_stats",
    ("linear_logprobs_bwd", "cpu"): "torch.ops.rlvr_kernels_C:linear_logprobs_bwd",
    ("linear_logprobs_bwd", "triton"): "rlvr_kernels.triton.logprobs:linear_logprobs_bwd",
    ("logprobs_from_logits_stats", "cpu"): "torch.ops.rlvr_kernels_C:logprobs_from_logits_stats",
    ("logprobs_from_logits_stats", "triton"): "rlvr_kernels.triton.logprobs:logprobs_from_logits_stats",
    ("logprobs_from_logits_bwd", "cpu"): "torch.ops.rlvr_kernels_C:logprobs_from_logits_bwd",
    ("logprobs_from_logits_bwd", "triton"): "rlvr_kernels.triton.logprobs:logprobs_from_logits_bwd",
    ("logprobs_from_logits_bwd_", "cpu"): "torch.ops.rlvr_kernels_C:logprobs_from_logits_bwd_",
    ("logprobs_from_logits_bwd_", "triton"): "rlvr_kernels.triton.logprobs:logprobs_from_logits_bwd_",
    ("support_bits", "reference"): "rlvr_kernels.reference.logprobs:support_bits",
    ("support_bits", "cpu"): "torch.ops.rlvr_kernels_C:support_bits",
    ("support_bits", "triton"): "rlvr_kernels.triton.support_bits:support_bits",
    ("linear_logprobs_threshold", "cpu"): "torch.ops.rlvr_kernels_C:linear_logprobs_threshold",
    ("linear_logprobs_threshold", "triton"): "rlvr_kernels.triton.logprobs:linear_logprobs_threshold",
    ("logprobs_from_logits_threshold", "cpu"): "torch.ops.rlvr_kernels_C:logprobs_from_logits_threshold",
    ("logprobs_from_logits_threshold", "triton"): "rlvr_kernels.triton.logprobs:logprobs_from_logits_threshold",
    # rollout_mismatch
    ("rollout_mismatch", "reference"): "rlvr_kernels.reference.rollout_mismatch:rollout_mismatch",
    ("rollout_mismatch_stats", "cpu"): "torch.ops.rlvr_kernels_C:rollout_mismatch_stats",
    ("rollout_mismatch_stats", "triton"): "rlvr_kernels.triton.rollout_mismatch:rollout_mismatch_stats",
    # prefix-tree packing (a host-side build: no Triton row)
    ("prefix_tree_build", "reference"): "rlvr_kernels.reference.packing:prefix_tree_build",
    ("prefix_tree_build", "cpu"): "torch.ops.rlvr_kernels_C:prefix_tree_build",
}

_C_PREFIX = "torch.ops.rlvr_kernels_C:"


@functools.cache
def load_extension() -> bool:
    """Load the C++ CPU kernels (compiled on first use and cached, ``rlvr_kernels._core.extension``),
    or a build named by ``RLVR_KERNELS_EXTENSION`` (the sanitizer build of ``make sanitize``).
    False when no C++ compiler or ninja is here to compile them."""
    from . import extension

    try:
        extension.load()
    except extension.ExtensionUnavailable:
        return False
    return True


def extension_module():
    """The C++ library's Python module (``rlvr_kernels._core.extension.module``); RuntimeError
    when the C++ kernels cannot be built here."""
    if not load_extension():
        raise RuntimeError("the C++ kernels are not built (see `rlvr-kernels info`)")
    from . import extension

    return extension.module()


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_backend(backend: str) -> None:
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend: expected one of {BACKEND_CHOICES}, got {backend!r}")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete kernel backend ("cpu" or "triton") for tensors on ``device``; raises,
    naming what is missing, when it cannot run here."""
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "cpu"
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend: 'cpu' runs on CPU tensors, got tensors on {device}")
        if not load_extension():
            raise RuntimeError(
                "backend: 'cpu' needs the C++ kernels, compiled on first use, which needs a C++ compiler "
                "and ninja (e.g. `apt install g++`, `pip install ninja`; `rlvr-kernels info` shows what is "
                "missing), then `rlvr-kernels build`. The Triton (GPU) kernels and backend='reference' need neither."
            )
    elif backend == "triton":
        if not triton_available():
            raise RuntimeError("backend: 'triton' needs the triton package")
        if device.type == "cpu" and not triton_interpreted():
            raise ValueError(
                "backend: 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before rlvr_kernels imports"
            )
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"backend: 'triton' runs on CUDA tensors, got tensors on {device}")
    else:
        raise ValueError(f"backend: expected 'auto', 'cpu' or 'triton' here, got {backend!r}")
    return backend


@functools.cache
def kernel(op: str, backend: str) -> Callable:
    """The function that runs ``op`` on a concrete ``backend`` (a row of :data:`KERNELS`),
    imported on first use. A missing row, module or C++ op is an error, never a fallback."""
    try:
        provider = KERNELS[(op, backend)]
    except KeyError:
        have = sorted(b for o, b in KERNELS if o == op)
        raise NotImplementedError(f"backend: {op!r} has no {backend!r} kernel (it has: {', '.join(have)})") from None
    if provider.startswith(_C_PREFIX):
        if not load_extension():
            raise RuntimeError(
                f"the C++ kernels are not built (see `rlvr-kernels info`), so the C++ kernel {op!r} is missing"
            )
        name = provider[len(_C_PREFIX) :]
        if not hasattr(torch.ops.rlvr_kernels_C, name):
            raise RuntimeError(f"the loaded C++ kernels lack the op {name!r}: rebuild them (`rlvr-kernels build`)")
        return getattr(torch.ops.rlvr_kernels_C, name)
    module, attr = provider.split(":")
    return getattr(importlib.import_module(module), attr)


def run(op: str, backend: str, device: torch.device, *args):
    """``kernel(op, resolve_backend(backend, device))(*args)``: how a custom op calls its kernel."""
    return kernel(op, resolve_backend(backend, device))(*args)


def available_backends(device: str) -> List[str]:
    """The backends that can run on ``device`` here ("cpu" or "cuda"): the reference always,
    the C++ kernels on CPU when built, Triton on CUDA or when interpreted. The CLI's and the
    tests' backend lists."""
    out = []
    for backend in BACKENDS:
        if backend == "reference":
            out.append(backend)
        elif backend == "cpu" and device == "cpu" and load_extension():
            out.append(backend)
        elif backend == "triton" and triton_available() and (device == "cuda" or triton_interpreted()):
            out.append(backend)
    return out
