"""``rollout_mismatch`` (docs/rollout-mismatch.md): the train–rollout log-prob mismatch metrics RL
trainers log (verl's rollout-correction diagnostics, TRL's vLLM importance-sampling metrics,
slime's ``train_rollout_logprob_abs_diff``), in one fused pass with no host sync, as the
``rlvr_kernels::rollout_mismatch`` custom op over the C++ (CPU) and Triton (CUDA) kernels.

Kernel contract (C++ ``csrc/rollout_mismatch.cpp``, Triton ``triton/rollout_mismatch.py``; both
named ``rollout_mismatch_stats`` in the dispatch table):

  rollout_mismatch_stats(train_logprobs [B, L] / [T] float, rollout_logprobs (same shape) float,
                         response_mask (same shape) bool/int/float or None,
                         cu_seqlens [B + 1] int32/int64 or None (packed [T] layout),
                         fparams, iparams (RolloutMismatchParams.pack()))
      -> (out [NUM_MISMATCH_OUT] (MismatchOut), seq [B, NUM_MISMATCH_SEQ] (MismatchSeq),
          num_tokens [] int64)
  - A token is valid when it lies in a sequence (padded: every row; packed: the spans of
    the sanitised offsets, ``csrc/spans.h``) and its mask entry, if given, is non-zero.
    Only valid tokens are read: padding may hold anything, NaN included.
  - Δ = train − rollout, formed in the compute dtype (float32; float64 when an input is
    float64), which is also the dtype of ``out`` and ``seq``. The C++ kernel accumulates
    in float64, the Triton kernels in the compute dtype; both in a fixed order (no atomics).
  - Token entries are over the N valid tokens, sequence entries over all B sequences (an
    empty sequence counts with mean 0, as verl's masked_mean and slime's per-sample mean
    count it); every entry is 0 when N = 0, and ``seq`` is 0 for an empty sequence.
  The kernels check every shape relation they rely on; ``cu_seqlens`` values are checked
  here only with ``validate=True`` (a host sync), and are harmless when wrong.

The outputs are metrics: the op has no autograd formula and its inputs are detached.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch

from .._core import dispatch as _dispatch
from .._core.layout import compute_dtype
from .._core.validation import (
    FLOAT_DTYPES,
    MASK_DTYPES,
    MAX_COUNT,
    check_cu_seqlens,
    check_like,
    check_number,
    check_tensor,
)
from ..contracts.rollout_mismatch import (
    LOG_RATIO_BOUND,
    NUM_MISMATCH_OUT,
    NUM_MISMATCH_SEQ,
    RolloutMismatch,
    RolloutMismatchParams,
)


# ------------------------------------------------------------------ custom op
@torch.library.custom_op("rlvr_kernels::rollout_mismatch", mutates_args=())
def _rollout_mismatch_op(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    fparams: List[float],
    iparams: List[int],
    backend: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel contract above."""
    return _dispatch.run(
        "rollout_mismatch_stats",
        backend,
        train_logprobs.device,
        train_logprobs,
        rollout_logprobs,
        response_mask,
        cu_seqlens,
        fparams,
        iparams,
    )


@_rollout_mismatch_op.register_fake
def _(train_logprobs, rollout_logprobs, response_mask, cu_seqlens, fparams, iparams, backend):
    cdt = compute_dtype(torch.promote_types(train_logprobs.dtype, rollout_logprobs.dtype))
    B = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else train_logprobs.shape[0]
    new = train_logprobs.new_empty
    return new((NUM_MISMATCH_OUT,), dtype=cdt), new((B, NUM_MISMATCH_SEQ), dtype=cdt), new((), dtype=torch.int64)


# ------------------------------------------------------------------ validation
@dataclasses.dataclass(frozen=True)
class _Inputs:
    """Kernel-ready inputs of one call, as :func:`_validate` returns them."""

    train: torch.Tensor  # [B, L] or [T], detached
    rollout: torch.Tensor
    mask: Optional[torch.Tensor]  # same shape, bool (a bool mask as given)
    cu_seqlens: Optional[torch.Tensor]  # [B + 1] int32/int64
    ratio_bounds: Tuple[float, float]


