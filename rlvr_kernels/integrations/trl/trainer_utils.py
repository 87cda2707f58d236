"""Drop-ins for ``trl.trainer.utils`` (TRL 1.16): ``selective_log_softmax``,
``entropy_from_logits`` and ``selective_log_softmax_and_entropy``, on the fused
``logprobs_from_logits`` op: one fp32 pass over each row of logits (fp64 for fp64 logits),
no ``[N, V]`` temporaries in the forward; the backward writes the logits' gradient.

Each has TRL's signature and TRL's semantics, read from trl/trainer/utils.py:

* **Output dtype.** TRL runs its Triton kernel, whose outputs are fp32 whatever the
  logits' dtype, when Triton is installed and ``_supports_trl_loss_kernel`` accepts the
  inputs (CUDA/XPU, fp16/bf16/fp32 logits with 1 to 3 dimensions and a contiguous last
  one, one index per position, int32/int64 ids, a row mask shaped like the index); else
  its torch code, whose outputs have the logits' dtype. The drop-ins return the dtype
  TRL's path would (:func:`_kernel_supports` mirrors TRL's predicate;
  tests/integrations/test_trl_dropins.py checks it against TRL's own).
* **row_mask.** Where ``row_mask == 0`` the log-prob and the entropy are 0, with no
  gradient (TRL's ``masked_fill``, with its broadcasting).
* **index [..., K].** K log-probs per position (TRL's torch path): the op scores the
  first id of each row in its one pass, which fixes the row's normaliser, and the others
  are gathered from it, ``logp_k = logp_0 + (z_k − z_0) / T``: exact, with the exact
  gradient ``(e_k − p) / T``, and one pass per row whatever K (TRL's torch path builds a
  ``[.., V]`` log-softmax per batch row).
* Outputs never alias the op's saved tensors (the op's guarantee), so a caller may modify
  them in place before the backward (TRL's trainers mask log-probs in place).
"""

from __future__ import annotations

import importlib.util
from typing import Optional, Tuple

import torch

from ..._core.validation import FLOAT_DTYPES, INDEX_DTYPES, MASK_DTYPES, check_tensor, checks_enabled
from ...ops.logprobs import logprobs_from_logits
from .._backend import current_backend
from .._errors import caller_names

__all__ = ["selective_log_softmax", "entropy_from_logits", "selective_log_softmax_and_entropy"]

# the op's argument names -> TRL's
_NAMES = {"targets": "index"}
# the target id the op ignores (log-prob 0, no gradient): given to the op for masked rows only
_IGNORE = -100


def selective_log_softmax(
    logits: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    row_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """TRL ``trainer.utils.selective_log_softmax``: the log-softmax of ``logits /
    temperature`` gathered at ``index`` (``logits.shape[:-1]``, or ``[..., K]`` for K ids
    per position), shaped like ``index``; 0 where ``row_mask`` is 0. Dtype as TRL's path
    (module docstring)."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    logp, _ = _select(logits, index, temperature, row_mask, need_entropy=False)
    return logp.to(torch.float32 if _trl_kernel_runs(logits, index, row_mask) else logits.dtype)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """TRL ``trainer.utils.entropy_from_logits``: the entropy of every row of ``logits``,
    shaped ``logits.shape[:-1]``. ``chunk_size`` only bounds TRL's memory (rows per
    ``[chunk, V]`` temporary); the op builds no such temporary, so it changes nothing."""
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES)
    if logits.dim() < 1:
        raise ValueError("logits: expected a [..., V] tensor, got a 0-d tensor")
    ignored = torch.full(logits.shape[:-1], _IGNORE, dtype=torch.int64, device=logits.device)
    with caller_names(_NAMES):
        entropy = logprobs_from_logits(logits, ignored, return_entropy=True, backend=current_backend()).entropy
    return entropy.to(torch.float32 if _trl_kernel_runs(logits) else logits.dtype)


def selective_log_softmax_and_entropy(
    logits: torch.Tensor,
    index: torch.Tensor,
    entropy_requires_grad: bool = True,
    temperature: float = 1.0,
    row_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """TRL ``trainer.utils.selective_log_softmax_and_entropy``: both of the above from one
    read of the logits, at ``temperature``; log-prob and entropy 0 where ``row_mask`` is 0;
    the entropy detached unless ``entropy_requires_grad``. Dtypes as TRL's path."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    logp, entropy = _select(logits, index, temperature, row_mask, need_entropy=True)
    logp_dtype, entropy_dtype = _and_entropy_dtypes(logits, index, temperature, row_mask)
    entropy = entropy.to(entropy_dtype)
    return logp.to(logp_dtype), entropy if entropy_requires_grad else entropy.detach()


# ------------------------------------------------------------------ computation
def _select(logits, index, temperature, row_mask, need_entropy: bool):
    """(log-probs shaped like ``index``, entropies ``logits.shape[:-1]`` or None) in the
    op's dtype, 0 where ``row_mask`` is 0."""
    multi = _validate(logits, index, row_mask, need_entropy)
    lead = tuple(logits.shape[:-1])
    zero = None if row_mask is None else row_mask == 0
    if not multi:
        # Masked rows go to the op as ignored ids: log-prob 0 and no gradient already.
        targets = index if zero is None else torch.where(zero, _IGNORE, index)
    elif index.shape[-1]:
        targets = index[..., 0]
    else:
        targets = torch.full(lead, _IGNORE, dtype=index.dtype, device=index.device)
    with caller_names(_NAMES):
        logp, entropy = logprobs_from_logits(
            logits, targets, temperature, return_entropy=need_entropy, validate=False, backend=current_backend()
        )
    if multi:
        # The row's normaliser is in logp_0 = z_0 − lse: logp_k = logp_0 + (z_k − z_0) / T.
        # The ids were checked (_validate); the clamp keeps an unchecked call (torch.compile) in bounds.
        z = logits.gather(-1, index.long().clamp(0, logits.shape[-1] - 1)).to(logp.dtype)
        logp = logp.unsqueeze(-1) + (z - z[..., :1]) / temperature
        if zero is not None:
            logp = logp.masked_fill(zero, 0.0)
    if entropy is not None and zero is not None:
        entropy = entropy.masked_fill(zero, 0.0)
    return logp, entropy


