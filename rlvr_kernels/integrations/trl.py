"""Drop-ins for TRL's group-advantage computation (TRL 1.16), built on the fused op.

TRL computes advantages inline in ``GRPOTrainer._generate_and_score_completions`` and in
the async rollout worker; these functions are those computations as functions, matching
them to 1e-6 (tests/test_integrations_trl.py runs TRL's own code on the same inputs).
Groups are contiguous: rows ``[k·G, (k+1)·G)`` are the G completions of prompt k.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops.advantages import group_advantages

__all__ = ["compute_grpo_advantages", "compute_async_grpo_advantages"]


def compute_grpo_advantages(
    rewards_per_func: torch.Tensor,
    num_generations: int,
    reward_weights: Optional[torch.Tensor] = None,
    scale_rewards: str = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Advantages ``[B]`` from ``rewards_per_func [B, n_funcs]`` (NaN = the function gave None).

    ``sum_then_normalize``: r = nansum_k w_k r_k, (r − mean_group)/(std + 1e-4) with the std
    per group or over the batch (``scale_rewards``), or no division (``"none"``).
    ``normalize_then_sum``: each function normalised per group, weighted sum, then
    whitened over the batch. Rows where every function gave NaN get 0.
    """
    if multi_objective_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
        raise ValueError(
            "multi_objective_aggregation: expected 'sum_then_normalize' or 'normalize_then_sum', "
            f"got {multi_objective_aggregation!r}"
        )
    # TRL's result has the dtype of `rewards_per_func * reward_weights` (float32 weights by default).
    out_dtype = torch.promote_types(rewards_per_func.dtype,
                                    reward_weights.dtype if reward_weights is not None else torch.float32)  # fmt: skip
    if multi_objective_aggregation == "normalize_then_sum":
        out = group_advantages(rewards_per_func, group_size=num_generations, preset="trl", estimator="gdpo",
                               reward_weights=reward_weights, out_dtype=out_dtype)  # fmt: skip
    else:
        estimator = "dr_grpo" if scale_rewards == "none" else "grpo"
        scale = None if scale_rewards == "none" else scale_rewards
        out = group_advantages(rewards_per_func, group_size=num_generations, preset="trl", estimator=estimator,
                               scale=scale, reward_weights=reward_weights, out_dtype=out_dtype)  # fmt: skip
    return out.advantages


def compute_async_grpo_advantages(rewards_per_func: torch.Tensor, num_generations: int) -> torch.Tensor:
    """TRL AsyncGRPO's rollout-worker advantages: per group, (r − mean)/(std + 1e-8) with
    the population std over the scorable completions; unscorable ones get 0."""
    # The worker works in float64 (`np.array(all_rewards, dtype=float)`), the sum over reward
    # functions included: a float32 sum can merge two rewards that TRL tells apart.
    rewards_per_func = rewards_per_func.to(torch.float64)
    return group_advantages(rewards_per_func, group_size=num_generations, preset="trl_async").advantages
