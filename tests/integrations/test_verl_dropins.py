"""The verl drop-ins beyond the peer grids of tests/*/test_peers_verl.py: edge inputs
verl divides by zero on, errors that name the caller's arguments, the shapes verl's
kernel paths return, the lean kl_penalty / agg_loss against verl bit for bit, the
actor-config cache (mutation, interpolation, one parse) and the backend selection."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import verl.utils.torch_functional as verl_F
from omegaconf import OmegaConf
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig

from rlvr_kernels.integrations import verl as ours
from rlvr_kernels.integrations.verl import _advantages as ours_advantages
from rlvr_kernels.integrations.verl import _config
from rlvr_kernels.integrations.verl import _losses as ours_losses

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
FIELDS = dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean")


def actor_config(**kw) -> ActorConfig:
    fields = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **FIELDS)
    fields.update(kw)
    return ActorConfig(**fields)


def batch(seed=0, B=5, L=11):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, L + 1, (B,), generator=gen)
    lengths[-1] = 0
    mask = torch.arange(L)[None, :] < lengths[:, None]
    old = -torch.rand(B, L, generator=gen) * 2 - 0.1
    lp = old + 0.4 * torch.randn(B, L, generator=gen)
    ref = lp + torch.randn(B, L, generator=gen)
    adv = torch.randn(B, generator=gen)[:, None] * mask
    return dict(old=old, lp=lp, ref=ref, adv=adv, mask=mask, entropy=torch.rand(B, L, generator=gen))


def value_and_grad(fn, x, *args, up=None):
    x = x.clone().requires_grad_(True)
    out = fn(x, *args)
    out.backward(torch.ones_like(out) if up is None else up)
    return out.detach(), x.grad


# ---------------------------------------------------------------------------------------
# agg_loss / kl_penalty: verl's numbers, and 0 where verl divides by a zero count
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("shape", [(2, 0), (3, 5)])
def test_agg_loss_with_no_valid_token_is_zero(mode, shape):
    """No valid token: verl divides 0 by 0 (and seq-mean-token-sum-norm by L = 0 for an
    empty response); the drop-in gives 0 and a zero gradient, never NaN and never an error
    about an argument the caller did not pass."""
    x = torch.randn(shape)
    mask = torch.zeros(shape, dtype=torch.bool)
    for kwargs in ({}, dict(dp_size=2, batch_num_tokens=0, global_batch_size=0)):
        loss, grad = value_and_grad(lambda t: ours.agg_loss(t, mask, mode, **kwargs), x)
        assert loss.shape == () and float(loss) == 0.0, (mode, kwargs, loss)
        assert torch.equal(grad, torch.zeros(shape))


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("mask_kind", ["bool", "float", "weights", "int"])
def test_agg_loss_is_verls_bit_for_bit(mode, mask_kind):
    """The lean aggregation computes verl's expression in verl's order: the same bits (bool
    masks, and float masks that weight tokens, as verl's masked_sum does), the same gradient."""
    b = batch(1, B=9, L=37)
    mask = {
        "bool": b["mask"],
        "float": b["mask"].float(),
        "weights": b["mask"] * torch.rand(b["mask"].shape, generator=torch.Generator().manual_seed(2)),
        "int": b["mask"].long(),
    }[mask_kind]
    up = torch.tensor(1.7)
    for kwargs in ({}, dict(dp_size=2, batch_num_tokens=777, global_batch_size=21, loss_scale_factor=64)):
        theirs = value_and_grad(lambda t: core_algos.agg_loss(t, mask, mode, **kwargs), b["ref"], up=up)
        mine = value_and_grad(lambda t: ours.agg_loss(t, mask, mode, **kwargs), b["ref"], up=up)
        assert mine[0].dtype == theirs[0].dtype and torch.equal(mine[0], theirs[0]), (mode, mask_kind, kwargs)
        torch.testing.assert_close(mine[1], theirs[1], rtol=1e-6, atol=1e-7)


def test_agg_loss_float64_mask_promotes_like_verl():
    b = batch(2)
    mask = b["mask"].double()
    for mode in AGG_MODES:
        mine = value_and_grad(lambda t: ours.agg_loss(t, mask, mode), b["ref"])
        theirs = value_and_grad(lambda t: core_algos.agg_loss(t, mask, mode), b["ref"])
        assert mine[0].dtype == theirs[0].dtype == torch.float64
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_ignores_non_finite_padding(mode):
    """verl's masked_sum zeroes padding before summing (its token modes); the drop-in does
    in every mode, and a non-finite value on a valid token still propagates."""
    b = batch(6)
    x = b["ref"].clone()
    x[~b["mask"]] = float("nan")
    x[0, -1] = float("inf") if not b["mask"][0, -1] else x[0, -1]
    mine = value_and_grad(lambda t: ours.agg_loss(t, b["mask"], mode), x)
    clean = value_and_grad(lambda t: ours.agg_loss(t, b["mask"], mode), torch.where(b["mask"], x, 0.0))
    assert torch.equal(mine[0], clean[0]) and torch.equal(mine[1], clean[1])
    if mode.startswith("token"):
        assert torch.equal(mine[0], core_algos.agg_loss(x, b["mask"], mode))
    x[0, 0] = float("nan")  # a valid token
    assert ours.agg_loss(x, b["mask"], mode).isnan()


@pytest.mark.parametrize("agg", AGG_MODES)
def test_gpg_is_verls_bit_for_bit(agg):
    """GPG runs verl's expression: the same loss bits and gradient; like verl, any weights
    (negative ones too) multiply the per-token loss."""
    b = batch(16, B=9, L=41)
    w = torch.randn(b["lp"].shape, generator=torch.Generator().manual_seed(3))
    cfg = actor_config(global_batch_info={"dp_size": 2, "batch_num_tokens": 300, "global_batch_size": 20})
    for weights in (None, w):

        def run(fn):
            lp = b["lp"].clone().requires_grad_(True)
            loss, metrics = fn(b["old"], lp, b["adv"], b["mask"], agg, cfg, weights)
            loss.backward()
            return loss.detach(), lp.grad, metrics

        mine, theirs = run(ours.compute_policy_loss_gpg), run(core_algos.compute_policy_loss_gpg)
        assert torch.equal(mine[0], theirs[0]) and mine[2] == theirs[2] == {}
        torch.testing.assert_close(mine[1], theirs[1], rtol=0, atol=0)


def test_gpg_ignores_non_finite_padding_like_verl():
    b = batch(17)
    adv = b["adv"].clone()
    adv[~b["mask"]] = float("nan")
    for fn in (ours.compute_policy_loss_gpg, core_algos.compute_policy_loss_gpg):
        loss, _ = fn(b["old"], b["lp"], adv, b["mask"], "token-mean", actor_config())
        clean, _ = fn(b["old"], b["lp"], b["adv"], b["mask"], "token-mean", actor_config())
        assert torch.equal(loss, clean)


@pytest.mark.parametrize("kind", ["low_var_kl", "k3", "low_var_kl+", "k3+"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_kl_penalty_k3_is_verls(kind, dtype):
    """The k3 fast path: verl's value bit for bit (both clamps active somewhere), verl's
    gradient to rounding, for log_prob and (when it requires one) ref_log_prob."""
    b = batch(3, B=7, L=53)
    lp, ref = b["lp"].to(dtype), b["ref"].to(dtype)
    ref = torch.where(torch.rand(ref.shape, generator=torch.Generator().manual_seed(4)) < 0.1, lp + 25, ref)
    ref[0, :3] = lp[0, :3] + 3.5  # k3 > 10
    ref[1, :3] = lp[1, :3] - 30  # y below -20
    up = torch.randn(lp.shape, generator=torch.Generator().manual_seed(5)).to(dtype)

    def run(fn):
        a, r = lp.clone().requires_grad_(True), ref.clone().requires_grad_(True)
        out = fn(a, r, kind)
        out.backward(up)
        return out.detach(), a.grad, r.grad

    mine, theirs = run(ours.kl_penalty), run(core_algos.kl_penalty)
    assert mine[0].dtype == theirs[0].dtype == dtype
    assert torch.equal(mine[0], theirs[0])
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mine[1], theirs[1], **tol)
    torch.testing.assert_close(mine[2], theirs[2], **tol)


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3", "k3+", "abs+", "k1+", "mse+"])
def test_kl_penalty_broadcast_and_mixed_dtypes(kind):
    """Shapes or dtypes the fast path does not take run verl's own expression."""
    b = batch(4)
    for ref in (b["ref"][:, :1].clone(), b["ref"].double()):
        mine = value_and_grad(lambda t: ours.kl_penalty(t, ref, kind), b["lp"])
        theirs = value_and_grad(lambda t: core_algos.kl_penalty(t, ref, kind), b["lp"])
        assert mine[0].dtype == theirs[0].dtype and mine[0].shape == theirs[0].shape
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_kl_penalty_without_grad():
    b = batch(5)
    with torch.no_grad():
        assert torch.equal(ours.kl_penalty(b["lp"], b["ref"], "k3"), core_algos.kl_penalty(b["lp"], b["ref"], "k3"))


# ---------------------------------------------------------------------------------------
# Shapes of verl's kernel paths
# ---------------------------------------------------------------------------------------


def test_linear_cross_entropy_returns_flat_like_verls_kernel():
    """verl's kernel views hidden as [N, H] and labels as [N] and returns [N] results."""
    gen = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(1, 13, 16, generator=gen), torch.randn(97, 16, generator=gen)
    labels = torch.randint(0, 97, (1, 13), generator=gen)
    logp, ent = ours.linear_cross_entropy(hidden, weight, labels)
    assert logp.shape == ent.shape == (13,)
    flat = ours.linear_cross_entropy(hidden[0], weight, labels[0])
    assert torch.equal(logp, flat[0]) and torch.equal(ent, flat[1])
    logits = hidden[0] @ weight.T
    torch.testing.assert_close(logp, verl_F.logprobs_from_logits(logits, labels[0]), rtol=1e-5, atol=1e-5)
    logp2, _ = ours.linear_cross_entropy(hidden.reshape(13, 1, 16), weight, labels.reshape(13, 1))
    assert logp2.shape == (13,)


def test_logprobs_from_logits_takes_labels_like_verls_flash_path():
    """verl's flash-attn path flattens the labels and returns logits.shape[:-1]: [1, N]
    labels with [N, V] logits, or [B·T] labels with [B, T, V] logits."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(12, 50, generator=gen)
    labels = torch.randint(0, 50, (12,), generator=gen)
    want = verl_F.logprobs_from_logits(logits, labels)
    up = torch.randn(12, generator=gen)
    got = value_and_grad(lambda z: ours.logprobs_from_logits(z, labels[None, :]), logits, up=up)
    assert got[0].shape == (12,)
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], value_and_grad(lambda z: ours.logprobs_from_logits(z, labels), logits, up=up)[1])
    lp3 = ours.logprobs_from_logits(logits.reshape(3, 4, 50), labels)
    assert lp3.shape == (3, 4)
    torch.testing.assert_close(lp3.reshape(-1), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="labels: expected one label per row"):
        ours.logprobs_from_logits(logits, labels[:5])


# ---------------------------------------------------------------------------------------
# Errors name the caller's arguments
# ---------------------------------------------------------------------------------------

# The inner ops' argument names, which a drop-in caller never passed.
INNER = re.compile(
    r"(?<![\w.])(scores|logprobs|old_logprobs|ref_logprobs|rollout_logprobs|targets|group_index|uids|"
    r"global_num_tokens|global_num_seqs|process_group|clip_low|clip_high|kl_coef|entropy_coef)\b"
    r"|(?<![\w.])(mask|eps|agg):"
)


def _bad_calls():
    b = batch(8)
    old, lp, adv, mask, ref, ent = b["old"], b["lp"], b["adv"], b["mask"], b["ref"], b["entropy"]
    cfg = actor_config()
    kl_cfg = actor_config(use_kl_loss=True, kl_loss_type="low_var_kl")
    nan_lp = lp.clone()
    nan_lp[0, 0] = float("nan")
    idx = np.array(["a", "a", "b", "b", "c"], dtype=object)
    rewards = torch.rand(5, 11)
    nan_rewards = rewards.clone()
    nan_rewards[2, 3] = float("inf")
    logits, labels = torch.randn(6, 10), torch.randint(0, 10, (6,))
    hidden, weight = torch.randn(6, 8), torch.randn(10, 8)
    vanilla, sapo = ours.compute_policy_loss_vanilla, ours.compute_policy_loss_sapo
    return [
        ("config.tau_pos", lambda: sapo(old, lp, adv, mask, config={"clip_ratio": 0.2, "tau_neg": 1.05})),
        ("config.tau_neg", lambda: sapo(old, lp, adv, mask, config=dict(FIELDS, tau_pos=1.0, tau_neg="x"))),
        ("config", lambda: vanilla(old, lp, adv, mask)),
        ("config.clip_ratio_low", lambda: vanilla(old, lp, adv, mask, config=actor_config(clip_ratio_low=1.5))),
        ("config.clip_ratio", lambda: vanilla(old, lp, adv, mask, config={"clip_ratio": -0.1})),
        ("config.clip_ratio_c", lambda: vanilla(old, lp, adv, mask, config=actor_config(clip_ratio_c=0.5))),
        (
            "config.policy_loss.loss_mode",
            lambda: ours.policy_loss_verl(old, lp, adv, mask, {"policy_loss": {"loss_mode": "no_such_mode"}, **FIELDS}),
        ),
        (
            "config.policy_loss.dro_beta",
            lambda: ours.policy_loss_verl(old, lp, adv, mask, {"policy_loss": {"loss_mode": "dro"}, **FIELDS}),
        ),
        (
            "config.policy_loss.kl_cov_ratio",
            lambda: ours.policy_loss_verl(
                old, lp, adv, mask, {"policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": -1.0}, **FIELDS}
            ),
        ),
        (
            "config.global_batch_info.dp_size",
            lambda: vanilla(old, lp, adv, mask, config=dict(FIELDS, global_batch_info={"dp_size": 0})),
        ),
        (
            "config.global_batch_info.batch_num_tokens",
            lambda: vanilla(old, lp, adv, mask, config=dict(FIELDS, global_batch_info={"batch_num_tokens": -3})),
        ),
        ("loss_agg_mode", lambda: vanilla(old, lp, adv, mask, "token-avg", cfg)),
        ("old_log_prob", lambda: vanilla(old[:, :5], lp, adv, mask, config=cfg)),
        ("old_log_prob", lambda: vanilla(old.long(), lp, adv, mask, config=cfg)),
        ("log_prob", lambda: vanilla(old, nan_lp, adv, mask, config=cfg)),
        ("log_prob", lambda: vanilla(old, lp.tolist(), adv, mask, config=cfg)),
        ("response_mask", lambda: vanilla(old, lp, adv, mask[:, :3], config=cfg)),
        ("advantages", lambda: vanilla(old, lp, adv[:, :2], mask, config=cfg)),
        ("advantages", lambda: ours.compute_policy_loss_gpg(old, lp, adv[:, :2], mask, config=cfg)),
        ("response_mask", lambda: ours.compute_policy_loss_gpg(old, lp, adv, mask[:2, :3], config=cfg)),
        (
            "rollout_is_weights",
            lambda: vanilla(old, lp, adv, mask, config=cfg, rollout_is_weights=-torch.ones_like(lp)),
        ),
        (
            "rollout_is_threshold",
            lambda: ours.policy_loss_verl(
                old, lp, adv, mask, cfg, rollout_log_probs=old, rollout_is="token", rollout_is_threshold="abc"
            ),
        ),
        (
            "rollout_log_probs",
            lambda: ours.policy_loss_verl(old, lp, adv, mask, cfg, rollout_log_probs=old[:, :4], rollout_is="token"),
        ),
        ("ref_log_prob", lambda: ours.policy_loss_verl(old, lp, adv, mask, kl_cfg, ref_log_prob=ref[:2])),
        ("ref_log_prob", lambda: ours.policy_loss_verl(old, lp, adv, mask, kl_cfg)),
        (
            "config.kl_loss_type",
            lambda: ours.policy_loss_verl(
                old, lp, adv, mask, actor_config(use_kl_loss=True, kl_loss_type="bogus"), ref_log_prob=ref
            ),
        ),
        (
            "config.kl_loss_coef",
            lambda: ours.policy_loss_verl(
                old, lp, adv, mask, dict(FIELDS, use_kl_loss=True, kl_loss_coef="big"), ref_log_prob=ref
            ),
        ),
        (
            "config.loss_scale_factor",
            lambda: ours.policy_loss_verl(old, lp, adv, mask, dict(FIELDS, loss_scale_factor=0)),
        ),
        ("config.loss_agg_mode", lambda: ours.policy_loss_verl(old, lp, adv, mask, dict(FIELDS, loss_agg_mode="x"))),
        (
            "entropy",
            lambda: ours.policy_loss_verl(old, lp, adv, mask, actor_config(entropy_coeff=0.01), entropy=ent[:1]),
        ),
        ("token_level_rewards", lambda: ours.compute_grpo_outcome_advantage(nan_rewards, mask, idx)),
        ("token_level_rewards", lambda: ours.compute_rloo_outcome_advantage(rewards.long(), mask, idx)),
        ("token_level_rewards", lambda: ours.compute_grpo_outcome_advantage(rewards[0], mask, idx)),
        ("response_mask", lambda: ours.compute_opo_outcome_advantage(rewards, mask[:2], idx)),
        ("index", lambda: ours.compute_grpo_outcome_advantage(rewards, mask, idx[:3])),
        ("index", lambda: ours.compute_grpo_outcome_advantage(rewards, mask, np.zeros((5, 2)))),
        ("epsilon", lambda: ours.compute_grpo_outcome_advantage(rewards, mask, idx, epsilon=-1.0)),
        (
            "non_tensor_batch",
            lambda: ours.compute_gdpo_outcome_advantage(
                rewards, mask, idx, config={"gdpo_reward_keys": ["acc"]}, non_tensor_batch={}, batch={}
            ),
        ),
        ("logprob", lambda: ours.kl_penalty(lp.long(), ref, "k3")),
        ("ref_logprob", lambda: ours.kl_penalty(lp, ref[:, :2], "k3")),
        ("kl_penalty", lambda: ours.kl_penalty(lp, ref, "bogus")),
        ("loss_mask", lambda: ours.agg_loss(lp, mask[:, :3], "token-mean")),
        ("loss_scale_factor", lambda: ours.agg_loss(lp, mask, "seq-mean-token-sum-norm", loss_scale_factor=0)),
        ("dp_size", lambda: ours.agg_loss(lp, mask, "token-sum", dp_size=0)),
        ("labels", lambda: ours.logprobs_from_logits(logits, labels + 10)),
        ("labels", lambda: ours.logprobs_from_logits(logits, labels.float())),
        ("logits", lambda: ours.entropy_from_logits(logits.long())),
        ("labels", lambda: ours.linear_cross_entropy(hidden, weight, labels[:4])),
        ("labels", lambda: ours.linear_cross_entropy(hidden, weight, labels + 10)),
        ("weight", lambda: ours.linear_cross_entropy(hidden, weight[:, :3], labels)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_errors_name_the_callers_argument(case):
    name, call = _bad_calls()[case]
    with pytest.raises((ValueError, TypeError, NotImplementedError)) as err:
        call()
    message = str(err.value)
    assert re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", message), f"{name!r} not named in: {message}"
    assert not INNER.search(message), f"an inner op's argument name leaked: {message}"


# ---------------------------------------------------------------------------------------
# The actor config: parsed once per content, never stale
# ---------------------------------------------------------------------------------------


def _actor_loss(cfg, b, **kw):
    lp = b["lp"].clone().requires_grad_(True)
    loss, metrics = ours.policy_loss_verl(b["old"], lp, b["adv"], b["mask"], cfg, ref_log_prob=b["ref"], **kw)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def _same(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]


def test_config_kinds_agree():
    b = batch(9)
    fields = dict(FIELDS, use_kl_loss=True, kl_loss_coef=0.05, clip_ratio_c=2.5)
    want = _actor_loss(actor_config(**fields), b)
    _same(_actor_loss(OmegaConf.create(dict(fields, policy_loss={"loss_mode": "vanilla"})), b), want)
    _same(_actor_loss(dict(fields), b), want)


def test_mutated_configs_are_read_again():
    """The parse is keyed by the values read, so mutating a DictConfig or a dict (or a new
    object that reuses a dead one's id) can never return a stale parse."""
    b = batch(10)
    base = dict(FIELDS, use_kl_loss=True, kl_loss_coef=0.05)
    for make in (lambda d: OmegaConf.create(d), dict):
        cfg = make(dict(base))
        first = _actor_loss(cfg, b)
        cfg["kl_loss_coef"] = 0.5
        cfg["clip_ratio_high"] = 0.4
        _same(_actor_loss(cfg, b), _actor_loss(actor_config(**dict(base, kl_loss_coef=0.5, clip_ratio_high=0.4)), b))
        cfg["kl_loss_coef"] = 0.05
        cfg["clip_ratio_high"] = 0.28
        _same(_actor_loss(cfg, b), first)
        cfg["policy_loss"] = {"loss_mode": "gpg"}
        assert "actor/pg_clipfrac" not in _actor_loss(cfg, b)[2]


def test_interpolated_dictconfig_fields_are_resolved():
    b = batch(11)
    cfg = OmegaConf.create(dict(FIELDS, use_kl_loss=True, kl_loss_coef="${algo.kl}", algo={"kl": 0.05}))
    _same(_actor_loss(cfg, b), _actor_loss(actor_config(use_kl_loss=True, kl_loss_coef=0.05), b))
    cfg.algo.kl = 0.3
    _same(_actor_loss(cfg, b), _actor_loss(actor_config(use_kl_loss=True, kl_loss_coef=0.3), b))


def test_global_batch_info_is_read_every_call():
    """verl's ppo_loss rewrites global_batch_info in place every step."""
    b = batch(12)
    cfg = actor_config()
    one = _actor_loss(cfg, b)
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=int(b["mask"].sum()))
    two = _actor_loss(cfg, b)
    torch.testing.assert_close(two[0], 2 * one[0])
    cfg.global_batch_info.clear()
    _same(_actor_loss(cfg, b), one)


def test_config_is_parsed_once(monkeypatch):
    b = batch(13)
    built, resolved = [], []
    real_parse, real_resolve = _config.ActorLossConfig, _config.resolve_policy_loss_options
    monkeypatch.setattr(_config, "_CACHE", {})
    monkeypatch.setattr(_config, "ActorLossConfig", lambda values: built.append(1) or real_parse(values))
    monkeypatch.setattr(
        _config, "resolve_policy_loss_options", lambda *a, **k: resolved.append(1) or real_resolve(*a, **k)
    )
    for cfg in (actor_config(use_kl_loss=True), OmegaConf.create(dict(FIELDS, use_kl_loss=True, kl_loss_coef=0.001))):
        built.clear(), resolved.clear()
        for _ in range(3):
            _actor_loss(cfg, b)
            ours.compute_policy_loss_vanilla(b["old"], b["lp"], b["adv"], b["mask"], config=cfg)
        assert len(built) == 1
        assert len(resolved) == 2  # the fused actor options, and the pg-only ones (vanilla's too)


def test_policy_loss_config_objects_are_not_required_to_be_hashable_or_weakrefable():
    b = batch(14)
    cfg = dict(FIELDS, extra=[1, 2])  # a plain dict: neither hashable nor weakref-able
    _actor_loss(cfg, b)
    cfg2 = dict(FIELDS, clip_ratio_high=[0.3])  # an unhashable field value: parsed, not cached
    with pytest.raises(ValueError, match="config.clip_ratio_high"):
        _actor_loss(cfg2, b)


# ---------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------


def test_use_backend_reaches_every_kind_of_dropin(monkeypatch):
    seen = []
    real_adv, real_pl = ours_advantages.group_advantages, ours_losses.policy_loss

    def adv_spy(*a, backend, **k):
        seen.append(("advantages", backend))
        return real_adv(*a, backend=backend, **k)

    def pl_spy(*a, backend, **k):
        seen.append(("policy_loss", backend))
        return real_pl(*a, backend=backend, **k)

    monkeypatch.setattr(ours_advantages, "group_advantages", adv_spy)
    monkeypatch.setattr(ours_losses, "policy_loss", pl_spy)
    b = batch(15)
    idx = np.array(["a", "a", "b", "b", "c"], dtype=object)
    with ours.use_backend("reference"):
        ours.compute_grpo_outcome_advantage(torch.rand(5, 11), b["mask"], idx)
        ours.compute_policy_loss_vanilla(b["old"], b["lp"], b["adv"], b["mask"], config=actor_config())
    ours.compute_policy_loss_vanilla(b["old"], b["lp"], b["adv"], b["mask"], config=actor_config())
    assert seen == [("advantages", "reference"), ("policy_loss", "reference"), ("policy_loss", "auto")]
    with pytest.raises(ValueError, match="backend"):
        with ours.use_backend("gpu"):
            pass
