"""OpenRLHF 0.11.2's experience-maker advantages, ``RemoteExperienceMaker.
compute_advantages_and_returns`` (``openrlhf/trainer/ppo_utils/experience_maker.py``), run for
real on a stand-in experience maker (its ``strategy.args``, ``advantage_estimator``,
``kl_ctl`` and its own ``get_advantages_and_returns`` / ``get_cumulative_returns``), against
the drop-in (``rlvr_kernels.integrations.openrlhf.experience_maker``) on the same random
experiences: shuffled prompt order across experiences of different widths, masked tails, a
row with no action token, the KL reward, reward clipping and DAPO's overlong penalty; and
``apply(advantages=True)`` / ``unapply()`` on the class. Ray and vLLM are not started
(``vllm`` is a placeholder module for the import)."""

from __future__ import annotations

import copy
import types
from types import SimpleNamespace as NS

import pytest
import torch

from rlvr_kernels.integrations import openrlhf as ours
from rlvr_kernels.integrations.openrlhf.experience_maker import compute_advantages_and_returns
from rlvr_kernels.testing.peers import import_openrlhf_models, stubbed_modules

import_openrlhf_models()
with stubbed_modules({"vllm": (), "vllm.inputs": ("TokensPrompt",), "vllm.utils": ("random_uuid",)}):
    from openrlhf.trainer.ppo_utils import experience_maker as em  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402

RME = em.RemoteExperienceMaker
PEER = RME.compute_advantages_and_returns


def _maker(estimator, gamma=1.0, lambd=0.95, no_std_norm=False, clip=None, overlong=None, n=4, A=9):
    args = NS(
        rollout=NS(n_samples_per_prompt=n, max_new_tokens=A),
        reward=NS(clip_range=clip, overlong_buffer_len=overlong, overlong_penalty_factor=0.5),
        algo=NS(advantage=NS(estimator=estimator, gamma=gamma, lambd=lambd, no_std_norm=no_std_norm)),
        data=NS(max_len=A),
    )
    self = NS(strategy=NS(args=args), advantage_estimator=estimator, kl_ctl=NS(value=0.05))
    self.get_advantages_and_returns = types.MethodType(RME.get_advantages_and_returns, self)
    self.get_cumulative_returns = types.MethodType(RME.get_cumulative_returns, self)
    return self


def _experiences(seed=0, n=4, prompts=3, sizes=(5, 4, 3), widths=(9, 6, 8)):
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n * prompts, generator=g).tolist()
    out, start = [], 0
    for b, A in zip(sizes, widths):
        lengths = torch.randint(1, A + 1, (b,), generator=g)
        lengths[0] = 0 if b == 4 else lengths[0]  # a row without an action token
        mask = torch.arange(A)[None, :] < lengths[:, None]
        out.append(
            Experience(
                action_mask=mask,
                values=torch.randn(b, A, generator=g),
                kl=0.2 * torch.randn(b, A, generator=g),
                rewards=torch.randn(b, generator=g) * 2,
                response_length=lengths.float(),
                index=order[start : start + b],
                info={},
            )
        )
        start += b
    return out


def _compare(got, want):
    for e, w in zip(got, want):
        torch.testing.assert_close(e.advantages, w.advantages, rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(e.returns, w.returns, rtol=1e-5, atol=2e-5)
        assert e.kl is None and w.kl is None
        assert set(e.info) == set(w.info)
        for k in w.info:
            torch.testing.assert_close(e.info[k], w.info[k], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(e.rewards, w.rewards)


@pytest.mark.parametrize(
    "estimator,kw",
    [
        ("group_norm", {}),
        ("rloo", dict(clip=(-1.5, 1.5))),
        ("reinforce_baseline", {}),
        ("dr_grpo", dict(gamma=0.9)),  # OpenRLHF resets gamma to 1 (with a warning)
        ("flash_reinforce", {}),
        ("reinforce", dict(gamma=0.97)),
        ("reinforce", dict(no_std_norm=True, overlong=3)),
        ("gae", dict(gamma=0.99, lambd=0.95)),
        ("gae", dict(gamma=1.0, lambd=1.0, n=1)),
    ],
)
def test_matches_openrlhf(estimator, kw):
    n = kw.get("n", 4)
    exps = _experiences(seed=len(estimator) + len(kw), n=n, prompts=12 // n)
    a, b = copy.deepcopy(exps), copy.deepcopy(exps)
    peer_self, our_self = _maker(estimator, **kw), _maker(estimator, **kw)
    want = PEER(peer_self, a)
    got = compute_advantages_and_returns(our_self, b)
    assert got is b
    _compare(got, want)
    assert our_self.strategy.args.algo.advantage.gamma == peer_self.strategy.args.algo.advantage.gamma


def test_hand_computed():
    """Two prompts of two samples, rewards (1, 0 | 3, 3), group_norm: (±0.5 / 0.7071) and 0;
    one action token each, no KL coefficient: the advantage is the shaped reward."""
    exps = [
        Experience(
            action_mask=torch.ones(4, 1, dtype=torch.bool),
            values=torch.zeros(4, 1),
            kl=torch.zeros(4, 1),
            rewards=torch.tensor([1.0, 0.0, 3.0, 3.0]),
            response_length=torch.ones(4),
            index=[0, 1, 2, 3],
            info={},
        )
    ]
    self = _maker("group_norm", n=2)
    self.kl_ctl.value = 0.0
    (e,) = compute_advantages_and_returns(self, exps)
    assert e.advantages[:, 0].tolist() == pytest.approx([0.70710678, -0.70710678, 0.0, 0.0], rel=1e-6)
    assert e.info["group_reward_std"].tolist() == pytest.approx([0.70710678, 0.70710678, 0.0, 0.0], rel=1e-6)


def test_errors():
    with pytest.raises(ValueError, match="advantage_estimator"):
        compute_advantages_and_returns(_maker("grpo"), _experiences())
    exps = _experiences()
    exps[1].rewards[0] = float("nan")
    with pytest.raises(ValueError, match=r"experiences\[1\].rewards"):
        compute_advantages_and_returns(_maker("rloo"), exps)
    with pytest.raises(ValueError, match="groups of 5"):
        compute_advantages_and_returns(_maker("rloo", n=5), _experiences())


def test_apply_patches_the_experience_maker():
    try:
        ours.apply(policy_loss=False, kl=False, logprobs=False, advantages=True)
        assert RME.compute_advantages_and_returns is compute_advantages_and_returns
        assert ours.applied_options()["advantages"] is True
    finally:
        ours.unapply()
    assert RME.compute_advantages_and_returns is PEER
    ours.apply(policy_loss=False, kl=False, logprobs=False)  # off by default
    try:
        assert RME.compute_advantages_and_returns is PEER
    finally:
        ours.unapply()
    with pytest.raises(TypeError, match="advantages"):
        ours.apply(advantages=1)
