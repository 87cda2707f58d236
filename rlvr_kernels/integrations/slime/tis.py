"""slime's truncated importance sampling functions for ``--custom-tis-function-path``.

slime (``slime/backends/megatron_utils/loss.py``) calls the TIS function inside
``policy_loss_function`` when ``--use-tis`` or ``--get-mismatch-metrics`` is on, with
keywords ``args, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
response_lengths``; it returns ``(pg_loss, loss_masks, metrics)``, the per-token pg loss times
the IS weight, the masks the loss is then reduced with, and per-token metrics that slime
reduces with its per-sample mean. The weights here come from the fused rollout-correction
op (:func:`rlvr_kernels.rollout_correction`, one kernel pass over the micro-batch) on the
token ratio exp(train − rollout):

- ``vanilla_tis_function`` (slime's default): clamp(ratio, ``tis_clip_low``, ``tis_clip``),
  the op's ``is_mode="clamp"``;
- ``icepop_function``: the ratio where ``tis_clip_low`` <= ratio <= ``tis_clip``, else 0, the
  op's ``is_mode="gate"``.

Neither rejects a token: the masks come back unchanged.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

from ...ops.policy_loss import rollout_correction
from ...options import RolloutCorrection
from .._backend import current_backend
from .hooks import _arg

_Out = Tuple[torch.Tensor, List[torch.Tensor], Dict[str, torch.Tensor]]


def _cat(name: str, xs: Sequence[torch.Tensor]) -> torch.Tensor:
    if not isinstance(xs, (list, tuple)) or not all(isinstance(x, torch.Tensor) and x.dim() == 1 for x in xs):
        raise ValueError(f"{name}: expected a list of 1-D per-sample tensors")
    return torch.cat(list(xs)) if xs else torch.zeros(0)


def _weights(args, mode: str, pg_loss, train_log_probs, rollout_log_probs, loss_masks) -> _Out:
    train = _cat("train_log_probs", train_log_probs)
    rollout = _cat("rollout_log_probs", rollout_log_probs)
    if not isinstance(pg_loss, torch.Tensor) or pg_loss.shape != train.shape:
        got = tuple(pg_loss.shape) if isinstance(pg_loss, torch.Tensor) else type(pg_loss).__name__
        raise ValueError(f"pg_loss: expected the samples' concatenated tokens, shape {tuple(train.shape)}, got {got}")
    if rollout.shape != train.shape:
        raise ValueError(
            f"rollout_log_probs: expected {tuple(train.shape)} tokens (train_log_probs), got {tuple(rollout.shape)}"
        )
    if len(loss_masks) != len(train_log_probs):
        raise ValueError(f"loss_masks: expected {len(train_log_probs)} (one per sample), got {len(loss_masks)}")
    high, low = float(_arg(args, "tis_clip")), float(_arg(args, "tis_clip_low"))
    train, rollout = train.detach(), rollout.detach().to(device=train.device)
    # slime weighs every token, masked or not (its reducers drop the masked ones): the
    # packed layout with every token valid, one span per sample.
    lengths = torch.tensor([0] + [int(x.shape[0]) for x in train_log_probs], device=train.device)
    cu = torch.cumsum(lengths, 0)
    correction = RolloutCorrection(is_level="token", is_mode=mode, is_threshold=high, is_threshold_low=low)
    if train.numel():
        w, _, _ = rollout_correction(correction, train, rollout, cu_seqlens=cu, backend=current_backend())
    else:
        w = train.float()
    return pg_loss * w.to(pg_loss.dtype), loss_masks, tis_metrics(args, train, rollout)


def tis_metrics(args, train: torch.Tensor, rollout: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The per-token metrics both functions return, from the unbounded ratio exp(train −
    rollout): ``tis``, ``tis_clipfrac``, ``tis_abs`` (|ratio − 1|)."""
    high, low = float(_arg(args, "tis_clip")), float(_arg(args, "tis_clip_low"))
    ratio = torch.exp(train.detach().float() - rollout.detach().float().to(train.device))
    return {
        "tis": ratio,
        # slime's (weight != ratio): the ratio outside the bounds (both functions change
        # exactly those tokens), read from the ratio so an ulp of the kernel's exp is no clip.
        "tis_clipfrac": ((ratio < low) | (ratio > high)).float(),
        "tis_abs": (ratio - 1).abs(),
    }


def vanilla_tis_function(
    args: Any,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: List[torch.Tensor],
    rollout_log_probs: List[torch.Tensor],
    loss_masks: List[torch.Tensor],
    **kwargs: Any,
) -> _Out:
    """slime's ``vanilla_tis_function``: ``pg_loss`` × clamp(exp(train − rollout),
    ``args.tis_clip_low``, ``args.tis_clip``); metrics ``tis`` (the ratio), ``tis_clipfrac``
    (1 where the clamp changed it) and ``tis_abs`` (|ratio − 1|), per token. The weight is
    the op's exp(clamp(train − rollout, ±20)) clamped, the same unless a log-ratio leaves
    ±20 with ``tis_clip`` above e^20 or ``tis_clip_low`` below e^−20."""
    return _weights(args, "clamp", pg_loss, train_log_probs, rollout_log_probs, loss_masks)


def icepop_function(
    args: Any,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: List[torch.Tensor],
    rollout_log_probs: List[torch.Tensor],
    loss_masks: List[torch.Tensor],
    **kwargs: Any,
) -> _Out:
    """slime's ``icepop_function``: ``pg_loss`` × the ratio exp(train − rollout) where
    ``args.tis_clip_low`` <= ratio <= ``args.tis_clip``, × 0 elsewhere; the metrics as
    :func:`vanilla_tis_function`'s (``tis_clipfrac``: the tokens given 0)."""
    return _weights(args, "gate", pg_loss, train_log_probs, rollout_log_probs, loss_masks)
