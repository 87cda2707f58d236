"""Our verl policy-loss drop-ins against verl's own code, on every backend.

verl's functions are called for real: ``core_algos.compute_policy_loss_{vanilla,gspo,
cispo,sapo,gpg,dppo_tv,dppo_kl}``, ``kl_penalty``, ``agg_loss``, ``rollout_corr_helper.
compute_rollout_correction_weights`` and the actor loss ``workers.utils.losses.ppo_loss``
(with only its packed→padded reshaping, ``no_padding_2_padding``, replaced by the
identity because the test hands it padded tensors). Each case runs verl and ours on
copies of the same fp32 batch and compares the loss, the gradient w.r.t. ``log_prob``
(and ``entropy``), and the metrics, to atol 1e-6 / rtol 1e-5.

verl computes in float32, and a sum like token-sum's Σ −A·logπ over a few hundred tokens
cancels down to O(1) with verl's own rounding error above 1e-6 (ours accumulates
differently), so the reference is verl's code run twice, as in test_integrations_verl.py
(``close``): ours must be within the tolerance of verl's function evaluated in float64,
widened by twice verl's own float32 rounding |verl32 − verl64| (ours may be no worse than
verl), and, wherever verl's float32 result is within a quarter of the tolerance of its
float64 one, within the tolerance of verl's float32 result itself.

The batches (``make_batch``): B in 6..16, L in 20..50, ragged lengths with an empty row,
sequence advantages of both signs (plus token-level noise in some batches), log-ratios
spread so that both clip sides and verl's dual clip (ρ > 3 with A < 0) are active,
reference log-probs far enough away to hit k3's clamps, and finite padding.
"""

from __future__ import annotations

import inspect
from unittest import mock

import pytest
import torch
import verl.workers.utils.losses as verl_losses
from _backends import ALL
from tensordict import TensorDict
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig
from verl.workers.config.actor import PolicyLossConfig

from rlvr_kernels.integrations import verl as ours

ATOL, RTOL = 1e-6, 1e-5
LOSS_MODES = ["vanilla", "gspo", "cispo", "sapo", "gpg", "dppo_tv", "dppo_kl"]
DPPO_MODES = ["dppo_tv", "dppo_kl"]
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KL_TYPES = [
    "kl",
    "k1",
    "abs",
    "mse",
    "k2",
    "low_var_kl",
    "k3",
    "kl+",
    "k1+",
    "abs+",
    "mse+",
    "k2+",
    "low_var_kl+",
    "k3+",
]
# One spelling per distinct estimator (both spellings of each appear), for the actor-loss grid;
# test_kl_penalty_matches_verl runs every name.
KL_DISTINCT = ["k1", "abs", "mse", "low_var_kl", "kl+", "abs+", "k2+", "k3+"]
NEW_NAMES = [
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_policy_loss_cispo",
    "compute_policy_loss_sapo",
    "compute_policy_loss_gpg",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_dro",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
    "kl_penalty",
    "agg_loss",
]


# ---------------------------------------------------------------------------------------
# Batches, configs, comparison
# ---------------------------------------------------------------------------------------


def make_batch(seed: int, device="cpu", token_adv=None) -> dict:
    gen = torch.Generator().manual_seed(seed)
    B = int(torch.randint(6, 17, (), generator=gen))
    L = int(torch.randint(20, 51, (), generator=gen))
    lengths = torch.randint(1, L + 1, (B,), generator=gen)
    lengths[int(torch.randint(0, B, (), generator=gen))] = 0  # an empty row
    lengths[0] = L  # and a full one
    mask = torch.arange(L)[None, :] < lengths[:, None]
    old = -torch.rand(B, L, generator=gen) * 3 - 0.05
    delta = torch.randn(B, L, generator=gen) * 0.6
    far = torch.rand(B, L, generator=gen) < 0.08
    jump = torch.randn(B, L, generator=gen).sign() * (1.3 + torch.rand(B, L, generator=gen) * 2)  # |δ| in [1.3, 3.3]
    delta = torch.where(far, jump, delta)
    adv = torch.randn(B, generator=gen)
    adv[0], adv[1] = abs(float(adv[0])) + 0.1, -abs(float(adv[1])) - 0.1  # both signs
    if token_adv is None:
        token_adv = bool(seed % 3 == 0)
    adv = adv[:, None].expand(B, L).clone()
    if token_adv:
        adv = adv + 0.3 * torch.randn(B, L, generator=gen)
    adv = adv * mask  # verl's advantages are 0 outside the response
    kl_gap = torch.randn(B, L, generator=gen) * 0.5
    kl_far = torch.rand(B, L, generator=gen)
    kl_gap = torch.where(kl_far < 0.05, torch.full_like(kl_gap, 25.0), kl_gap)  # beyond the ±20 clamp
    kl_gap = torch.where((kl_far >= 0.05) & (kl_far < 0.12), torch.full_like(kl_gap, 3.5), kl_gap)  # k3 > 10
    kl_gap = torch.where((kl_far >= 0.12) & (kl_far < 0.17), torch.full_like(kl_gap, -12.0), kl_gap)
    log_prob = old + delta
    rollout_gap = 0.15 * torch.randn(B, L, generator=gen)
    rollout_far = torch.rand(B, L, generator=gen) < 0.06  # some tokens outside IcePop's bounds
    rollout_gap = torch.where(rollout_far, 1.2 * torch.randn(B, L, generator=gen), rollout_gap)
    return dict(
        log_prob=log_prob.to(device),
        old_log_prob=old.to(device),
        advantages=adv.to(device),
        response_mask=mask.to(device),
        ref_log_prob=(log_prob + kl_gap).to(device),
        rollout_log_probs=(old + rollout_gap).to(device),
        entropy=(torch.rand(B, L, generator=gen) * 2).to(device),
    )