def _validate(train_logprobs, rollout_logprobs, response_mask, cu_seqlens, ratio_bounds, validate) -> _Inputs:
    """Static checks (types, dtypes, shapes, devices, numbers: no tensor data read), and the
    ``cu_seqlens`` value checks when ``validate``."""
    packed = cu_seqlens is not None
    check_tensor("train_logprobs", train_logprobs, dtypes=FLOAT_DTYPES)
    if train_logprobs.dim() != (1 if packed else 2):
        want = (
            "a packed 1-D [T] tensor with cu_seqlens"
            if packed
            else "a padded 2-D [B, L] tensor (or [T] with cu_seqlens)"
        )
        raise ValueError(f"train_logprobs: expected {want}, got shape {tuple(train_logprobs.shape)}")
    like = dict(like=train_logprobs, like_name="train_logprobs")
    check_like("rollout_logprobs", rollout_logprobs, train_logprobs, "train_logprobs", dtypes=FLOAT_DTYPES)
    if response_mask is not None:
        check_like("response_mask", response_mask, train_logprobs, "train_logprobs", dtypes=MASK_DTYPES)
        if response_mask.dtype != torch.bool:
            response_mask = response_mask != 0
    if packed:
        check_cu_seqlens(cu_seqlens, **like, num_tokens=train_logprobs.shape[0], validate=validate)
        B = cu_seqlens.shape[0] - 1
    else:
        B = train_logprobs.shape[0]
    if B > MAX_COUNT or train_logprobs.numel() > MAX_COUNT:
        raise ValueError(
            f"train_logprobs: expected at most {MAX_COUNT} sequences and tokens, "
            f"got shape {tuple(train_logprobs.shape)}"
        )
    low, high = _ratio_bounds(ratio_bounds)
    return _Inputs(train_logprobs.detach(), rollout_logprobs.detach(), response_mask, cu_seqlens, (low, high))


def _ratio_bounds(ratio_bounds) -> Tuple[float, float]:
    if not isinstance(ratio_bounds, Sequence) or isinstance(ratio_bounds, str) or len(ratio_bounds) != 2:
        raise TypeError(f"ratio_bounds: expected a (low, high) pair of numbers, got {ratio_bounds!r}")
    low = check_number("ratio_bounds[0]", ratio_bounds[0], minimum=0.0)
    high = check_number("ratio_bounds[1]", ratio_bounds[1], minimum=0.0)
    if low > high:
        raise ValueError(f"ratio_bounds: expected low <= high, got {ratio_bounds!r}")
    return low, high


# ------------------------------------------------------------------ public function
def rollout_mismatch(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: Optional[torch.Tensor] = None,
    *,
    cu_seqlens: Optional[torch.Tensor] = None,
    ratio_bounds: Tuple[float, float] = (1 / 1.1, 1.1),
    validate: bool = False,
    backend: str = "auto",
) -> RolloutMismatch:
    """Train–rollout log-prob mismatch metrics (docs/rollout-mismatch.md), fused, no host sync.

    Args:
        train_logprobs: the training engine's log-probs of the sampled tokens: padded
            ``[B, L]``, or packed ``[T]`` with ``cu_seqlens``. fp16/bf16/fp32/fp64.
        rollout_logprobs: the rollout engine's log-probs of the same tokens, same shape.
        response_mask: valid tokens (bool, or 0/1 of any real dtype), same shape; None:
            every token of every sequence is valid.
        cu_seqlens: ``[B + 1]`` int32/int64 offsets of the packed layout; tokens past
            ``cu_seqlens[-1]`` belong to no sequence.
        ratio_bounds: ``(low, high)``: a token ratio exp(train − rollout) below ``low`` or
            above ``high`` counts in ``ratio_frac_low`` / ``ratio_frac_high``.
        validate: also check the ``cu_seqlens`` values (starts at 0, non-decreasing, within
            T): reads them, a host sync, so off by default; the kernels stay in bounds on
            any offsets. Types, dtypes, shapes and devices are always checked.
        backend: ``"auto"``, or ``"reference"``, ``"cpu"``, ``"triton"`` for tests.

    Returns:
        :class:`RolloutMismatch`: 0-d device tensors (``per_seq_*``: ``[B]``) in float32
        (float64 when an input is float64), ``num_tokens`` int64; all 0 when no token is
        valid. Detached: metrics carry no gradient.
    """
    _dispatch.check_backend(backend)
    x = _validate(train_logprobs, rollout_logprobs, response_mask, cu_seqlens, ratio_bounds, validate)
    if backend == "reference":
        return _dispatch.kernel("rollout_mismatch", "reference")(
            x.train, x.rollout, x.mask, x.cu_seqlens, x.ratio_bounds
        )
    fparams, iparams = RolloutMismatchParams(*x.ratio_bounds, log_ratio_bound=LOG_RATIO_BOUND).pack()
    out, seq, num_tokens = _rollout_mismatch_op(x.train, x.rollout, x.mask, x.cu_seqlens, fparams, iparams, backend)
    return RolloutMismatch.from_kernel(out, seq, num_tokens)


__all__ = ["rollout_mismatch", "RolloutMismatch"]