def _validate(logits, index, row_mask, need_entropy: bool) -> bool:
    """Static checks, then the ids (a host sync; skipped under torch.compile and for meta
    tensors). Returns whether ``index`` holds K ids per position."""
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES)
    if logits.dim() < 1:
        raise ValueError("logits: expected a [..., V] tensor, got a 0-d tensor")
    check_tensor("index", index, dtypes=INDEX_DTYPES, like=logits, like_name="logits")
    lead = tuple(logits.shape[:-1])
    if index.dim() not in (len(lead), len(lead) + 1) or tuple(index.shape[: len(lead)]) != lead:
        raise ValueError(
            f"index: expected shape {lead} (logits.shape[:-1]) or {lead + ('K',)} (K ids per position), "
            f"got {tuple(index.shape)} with logits {tuple(logits.shape)}"
        )
    multi = index.dim() == len(lead) + 1
    if row_mask is not None:
        check_tensor("row_mask", row_mask, dtypes=MASK_DTYPES, like=logits, like_name="logits")
        _check_broadcasts(row_mask, tuple(index.shape), "the log-probs, shaped like index")
        if need_entropy:
            _check_broadcasts(row_mask, lead, "the entropies, logits.shape[:-1]")
    vocab = logits.shape[-1]
    if vocab < 1:
        raise ValueError(f"logits: expected a vocabulary of at least 1 (last dimension), got {tuple(logits.shape)}")
    if index.numel() and checks_enabled(True, logits, index):
        bad = (index < 0) | (index >= vocab)
        if row_mask is not None and not multi:  # masked rows are skipped (TRL's kernel never reads their ids)
            bad = bad & (row_mask != 0)
        if bool(bad.any()):
            k = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(f"index: expected ids in [0, {vocab}), got {int(index[k])} at {k}")
    return multi


def _check_broadcasts(row_mask: torch.Tensor, shape: Tuple[int, ...], what: str) -> None:
    """TRL masks with ``out.masked_fill(row_mask == 0, 0.0)``: the mask broadcasts to ``out``."""
    try:
        ok = torch.broadcast_shapes(tuple(row_mask.shape), shape) == shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"row_mask: expected a shape that broadcasts to {shape} ({what}), got {tuple(row_mask.shape)}")


# ------------------------------------------------------------------ TRL's output dtypes
# TRL's ``is_triton_available()`` (transformers): the package is installed (not imported here).
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def _kernel_supports(logits, index=None, row_mask=None, last_stride=None) -> bool:
    """TRL's ``_supports_trl_loss_kernel`` (trl/trainer/utils.py), condition for
    condition; ``last_stride`` stands for ``logits.stride(-1)`` (the stride of
    ``logits / temperature`` when TRL calls it on the scaled logits)."""
    stride = logits.stride(-1) if last_stride is None else last_stride
    supported = (
        logits.device.type in ("cuda", "xpu")
        and logits.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and 1 <= logits.ndim <= 3
        and stride == 1
        and logits.shape[-1] > 0
    )
    if index is not None:
        supported = (
            supported
            and index.shape == logits.shape[:-1]
            and index.dtype in (torch.int32, torch.int64)
            and index.device == logits.device
        )
    if row_mask is not None:
        supported = (
            supported
            and index is not None
            and row_mask.shape == index.shape
            and row_mask.dtype in (torch.bool, torch.int32, torch.int64)
            and row_mask.device == logits.device
        )
    return supported


def _trl_kernel_runs(logits, index=None, row_mask=None, last_stride=None) -> bool:
    return _TRITON_INSTALLED and _kernel_supports(logits, index, row_mask, last_stride)


def _and_entropy_dtypes(logits, index, temperature, row_mask) -> Tuple[torch.dtype, torch.dtype]:
    """TRL's ``selective_log_softmax_and_entropy`` returns the kernel's fp32 outputs when its
    kernel takes the inputs; else it divides the logits by the temperature and calls
    ``selective_log_softmax`` and ``entropy_from_logits`` on them, each of which makes
    its own choice (the entropy one without the index and mask)."""
    if _trl_kernel_runs(logits, index, row_mask):
        return torch.float32, torch.float32
    stride = None if temperature == 1.0 else _scaled_last_stride(logits)
    logp = torch.float32 if _trl_kernel_runs(logits, index, row_mask, stride) else logits.dtype
    entropy = torch.float32 if _trl_kernel_runs(logits, last_stride=stride) else logits.dtype
    return logp, entropy


def _scaled_last_stride(logits: torch.Tensor) -> int:
    """``(logits / temperature).stride(-1)``, from a meta tensor of the logits' layout
    (no memory; the stride does not depend on the temperature's value)."""
    if logits.device.type not in ("cuda", "xpu"):  # TRL's kernel is out anyway
        return logits.stride(-1)
    meta = torch.empty_strided(logits.shape, logits.stride(), dtype=logits.dtype, device="meta")
    return (meta / 2.0).stride(-1)
