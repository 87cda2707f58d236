"""TRL AsyncGRPO's rollout-worker advantages
(``trl.experimental.async_grpo.async_rollout_worker``, computed inline when a group of
rollouts is scored) as a function: :func:`compute_async_grpo_advantages`, one fused
``group_advantages`` call (tests/advantages/test_peers_trl.py runs TRL's own block)."""

from __future__ import annotations

import torch

from ..._core.validation import FLOAT_DTYPES, check_tensor
from ...ops.advantages import group_advantages
from .._backend import current_backend
from .._errors import caller_names
from ._names import ADV_NAMES

__all__ = ["compute_async_grpo_advantages"]


def compute_async_grpo_advantages(rewards_per_func: torch.Tensor, num_generations: int) -> torch.Tensor:
    """TRL AsyncGRPO's rollout-worker advantages: per group, (r − mean)/(std + 1e-8) with
    the population std over the scorable completions; unscorable ones get 0."""
    check_tensor("rewards_per_func", rewards_per_func, dtypes=FLOAT_DTYPES)
    # The worker works in float64 (`np.array(all_rewards, dtype=float)`), the sum over reward
    # functions included: a float32 sum can merge two rewards that TRL tells apart.
    rewards_per_func = rewards_per_func.to(torch.float64)
    with caller_names(ADV_NAMES):
        out = group_advantages(
            rewards_per_func, group_size=num_generations, preset="trl_async", backend=current_backend()
        )
    return out.advantages
