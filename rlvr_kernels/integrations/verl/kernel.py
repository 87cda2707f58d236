"""Drop-in for ``verl.utils.kernel.linear_cross_entropy`` (verl's fused LM-head
log-prob/entropy kernel, CUDA-only there), on the fused ``linear_logprobs`` op, which
also runs on CPU."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..._core.validation import FLOAT_DTYPES, INDEX_DTYPES, check_tensor
from ...ops.logprobs import linear_logprobs
from .._backend import current_backend
from .._errors import caller_names
from . import _head

__all__ = ["linear_cross_entropy"]

# the op's argument names -> verl's
_NAMES = {"targets": "labels", "process_group": "dist_process_group"}


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: Optional[float] = 1.0,
    reduction: Optional[str] = "none",
    dist_process_group=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """verl ``utils.kernel.linear_cross_entropy``: ``(log-probs, entropy)`` of ``labels``
    from ``hidden [..., H]`` and the (vocab-parallel, with ``dist_process_group``) LM head
    ``weight [V, H]``, fp32. Like verl's kernel, ``hidden`` is viewed as ``[N, H]`` and
    ``labels`` as ``[N]``, and both results are flat ``[N]`` whatever the input shapes
    (``[1, N]`` labels give ``[N]``). Runs on CPU and GPU; only ``reduction="none"``
    (what verl's actor uses). Under ``apply(logits_precision=..., match_sampling=True)``
    the op gets those settings (``_head``)."""
    if reduction != "none":
        raise NotImplementedError(f"reduction: only 'none' is supported, got {reduction!r}")
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES)
    check_tensor("labels", labels, dtypes=INDEX_DTYPES)
    if hidden.dim() < 1:
        raise ValueError("hidden: expected a [..., H] tensor, got a 0-d tensor")
    with caller_names(_NAMES):
        out = linear_logprobs(
            hidden.reshape(-1, hidden.shape[-1]),
            weight,
            labels.reshape(-1),
            temperature=temperature,
            return_entropy=True,
            process_group=dist_process_group,
            backend=current_backend(),
            **_head.head_kwargs(),
        )
    return out.logp, out.entropy