def actor_config(loss_mode="vanilla", agg="token-mean", **kw) -> ActorConfig:
    fields = dict(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        loss_agg_mode=agg,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
    )
    fields.update(kw)
    return ActorConfig(**fields)


def batch_info(kind: str, batch: dict) -> dict:
    """verl's ``global_batch_info``: empty (this micro-batch), or two data-parallel ranks
    with global counts as ints or as device tensors."""
    if kind == "local":
        return {}
    mask = batch["response_mask"]
    n_tok = int(mask.sum()) * 2 + 3
    n_seq = mask.shape[0] * 2 + 1
    if kind == "tensor":
        dev = mask.device
        n_tok, n_seq = torch.tensor(n_tok, device=dev), torch.tensor(n_seq, device=dev)
    return dict(dp_size=2, batch_num_tokens=n_tok, global_batch_size=n_seq, loss_scale_factor=64)


def interpreted(backend, device) -> bool:
    return backend == "triton" and device == "cpu"


def subsample(backend, device, cases):
    """Every case, except on Triton's CPU interpreter (seconds per kernel call), where one
    case from the middle of the list stands for them (all run on a GPU)."""
    cases = list(cases)
    if interpreted(backend, device):
        return cases[len(cases) // 2 : len(cases) // 2 + 1]
    return cases


def backend_modes(modes, keep):
    """(backend, device, loss_mode) cases: every loss mode on every backend, except on
    Triton's CPU interpreter, where only the modes in ``keep`` run (each mode is kept by one
    test of the file); the GPU runs them all."""
    cases = []
    for p in ALL:
        backend, device = p.values
        for mode in modes:
            if not interpreted(backend, device) or mode in keep:
                cases.append(pytest.param(backend, device, mode, id=f"{p.id}-{mode}", marks=p.marks))
    return cases


def as64(batch: dict) -> dict:
    return {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}


def close(mine, v32, v64, what):
    """``mine`` against verl's float32 result ``v32`` and float64 result ``v64`` (tensors
    or floats), as the module docstring says."""
    if isinstance(v32, torch.Tensor):
        assert isinstance(mine, torch.Tensor), what
        assert mine.dtype == v32.dtype, f"{what}: dtype {mine.dtype} != verl's {v32.dtype}"
        assert mine.shape == v32.shape, f"{what}: shape {tuple(mine.shape)} != verl's {tuple(v32.shape)}"
        assert mine.device == v32.device, what
        m, a, e = mine.detach().double().cpu(), v32.detach().double().cpu(), v64.detach().double().cpu()
    else:
        assert isinstance(mine, float), f"{what}: {type(mine).__name__}, verl gives a float"
        m, a, e = (torch.tensor(float(x), dtype=torch.float64) for x in (mine, v32, v64))
    tol = ATOL + RTOL * e.abs()
    verl_err = (a - e).abs()
    err = (m - e).abs()
    bad = err > tol + 2 * verl_err
    assert not bad.any(), (
        f"{what}: ours differs from verl's float64 result by {float((err - tol - 2 * verl_err).max()):.3g} "
        f"beyond the tolerance (verl's own float32 error up to {float(verl_err.max()):.3g})"
    )
    if (verl_err <= tol / 4).all():
        torch.testing.assert_close(m, a, atol=ATOL, rtol=RTOL, msg=lambda msg: f"{what} vs verl float32\n{msg}")


def close_metrics(mine: dict, v32: dict, v64: dict, what):
    assert set(mine) == set(v32), f"{what}: metric keys {sorted(mine)} != verl's {sorted(v32)}"
    for k in v32:
        if k == "kl_coef":
            assert mine[k] == v32[k], what
            continue
        close(mine[k], v32[k], v64[k], f"{what} metric {k}")


def against_verl(compare, mine, t32, run64):
    """``compare(mine, verl32, verl64)``, running verl in float64 (``run64()``) only when
    ours is not already within the tolerance of verl's float32 result."""
    try:
        compare(mine, t32, t32)
    except AssertionError:
        compare(mine, t32, run64())


def call_policy_fn(fn, batch, backend, *args, **kwargs):
    """(loss, metrics, grad log_prob) of ``fn`` on copies of the batch; ``backend`` None = verl."""
    lp = batch["log_prob"].clone().requires_grad_(True)
    old, adv, mask = batch["old_log_prob"].clone(), batch["advantages"].clone(), batch["response_mask"].clone()
    with ours.use_backend(backend or "auto"):
        loss, metrics = fn(old, lp, adv, mask, *args, **kwargs)
    loss.backward()
    assert torch.equal(old, batch["old_log_prob"]) and torch.equal(adv, batch["advantages"])
    return loss, metrics, lp.grad


def compare_policy_fn(name, batch, backend, what, weights=None, **kwargs):
    """verl's ``name`` in float32 and float64 and ours (float32) on the same batch."""
    w64 = None if weights is None else dict(rollout_is_weights=weights.double())
    w32 = {} if weights is None else dict(rollout_is_weights=weights.clone())
    t32 = call_policy_fn(getattr(core_algos, name), batch, None, **kwargs, **w32)
    mine = call_policy_fn(getattr(ours, name), batch, backend, **kwargs, **w32)

    def compare(mine, t32, t64):
        close(mine[0], t32[0], t64[0], what + " loss")
        close(mine[2], t32[2], t64[2], what + " grad")
        close_metrics(mine[1], t32[1], t64[1], what)

    against_verl(
        compare,
        mine,
        t32,
        lambda: call_policy_fn(getattr(core_algos, name), as64(batch), None, **kwargs, **(w64 or {})),
    )


# ---------------------------------------------------------------------------------------
# Signatures and the test data itself
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NEW_NAMES)
def test_signatures_match_verl(name):
    """Same parameter names, kinds and defaults as verl's function (a true drop-in)."""
    want = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(core_algos, name)).parameters.values()]
    got = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(ours, name)).parameters.values()]
    assert got == want
    assert name in ours.__all__


