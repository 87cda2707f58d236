"""slime's advantage hook and TIS functions (rlvr_kernels.integrations.slime) against the fp64
transcriptions of slime's estimators and TIS functions (tests/_slime.py) and hand-computed
values."""

import math
import types

import pytest
import torch
from _slime import gae, grpo_returns, rpp_baseline, rpp_returns, tis_weights

from rlvr_kernels.integrations import slime
from rlvr_kernels.integrations._torch_math import discounted_returns


def _args(**kw):
    base = dict(advantage_estimator="grpo", kl_coef=0.0, gamma=1.0, lambd=1.0, context_parallel_size=1)
    return types.SimpleNamespace(**{**base, **kw})


def _data(seed=0, lengths=(5, 1, 9, 300, 2)):
    g = torch.Generator().manual_seed(seed)
    masks = []
    for n in lengths:
        m = (torch.rand(n, generator=g) > 0.3).int()
        m[int(torch.randint(0, n, (), generator=g))] = 1
        masks.append(m)
    return dict(
        rewards=torch.randn(len(lengths), generator=g).tolist(),
        kl=[0.1 * torch.randn(n, generator=g) for n in lengths],
        loss_masks=masks,
        values=[torch.randn(n, generator=g) for n in lengths],
        response_lengths=list(lengths),
        total_lengths=[n + 3 for n in lengths],
    )


def _close(got, want, atol=2e-5):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=atol)


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "cispo"])
def test_reward_on_every_token(estimator):
    d = _data()
    slime.compute_advantages_and_returns(_args(advantage_estimator=estimator, kl_coef=0.3), d)
    _close(d["advantages"], grpo_returns(d["rewards"], d["kl"]))
    _close(d["returns"], grpo_returns(d["rewards"], d["kl"]))


def test_reinforce_plus_plus_baseline():
    d = _data(1)
    slime.compute_advantages_and_returns(_args(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.05), d)
    _close(d["advantages"], rpp_baseline(d["rewards"], d["kl"], 0.05))
    assert d["returns"] is d["advantages"]


@pytest.mark.parametrize("gamma", [1.0, 0.99, 0.5, 0.0])
def test_reinforce_plus_plus(gamma):
    d = _data(2)
    slime.compute_advantages_and_returns(_args(advantage_estimator="reinforce_plus_plus", kl_coef=0.1, gamma=gamma), d)
    want = rpp_returns(d["rewards"], d["kl"], d["loss_masks"], 0.1, gamma)
    _close(d["returns"], want, atol=1e-4)
    _close(d["advantages"], want, atol=1e-4)


@pytest.mark.parametrize("gamma,lambd", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.5)])
def test_ppo_gae(gamma, lambd):
    d = _data(3)
    slime.compute_advantages_and_returns(_args(advantage_estimator="ppo", kl_coef=0.2, gamma=gamma, lambd=lambd), d)
    advs, rets = gae(d["rewards"], d["kl"], d["values"], 0.2, gamma, lambd)
    _close(d["advantages"], advs, atol=1e-4)
    _close(d["returns"], rets, atol=1e-4)


def test_hand_computed():
    """Two tokens, reward 1, kl (0.5, 0.5), kl_coef 0.1, γ = 0.5, mask (1, 0): the token rewards
    are (−0.05 + 1, 0): returns (0.95, 0). PPO with values (1, 2), λ = 1: token rewards
    (−0.05, −0.05 + 1); δ = (−0.05 + 0.5·2 − 1, 0.95 − 2) = (−0.05, −1.05); A = (−0.05 −
    0.525, −1.05) = (−0.575, −1.05); returns A + V = (0.425, 0.95)."""
    d = dict(rewards=[1.0], kl=[torch.tensor([0.5, 0.5])], loss_masks=[torch.tensor([1, 0])])
    slime.compute_advantages_and_returns(_args(advantage_estimator="reinforce_plus_plus", kl_coef=0.1, gamma=0.5), d)
    assert d["returns"][0].tolist() == pytest.approx([0.95, 0.0])
    d = dict(rewards=[1.0], kl=[torch.tensor([0.5, 0.5])], values=[torch.tensor([1.0, 2.0])])
    slime.compute_advantages_and_returns(_args(advantage_estimator="ppo", kl_coef=0.1, gamma=0.5, lambd=1.0), d)
    assert d["advantages"][0].tolist() == pytest.approx([-0.575, -1.05])
    assert d["returns"][0].tolist() == pytest.approx([0.425, 0.95])


