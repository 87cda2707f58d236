"""The hook functions. Each reads what slime passes it and makes one fused call where slime
runs a Python loop over the samples."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from ...ops.advantages import group_advantages
from .._backend import current_backend

# slime's estimators whose rewards it group-normalises (slime/ray/rollout.py,
# RolloutManager._post_process_rewards), and those of them it also divides by the group std.
_CENTRED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
_SCALED = ("grpo", "gspo", "cispo")


def _arg(args: Any, name: str):
    if not hasattr(args, name):
        raise TypeError(f"args.{name}: slime's argument namespace must have it")
    return getattr(args, name)


def reward_post_process(args: Any, samples: Sequence[Any]) -> Tuple[List[float], List[float]]:
    """slime's default reward post-processing (``RolloutManager._post_process_rewards``) for
    ``--custom-reward-post-process-path``: ``(raw_rewards, rewards)``, the raw reward of each
    sample (``sample.get_reward_value(args)``) and the reward the advantages start from.

    With ``args.rewards_normalization`` and ``args.advantage_estimator`` in grpo / gspo / cispo /
    reinforce_plus_plus_baseline, the rewards are centred on their group mean and, for the first
    three with ``args.grpo_std_normalization``, divided by (the unbiased group std + 1e-6), all in
    fp32: one ``group_advantages(preset="slime")`` call. The groups are slime's: consecutive runs
    of ``args.n_samples_per_prompt`` samples when there are exactly ``n_samples_per_prompt ×
    rollout_batch_size`` of them, else one group of all the samples (slime's fallback for groups
    of unequal sizes). Otherwise the rewards are the raw ones.

    A group of one sample gets 0 (slime: r − mean = 0, then 0 / NaN std = NaN with the std
    division; slime's argument checks turn the division off for ``n_samples_per_prompt = 1``).
    A non-finite reward raises ``ValueError`` naming the sample."""
    if isinstance(samples, (str, bytes)) or not isinstance(samples, Sequence):
        raise TypeError(f"samples: expected a list of slime Samples, got {type(samples).__name__}")
    estimator = _arg(args, "advantage_estimator")
    normalise = estimator in _CENTRED and bool(_arg(args, "rewards_normalization"))
    raw = []
    for i, sample in enumerate(samples):
        if not hasattr(sample, "get_reward_value"):
            raise TypeError(
                f"samples[{i}]: expected a slime Sample (with get_reward_value), got {type(sample).__name__}"
            )
        raw.append(sample.get_reward_value(args))
    if not normalise or not raw:
        return raw, raw
    rewards = torch.tensor(raw, dtype=torch.float32)
    n = int(_arg(args, "n_samples_per_prompt"))
    contiguous = rewards.shape[0] == n * int(_arg(args, "rollout_batch_size"))
    scaled = estimator in _SCALED and bool(_arg(args, "grpo_std_normalization"))
    bad = (~torch.isfinite(rewards)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"samples[{i}]: non-finite reward {raw[i]}")
    out = group_advantages(
        rewards,
        group_size=n if contiguous else rewards.shape[0],
        preset="slime",
        scale="group" if scaled else "none",
        backend=current_backend(),
    )
    return raw, out.advantages.tolist()


def pg_loss_reducer(
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    loss_masks: Sequence[torch.Tensor],
    calculate_per_token_loss: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The reducer slime builds by default (``get_sum_of_sample_mean`` in
    ``slime/backends/megatron_utils/cp_utils.py``, no context parallelism, each sample's own
    mask count as its denominator), for ``--custom-pg-loss-reducer-function-path``: x (the
    concatenated per-token values of the samples, ``sum(response_lengths)`` long) →
    Σ_i Σ_t x_{i,t} m_{i,t} / max(Σ_t m_{i,t}, 1), or Σ_i Σ_t x_{i,t} m_{i,t} with
    ``calculate_per_token_loss``. One segmented reduction for the whole micro-batch, where
    slime launches a few kernels per sample. Context parallelism (each rank holding zigzag
    chunks of every sample) is refused: a mask longer than its sample raises."""
    if len(loss_masks) != len(response_lengths) or len(total_lengths) != len(response_lengths):
        raise ValueError(
            f"loss_masks: expected one per sample ({len(response_lengths)} response_lengths, {len(total_lengths)} "
            f"total_lengths), got {len(loss_masks)}"
        )
    return _sample_mean_reducer(response_lengths, loss_masks, None, calculate_per_token_loss)


def _sample_mean_reducer(
    response_lengths: Sequence[int],
    loss_masks: Sequence[torch.Tensor],
    denominators: Optional[Sequence] = None,
    calculate_per_token_loss: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Σ_i Σ_t x m / max(d_i, 1) (or Σ x m per token) over the concatenated samples, with d_i
    each mask's own count, or ``denominators`` (slime's ``rollout_mask_sums``) when given."""
    lengths = [int(n) for n in response_lengths]
    if len(lengths) != len(loss_masks):
        raise ValueError(
            f"loss_masks: expected one per sample ({len(lengths)} response_lengths), got {len(loss_masks)}"
        )
    for i, (n, m) in enumerate(zip(lengths, loss_masks)):
        if not isinstance(m, torch.Tensor) or m.dim() != 1 or m.shape[0] != n:
            got = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"loss_masks[{i}]: expected a [{n}] tensor (response_lengths[{i}]), got {got}")
    mask = torch.cat([m.reshape(-1) for m in loss_masks]) if lengths else torch.zeros(0)
    device = mask.device
    seg_lengths = torch.tensor(lengths, dtype=torch.int64, device=device)
    # Each sample's denominator, max(Σ m, 1): exact in fp32 below 2^24 tokens, as slime's
    # integer count is when it divides an fp32 sum.
    if denominators is not None:
        if len(denominators) != len(lengths):
            raise ValueError(f"rollout_mask_sums: expected one per sample ({len(lengths)}), got {len(denominators)}")
        d = denominators if isinstance(denominators, torch.Tensor) else torch.tensor([float(v) for v in denominators])
        counts = d.to(device=device, dtype=torch.float64).reshape(-1).clamp_min(1)
    elif lengths:
        counts = torch.segment_reduce(mask.double(), "sum", lengths=seg_lengths).clamp_min(1)
    else:
        counts = None
    total = sum(lengths)

    def reduce(x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.shape != (total,):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: expected the samples' concatenated tokens, shape ({total},), got {got}")
        weighted = x * mask.to(device=x.device, dtype=x.dtype)
        if calculate_per_token_loss or not lengths:
            return weighted.sum()
        per_sample = torch.segment_reduce(weighted, "sum", lengths=seg_lengths.to(x.device))
        return (per_sample / counts.to(device=x.device, dtype=x.dtype)).sum()

    return reduce