def test_batches_exercise_every_branch():
    """The random batches clip on both sides and trigger the dual clip and k3's clamps
    (measured with verl's own functions), else the comparisons below prove little."""
    for seed in range(4):
        b = make_batch(seed)
        _, m = core_algos.compute_policy_loss_vanilla(
            b["old_log_prob"], b["log_prob"], b["advantages"], b["response_mask"], config=actor_config()
        )
        assert m["actor/pg_clipfrac"] > 0.05 and m["actor/pg_clipfrac_lower"] > 0.005
        ratio = (b["log_prob"] - b["old_log_prob"]).exp()[b["response_mask"]]
        adv = b["advantages"][b["response_mask"]]
        assert ((ratio > 1.28) & (adv > 0)).any() and ((ratio < 0.8) & (adv < 0)).any()
        x = (b["ref_log_prob"] - b["log_prob"])[b["response_mask"]]
        assert (x > 20).any() and (torch.exp(x.clamp(max=20)) - x.clamp(max=20) - 1 > 10).any()
        assert (b["response_mask"].sum(-1) == 0).any()


# ---------------------------------------------------------------------------------------
# compute_policy_loss_*
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,device,loss_mode", backend_modes(LOSS_MODES, ("vanilla", "gpg")))
def test_policy_losses_match_verl(backend, device, loss_mode):
    """Every loss type × every aggregation × local / global (int and tensor) batch info."""
    name = f"compute_policy_loss_{loss_mode}"
    grid = [(i, agg, j, info) for i, agg in enumerate(AGG_MODES) for j, info in enumerate(["local", "int", "tensor"])]
    for i, agg, j, info in subsample(backend, device, grid):
        batch = make_batch(100 * i + 10 * j + LOSS_MODES.index(loss_mode), device)
        cfg = actor_config(
            loss_mode, agg, clip_ratio_c=2.5 if j == 1 else 3.0, tau_pos=1.0 if j else 1.3, tau_neg=1.05 if j else 0.9
        )
        cfg.global_batch_info.update(batch_info(info, batch))
        compare_policy_fn(name, batch, backend, f"{name} agg={agg} info={info}", loss_agg_mode=agg, config=cfg)


WEIGHT_KINDS = [("token", 2.0), ("sequence", 2.0), ("token", "0.5_2.0"), ("sequence", "0.6_1.8")]


@pytest.mark.parametrize("backend,device,loss_mode", backend_modes(LOSS_MODES, ("cispo",)))
def test_rollout_is_weights_match_verl(backend, device, loss_mode):
    """``rollout_is_weights`` from verl's own compute_rollout_correction_weights (TIS and
    IcePop, token and sequence): folded into the advantages, loss, gradient and metrics
    (IcePop's zero weights included) match."""
    name = f"compute_policy_loss_{loss_mode}"
    grid = [
        (k, level, threshold, agg)
        for k, (level, threshold) in enumerate(WEIGHT_KINDS)
        for agg in ("token-mean", "seq-mean-token-mean")
    ]
    for k, level, threshold, agg in subsample(backend, device, grid):
        batch = make_batch(7 + k, device)
        w, _ = compute_rollout_correction_weights(
            batch["old_log_prob"] - batch["rollout_log_probs"],
            batch["response_mask"],
            rollout_is=level,
            rollout_is_threshold=threshold,
        )
        if isinstance(threshold, str):
            assert ((w == 0) & batch["response_mask"]).any()  # IcePop dropped tokens
        what = f"{name} rollout_is={level} threshold={threshold} agg={agg}"
        compare_policy_fn(name, batch, backend, what, weights=w, loss_agg_mode=agg, config=actor_config(loss_mode, agg))


