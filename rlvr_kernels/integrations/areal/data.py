"""Drop-in for ``areal.utils.data.Normalization`` (AReaL 1.0.4), the reward and advantage
normalisation of ``PPOActor._compute_advantages`` (``reward_norm``, ``adv_norm``), on
``group_advantages``.

AReaL's ``Normalization(config)(x, loss_mask)`` centres ``x`` on the mean of its level
(``"batch"``: every valid element; ``"group"``: each block of ``group_size`` rows) and divides by
the standard deviation of its level about that mean (Bessel's with ``std_unbiased``) plus
``eps``, masked elements 0; ``None`` skips the step (eps 0 without the division). In the op's
terms, ``x`` a ``[B]`` vector (``reward_norm``: one score per response):

- group / group: ``estimator="grpo"`` with ``group_size``, ``scale="group"``, the std of
  ``std_unbiased``, eps added to σ; a one-row group gives 0 (AReaL: its own mean, σ = 1 or 0);
- batch / batch: the same with one group of all the rows;
- group or batch / None: ``scale="none"`` (A = x − mean);
- ``loss_mask`` (``[B]``): ``sample_mask``.

``x`` of ``[B, T]`` with its ``loss_mask`` (``adv_norm`` over the tokens) at batch / batch is the
token-weighted whitening of ``group_advantages`` (``Whitening("tokens", eps, eps_in_sqrt=False)``
over the rows' values), which holds when each row carries one value on its valid tokens (discount
1, no critic, no KL reward: AReaL's GRPO); a row whose values vary raises NotImplementedError
(one comparison pass and a host sync check it). Not served, each raising NotImplementedError
naming the field: ``mean_leave1out``, a ``std_level`` without a ``mean_level`` (AReaL's σ is then
about 0), different mean and std levels, ``[B, T]`` at the group level or without the std step,
a ``group_size`` that does not divide B (AReaL leaves the rows after the last whole group
unnormalised), and a batch level across several ranks (AReaL all-reduces over
``reduce_group``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...ops.advantages import group_advantages
from ...options import Whitening
from .._backend import current_backend
from .._patch import record

__all__ = ["Normalization"]

LEVELS = ("batch", "group", None)


class Normalization:
    """AReaL ``areal.utils.data.Normalization`` on ``group_advantages`` (module docstring)."""

    def __init__(self, config):
        for name in ("mean_level", "std_level"):
            if getattr(config, name) not in LEVELS:
                raise ValueError(f"config.{name}: expected one of {LEVELS}, got {getattr(config, name)!r}")
        if config.mean_leave1out:
            raise NotImplementedError("config.mean_leave1out: AReaL's leave-one-out mean is not served by the drop-in")
        if config.mean_level is None and config.std_level is not None:
            raise NotImplementedError(
                "config.std_level: without a mean_level AReaL's σ is about 0, which the drop-in does not serve"
            )
        if config.std_level is not None and config.std_level != config.mean_level:
            raise NotImplementedError(
                f"config.std_level: {config.std_level!r} with mean_level={config.mean_level!r} (different levels) "
                "is not served by the drop-in"
            )
        if "group" in (config.mean_level, config.std_level) and config.group_size < 1:
            raise ValueError(f"config.group_size: expected a positive integer, got {config.group_size}")
        self.mean_level = config.mean_level
        self.mean_leave1out = config.mean_leave1out
        self.std_level = config.std_level
        self.std_unbiased = config.std_unbiased
        self.group_size = config.group_size
        self.eps = config.eps

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, loss_mask=None, high_precision: bool = True, reduce_group=None) -> torch.Tensor:
        record("areal.Normalization")
        if loss_mask is not None and tuple(loss_mask.shape) != tuple(x.shape):
            raise ValueError(f"loss_mask: expected the shape of x {tuple(x.shape)}, got {tuple(loss_mask.shape)}")
        if loss_mask is not None and not bool(loss_mask.any()):
            return x.float()  # AReaL's early return
        if self.mean_level is None:  # nothing to normalise: AReaL's masked copy
            return (x * loss_mask if loss_mask is not None else x).float()
        batch = self.mean_level == "batch"
        if batch and dist.is_initialized() and dist.get_world_size(reduce_group) > 1:
            raise NotImplementedError(
                "reduce_group: the batch level across several ranks (AReaL all-reduces its sums) is not served"
            )
        std = "unbiased" if self.std_unbiased else "population"
        scale = "group" if self.std_level is not None else "none"
        if x.dim() == 1:
            B = x.shape[0]
            size = B if batch else self.group_size
            if B % size:
                raise NotImplementedError(
                    f"group_size: {size} does not divide the {B} rows (AReaL leaves the rows after the last "
                    "whole group unnormalised)"
                )
            out = group_advantages(
                x,
                group_size=size,
                estimator="grpo",
                std=std,
                eps=float(self.eps),
                eps_in_sqrt=False,
                scale=scale,
                singleton="zero",
                nan_policy="error",
                sample_mask=None if loss_mask is None else loss_mask.bool(),
                out_dtype=torch.float64 if high_precision else torch.float32,
                backend=current_backend(),
            )
            return out.advantages.float()
        return self._tokens(x, loss_mask, std, scale)

    def _tokens(self, x, loss_mask, std, scale) -> torch.Tensor:
        """``[B, T]`` values at batch / batch: the token-weighted whitening of the rows' values."""
        if x.dim() != 2 or loss_mask is None:
            raise NotImplementedError(
                f"x: the drop-in serves [B] or [B, T] with a loss_mask, got shape {tuple(x.shape)}"
            )
        if self.mean_level != "batch" or scale == "none":
            raise NotImplementedError(
                f"config.mean_level / std_level: [B, T] values are served at batch / batch, got "
                f"{self.mean_level!r} / {self.std_level!r}"
            )
        m = loss_mask.to(torch.float64)
        lengths = m.sum(-1)
        rows = (x.double() * m).sum(-1) / lengths.clamp(min=1)
        if bool(((x.double() - rows[:, None]) * m).ne(0).any()):
            raise NotImplementedError(
                "x: values that vary along a row's valid tokens (a critic, a discount or a KL reward); the drop-in "
                "serves one value per row, as AReaL's GRPO gives"
            )
        B = x.shape[0]
        out = group_advantages(
            rows,
            torch.arange(B, device=x.device),
            num_groups=B,
            estimator="grpo",
            scale="none",
            singleton="raw",  # each row its own group, against mean 0: A_i = its value
            sample_mask=lengths > 0,
            response_mask=loss_mask,
            batch_whiten=True,
            whitening=Whitening("tokens", float(self.eps), False, std=std),
            out_dtype=torch.float64,
            backend=current_backend(),
        )
        return out.token_advantages.float()
