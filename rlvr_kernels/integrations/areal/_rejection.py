"""AReaL 1.0.4's rejection sampling (``areal/utils/functional/functional.py``,
``apply_rejection_sampling``) as the mask and the weights the fused loss takes, formed without
gradient in lean torch (elementwise and per-sequence sums over ``[T]``: no kernel is faster).

With x = proximal − behaviour log-probs (fp32, non-finite x read as 0) and the bounds
[``lower``, ``upper``] of a ``RejectionSamplingConfig`` (no lower bound when ``lower`` is None):

- the metric: ``ratio`` e^x; ``kl_k1`` x, ``kl_k2`` x²/2, ``kl_k3`` e^(−x) − 1 + x (AReaL's
  ``KLEstimator`` with the proximal policy first: the opposite sign convention of verl's
  rejection options, and no ±20 clamp, which is why the op's ``RolloutCorrection`` is not used);
- the weight w = e^x per token; at ``level="sequence"`` with the ratio metric, the geometric
  mean exp(mean x) of the sequence for each of its tokens;
- ``level="token"``: ``mask`` keeps a token whose metric is in bounds, ``clamp`` bounds w to
  [lower or 0, upper] whatever the metric;
- ``level="sequence"``: the sequence statistic is the sum / mean / max (``agg``) of x (ratio,
  compared as e^stat) or of the metric over the valid tokens (a sequence without one: 0 for
  max); ``mask`` drops a whole sequence out of bounds, ``clamp`` bounds the weights of its
  tokens;
- the weight is 0 outside the kept tokens; ``filtered_fraction`` is the fraction of the valid
  tokens dropped (``mask``) or whose weight the clamp changed (``clamp``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

LEVELS = ("token", "sequence")
ACTIONS = ("mask", "clamp")
METRICS = ("ratio", "kl_k1", "kl_k2", "kl_k3")
AGGS = ("sum", "mean", "max")


class Rejection(NamedTuple):
    loss_mask: torch.Tensor  # the kept tokens, in the dtype of the given mask
    behave_imp_weight: torch.Tensor  # fp32, 0 outside the kept tokens
    filtered_fraction: float


def check_config(config) -> None:
    """AReaL's choices, raised as ValueError naming the field (AReaL raises on a bad metric or
    agg when it meets it; the drop-in before any work)."""
    for name, choices in (("level", LEVELS), ("action", ACTIONS), ("metric", METRICS)):
        value = getattr(config, name)
        if value not in choices:
            raise ValueError(f"rejection_sampling.{name}: expected one of {choices}, got {value!r}")
    if config.level == "sequence" and config.agg not in AGGS:
        raise ValueError(f"rejection_sampling.agg: expected one of {AGGS}, got {config.agg!r}")


def sequence_index(shape, cu_seqlens: Optional[torch.Tensor], device) -> torch.Tensor:
    """The sequence of each token of the flattened layout: the row of a padded ``[B, L]``
    tensor, the ``cu_seqlens`` segment of a packed ``[T]`` one."""
    if len(shape) == 2:
        return torch.arange(shape[0], device=device).repeat_interleave(shape[1])
    if cu_seqlens is None:
        raise ValueError("cu_seqlens: required for 1-D (packed) tensors at the sequence level, as in AReaL")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=device, dtype=torch.long)
    return torch.arange(lengths.numel(), device=device).repeat_interleave(lengths, output_size=shape[0])


def segment_sum(values: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    return values.new_zeros(n).index_add_(0, index, values)


def _in_bounds(stat: torch.Tensor, config) -> torch.Tensor:
    ok = stat <= config.upper
    return ok & (stat >= config.lower) if config.lower is not None else ok


def _clamp(w: torch.Tensor, config) -> torch.Tensor:
    return w.clamp(min=config.lower if config.lower is not None else 0.0, max=config.upper)


@torch.no_grad()
def rejection_sampling(proximal, old, loss_mask, cu_seqlens, config) -> Rejection:
    """The kept tokens and weights of ``config`` (module docstring)."""
    check_config(config)
    for name, t in (("old_logprobs", old), ("loss_mask", loss_mask)):
        if tuple(t.shape) != tuple(proximal.shape):
            raise ValueError(
                f"{name}: expected the shape of proximal_logprobs {tuple(proximal.shape)}, got {tuple(t.shape)}"
            )
    if proximal.dim() not in (1, 2):
        raise ValueError(f"proximal_logprobs: expected 1-D (packed) or 2-D (padded), got ndim={proximal.dim()}")
    shape = proximal.shape
    raw = proximal.detach().float() - old.detach().float()
    x = torch.where(torch.isfinite(raw), raw, 0.0).reshape(-1)
    raw = raw.reshape(-1)
    valid = loss_mask.reshape(-1).bool()
    ratio = config.metric == "ratio"
    if ratio:
        metric = x.exp()
    elif config.metric == "kl_k1":
        metric = raw
    elif config.metric == "kl_k2":
        metric = raw.square() / 2.0
    else:
        metric = (-raw).exp() - 1 + raw
    w = x.exp()
    if config.level == "token":
        if config.action == "mask":
            keep = valid & _in_bounds(metric, config)
        else:
            keep = valid
            clamped = _clamp(w, config)
            changed, w = clamped != w, clamped
    else:
        index = sequence_index(shape, cu_seqlens, x.device)
        rows = shape[0] if len(shape) == 2 else cu_seqlens.numel() - 1
        values = torch.where(valid, x if ratio else metric, 0.0)
        count = segment_sum(valid.float(), index, rows)
        if ratio:
            w = (segment_sum(values, index, rows) / count.clamp(min=1)).exp()[index]
        if config.agg == "max":
            stat = values.new_full((rows,), float("-inf"))
            stat = stat.scatter_reduce(0, index, torch.where(valid, values, float("-inf")), reduce="amax")
            stat = torch.where(count == 0, 0.0, stat)
        else:
            stat = segment_sum(values, index, rows)
            if config.agg == "mean":
                stat = stat / count.clamp(min=1)
        inside = _in_bounds(stat.exp() if ratio else stat, config)[index]
        if config.action == "mask":
            keep = valid & inside
        else:
            keep = valid
            clamped = torch.where(inside, w, _clamp(w, config))
            changed, w = clamped != w, clamped
    total = max(int(valid.sum()), 1)
    dropped = valid & ~keep if config.action == "mask" else valid & changed
    fraction = int(dropped.sum()) / total
    w = torch.where(keep, w, 0.0)
    return Rejection(keep.reshape(shape).to(loss_mask.dtype), w.reshape(shape), fraction)
