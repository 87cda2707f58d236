"""The six framework presets of group_advantages (docs/presets.md): hand-computed values
for the peers that are not installed (slime, NeMo-RL, prime-rl, OpenRLHF's inline code),
and the installed peers' own functions (AReaL's Normalization, SkyRL's GRPO estimator)."""

import importlib
import importlib.machinery
import math
import os
import sys
import types

import numpy as np
import pytest
import torch
from _backends import ALL, to

import rlvr_kernels as rk


def run(backend, device, **kw):
    out = rk.group_advantages(**to(kw, device), backend=backend, out_dtype=torch.float64)
    return out.advantages.cpu()


def close(actual, expected, tol=1e-6):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert torch.allclose(actual.double(), expected, atol=tol, rtol=0), (actual, expected)


R = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 3.0, 5.0])
GI = torch.tensor([0] * 4 + [1] * 4 + [2] * 2)


@pytest.mark.parametrize("backend,device", ALL)
def test_nemo_rl_leave_one_out_mean_and_std(backend, device):
    # nemo_rl/algorithms/utils.py calculate_baseline_and_std_per_prompt (NeMo-RL 0.6.0): the
    # others' mean and Bessel std; advantage_estimator.py GRPOAdvantageEstimator divides by
    # std + 1e-6 only where std > 0. [1,0,0,0]: sample 0's others are constant (A = 1);
    # the others of a 0 are [1,0,0]: μ = 1/3, σ = sqrt(1/3). [3,5]: one other, σ = 0: A = ±2.
    s = math.sqrt(1 / 3) + 1e-6
    t = math.sqrt(1 / 3) + 1e-6  # [1,1,0,0]: others of a 1 are [1,0,0] (μ 1/3), of a 0 [1,1,0]
    exp = [1.0, -1 / 3 / s, -1 / 3 / s, -1 / 3 / s, (2 / 3) / t, (2 / 3) / t, -(2 / 3) / t, -(2 / 3) / t, -2.0, 2.0]
    close(run(backend, device, scores=R, group_index=GI, preset="nemo_rl"), exp)
    # A prompt with one valid sample gets 0 (baseline := reward).
    close(run(backend, device, scores=torch.tensor([2.0]), group_size=1, preset="nemo_rl"), [0.0])


@pytest.mark.parametrize("backend,device", ALL)
def test_slime_and_prime_rl(backend, device):
    # slime 0.3.1 slime/ray/rollout.py RolloutManager._post_process_rewards: (r − mean)/(std + 1e-6).
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    close(run(backend, device, scores=r, group_size=4, preset="slime"), [0.75 / 0.500001] + [-0.25 / 0.500001] * 3)
    # prime-rl 0.8.0 src/prime_rl/orchestrator/algo/grpo.py GRPOAlgorithm.score_group: r − mean.
    close(run(backend, device, scores=r, group_size=4, preset="prime_rl"), [0.75, -0.25, -0.25, -0.25])
    close(run(backend, device, scores=torch.tensor([2.0]), group_size=1, preset="prime_rl"), [0.0])


@pytest.mark.parametrize("backend,device", ALL)
def test_openrlhf_group_norm_and_reinforce_baseline(backend, device):
    # openrlhf 0.11.2 trainer/ppo_utils/experience_maker.py compute_advantages_and_returns:
    # group_norm (r − mean)/(std + 1e-9); reinforce_baseline r − mean, then over the action
    # tokens (x − mean)·var.clamp(min=1e-8).rsqrt() with the population variance.
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    close(run(backend, device, scores=r, group_size=4, preset="openrlhf"), [1.5, -0.5, -0.5, -0.5])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    out = run(
        backend,
        device,
        scores=r,
        group_size=4,
        preset="openrlhf",
        estimator="reinforce_pp_baseline",
        response_mask=mask,
    )
    tok = torch.tensor([0.75] * 3 + [-0.25] * 1 + [-0.25] * 2 + [-0.25] * 3, dtype=torch.float64)
    mean = tok.mean()
    var = ((tok - mean) ** 2).mean().clamp(min=1e-8)
    close(out, (torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=torch.float64) - mean) * var.rsqrt())
    # The clamp is a floor: a constant batch gives 0 / sqrt(1e-8) = 0, never a division by ~0.
    const = run(
        backend,
        device,
        scores=torch.ones(4),
        group_size=2,
        preset="openrlhf",
        estimator="reinforce_pp_baseline",
        lengths=torch.tensor([1, 2, 3, 4]),
    )
    close(const, [0.0] * 4)