def test_discounted_returns_blocks():
    """Across block boundaries (L = 300 > 2 blocks of 128), against the plain recurrence."""
    x = torch.randn(3, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for gamma in (1.0, 0.9, 0.0):
        want, run = torch.zeros_like(x), torch.zeros(3, dtype=torch.float64)
        for t in range(299, -1, -1):
            run = x[:, t] + gamma * run
            want[:, t] = run
        torch.testing.assert_close(discounted_returns(x, gamma), want, rtol=1e-12, atol=1e-12)
    assert discounted_returns(torch.zeros(2, 0), 0.5).shape == (2, 0)


def test_empty_and_errors():
    d = dict(rewards=[], kl=[])
    slime.compute_advantages_and_returns(_args(), d)
    assert d["advantages"] == [] and d["returns"] == []
    with pytest.raises(ValueError, match="args.advantage_estimator"):
        slime.compute_advantages_and_returns(_args(advantage_estimator="rloo"), _data())
    with pytest.raises(ValueError, match="args.context_parallel_size"):
        slime.compute_advantages_and_returns(_args(context_parallel_size=2), _data())
    with pytest.raises(ValueError, match=r"rollout_data\['kl'\]"):
        slime.compute_advantages_and_returns(_args(), dict(rewards=[1.0, 2.0], kl=[torch.zeros(3)]))
    with pytest.raises(ValueError, match=r"rollout_data\['rewards'\]\[1\]"):
        slime.compute_advantages_and_returns(_args(), dict(rewards=[1.0, math.inf], kl=[torch.zeros(3)] * 2))
    d = _data()
    d["loss_masks"][2] = torch.zeros(9, dtype=torch.int)
    with pytest.raises(ValueError, match=r"loss_masks'\]\[2\]: the sample is fully masked"):
        slime.compute_advantages_and_returns(_args(advantage_estimator="reinforce_plus_plus"), d)
    d = _data()
    d["values"][0] = torch.zeros(4)
    with pytest.raises(ValueError, match=r"rollout_data\['values'\]\[0\]"):
        slime.compute_advantages_and_returns(_args(advantage_estimator="ppo"), d)
    with pytest.raises(TypeError, match="args.kl_coef"):
        slime.compute_advantages_and_returns(types.SimpleNamespace(advantage_estimator="grpo"), _data())


def _tis_inputs(seed=0, lengths=(4, 1, 7)):
    g = torch.Generator().manual_seed(seed)
    train = [-torch.rand(n, generator=g) * 2 for n in lengths]
    rollout = [t + 0.6 * torch.randn(n, generator=g) for t, n in zip(train, lengths)]
    masks = [torch.ones(n, dtype=torch.int) for n in lengths]
    return train, rollout, masks


@pytest.mark.parametrize("kind", ["vanilla", "icepop"])
@pytest.mark.parametrize("low,high", [(0.0, 2.0), (0.5, 1.5), (0.8, 1.0)])
def test_tis_functions(kind, low, high):
    train, rollout, masks = _tis_inputs()
    pg = torch.randn(12, generator=torch.Generator().manual_seed(1))
    fn = slime.vanilla_tis_function if kind == "vanilla" else slime.icepop_function
    args = types.SimpleNamespace(tis_clip=high, tis_clip_low=low)
    out, out_masks, metrics = fn(
        args, pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks, total_lengths=[]
    )
    w, ratio = tis_weights(kind, torch.cat(train).double(), torch.cat(rollout).double(), low, high)
    torch.testing.assert_close(out.double(), pg.double() * w, rtol=1e-6, atol=1e-7)
    assert out_masks is masks
    assert metrics["tis_clipfrac"].tolist() == (w != ratio).double().tolist()
    torch.testing.assert_close(metrics["tis"].double(), ratio, rtol=1e-6, atol=0)
    torch.testing.assert_close(metrics["tis_abs"].double(), (ratio - 1).abs(), rtol=1e-5, atol=1e-7)


def test_tis_hand_computed_and_errors():
    """ratio e^(−1 − (−1.5)) = e^0.5 = 1.6487 (kept), e^−1 = 0.3679 (clamped to 0.5 / dropped)."""
    args = types.SimpleNamespace(tis_clip=2.0, tis_clip_low=0.5)
    kw = dict(
        pg_loss=torch.ones(2),
        train_log_probs=[torch.tensor([-1.0, -2.0])],
        rollout_log_probs=[torch.tensor([-1.5, -1.0])],
        loss_masks=[torch.ones(2)],
    )
    out, _, m = slime.vanilla_tis_function(args, **kw)
    assert out.tolist() == pytest.approx([math.exp(0.5), 0.5], rel=1e-6)
    assert m["tis_clipfrac"].tolist() == [0.0, 1.0]
    out, _, _ = slime.icepop_function(args, **kw)
    assert out.tolist() == pytest.approx([math.exp(0.5), 0.0], rel=1e-6)
    with pytest.raises(ValueError, match="pg_loss"):
        slime.vanilla_tis_function(args, **dict(kw, pg_loss=torch.ones(3)))
    with pytest.raises(ValueError, match="rollout_log_probs"):
        slime.vanilla_tis_function(args, **dict(kw, rollout_log_probs=[torch.zeros(3)]))
    with pytest.raises(TypeError, match="args.tis_clip"):
        slime.vanilla_tis_function(types.SimpleNamespace(), **kw)
