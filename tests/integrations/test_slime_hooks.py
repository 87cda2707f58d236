"""slime's hooks (rlvr_kernels.integrations.slime) on hand-computed values: slime is not an
installable package, so the expected numbers below are worked out from the formulas of
slime/ray/rollout.py (RolloutManager._post_process_rewards) and
slime/backends/megatron_utils/cp_utils.py (get_sum_of_sample_mean) by hand."""

import math
import types

import pytest
import torch

from rlvr_kernels.integrations import slime


class Sample:
    """What the hook reads of slime's Sample: its reward, through get_reward_value(args)."""

    def __init__(self, reward):
        self.reward = reward

    def get_reward_value(self, args):
        return self.reward if args.reward_key is None else self.reward[args.reward_key]


def _args(**kw):
    base = dict(
        advantage_estimator="grpo",
        rewards_normalization=True,
        grpo_std_normalization=True,
        n_samples_per_prompt=4,
        rollout_batch_size=2,
        reward_key=None,
    )
    return types.SimpleNamespace(**{**base, **kw})


def _grpo(group):
    """(r − mean) / (unbiased std + 1e-6), by hand."""
    n = len(group)
    mean = sum(group) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1))
    return [(r - mean) / (std + 1e-6) for r in group]


def test_grpo_groups_of_n():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]
    raw, out = slime.reward_post_process(_args(), [Sample(r) for r in rewards])
    assert raw == rewards
    # group 1: mean 0.5, std sqrt(1/3): ±0.5 / 0.57735 = ±0.866024...; group 2: all equal, 0
    want = _grpo(rewards[:4]) + [0.0] * 4
    assert out == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert out[0] == pytest.approx(0.8660240, rel=1e-6)


def test_unequal_groups_fall_back_to_one_group():
    """6 samples where n × rollout_batch_size is 8: slime normalises them as one group."""
    rewards = [3.0, 1.0, 0.0, 2.0, 2.0, 4.0]
    _, out = slime.reward_post_process(_args(), [Sample(r) for r in rewards])
    assert out == pytest.approx(_grpo(rewards), rel=1e-6)


@pytest.mark.parametrize(
    "kw",
    [
        dict(advantage_estimator="reinforce_plus_plus_baseline"),
        dict(grpo_std_normalization=False),
        dict(advantage_estimator="gspo", grpo_std_normalization=False),
    ],
)
def test_centring_only(kw):
    rewards = [1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 6.0, 8.0]
    _, out = slime.reward_post_process(_args(**kw), [Sample(r) for r in rewards])
    assert out == pytest.approx([0.75, -0.25, -0.25, -0.25, -3.0, -1.0, 1.0, 3.0], rel=1e-6)


@pytest.mark.parametrize("kw", [dict(rewards_normalization=False), dict(advantage_estimator="ppo")])
def test_raw_rewards_pass_through(kw):
    rewards = [1.0, 0.0, 0.25, 1.0]
    raw, out = slime.reward_post_process(_args(n_samples_per_prompt=2, **kw), [Sample(r) for r in rewards])
    assert raw == out == rewards


def test_reward_key_and_singletons():
    """get_reward_value with a reward key; n = 1: every reward centres on itself, 0."""
    samples = [Sample({"acc": r}) for r in (1.0, 0.0, 1.0)]
    raw, out = slime.reward_post_process(_args(n_samples_per_prompt=1, rollout_batch_size=3, reward_key="acc"), samples)
    assert raw == [1.0, 0.0, 1.0] and out == [0.0, 0.0, 0.0]


def test_bad_input_raises():
    with pytest.raises(ValueError, match=r"samples\[1\]: non-finite"):
        slime.reward_post_process(_args(n_samples_per_prompt=2, rollout_batch_size=1), [Sample(1.0), Sample(math.nan)])
    with pytest.raises(TypeError, match=r"samples\[0\]"):
        slime.reward_post_process(_args(), [1.0])
    with pytest.raises(TypeError, match="samples"):
        slime.reward_post_process(_args(), "abc")
    with pytest.raises(TypeError, match="args.rewards_normalization"):
        slime.reward_post_process(types.SimpleNamespace(advantage_estimator="grpo"), [Sample(1.0)])


def test_pg_loss_reducer_sample_means():
    """Σ_i Σ_t x·m / max(Σ m, 1): lengths 2, 3, 2; masks [1, 0], [1, 1, 0], [0, 0]."""
    masks = [torch.tensor([1, 0]), torch.tensor([1, 1, 0]), torch.tensor([0, 0])]
    reduce = slime.pg_loss_reducer([5, 6, 4], [2, 3, 2], masks, False)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], requires_grad=True)
    loss = reduce(x)
    assert loss.item() == pytest.approx(1.0 + 3.5 + 0.0)
    loss.backward()
    assert x.grad.tolist() == [1.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.0]
    per_token = slime.pg_loss_reducer([5, 6, 4], [2, 3, 2], masks, True)
    assert per_token(x).item() == 8.0


def test_pg_loss_reducer_float_masks_and_errors():
    reduce = slime.pg_loss_reducer([3], [3], [torch.tensor([0.5, 1.0, 0.0])], False)
    assert reduce(torch.tensor([2.0, 4.0, 8.0])).item() == pytest.approx((1.0 + 4.0) / 1.5)
    with pytest.raises(ValueError, match=r"loss_masks\[0\]"):
        slime.pg_loss_reducer([3], [3], [torch.ones(2)], False)
    with pytest.raises(ValueError, match="loss_masks"):
        slime.pg_loss_reducer([3, 2], [3], [torch.ones(3)], False)
    with pytest.raises(ValueError, match="x: expected"):
        reduce(torch.ones(4))
    empty = slime.pg_loss_reducer([], [], [], False)
    assert empty(torch.zeros(0)).item() == 0.0