@pytest.mark.parametrize("backend,device", ALL)
def test_areal_group_then_batch_normalisation(backend, device):
    # areal 1.0.4 areal/utils/data.py Normalization, as reward_norm (group) then adv_norm
    # (batch over the loss-mask tokens), areal/trainer/ppo/actor.py _compute_advantages.
    from areal.api.cli_args import NormConfig
    from areal.utils.data import Normalization

    gen = torch.Generator().manual_seed(0)
    G, n, L = 3, 4, 6
    r = torch.randint(0, 3, (G * n,), generator=gen).double()
    lengths = torch.randint(1, L + 1, (G * n,), generator=gen)
    mask = (torch.arange(L)[None] < lengths[:, None]).double()
    group = Normalization(NormConfig(mean_level="group", std_level="group", group_size=n))(r)
    tokens = group[:, None].double() * mask
    peer = Normalization(NormConfig(mean_level="batch", std_level="batch"))(tokens, mask)
    out = rk.group_advantages(
        **to(dict(scores=r, group_size=n, response_mask=mask), device),
        preset="areal",
        backend=backend,
        out_dtype=torch.float64,
    )
    close(out.token_advantages.cpu(), peer.double() * mask, tol=1e-5)


def _skyrl_ppo_utils():
    """SkyRL 0.3.0's ppo_utils with its package __init__ files and skyrl.train.config (pydantic
    refuses typing.TypedDict on Python < 3.12) left out: the advantage code needs neither."""
    import skyrl

    root = os.path.dirname(skyrl.__file__)
    saved = {
        k: sys.modules.get(k)
        for k in (
            "skyrl.backends",
            "skyrl.backends.skyrl_train",
            "skyrl.backends.skyrl_train.utils",
            "skyrl.train.config",
        )
    }
    for name, sub in (
        ("skyrl.backends", "backends"),
        ("skyrl.backends.skyrl_train", "backends/skyrl_train"),
        ("skyrl.backends.skyrl_train.utils", "backends/skyrl_train/utils"),
    ):
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(root, sub)]
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules[name] = mod
    cfg = types.ModuleType("skyrl.train.config")
    cfg.__spec__ = importlib.machinery.ModuleSpec("skyrl.train.config", None)
    cfg.AlgorithmConfig = type("AlgorithmConfig", (), {})
    sys.modules["skyrl.train.config"] = cfg
    try:
        return importlib.import_module("skyrl.backends.skyrl_train.utils.ppo_utils")
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


@pytest.mark.parametrize("backend,device", ALL)
def test_skyrl_grpo_and_rloo(backend, device):
    ppo = _skyrl_ppo_utils()
    gen = torch.Generator().manual_seed(1)
    index = np.array([0, 0, 0, 1, 2, 2, 2, 2, 3, 3])
    r = torch.randint(0, 4, (10,), generator=gen).float()
    mask = torch.ones(10, 3)
    peer, _ = ppo.compute_grpo_outcome_advantage(r[:, None] * torch.tensor([[0.0, 0.0, 1.0]]), mask, index)
    gi = torch.as_tensor(index)
    close(run(backend, device, scores=r.double(), group_index=gi, preset="skyrl"), peer[:, 0].double(), tol=1e-5)
    peer, _ = ppo.compute_rloo_outcome_advantage(r[:, None] * torch.tensor([[0.0, 0.0, 1.0]]), mask, index)
    ours = run(backend, device, scores=r.double(), group_index=gi, preset="skyrl", estimator="rloo", singleton="zero")
    close(ours, peer[:, 0].double(), tol=1e-5)


@pytest.mark.parametrize("preset,name", [("areal", "batch_whiten"), ("nemo_rl", "leave_one_out")])
def test_data_parallel_refuses_the_options_it_does_not_support(preset, name):
    # The rank-local check that runs before any collective (no process group needed).
    import torch.distributed as dist

    from rlvr_kernels.ops.advantages import _validate_distributed

    kw = dict(preset=preset, options=None)
    tensors = (torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), 1, None, None, None, None, None)
    with pytest.raises(NotImplementedError, match=name):
        _validate_distributed("auto", kw, tensors, None, torch.float32, True)
    assert not dist.is_initialized()