# DPPO's trust-region thresholds: asymmetric, one side tight, from clip_ratio alone; the
# truncation cap c from the config, or verl's default 20.0 when the config has none.
DPPO_CASES = [
    (dict(clip_ratio_low=0.05, clip_ratio_high=0.3, clip_ratio_c=2.0), "token-mean"),
    (dict(clip_ratio_low=0.3, clip_ratio_high=0.02, clip_ratio_c=5.0), "seq-mean-token-mean"),
    (dict(clip_ratio=0.1, clip_ratio_low=None, clip_ratio_high=None), "token-sum"),
    (dict(clip_ratio_low=0.01, clip_ratio_high=0.01, clip_ratio_c=1.5), "seq-mean-token-sum"),
    (dict(clip_ratio_low=0.2, clip_ratio_high=0.1, clip_ratio_c=None), "seq-mean-token-sum-norm"),
]


def token_is_weights(batch, threshold):
    """verl's token-level rollout IS weights of the batch (rollout_corr_helper)."""
    w, _ = compute_rollout_correction_weights(
        batch["old_log_prob"] - batch["rollout_log_probs"],
        batch["response_mask"],
        rollout_is="token",
        rollout_is_threshold=threshold,
    )
    return w


def dppo_config(loss_mode, agg, fields):
    """An ActorConfig, or (``clip_ratio_c=None``) a DictConfig without clip_ratio_c, so that
    verl's ``config.get("clip_ratio_c", 20.0)`` takes its default."""
    if fields.get("clip_ratio_c", 0) is not None:
        return actor_config(loss_mode, agg, **fields)
    from omegaconf import OmegaConf

    f = {k: v for k, v in fields.items() if k != "clip_ratio_c"}
    return OmegaConf.create(
        dict(clip_ratio=0.2, **f, loss_agg_mode=agg, policy_loss=dict(loss_mode=loss_mode), global_batch_info={})
    )


@pytest.mark.parametrize("backend,device,loss_mode", backend_modes(DPPO_MODES, ("dppo_kl",)))
def test_dppo_thresholds_and_cap_match_verl(backend, device, loss_mode):
    """DPPO-Binary-TV / -KL: asymmetric clip_ratio_low / clip_ratio_high, clip_ratio alone,
    clip_ratio_c given or verl's default, with and without rollout_is_weights (IcePop's
    zeros included): loss, gradient and the three metrics match verl's."""
    name = f"compute_policy_loss_{loss_mode}"
    grid = [(k, fields, agg, weighted) for k, (fields, agg) in enumerate(DPPO_CASES) for weighted in (False, True)]
    for k, fields, agg, weighted in subsample(backend, device, grid):
        batch = make_batch(300 + 2 * k + weighted, device)
        w = token_is_weights(batch, "0.5_2.0" if k % 2 else 2.0) if weighted else None
        cfg = dppo_config(loss_mode, agg, fields)
        what = f"{name} {fields} agg={agg} weights={weighted}"
        compare_policy_fn(name, batch, backend, what, weights=w, loss_agg_mode=agg, config=cfg)


def test_dppo_batches_exercise_every_branch():
    """On the test batches verl's DPPO masks tokens out and truncates kept ones (measured
    with verl's own functions), for both signs of A, else the comparisons prove little."""
    for loss_mode in DPPO_MODES:
        fn = getattr(core_algos, f"compute_policy_loss_{loss_mode}")
        for k, (fields, agg) in enumerate(DPPO_CASES):
            b = make_batch(300 + 2 * k)
            args = (b["old_log_prob"], b["log_prob"], b["advantages"], b["response_mask"], agg)
            _, m = fn(*args, config=dppo_config(loss_mode, agg, fields))
            assert m["actor/pg_clipfrac"] > 0.005, (loss_mode, fields)
            if fields.get("clip_ratio_c", 0) is not None:
                assert m["actor/pg_clipfrac_lower"] > 0.0, (loss_mode, fields)
            for sign in (1.0, -1.0):  # each side of the trust region masks something
                adv = sign * b["advantages"].abs()
                _, m = fn(args[0], args[1], adv, args[3], agg, config=dppo_config(loss_mode, agg, fields))
                assert m["actor/pg_clipfrac"] > 0.0, (loss_mode, fields, sign)


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("loss_mode", DPPO_MODES)
def test_dppo_empty_and_all_masked_give_zeros(backend, device, loss_mode):
    """No valid token (all masked, no row, no column): loss, gradient and metrics are 0,
    never NaN (verl's masked means divide by 0 there)."""
    fn = getattr(ours, f"compute_policy_loss_{loss_mode}")
    for B, L in ((4, 7), (0, 7), (3, 0)):
        for agg in AGG_MODES:
            lp = (-torch.rand(B, L) * 2).to(device).requires_grad_(True)
            mask = torch.zeros(B, L, dtype=torch.bool, device=device)
            with ours.use_backend(backend):
                loss, m = fn(
                    lp.detach() - 0.4, lp, torch.randn(B, L).to(device), mask, agg, actor_config(loss_mode, agg)
                )
            loss.backward()
            assert float(loss) == 0.0, (B, L, agg)
            assert lp.grad is not None and float(lp.grad.abs().sum()) == 0.0, (B, L, agg)
            assert set(m) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
            assert all(v == 0.0 for v in m.values()), (B, L, agg, m)


