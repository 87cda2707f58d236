"""The one backend-selection mechanism of every integration (verl, TRL).

A drop-in keeps its peer's signature exactly, so it has no ``backend`` argument. Instead,
every drop-in reads the backend of the innermost :func:`use_backend` block around the
call, ``"auto"`` outside any block. The setting is process-wide, like ``torch.backends``
flags (a rollout thread started inside the block sees it too), and restored on exit. It is a
plain module global so that torch.compile can read it inside a ``fullgraph`` region: Dynamo
guards on its value, so entering another ``use_backend`` block recompiles rather than
reusing a graph built for another backend (a ``contextvars.ContextVar`` cannot be traced).
Functions of our own with no peer signature to keep (``policy_loss_verl``, ``grpo_loss_trl``)
take ``backend=None`` too, which means "the ``use_backend`` one".

    from rlvr_kernels.integrations import verl as rk_verl
    with rk_verl.use_backend("reference"):   # the same object as trl.use_backend
        loss, metrics = rk_verl.compute_policy_loss_vanilla(...)
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from .._core.dispatch import check_backend

_BACKEND: str = "auto"


@contextlib.contextmanager
def use_backend(backend: str) -> Iterator[None]:
    """Run the drop-ins of every integration on ``backend`` ("auto", "reference", "cpu",
    "triton") inside the ``with`` block."""
    global _BACKEND
    check_backend(backend)
    previous, _BACKEND = _BACKEND, backend
    try:
        yield
    finally:
        _BACKEND = previous


def current_backend(backend: Optional[str] = None) -> str:
    """``backend`` when given (checked), else the backend of the innermost ``use_backend``."""
    if backend is None:
        return _BACKEND
    check_backend(backend)
    return backend
