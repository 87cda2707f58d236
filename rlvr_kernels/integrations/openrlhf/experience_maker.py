"""Drop-in for OpenRLHF 0.11.2's ``openrlhf/trainer/ppo_utils/experience_maker.py``:
``RemoteExperienceMaker.compute_advantages_and_returns``, the experience maker's advantages.

OpenRLHF shapes each prompt group's rewards in torch (``--algo.advantage.estimator`` rloo,
reinforce_baseline, dr_grpo, group_norm, flash_reinforce), then, per experience, turns them
into token rewards (``openrlhf.models.utils.compute_reward``: the KL penalty and the reward on
the last action token) and runs its returns as a Python loop over the response tokens
(``get_cumulative_returns``, or GAE in ``get_advantages_and_returns``), and whitens the
advantages over the action tokens (gae, reinforce, reinforce_baseline). Here the group
shaping and the group statistics are one :func:`rlvr_kernels.group_advantages` call
(``preset="openrlhf"``) on the rewards in the experiences' order (the groups from
``experience.index``, no reordering), and the returns one blocked scan per experience
(:func:`~rlvr_kernels.integrations._torch_math.discounted_returns`).

The length penalties (``apply_length_penalties``, a per-sample loop over the responses that
edits the rewards in place) are OpenRLHF's own function, called as OpenRLHF calls it.
"""

from __future__ import annotations

import logging
from typing import Any, List

import torch

from ...ops.advantages import group_advantages
from .._backend import current_backend
from .._torch_math import discounted_returns

_log = logging.getLogger(__name__)

ESTIMATORS = ("gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo", "flash_reinforce")
# estimator -> group_advantages' estimator for the group shaping (None: the rewards as they are)
_SHAPING = {"rloo": "rloo", "reinforce_baseline": "dr_grpo", "dr_grpo": "dr_grpo", "group_norm": "grpo"}
_WHITENED = ("gae", "reinforce", "reinforce_baseline")


def _token_rewards(r, kl_coef: float, kl, action_mask, clip_range):
    """``compute_reward``: −kl_coef·kl (kl_coef clamped at 0), plus r (clipped to
    ``clip_range`` when given) on the last action token of each row, or on the last column for
    a row without one (where OpenRLHF's search for it ends)."""
    kl_coef = max(float(kl_coef), 0.0)
    if clip_range:
        r = r.clamp(min=clip_range[0], max=clip_range[1])
    B, A = action_mask.shape
    cols = torch.arange(A, device=action_mask.device)
    last = torch.where(action_mask.bool(), cols, -1).amax(dim=1)
    last = torch.where(last < 0, A - 1, last)
    out = -kl_coef * kl
    out[torch.arange(B, device=out.device), last] += r.to(out.dtype)
    return out


@torch.no_grad()
def compute_advantages_and_returns(self: Any, experiences: List[Any]) -> List[Any]:
    """``RemoteExperienceMaker.compute_advantages_and_returns(self, experiences)``: sets each
    experience's ``advantages``, ``returns``, ``info["return"]`` (and
    ``info["group_reward_std"]`` with more than one sample per prompt), ``kl = None``, and
    returns the experiences, with OpenRLHF's numbers. ``self`` is the experience maker (its
    ``strategy.args``, ``advantage_estimator`` and ``kl_ctl``).

    Differences: a prompt group of one sample gets 0 under rloo and group_norm (OpenRLHF
    divides by n − 1 = 0, or by a NaN std; its CLI refuses n = 1), a non-finite reward raises
    ``ValueError`` naming the experience, and so does an unknown estimator."""
    from openrlhf.trainer.ppo_utils.length_penalty import apply_length_penalties

    args = self.strategy.args
    estimator = self.advantage_estimator
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage_estimator: expected one of {ESTIMATORS}, got {estimator!r}")
    for experience in experiences:
        experience.rewards = experience.rewards.to(torch.promote_types(experience.rewards.dtype, torch.float32))
    apply_length_penalties(experiences, args)

    n = int(args.rollout.n_samples_per_prompt)
    sizes = [len(e.index) for e in experiences]
    raw = torch.cat([e.rewards for e in experiences])
    for i, e in enumerate(experiences):
        if not torch.isfinite(e.rewards).all():
            raise ValueError(f"experiences[{i}].rewards: non-finite reward")
    if raw.shape[0] % n:
        raise ValueError(f"experiences: {raw.shape[0]} rewards is not a whole number of groups of {n}")
    # raw[k] is the sample at prompt-order position index[k] (OpenRLHF sorts by it, shapes the
    # groups of n consecutive positions, and gathers back): its group is index[k] // n.
    index = torch.tensor([i for e in experiences for i in e.index], device=raw.device)
    group = index // n
    shaping = _SHAPING.get(estimator)
    if n > 1 or shaping is not None:
        out = group_advantages(
            raw,
            group,
            num_groups=raw.shape[0] // n,
            estimator=shaping or "grpo",
            preset="openrlhf",
            out_dtype=raw.dtype,
            backend=current_backend(),
        )
    if n > 1:
        for e, std in zip(experiences, out.group_std[group].to(raw.dtype).split(sizes)):
            e.info["group_reward_std"] = std
    if shaping is not None:
        rewards = out.advantages
    elif estimator == "flash_reinforce":
        rewards = raw - raw.mean()
    else:
        rewards = raw

    adv_args = args.algo.advantage
    if estimator != "gae" and estimator != "reinforce" and adv_args.gamma != 1.0:
        _log.warning("gamma is set to 1.0 for %s", estimator)
        adv_args.gamma = 1.0
    for e, r in zip(experiences, rewards.split(sizes)):
        mask = e.action_mask
        reward = _token_rewards(r, self.kl_ctl.value, e.kl, mask, args.reward.clip_range)
        if estimator == "gae":
            values = mask * e.values
            masked = mask * reward
            nxt = torch.nn.functional.pad(values[:, 1:], (0, 1))
            adv = discounted_returns(masked + adv_args.gamma * nxt - values, adv_args.gamma * adv_args.lambd)
            e.advantages, e.returns = adv, adv + values
        else:
            e.returns = discounted_returns(mask * reward, adv_args.gamma)
            e.advantages = e.returns.clone()
        e.info["return"] = reward.sum(dim=-1)
        e.kl = None

    if estimator in _WHITENED:
        adv = torch.cat([e.advantages.flatten() for e in experiences]).float()
        m = torch.cat([e.action_mask.flatten() for e in experiences])
        count = m.sum()
        mean = (adv * m).sum() / count
        rstd = 1
        if not adv_args.no_std_norm:
            rstd = (((adv - mean).pow(2) * m).sum() / count).clamp(min=1e-8).rsqrt()
        for e in experiences:
            e.advantages = (e.advantages - mean) * rstd
    return experiences