def test_negative_rollout_is_weights_rejected():
    batch = make_batch(3)
    w = torch.ones_like(batch["log_prob"])
    w[0, 0] = -0.5
    with pytest.raises(ValueError, match="rollout_is_weights"):
        ours.compute_policy_loss_vanilla(
            batch["old_log_prob"],
            batch["log_prob"],
            batch["advantages"],
            batch["response_mask"],
            config=actor_config(),
            rollout_is_weights=w,
        )


def test_global_counts_required_like_verl():
    batch = make_batch(5)
    for agg, missing in (("token-mean", "batch_num_tokens"), ("seq-mean-token-mean", "global_batch_size")):
        cfg = actor_config("vanilla", agg)
        cfg.global_batch_info.update(dp_size=2)
        for fn in (core_algos.compute_policy_loss_vanilla, ours.compute_policy_loss_vanilla):
            with pytest.raises(ValueError, match=missing):
                fn(batch["old_log_prob"], batch["log_prob"], batch["advantages"], batch["response_mask"], agg, cfg)


# ---------------------------------------------------------------------------------------
# kl_penalty and agg_loss
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,device", ALL)
def test_kl_penalty_matches_verl(backend, device):
    """Every estimator verl names, value and gradient (a random upstream gradient)."""
    batch = make_batch(11, device)
    up = torch.randn(batch["log_prob"].shape, generator=torch.Generator().manual_seed(1)).to(device)
    for kind in subsample(backend, device, KL_TYPES):

        def run(fn, b, use):
            lp = b["log_prob"].clone().requires_grad_(True)
            with ours.use_backend(use):
                kl = fn(lp, b["ref_log_prob"].clone(), kind)
            (kl * up.to(kl.dtype)).sum().backward()
            return kl, lp.grad

        def compare(mine, t32, t64):
            close(mine[0], t32[0], t64[0], f"kl_penalty {kind} value")
            close(mine[1], t32[1], t64[1], f"kl_penalty {kind} grad")

        against_verl(
            compare,
            run(ours.kl_penalty, batch, backend),
            run(core_algos.kl_penalty, batch, "auto"),
            lambda: run(core_algos.kl_penalty, as64(batch), "auto"),
        )
    for fn in (core_algos.kl_penalty, ours.kl_penalty):
        with pytest.raises(NotImplementedError):
            fn(batch["log_prob"], batch["ref_log_prob"], "full")


@pytest.mark.parametrize("backend,device", ALL)
def test_agg_loss_matches_verl(backend, device):
    """Every aggregation × local / global counts (ints, tensors), bool and float masks."""
    grid = [(i, mode, j, info) for i, mode in enumerate(AGG_MODES) for j, info in enumerate(["local", "int", "tensor"])]
    for i, mode, j, info in subsample(backend, device, grid):
        batch = make_batch(40 + 3 * i + j, device)
        mask = batch["response_mask"] if j != 1 else batch["response_mask"].float()
        kwargs = batch_info(info, batch)

        def run(fn, dt, use):
            x = (batch["ref_log_prob"] - batch["log_prob"]).to(dt).requires_grad_(True)  # both signs
            m = mask.clone() if not mask.is_floating_point() else mask.to(dt)
            with ours.use_backend(use):
                loss = fn(x, m, mode, **kwargs)
            loss.backward()
            return loss, x.grad

        def compare(mine, t32, t64):
            close(mine[0], t32[0], t64[0], f"agg_loss {mode} {info} value")
            close(mine[1], t32[1], t64[1], f"agg_loss {mode} {info} grad")

        against_verl(
            compare,
            run(ours.agg_loss, torch.float32, backend),
            run(core_algos.agg_loss, torch.float32, "auto"),
            lambda: run(core_algos.agg_loss, torch.float64, "auto"),
        )
    batch = make_batch(0)
    for fn in (core_algos.agg_loss, ours.agg_loss):
        with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
            fn(batch["entropy"], batch["response_mask"], "token-avg")
        with pytest.raises(ValueError, match="batch_num_tokens"):
            fn(batch["entropy"], batch["response_mask"], "token-mean", dp_size=2)


# ---------------------------------------------------------------------------------------
# policy_loss_verl against verl's actor loss (workers.utils.losses.ppo_loss)
# ---------------------------------------------------------------------------------------


def verl_actor_loss(cfg, batch, info, *, entropy=True, rollout_is_weights=None):
    """verl's ppo_loss on the padded batch; returns (loss, {key: float}, grad logp, grad entropy)."""
    lp = batch["log_prob"].clone().requires_grad_(True)
    ent = batch["entropy"].clone().requires_grad_(True)
    B = lp.shape[0]
    fields = dict(
        response_mask=batch["response_mask"].clone(),
        old_log_probs=batch["old_log_prob"].clone(),
        advantages=batch["advantages"].clone(),
        ref_log_prob=batch["ref_log_prob"].clone(),
    )
    if rollout_is_weights is not None:
        fields["rollout_is_weights"] = rollout_is_weights.clone()
    data = TensorDict(fields, batch_size=[B])
    tu.assign_non_tensor(
        data,
        dp_size=info.get("dp_size", 1),
        batch_num_tokens=info.get("batch_num_tokens"),
        global_batch_size=info.get("global_batch_size"),
    )
    out = {"log_probs": lp}
    if entropy:
        out["entropy"] = ent
    with mock.patch.object(verl_losses, "no_padding_2_padding", lambda t, data: t):
        loss, metrics = verl_losses.ppo_loss(cfg, out, data)
    loss.backward()
    flat = {k: (v.values[0] if hasattr(v, "values") else v) for k, v in metrics.items()}
    return loss, flat, lp.grad, (ent.grad if entropy else None)


