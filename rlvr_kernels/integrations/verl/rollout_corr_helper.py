"""Drop-ins for verl 0.9.1's ``verl.trainer.ppo.rollout_corr_helper``: the same signatures,
return values and metric names, the weights and the rejection mask computed by the fused
``policy_loss_fwd`` kernel (:func:`rlvr_kernels.rollout_correction`, from
``RolloutCorrection.from_verl``), the metrics (verl's, as in ``_rollout_corr``) read back
in one host sync per call (verl syncs once per metric)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...ops.policy_loss import rollout_correction
from ...options import RolloutCorrection
from .._backend import current_backend
from ._losses import float_metrics, out_dtype
from ._rollout_corr import (
    check_world_for_batch_norm,
    correction_metrics,
    offpolicy_metrics,
    prefixed,
)

__all__ = [
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_rollout_correction_and_rejection_mask",
    "compute_offpolicy_metrics",
    "compute_rollout_corr_metrics_from_logprobs",
]

_NO_VALID = "response_mask must contain at least one valid token (1)."


def _run(rc: RolloutCorrection, log_ratio, response_mask, old=None, rollout=None):
    """The kernel's (weights, keep) for x = log_ratio (or old − rollout)."""
    check_world_for_batch_norm(rc)
    if old is None:
        old, rollout = log_ratio, torch.zeros_like(log_ratio)  # x − 0 is x exactly
    w, keep, _ = rollout_correction(rc, old.detach(), rollout.detach(), response_mask, backend=current_backend())
    return w, keep


def _read(pairs, response_mask, error=ValueError):
    """The metrics as floats and verl's no-valid-token error, in one host sync."""
    values = float_metrics(list(pairs.items()) + [("__any__", response_mask.any())])
    if not values.pop("__any__"):
        raise error(_NO_VALID)
    return values


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's IS weights: exp(clamp(log_ratio, ±20)) per token or exp(clamp(Σ_t m·log_ratio,
    ±20)) per sequence, masked, truncated at the threshold (TIS) or zeroed outside
    "lower_upper" (IcePop), optionally over their batch mean; detached. Returns
    ``(weights, metrics)`` with verl's ``rollout_is_*`` metrics (floats)."""
    if rollout_is not in ("token", "sequence"):
        raise ValueError(f"Invalid rollout_is: {rollout_is}. Must be one of {{'token', 'sequence'}}.")
    rc = RolloutCorrection.from_verl(rollout_is, rollout_is_threshold, rollout_is_batch_normalize)
    w, keep = _run(rc, log_ratio, response_mask)
    metrics = correction_metrics(rc, log_ratio.detach(), response_mask, keep)
    return w.to(out_dtype(log_ratio, response_mask)), _read(metrics, response_mask)


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: Optional[str | float] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's rejection chain (every option of the comma separated ``rollout_rs`` must pass).
    Returns ``(modified_response_mask, metrics)`` with verl's ``rollout_rs_*`` metrics."""
    if rollout_rs is None or not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a non-empty string (comma separated for multiple options).")
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    rc = RolloutCorrection.from_verl(rollout_rs=rollout_rs, rollout_rs_threshold=rollout_rs_threshold)
    w, keep = _run(rc, log_ratio, response_mask)
    metrics = correction_metrics(rc, log_ratio.detach(), response_mask, keep)
    return (response_mask * keep).to(dtype=response_mask.dtype), _read(metrics, response_mask)


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: Optional[str] = None,
    rollout_is_threshold: Optional[str | float] = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold: Optional[str | float] = None,
) -> tuple[Optional[Any], torch.Tensor, dict[str, float]]:
    """verl's IS weights and rejection in one kernel call on x = old_log_prob −
    rollout_log_prob. Returns ``(DataProto {"rollout_is_weights"} or None,
    modified_response_mask, metrics)``, the metrics "rollout_corr/"-prefixed (IS, rejection,
    off-policy)."""
    from verl.protocol import DataProto

    if old_log_prob.shape != rollout_log_prob.shape:
        raise ValueError(
            f"old_log_prob shape {old_log_prob.shape} does not match rollout_log_prob shape {rollout_log_prob.shape}."
        )
    if old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"log_prob shape {old_log_prob.shape} does not match response_mask shape {response_mask.shape}."
        )
    use_is = rollout_is is not None and rollout_is_threshold is not None
    if use_is and rollout_is not in ("token", "sequence"):
        raise ValueError(f"Invalid rollout_is: {rollout_is}. Must be one of {{'token', 'sequence'}}.")
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError(
                "rollout_rs_threshold must be explicitly provided when rollout_rs is enabled. "
                "Set rollout_rs_threshold to the desired threshold value."
            )
        if not isinstance(rollout_rs, str):
            raise ValueError("rollout_rs must be a non-empty string (comma separated for multiple options).")
    log_ratio = (old_log_prob - rollout_log_prob).detach()
    metrics = {}
    weights, mask_out = None, response_mask.clone()
    if use_is or rollout_rs is not None:
        rc = RolloutCorrection.from_verl(
            rollout_is if use_is else None,
            rollout_is_threshold if use_is else 2.0,
            rollout_is_batch_normalize,
            rollout_rs,
            rollout_rs_threshold if rollout_rs is not None else None,
        )
        w, keep = _run(rc, log_ratio, response_mask, old_log_prob, rollout_log_prob)
        metrics = correction_metrics(rc, log_ratio, response_mask, keep)
        if use_is:
            weights = w.to(out_dtype(log_ratio, response_mask))
        if rollout_rs is not None:
            mask_out = (response_mask * keep).to(dtype=response_mask.dtype)
    metrics.update(offpolicy_metrics(old_log_prob.detach(), rollout_log_prob.detach(), response_mask))
    values = prefixed(_read(metrics, response_mask))
    proto = DataProto.from_dict(tensors={"rollout_is_weights": weights}) if weights is not None else None
    return proto, mask_out, values


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: Optional[torch.Tensor],
    response_mask: torch.Tensor,
) -> dict[str, Any]:
    """verl's off-policy diagnostics (training / rollout perplexity, KL, k3 KL, log-PPL
    differences, χ²), without prefix, floats."""
    rollout = None if rollout_log_prob is None else rollout_log_prob.detach()
    # (verl asserts a valid token here)
    return _read(offpolicy_metrics(old_log_prob.detach(), rollout, response_mask), response_mask, AssertionError)


def compute_rollout_corr_metrics_from_logprobs(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """:func:`compute_offpolicy_metrics` of the current policy, "rollout_corr/"-prefixed."""
    return prefixed(compute_offpolicy_metrics(log_prob, rollout_log_prob, response_mask))
