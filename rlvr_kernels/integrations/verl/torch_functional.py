"""Drop-ins for ``verl.utils.torch_functional``: ``logprobs_from_logits`` and
``entropy_from_logits``, on the fused ``logprobs_from_logits`` op (one pass over each row
of logits, no ``[N, V]`` temporaries)."""

from __future__ import annotations

import torch

from ...ops.logprobs import logprobs_from_logits as _logprobs_from_logits
from .._backend import current_backend
from .._errors import caller_names, checked_labels, no_labels
from . import _head

__all__ = ["logprobs_from_logits", "entropy_from_logits"]

# the op's argument names -> verl's
_NAMES = {"targets": "labels"}


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """verl ``utils.torch_functional.logprobs_from_logits``: log p of ``labels`` from
    ``logits [..., V]``, shaped ``logits.shape[:-1]``, in the logits' dtype (computed in
    fp32, one pass, no ``[N, V]`` temporaries). As verl's flash-attn path (its GPU
    default), ``labels`` may have any shape with one label per row of logits (it is
    flattened), e.g. ``[1, N]`` with ``[N, V]`` logits. ``inplace_backward`` is accepted
    for signature compatibility; the backward writes only the logits' gradient in any case.
    Under ``apply(logits_precision=..., match_sampling=True)`` the op gets those settings
    (``_head``): then the log-probs of the rollout's kept set, −inf outside it."""
    labels = checked_labels(logits, labels)
    with caller_names(_NAMES):
        logp = _logprobs_from_logits(logits, labels, backend=current_backend(), **_head.head_kwargs()).logp
    return logp.to(logits.dtype)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """verl ``utils.torch_functional.entropy_from_logits``: logsumexp(z) − Σ softmax(z)·z per
    row, shaped ``logits.shape[:-1]``, in the logits' dtype. (When the log-probs are needed
    too, one call of :func:`rlvr_kernels.logprobs_from_logits` with ``return_entropy=True``
    reads the logits once.)"""
    ignored = no_labels(logits)
    with caller_names(_NAMES):
        entropy = _logprobs_from_logits(
            logits, ignored, return_entropy=True, backend=current_backend(), **_head.head_kwargs()
        ).entropy
    return entropy.to(logits.dtype)