def our_actor_loss(cfg, batch, info, backend, *, entropy=True, **kwargs):
    lp = batch["log_prob"].clone().requires_grad_(True)
    ent = batch["entropy"].clone().requires_grad_(True)
    loss, metrics = ours.policy_loss_verl(
        batch["old_log_prob"].clone(),
        lp,
        batch["advantages"].clone(),
        batch["response_mask"].clone(),
        cfg,
        entropy=ent if entropy else None,
        ref_log_prob=batch["ref_log_prob"].clone(),
        backend=backend,
        dp_size=info.get("dp_size", 1),
        batch_num_tokens=info.get("batch_num_tokens"),
        global_batch_size=info.get("global_batch_size"),
        **kwargs,
    )
    loss.backward()
    return loss, metrics, lp.grad, (ent.grad if entropy else None)


def compare_actor(mine, cfg, batch, info, what, *, entropy=True, weights=None, weights64=None):
    """Ours against verl's ppo_loss in float32 (and float64 when needed; ``weights64``: the
    float64 run's weights, default the float32 ones upcast)."""
    if weights is not None and weights64 is None:
        weights64 = weights.double()
    t32 = verl_actor_loss(cfg, batch, info, entropy=entropy, rollout_is_weights=weights)
    run64 = lambda: verl_actor_loss(cfg, as64(batch), info, entropy=entropy, rollout_is_weights=weights64)  # noqa: E731
    against_verl(lambda m, a, e: compare_actor_runs(m, a, e, what), mine, t32, run64)


def compare_actor_runs(mine, t32, t64, what):
    close(mine[0], t32[0], t64[0], what + " loss")
    close(mine[2], t32[2], t64[2], what + " grad log_prob")
    if t32[3] is not None:
        if mine[3] is None:  # entropy_coeff = 0: verl's gradient is −0·∂agg, ours none at all
            assert not t32[3].any(), what
        else:
            close(mine[3], t32[3], t64[3], what + " grad entropy")
    close_metrics(mine[1], t32[1], t64[1], what)


@pytest.mark.parametrize("backend,device,loss_mode", backend_modes(LOSS_MODES, ("gspo",)))
def test_actor_loss_matches_verl(backend, device, loss_mode):
    """pg + kl_loss_coef·kl − entropy_coeff·entropy in one call vs verl's ppo_loss: every
    loss type × aggregation × distinct KL estimator (fused or not) and without KL; the
    entropy term present (coefficient 0.01 or 0) or absent, local and global batch info
    (the config's loss_scale_factor too) switched across the cases."""
    pairs = [(agg, kl) for agg in AGG_MODES for kl in KL_DISTINCT + [None]]
    for case, (agg, kl_type) in subsample(backend, device, list(enumerate(pairs, start=1))):
        info_kind = ("local", "int", "tensor")[case % 3]
        entropy = case % 5 != 0
        batch = make_batch(1000 + 17 * case + LOSS_MODES.index(loss_mode), device)
        info = batch_info(info_kind, batch)
        cfg = actor_config(
            loss_mode,
            agg,
            use_kl_loss=kl_type is not None,
            kl_loss_type=kl_type or "low_var_kl",
            kl_loss_coef=0.05,
            entropy_coeff=0.01 if case % 4 else 0.0,
            loss_scale_factor=info.get("loss_scale_factor"),
        )
        mine = our_actor_loss(cfg, batch, info, backend, entropy=entropy)
        what = f"{loss_mode} agg={agg} kl={kl_type} entropy={entropy} info={info_kind}"
        compare_actor(mine, cfg, batch, info, what, entropy=entropy)


# (the Triton kernel refuses clip_cov / kl_cov; on its CPU interpreter dro stands for the rest)
NEW_ACTOR_MODES = [
    c for c in backend_modes(["geo_mean", "dro", "clip_cov", "kl_cov"], ("dro",)) if not c.values[-1].endswith("cov")
] + [
    pytest.param(*p.values, m, id=f"{p.id}-{m}", marks=p.marks)
    for p in ALL
    if p.values[0] != "triton"
    for m in ("clip_cov", "kl_cov")
]


