"""Drop-ins for ``openrlhf.models.utils`` (OpenRLHF 0.11.2): ``compute_approx_kl``,
``log_probs_from_logits`` and ``compute_entropy``.

The two log-prob functions run the fused ``logprobs_from_logits`` op (one pass over each row of
logits, no ``[N, V]`` temporaries: OpenRLHF's fp32 path forms a logsumexp per 1024-row chunk
and its bf16 path a ``log_softmax`` per row). ``compute_approx_kl`` is elementwise work (no kernel is
faster), lean torch with OpenRLHF's clamps: every estimate to ±10, and its ``unbiased_gradient``
straight-through form.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...ops.logprobs import logprobs_from_logits as _logprobs_from_logits
from .._backend import current_backend
from .._errors import caller_names, checked_labels, no_labels
from .._patch import record
from . import _head

__all__ = ["compute_approx_kl", "log_probs_from_logits", "compute_entropy"]

KL_ESTIMATORS = ("k1", "k2", "k3")
# OpenRLHF's KL_IS_WEIGHT_CLIP: the bound of the detached importance weight of unbiased_gradient.
KL_IS_WEIGHT_CLIP = 10.0
_NAMES = {"targets": "labels"}


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    log_probs_old: Optional[torch.Tensor] = None,
    kl_estimator: str = "k1",
    unbiased_gradient: bool = False,
) -> torch.Tensor:
    """OpenRLHF ``compute_approx_kl``: with x = logp − logp_base in fp32, k1 = x, k2 = x²/2,
    k3 = e^(−x) − 1 + x (x bounded below by −10 first), each clamped to ±10.
    ``unbiased_gradient``: the value of the estimator with the gradient of w·x²/2, w =
    min(exp(logp − logp_old), 10) detached (1 without ``log_probs_old``). fp32 result."""
    record("openrlhf.compute_approx_kl")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator: expected one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    lp, base = log_probs.float(), log_probs_base.float()
    x = lp - base
    # OpenRLHF's expressions in its order (k3 near x = 0 is a difference of nearly equal terms,
    # whose rounding depends on the order)
    if kl_estimator == "k1":
        value = x
    elif kl_estimator == "k2":
        value = x.square() / 2.0
    else:
        x3 = x.clamp(min=-10)  # bounds exp(−x) and its derivative: the ±10 clamp below is active there
        value = (-x3).exp() - 1 + x3
    value = value.clamp(min=-10, max=10)
    if not unbiased_gradient:
        return value
    k2 = x.square() / 2.0
    if log_probs_old is not None:
        w = (lp - log_probs_old.float()).exp().clamp(max=KL_IS_WEIGHT_CLIP).detach()
        k2 = w * k2
    return value.detach() + k2 - k2.detach()


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """OpenRLHF ``log_probs_from_logits``: log p of ``labels`` from ``logits [..., V]``, shaped
    ``labels``, in the logits' dtype (computed in fp32 in one pass). As OpenRLHF, a
    temperature other than 1 divides ``logits`` in place first (the caller's tensor is
    scaled)."""
    record("openrlhf.log_probs_from_logits")
    labels = checked_labels(logits, labels)
    if temperature != 1.0:
        logits.div_(temperature)
    with caller_names(_NAMES):
        logp = _logprobs_from_logits(logits, labels, backend=current_backend(), **_head.logits_kwargs()).logp
    return logp.to(logits.dtype)


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """OpenRLHF ``compute_entropy``: logsumexp(z) − Σ softmax(z)·z per row, shaped
    ``logits.shape[:-1]``, in the logits' dtype (fp32 inside, one pass)."""
    record("openrlhf.compute_entropy")
    ignored = no_labels(logits)
    with caller_names(_NAMES):
        entropy = _logprobs_from_logits(
            logits, ignored, return_entropy=True, backend=current_backend(), **_head.logits_kwargs()
        ).entropy
    return entropy.to(logits.dtype)
