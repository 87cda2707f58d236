"""slime's advantage estimators for ``--custom-advantage-function-path``.

slime's ``compute_advantages_and_returns`` (``slime/backends/megatron_utils/loss.py``) runs
the estimator of ``--advantage-estimator`` on per-sample lists, one small kernel or a
Python-level loop per sample; the group normalisation of the rewards happened before, in
``RolloutManager._post_process_rewards`` (our :func:`~.hooks.reward_post_process`). Here
each estimator is a few kernels over the whole micro-batch: the samples' tokens
concatenated (the packed layout), the per-sample scalars spread with one
``repeat_interleave``, the recurrences (discounted returns, GAE) as one blocked scan over a
padded ``[B, L]`` view.
"""

from __future__ import annotations

from typing import Any, List

import torch

from .._torch_math import discounted_returns
from .hooks import _arg

# slime/utils/arguments.py --advantage-estimator choices.
ESTIMATORS = ("grpo", "gspo", "cispo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def _per_sample(name: str, xs: Any, n: int) -> List[torch.Tensor]:
    if not isinstance(xs, (list, tuple)) or len(xs) != n:
        got = len(xs) if isinstance(xs, (list, tuple)) else type(xs).__name__
        raise ValueError(f"rollout_data[{name!r}]: expected a list of {n} per-sample tensors, got {got}")
    for i, x in enumerate(xs):
        if not isinstance(x, torch.Tensor) or x.dim() != 1:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"rollout_data[{name!r}][{i}]: expected a 1-D tensor, got {got}")
    return list(xs)


def _padded(flat: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """The packed ``flat`` as ``[B, width]`` rows, zero after each row's length."""
    B = lengths.shape[0]
    out = flat.new_zeros(B, width)
    valid = torch.arange(width, device=flat.device)[None, :] < lengths[:, None]
    out[valid] = flat
    return out


def compute_advantages_and_returns(args: Any, rollout_data: dict) -> None:
    """slime's estimators for ``--custom-advantage-function-path``: sets
    ``rollout_data["advantages"]`` and ``rollout_data["returns"]`` (lists of per-sample
    fp32 tensors) from ``rollout_data["rewards"]`` (the post-processed rewards), the
    per-token ``rollout_data["kl"]`` slime computed before calling the hook, and for the
    estimators that read them ``loss_masks`` and ``values``:

    - grpo / gspo / cispo: every token carries its sample's reward (returns = advantages);
    - reinforce_plus_plus_baseline: reward − ``kl_coef``·kl per token (returns = advantages);
    - reinforce_plus_plus: the discounted (``gamma``) returns of the token rewards
      −``kl_coef``·kl·mask with the reward added on the last token of the mask;
    - ppo: GAE (``gamma``, ``lambd``) on the critic's ``values`` with the token rewards
      −``kl_coef``·kl and the reward added on the last token; returns = advantages + values.

    What slime does after its estimator (on-policy distillation's penalty, the
    ``--normalize-advantages`` whitening) it still does after this hook. Context
    parallelism (``args.context_parallel_size`` > 1: each rank holding chunks of every
    sample) is refused, as is an estimator slime does not have."""
    estimator = _arg(args, "advantage_estimator")
    if estimator not in ESTIMATORS:
        raise ValueError(f"args.advantage_estimator: expected one of {ESTIMATORS}, got {estimator!r}")
    if int(getattr(args, "context_parallel_size", 1) or 1) != 1:
        raise ValueError(
            f"args.context_parallel_size: {args.context_parallel_size} (each rank holds chunks of every sample) is "
            "not supported by this hook"
        )
    if not isinstance(rollout_data, dict):
        raise TypeError(f"rollout_data: expected slime's dict of rollout lists, got {type(rollout_data).__name__}")
    rewards = rollout_data.get("rewards")
    if rewards is None:
        raise ValueError("rollout_data['rewards']: missing")
    n = len(rewards)
    kl = _per_sample("kl", rollout_data.get("kl"), n)
    if n == 0:
        rollout_data["advantages"], rollout_data["returns"] = [], []
        return
    device = kl[0].device
    sizes = [int(k.shape[0]) for k in kl]
    lengths = torch.tensor(sizes, device=device)
    kl_flat = torch.cat(kl).float()
    r = torch.as_tensor(rewards, dtype=torch.float32, device=device).reshape(-1)
    if not torch.isfinite(r).all():
        i = int((~torch.isfinite(r)).nonzero()[0, 0])
        raise ValueError(f"rollout_data['rewards'][{i}]: non-finite reward {float(r[i])}")
    kl_coef = float(_arg(args, "kl_coef"))

    if estimator in ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline"):
        adv = torch.repeat_interleave(r, lengths, output_size=sum(sizes))
        if estimator == "reinforce_plus_plus_baseline":
            adv = adv - kl_coef * kl_flat
        advantages = list(adv.split(sizes))
        rollout_data["advantages"], rollout_data["returns"] = advantages, advantages
        return

    width = max(sizes)
    ends = torch.cumsum(lengths, 0) - 1  # each sample's last token in the packed layout
    if estimator == "reinforce_plus_plus":
        masks = _per_sample("loss_masks", rollout_data.get("loss_masks"), n)
        for i, (m, s) in enumerate(zip(masks, sizes)):
            if m.shape[0] != s:
                raise ValueError(f"rollout_data['loss_masks'][{i}]: expected {s} tokens (its kl), got {m.shape[0]}")
        mask = torch.cat(masks).to(device=device, dtype=torch.float32)
        counts = torch.segment_reduce(mask, "sum", lengths=lengths)
        if not (counts > 0).all():
            i = int((counts <= 0).nonzero()[0, 0])
            raise ValueError(f"rollout_data['loss_masks'][{i}]: the sample is fully masked (no token for its reward)")
        tok = -kl_coef * (kl_flat * mask)
        # The last token of each mask: the largest masked position of the sample.
        # (fp64 positions: exact for any token count)
        pos = torch.arange(tok.shape[0], device=device, dtype=torch.float64)
        last = torch.segment_reduce(torch.where(mask != 0, pos, -1.0), "max", lengths=lengths).long()
        tok = tok.index_add(0, last, r)
        ret = discounted_returns(_padded(tok, lengths, width), float(_arg(args, "gamma")))
        valid = torch.arange(width, device=device)[None, :] < lengths[:, None]
        returns = list(ret[valid].split(sizes))
        rollout_data["advantages"], rollout_data["returns"] = returns, returns
        return

    # ppo
    values = _per_sample("values", rollout_data.get("values"), n)
    for i, (v, s) in enumerate(zip(values, sizes)):
        if v.shape[0] != s:
            raise ValueError(f"rollout_data['values'][{i}]: expected {s} tokens (its kl), got {v.shape[0]}")
    gamma, lambd = float(_arg(args, "gamma")), float(_arg(args, "lambd"))
    tok = (-kl_coef * kl_flat).index_add(0, ends, r)
    v_flat = torch.cat(values).to(torch.float32)
    V = _padded(v_flat, lengths, width)
    R = _padded(tok, lengths, width)
    nxt = torch.nn.functional.pad(V[:, 1:], (0, 1))  # V_{t+1}, 0 after each row's end
    delta = R + gamma * nxt - V
    adv = discounted_returns(delta, gamma * lambd)
    valid = torch.arange(width, device=device)[None, :] < lengths[:, None]
    adv_flat = adv[valid]
    rollout_data["advantages"] = list(adv_flat.split(sizes))
    rollout_data["returns"] = list((adv_flat + v_flat).split(sizes))