@pytest.mark.parametrize("backend,device,loss_mode", NEW_ACTOR_MODES)
def test_actor_loss_geo_mean_dro_cov_match_verl(backend, device, loss_mode):
    """policy_loss_verl for geo_mean / dro / clip_cov / kl_cov vs verl's ppo_loss calling
    verl's compute_policy_loss_<mode>: every aggregation, a fused and an unfused KL
    estimator and none, the entropy term present or not, local and global batch info, with
    and without token rollout_is_weights; each pair of runs under the same torch seed
    (clip_cov draws torch.randperm)."""
    policy = PolicyLossConfig(loss_mode=loss_mode, dro_beta=0.3, **COV_CONFIG)
    grid = [(agg, kl) for agg in AGG_MODES for kl in ("low_var_kl", "abs", None)]
    for case, (agg, kl_type) in subsample(backend, device, list(enumerate(grid, start=1))):
        info_kind = ("local", "int", "tensor")[case % 3]
        entropy, weighted = case % 5 != 0, case % 2 == 0
        batch = make_batch(2000 + 13 * case, device)
        info = batch_info(info_kind, batch)
        cfg = actor_config(
            loss_mode,
            agg,
            clip_ratio_low=0.1,
            clip_ratio_high=0.15,
            use_kl_loss=kl_type is not None,
            kl_loss_type=kl_type or "low_var_kl",
            kl_loss_coef=0.05,
            entropy_coeff=0.01 if case % 4 else 0.0,
            loss_scale_factor=info.get("loss_scale_factor"),
            policy_loss=policy,
        )
        w = token_is_weights(batch, 2.0) if weighted else None
        kw = {} if w is None else dict(rollout_is_weights=w.clone())
        mine = seeded(our_actor_loss)(cfg, batch, info, backend, entropy=entropy, **kw)
        t32 = seeded(verl_actor_loss)(cfg, batch, info, entropy=entropy, rollout_is_weights=w)
        what = f"{loss_mode} agg={agg} kl={kl_type} entropy={entropy} info={info_kind} weights={weighted}"

        def run64(batch=batch, info=info, entropy=entropy, w=w, cfg=cfg):
            w64 = None if w is None else w.double()
            return seeded(verl_actor_loss)(cfg, as64(batch), info, entropy=entropy, rollout_is_weights=w64)

        against_verl(lambda m, a, e, what=what: compare_actor_runs(m, a, e, what), mine, t32, run64)
        if loss_mode == "clip_cov":
            assert t32[1]["actor/pg_clipfrac"] > 0, what  # some tokens are selected


@pytest.mark.parametrize("backend,device,loss_mode", backend_modes(["vanilla", "gspo", "sapo"], ("sapo",)))
def test_actor_loss_rollout_correction_matches_verl(backend, device, loss_mode):
    """verl's TIS weights (token / sequence, float threshold) computed inside our kernel
    from rollout_log_probs, and verl's weights given as a tensor (TIS and IcePop), vs
    ppo_loss with verl's rollout_is_weights."""
    grid = [
        (k, level, threshold, agg)
        for k, (level, threshold) in enumerate(WEIGHT_KINDS)
        for agg in ("token-mean", "seq-mean-token-sum")
    ]
    for k, level, threshold, agg in subsample(backend, device, grid):
        batch = make_batch(300 + 2 * k + (agg == "token-mean"), device)
        b64 = as64(batch)
        w, w64 = (
            compute_rollout_correction_weights(
                b["old_log_prob"] - b["rollout_log_probs"],
                b["response_mask"],
                rollout_is=level,
                rollout_is_threshold=threshold,
            )[0]
            for b in (batch, b64)
        )
        cfg = actor_config(loss_mode, agg, use_kl_loss=True, kl_loss_type="low_var_kl", entropy_coeff=0.02)
        what = f"{loss_mode} rollout_is={level} threshold={threshold} agg={agg}"
        mine = our_actor_loss(cfg, batch, {}, backend, rollout_is_weights=w.clone())
        compare_actor(mine, cfg, batch, {}, what + " (weights tensor)", weights=w)
        if not isinstance(threshold, str):
            mine = our_actor_loss(
                cfg,
                batch,
                {},
                backend,
                rollout_log_probs=batch["rollout_log_probs"],
                rollout_is=level,
                rollout_is_threshold=threshold,
            )
            compare_actor(mine, cfg, batch, {}, what + " (fused TIS)", weights=w, weights64=w64)


def test_actor_loss_tensor_metrics():
    """return_tensors=True: the same numbers as detached 0-d tensors, kl_coef as given."""
    batch = make_batch(21)
    cfg = actor_config("vanilla", "token-mean", use_kl_loss=True, entropy_coeff=0.01)
    _, floats, _, _ = our_actor_loss(cfg, batch, {}, "reference")
    _, tensors, _, _ = our_actor_loss(cfg, batch, {}, "reference", return_tensors=True)
    assert set(floats) == set(tensors)
    for k, v in tensors.items():
        if k == "kl_coef":
            assert v == floats[k]
            continue
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad
        assert float(v) == pytest.approx(floats[k], abs=1e-7)


def test_actor_loss_icepop_threshold_not_fused():
    batch = make_batch(2)
    with pytest.raises(NotImplementedError, match="IcePop"):
        our_actor_loss(
            actor_config(),
            batch,
            {},
            "reference",
            rollout_log_probs=batch["rollout_log_probs"],
            rollout_is="token",
            rollout_is_threshold="0.5_2.0",
        )


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("loss_mode", ["geo_mean", "dro"])
def test_geo_mean_dro_match_verl(backend, device, loss_mode):
    """Loss, gradient and metrics against verl's compute_policy_loss_geo_mean / _dro, with
    asymmetric clip ratios, every agg (geo_mean ignores it, as verl), and with token
    rollout_is_weights (geo_mean: their geometric mean per sequence; dro: per token)."""
    name = f"compute_policy_loss_{loss_mode}"
    for k, agg in enumerate(AGG_MODES):
        for weighted in (False, True):
            batch = make_batch(500 + 2 * k + weighted, device)
            w = token_is_weights(batch, 2.0) if weighted else None
            cfg = actor_config(
                loss_mode,
                agg,
                clip_ratio_low=0.1,
                clip_ratio_high=0.15,
                policy_loss=PolicyLossConfig(loss_mode=loss_mode, dro_beta=0.3),
            )
            what = f"{name} agg={agg} weights={weighted}"
            compare_policy_fn(name, batch, backend, what, weights=w, loss_agg_mode=agg, config=cfg)


