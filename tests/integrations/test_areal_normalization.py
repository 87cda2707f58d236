"""The ``Normalization`` drop-in against AReaL 1.0.4's own (``areal/utils/data.py``): every served
level combination on ``[B]`` scores (group sizes 1, 3 and 4, Bessel's and the population std,
with and without a mask, fp32 and fp64), the token-weighted ``[B, T]`` batch step, and
``PPOActor._compute_advantages`` (group ``reward_norm`` then batch ``adv_norm``) with the drop-ins
in place of AReaL's objects; what it does not serve raises naming the field."""

from __future__ import annotations

import pytest
import torch
from areal.api.cli_args import NormConfig
from areal.utils.data import Normalization as Peer

from rlvr_kernels.integrations.areal import Normalization
from rlvr_kernels.testing.peers import import_areal_actor

peer_actor = import_areal_actor()

CONFIGS = [
    dict(mean_level="group", std_level="group", group_size=4),
    dict(mean_level="group", std_level="group", group_size=1),
    dict(mean_level="group", std_level="group", group_size=3, std_unbiased=False),
    dict(mean_level="group", std_level="group", group_size=1, std_unbiased=False),
    dict(mean_level="batch", std_level="batch"),
    dict(mean_level="batch", std_level="batch", std_unbiased=False, eps=1e-3),
    dict(mean_level="group", std_level=None, group_size=4),
    dict(mean_level="batch", std_level=None),
    dict(mean_level=None, std_level=None),
]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_scores_match_areal(cfg, dtype, masked):
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 3, (12,), generator=g).to(dtype)  # ties and constant groups
    r[:4] = 1.0
    mask = (torch.rand(12, generator=g) > 0.3).to(dtype) if masked else None
    config = NormConfig(**cfg)
    theirs, ours = Peer(config)(r, mask), Normalization(config)(r, mask)
    assert ours.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, atol=3e-7, rtol=1e-6)


@pytest.mark.parametrize("unbiased", [True, False])
def test_token_batch_step_matches_areal(unbiased):
    """adv_norm over the loss-mask tokens, rows of one value (an empty row included)."""
    g = torch.Generator().manual_seed(1)
    B, L = 10, 7
    lengths = torch.randint(0, L + 1, (B,), generator=g)
    lengths[0] = 0
    mask = (torch.arange(L)[None] < lengths[:, None]).float()
    x = torch.randn(B, 1, generator=g).expand(B, L) * mask
    config = NormConfig(mean_level="batch", std_level="batch", std_unbiased=unbiased)
    torch.testing.assert_close(Normalization(config)(x, mask), Peer(config)(x, mask), atol=3e-7, rtol=1e-6)


def test_compute_advantages_with_the_drop_ins():
    """AReaL's own PPOActor._compute_advantages (GRPO: group reward_norm, batch adv_norm, no
    KL reward) with its two Normalization objects replaced by ours: the same advantages."""
    from areal.api.cli_args import PPOActorConfig

    config = PPOActorConfig(
        experiment_name="rlvr-kernels",
        trial_name="test",
        path="",
        reward_norm=NormConfig(mean_level="group", std_level="group", group_size=4),
        adv_norm=NormConfig(mean_level="batch", std_level="batch"),
        kl_ctl=0.0,
    )
    g = torch.Generator().manual_seed(2)
    B, L = 8, 9
    attn = torch.arange(L)[None] < torch.randint(4, L + 1, (B,), generator=g)[:, None]
    loss_mask = attn & (torch.arange(L)[None] >= 2)
    data = dict(
        input_ids=torch.randint(2, 50, (B, L), generator=g) * attn,
        attention_mask=attn,
        loss_mask=loss_mask.int(),
        logprobs=torch.where(loss_mask, -torch.rand(B, L, generator=g), 0.0),
        rewards=torch.randint(0, 2, (B,), generator=g).float(),
    )
    stock = peer_actor.PPOActor(config, engine=None)
    ours = peer_actor.PPOActor(config, engine=None)
    ours.reward_norm, ours.adv_norm = Normalization(config.reward_norm), Normalization(config.adv_norm)
    a = stock._compute_advantages({k: v.clone() for k, v in data.items()})
    b = ours._compute_advantages({k: v.clone() for k, v in data.items()})
    assert a["advantages"].abs().max() > 0.1
    torch.testing.assert_close(b["advantages"], a["advantages"], atol=3e-7, rtol=1e-6)


def test_unserved_settings_raise_naming_them():
    with pytest.raises(NotImplementedError, match="mean_leave1out"):
        Normalization(NormConfig(mean_level="group", std_level="group", group_size=2, mean_leave1out=True))
    with pytest.raises(NotImplementedError, match="std_level"):
        Normalization(NormConfig(mean_level=None, std_level="batch"))
    with pytest.raises(NotImplementedError, match="std_level"):
        Normalization(NormConfig(mean_level="group", std_level="batch", group_size=2))
    with pytest.raises(NotImplementedError, match="group_size"):
        Normalization(NormConfig(mean_level="group", std_level="group", group_size=5))(torch.rand(12))
    mask = torch.ones(3, 4)
    with pytest.raises(NotImplementedError, match="vary along a row"):
        Normalization(NormConfig())(torch.rand(3, 4), mask)
    with pytest.raises(NotImplementedError, match="batch / batch"):
        Normalization(NormConfig(mean_level="group", std_level="group", group_size=1))(torch.ones(3, 4), mask)
    with pytest.raises(ValueError, match="loss_mask"):
        Normalization(NormConfig())(torch.rand(3), torch.ones(4))