def test_dro_beta_checked():
    batch = make_batch(7)
    cfg = actor_config("dro", policy_loss=PolicyLossConfig(loss_mode="dro", dro_beta=0.0))
    with pytest.raises(ValueError, match="dro_beta"):
        ours.compute_policy_loss_dro(
            batch["old_log_prob"], batch["log_prob"], batch["advantages"], batch["response_mask"], config=cfg
        )


# clip_cov and kl_cov, every backend.
# verl's clip_cov draws torch.randperm from the global RNG: every run is seeded alike.
COV_CONFIG = dict(clip_cov_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=2.0, kl_cov_ratio=0.05, ppo_kl_coef=0.7)


def seeded(fn, seed=1234):
    def run(*args, **kwargs):
        torch.manual_seed(seed)
        return fn(*args, **kwargs)

    return run


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("loss_mode", ["clip_cov", "kl_cov"])
def test_clip_cov_kl_cov_match_verl(backend, device, loss_mode):
    """Loss, gradient and metrics against verl's compute_policy_loss_clip_cov / _kl_cov under
    the same torch.manual_seed, every agg, with and without token rollout_is_weights."""
    name = f"compute_policy_loss_{loss_mode}"
    verl_fn, our_fn = seeded(getattr(core_algos, name)), seeded(getattr(ours, name))
    for k, agg in subsample(backend, device, enumerate(AGG_MODES)):
        for weighted in (False, True):
            batch = make_batch(600 + 2 * k + weighted, device)
            w = {} if not weighted else dict(rollout_is_weights=token_is_weights(batch, 2.0))
            cfg = actor_config(
                loss_mode,
                agg,
                clip_ratio_low=0.1,
                clip_ratio_high=0.15,
                policy_loss=PolicyLossConfig(loss_mode=loss_mode, **COV_CONFIG),
            )
            kw = dict(loss_agg_mode=agg, config=cfg)
            t32 = call_policy_fn(verl_fn, batch, None, **kw, **w)
            mine = call_policy_fn(our_fn, batch, backend, **kw, **w)
            what = f"{name} agg={agg} weights={weighted}"

            def compare(mine, t32, t64, what=what):
                close(mine[0], t32[0], t64[0], what + " loss")
                close(mine[2], t32[2], t64[2], what + " grad")
                close_metrics(mine[1], t32[1], t64[1], what)

            w64 = {key: v.double() for key, v in w.items()}
            against_verl(
                compare, mine, t32, lambda kw=kw, w64=w64: call_policy_fn(verl_fn, as64(batch), None, **kw, **w64)
            )
            if loss_mode == "clip_cov":
                assert t32[1]["actor/pg_clipfrac"] > 0  # some tokens are selected


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("loss_mode", ["clip_cov", "kl_cov"])
def test_clip_cov_kl_cov_empty_and_all_masked_give_zeros(backend, device, loss_mode):
    """No valid token (all masked, no row, no column): loss, gradient and verl's metric keys
    are 0, never NaN (verl's token-mean divides by 0 there)."""
    fn = seeded(getattr(ours, f"compute_policy_loss_{loss_mode}"))
    keys = {"actor/ppo_kl"} | ({"actor/pg_clipfrac"} if loss_mode == "clip_cov" else set())
    for B, L in ((4, 7), (0, 7), (3, 0)):
        for agg in subsample(backend, device, AGG_MODES):
            lp = (-torch.rand(B, L) * 2).to(device).requires_grad_(True)
            mask = torch.zeros(B, L, dtype=torch.bool, device=device)
            cfg = actor_config(loss_mode, agg, policy_loss=PolicyLossConfig(loss_mode=loss_mode, **COV_CONFIG))
            with ours.use_backend(backend):
                loss, m = fn(lp.detach() - 0.4, lp, torch.randn(B, L).to(device), mask, agg, cfg)
            loss.backward()
            assert float(loss) == 0.0, (B, L, agg)
            assert lp.grad is not None and float(lp.grad.abs().sum()) == 0.0, (B, L, agg)
            assert set(m) == keys and all(v == 0.0 for v in m.values()), (B, L, agg, m)


def test_cov_ratio_checked():
    batch = make_batch(7)
    for loss_mode, field in (("clip_cov", "clip_cov_ratio"), ("kl_cov", "kl_cov_ratio")):
        cfg = actor_config(loss_mode, policy_loss=PolicyLossConfig(loss_mode=loss_mode, **{field: 0.0}))
        with pytest.raises(ValueError, match=field):
            getattr(ours, f"compute_policy_loss_{loss_mode}")(
                batch["old_log_prob"], batch["log_prob"], batch["advantages"], batch["response_mask"], config=cfg
            )
