"""The KL clamp options (``kl_clamp`` scope, ``kl_clamp_input`` / ``kl_clamp_output``,
``kl_score_grad``) on every backend against the fp64 reference, and the loss presets of
OpenRLHF, slime, AReaL, NeMo-RL, SkyRL and prime-rl (docs/presets.md): against the
peers' own functions where they import (OpenRLHF 0.11.2, AReaL 1.0.4, SkyRL 0.3.0), against
their formulas written out here otherwise (slime, NeMo-RL, prime-rl)."""

import types

import pytest
import torch
from _backends import FAST

import rlvr_kernels as rk
from rlvr_kernels.ops.policy_loss import _kernel_params
from rlvr_kernels.options import LOSS_PRESETS, PolicyLossOptions, resolve_policy_loss_options
from rlvr_kernels.testing.peers import import_openrlhf_models, import_skyrl_ppo_utils

KLS = ["k1", "k2", "k3", "k3+"]


def _case(B=6, L=17, spread=8.0, seed=0, mismatch=0.3):
    """Padded inputs whose reference log-probs lie far enough away (``spread``) to reach every
    KL clamp; the last sequence is fully masked."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, L, generator=g, dtype=torch.float64) * 3
    old = lp + mismatch * torch.randn(B, L, generator=g, dtype=torch.float64)
    ref = lp + spread * torch.randn(B, L, generator=g, dtype=torch.float64)
    roll = old + 0.2 * torch.randn(B, L, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.rand(B, L, generator=g) > 0.2
    mask[-1] = False
    return dict(logprobs=lp, old_logprobs=old, ref_logprobs=ref, rollout_logprobs=roll, advantages=adv, mask=mask)


def _run(x, backend, dtype=torch.float64, **kw):
    """(loss, metrics, ∂loss/∂logprobs) of ``rk.policy_loss`` (agg="none": the sum's gradient)."""
    lp = x["logprobs"].to(dtype).detach().requires_grad_(True)
    args = {k: (v.to(dtype) if k != "mask" and k != "advantages" else v) for k, v in x.items() if k != "logprobs"}
    loss, met = rk.policy_loss(lp, backend=backend, **args, **kw)
    loss.sum().backward()
    return loss.detach().double(), met, lp.grad.double()


def _assert_rule(fast, ref64, same, what):
    """|fast − ref64| <= 2·|same − ref64| + atol (the suite's tolerance rule)."""
    atol = 1e-5 * (1.0 + ref64.abs().max().item() if ref64.numel() else 1.0)
    err = (fast - ref64).abs()
    bound = 2 * (same - ref64).abs() + atol
    assert bool((err <= bound).all()), f"{what}: max excess {(err - bound).max().item()}"


CLAMPS = [
    dict(kl_clamp=True),
    dict(kl_clamp=False),
    dict(kl_clamp="k3", kl_clamp_input=None, kl_clamp_output=10.0),
    dict(kl_clamp="all"),
    dict(kl_clamp="all", kl_clamp_input=None, kl_clamp_output=10.0),
    dict(kl_clamp="all", kl_clamp_input=5.0, kl_clamp_output=None),
    dict(kl_clamp="all", kl_clamp_input=3.0, kl_clamp_output=2.0, kl_score_grad=True),
    dict(kl_clamp="k3", kl_clamp_input=4.0, kl_clamp_output=3.0, kl_score_grad=True),
]


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("kl", KLS)
@pytest.mark.parametrize("clamp", CLAMPS, ids=[str(sorted(c.items())) for c in CLAMPS])
@pytest.mark.parametrize("agg", ["token-mean", "none"])
def test_kl_clamps_match_reference(backend, device, kl, clamp, agg):
    if kl == "k3" and clamp.get("kl_clamp") is False:
        spread = 2.0  # unclamped k3 of a spread of 8 overflows fp32 (e^y of y ~ 30 ± ...)
    else:
        spread = 8.0
    x = _case(spread=spread)
    x = {k: v.to(device) for k, v in x.items()}
    opts = PolicyLossOptions(kl=kl, kl_coef=0.3, agg=agg, **clamp)
    ref64 = _run(x, "reference", torch.float64, options=opts)
    same = _run(x, "reference", torch.float32, options=opts)
    fast = _run(x, backend, torch.float32, options=opts)
    _assert_rule(fast[0].cpu(), ref64[0].cpu(), same[0].cpu(), "loss")
    _assert_rule(fast[2].cpu(), ref64[2].cpu(), same[2].cpu(), "grad")
    for name in ("kl", "kl_loss", "pg_loss"):
        a, r, s = (getattr(m[1], name).double().cpu() for m in (fast, ref64, same))
        _assert_rule(a, r, s, name)


def test_kl_clamp_defaults_unchanged():
    """kl_clamp=True is verl's k3 clamps: the same kernel code (1) as before; "k3" equals True."""
    p = _kernel_params(PolicyLossOptions(kl="k3", kl_coef=0.1), True, rk.contracts.policy_loss.TokenOut.NONE)
    assert int(p.kl_clamp) == 1 and p.kl_clamp_input == 20.0 and p.kl_clamp_output == 10.0
    assert not p.kl_score_grad
    x = _case()
    a = _run(x, "reference", options=PolicyLossOptions(kl="k3", kl_coef=0.1, kl_clamp=True))
    b = _run(x, "reference", options=PolicyLossOptions(kl="k3", kl_coef=0.1, kl_clamp="k3"))
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
    for preset in ("verl", "trl"):
        o = resolve_policy_loss_options(preset)
        assert (o.kl_clamp_input, o.kl_clamp_output, o.kl_score_grad) == (20.0, 10.0, False)
    assert resolve_policy_loss_options("trl").kl_clamp_scope is None


def test_kl_score_grad_adds_kl_where_live():
    """∂/∂logp of β·kl with kl_score_grad = β·(∂kl + kl) where no clamp is active, 0 where one is;
    the value is unchanged."""
    x = _case(spread=4.0)
    base = dict(kl="k2", kl_coef=1.0, agg="none", kl_clamp="all", kl_clamp_input=3.0, kl_clamp_output=2.0)
    x["advantages"] = torch.zeros_like(x["advantages"])  # the pg term (and its gradient) is 0
    off = _run(x, "reference", options=PolicyLossOptions(**base))
    on = _run(x, "reference", options=PolicyLossOptions(**base, kl_score_grad=True))
    assert torch.equal(off[0], on[0])
    d = (x["logprobs"] - x["ref_logprobs"]) * x["mask"]
    live = (d.abs() <= 3.0) & (0.5 * d.square() <= 2.0) & x["mask"]
    expect = torch.where(live, d + 0.5 * d.square(), 0.0)
    torch.testing.assert_close(on[2], expect, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ presets
PRESET_FIELDS = {
    "openrlhf": dict(clip_ratio_c=None, log_ratio_clamp=20.0, gspo_log_clamp=None, kl_clamp_scope="all"),
    "slime": dict(clip_ratio_c=None, log_ratio_clamp=None, kl_clamp_scope="k3", kl_clamp_input=None),
    "areal": dict(clip_ratio_c=None, log_ratio_clamp=None, kl_clamp_scope="all", kl_clamp_input=None),
    "nemo_rl": dict(log_ratio_clamp=None, kl_clamp_scope="all", kl_clamp_input=20.0, kl_score_grad=True),
    "skyrl": dict(clip_ratio_c=None, log_ratio_clamp=20.0, kl_clamp_scope="k3", kl_clamp_output=10.0),
    "prime_rl": dict(loss_type="dppo_tv", clip_ratio_c=None, kl="k2", kl_coef=2e-3, kl_clamp_scope=None),
}
PRESET_AGG = {
    "openrlhf": "token-mean",
    "slime": "seq-mean-token-mean",
    "areal": "token-mean",
    "nemo_rl": "token-mean",
    "skyrl": "token-mean",
    "prime_rl": "token-mean",
}


@pytest.mark.parametrize("preset", sorted(PRESET_FIELDS))
def test_preset_resolution(preset):
    assert preset in LOSS_PRESETS
    o = resolve_policy_loss_options(preset)
    for k, v in dict(PRESET_FIELDS[preset], agg=PRESET_AGG[preset]).items():
        assert getattr(o, k) == v, (preset, k)
    # explicit overrides win over the preset
    assert resolve_policy_loss_options(preset, clip_high=0.28, agg="token-sum").clip_high == 0.28


def test_kl_option_validation():
    with pytest.raises(ValueError, match="kl_clamp"):
        PolicyLossOptions(kl_clamp="k2")
    with pytest.raises(TypeError, match="kl_clamp"):
        PolicyLossOptions(kl_clamp=1.5)
    with pytest.raises(ValueError, match="kl_clamp_input"):
        PolicyLossOptions(kl_clamp_input=0.0)
    with pytest.raises(ValueError, match="kl_clamp_output"):
        PolicyLossOptions(kl_clamp_output=-1.0)
    with pytest.raises(ValueError, match="kl_clamp_output"):
        PolicyLossOptions(kl_clamp_output=float("inf"))
    with pytest.raises(TypeError, match="kl_score_grad"):
        PolicyLossOptions(kl_score_grad=1)
    with pytest.raises(ValueError, match="kl_score_grad"):
        PolicyLossOptions(kl="k3", kl_score_grad=True, kl_ratio_correction=True)
    with pytest.raises(ValueError, match="preset"):
        resolve_policy_loss_options("openrlhf_v2")
    x = _case()
    x.pop("ref_logprobs")
    with pytest.raises(ValueError, match="ref_logprobs"):
        rk.policy_loss(**{k: v for k, v in x.items() if k != "rollout_logprobs"}, preset="prime_rl")


def _kl_only(x, backend, dtype=torch.float64, **kw):
    """Per-token β·kl (β = 1) and its gradient through policy_loss: zero advantages make the
    pg term 0 (agg="none" gives the per-token loss)."""
    x = dict(x, advantages=torch.zeros_like(x["advantages"]))
    x.pop("rollout_logprobs")
    return _run(x, backend, dtype, kl_coef=1.0, agg="none", **kw)


# ------------------------------------------------------------------ OpenRLHF 0.11.2
@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("kl", ["k1", "k2", "k3"])
def test_openrlhf_compute_approx_kl(backend, kl):
    """openrlhf/models/utils.py compute_approx_kl: values and gradients (every estimate
    clamped to ±10; k3's input x >= −10)."""
    _, utils = import_openrlhf_models()
    x = _case(spread=12.0)
    lp = x["logprobs"].clone().requires_grad_(True)
    peer = utils.compute_approx_kl(lp, x["ref_logprobs"], kl_estimator=kl).double()
    (peer * x["mask"]).sum().backward()
    loss, _, grad = _kl_only(
        x, backend, torch.float64 if backend == "reference" else torch.float32, preset="openrlhf", kl=kl
    )
    torch.testing.assert_close(loss, peer.detach() * x["mask"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, lp.grad.double(), rtol=1e-5, atol=1e-5)


OPENRLHF_LOSSES = [
    ("ppo", None, "token-mean"),
    ("ppo", 3.0, "token-mean"),
    ("ppo", None, "seq-mean-token-mean"),
    ("gspo", None, "seq-mean-token-mean"),  # PolicyLoss forces the per-sample mean for GSPO
]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("loss_type,dual_clip,agg", OPENRLHF_LOSSES)
def test_openrlhf_policy_loss(backend, loss_type, dual_clip, agg):
    """openrlhf/models/loss.py PolicyLoss with sequence-level advantages: loss, gradient, the
    clip fraction and ppo_kl (GSPO: the full gradient of exp(mean δ) equals the token form's
    under a per-sequence-uniform aggregation)."""
    loss_mod, _ = import_openrlhf_models()
    x = _case(mismatch=0.4)
    x["mask"][-1, :3] = True  # no fully masked row: OpenRLHF's GSPO divides by the count
    m = x["mask"].double()
    fn = loss_mod.PolicyLoss(
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        dual_clip=dual_clip,
        token_level_loss=agg == "token-mean",
        policy_loss_type=loss_type,
    )
    lp = x["logprobs"].clone().requires_grad_(True)
    peer, clip_ratio, ppo_kl, _, _ = fn(lp, x["old_logprobs"], x["advantages"][:, None].expand_as(lp), action_mask=m)
    peer.backward()
    dtype = torch.float64 if backend == "reference" else torch.float32
    kw = dict(preset="openrlhf", loss_type=loss_type, clip_high=0.28, agg=agg, clip_ratio_c=dual_clip)
    y = {k: v for k, v in x.items() if k not in ("ref_logprobs", "rollout_logprobs")}
    loss, met, grad = _run(y, backend, dtype, **kw)
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, peer.detach().double(), **tol)
    torch.testing.assert_close(grad, lp.grad.double(), **tol)
    torch.testing.assert_close(met.ppo_kl.double(), ppo_kl.double(), **tol)
    if loss_type == "ppo":
        torch.testing.assert_close(met.pg_clipfrac.double(), clip_ratio.double(), **tol)


@pytest.mark.parametrize("mode,ours", [("clip", "token_tis"), ("mask", "decoupled")])
def test_openrlhf_is_correction(mode, ours):
    """OpenRLHF's token-level IS correction with an upper bound only equals token_tis (clip,
    TIS) and decoupled (mask, ICEPOP: out-of-band tokens dropped, the others keep their weight)."""
    loss_mod, _ = import_openrlhf_models()
    x = _case(mismatch=0.4)
    m = x["mask"].double()
    fn = loss_mod.PolicyLoss(is_correction_level="token", is_correction_mode=mode, is_correction_threshold=(0.0, 1.1))
    lp = x["logprobs"].clone().requires_grad_(True)
    adv = x["advantages"][:, None].expand_as(lp)
    peer, *_ = fn(lp, x["old_logprobs"], adv, action_mask=m, rollout_log_probs=x["rollout_logprobs"])
    peer.backward()
    y = {k: v for k, v in x.items() if k != "ref_logprobs"}
    loss, _, grad = _run(y, "reference", preset="openrlhf", rollout_correction=ours, rollout_threshold=1.1)
    torch.testing.assert_close(loss, peer.detach().double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, lp.grad.double(), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ AReaL 1.0.4
@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("c_clip", [None, 3.0])
def test_areal_ppo_actor_loss(backend, c_clip):
    """areal/utils/functional/functional.py ppo_actor_loss_fn (token-level advantages, no δ
    clamp, dual clip c·|A|, sum over the loss mask / its count)."""
    from areal.utils.functional import ppo_actor_loss_fn

    x = _case(mismatch=0.5)
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(x["logprobs"].shape, generator=g, dtype=torch.float64)
    lp = x["logprobs"].clone().requires_grad_(True)
    peer, stat = ppo_actor_loss_fn(
        lp, x["old_logprobs"], x["old_logprobs"], adv, 0.2, x["mask"], eps_clip_higher=0.28, c_clip=c_clip
    )
    peer.backward()
    y = dict(logprobs=x["logprobs"], old_logprobs=x["old_logprobs"], advantages=adv, mask=x["mask"])
    dtype = torch.float64 if backend == "reference" else torch.float32
    loss, met, grad = _run(y, backend, dtype, preset="areal", clip_high=0.28, clip_ratio_c=c_clip)
    torch.testing.assert_close(loss, peer.detach().double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, lp.grad.double(), rtol=1e-5, atol=1e-6)
    n = x["mask"].sum()
    torch.testing.assert_close(met.pg_clipfrac.double(), (stat["clip_mask"].sum() / n).double(), rtol=1e-6, atol=1e-7)


def test_areal_decoupled_rejection_sampling():
    """ppo_actor_loss_fn with rejection_sampling (token, mask, ratio, upper C): our
    rollout_correction="decoupled" (old_logprobs = AReaL's proximal, rollout = its behaviour)."""
    from areal.api.cli_args import RejectionSamplingConfig
    from areal.utils.functional import ppo_actor_loss_fn

    x = _case(mismatch=0.4)
    adv = x["advantages"][:, None].expand_as(x["logprobs"]).contiguous()
    lp = x["logprobs"].clone().requires_grad_(True)
    cfg = RejectionSamplingConfig(level="token", action="mask", metric="ratio", upper=1.2)
    peer, _ = ppo_actor_loss_fn(
        lp, x["old_logprobs"], x["rollout_logprobs"], adv, 0.2, x["mask"], rejection_sampling=cfg
    )
    peer.backward()
    y = {k: v for k, v in x.items() if k != "ref_logprobs"}
    loss, _, grad = _run(y, "reference", preset="areal", rollout_correction="decoupled", rollout_threshold=1.2)
    torch.testing.assert_close(loss, peer.detach().double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, lp.grad.double(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kl", ["k1", "k2", "k3"])
def test_areal_kl_estimator(kl):
    """areal/utils/data.py KLEstimator (apply_clamp: every estimate to ±10, no input clamp)."""
    from areal.utils.data import KLEstimator

    x = _case(spread=6.0)
    lp = x["logprobs"].clone().requires_grad_(True)
    peer = KLEstimator(kl)(lp, x["ref_logprobs"]).double()
    (peer * x["mask"]).sum().backward()
    loss, _, grad = _kl_only(x, "reference", preset="areal", kl=kl)
    torch.testing.assert_close(loss, peer.detach() * x["mask"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, lp.grad.double(), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ SkyRL 0.3.0
@pytest.mark.parametrize("kl", ["k1", "k2", "k3"])
def test_skyrl_compute_approx_kl(kl):
    """skyrl/backends/skyrl_train/utils/ppo_utils.py compute_approx_kl (k3: input ±20, value ±10)."""
    ppo = import_skyrl_ppo_utils()
    x = _case(spread=12.0)
    lp = x["logprobs"].clone().requires_grad_(True)
    peer = ppo.compute_approx_kl(lp, x["ref_logprobs"], loss_mask=x["mask"].double(), kl_estimator_type=kl)
    peer.sum().backward()
    loss, _, grad = _kl_only(x, "reference", preset="skyrl", kl=kl)
    torch.testing.assert_close(loss, peer.detach().double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, lp.grad.double(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["regular", "dual_clip"])
def test_skyrl_ppo_policy_loss(loss_type):
    """PolicyLossRegistry "regular" / "dual_clip" (ppo_policy_loss) with token_mean: the
    advantages scaled by 1 / (valid tokens), then reduce_loss's masked sum."""
    ppo = import_skyrl_ppo_utils()
    x = _case(mismatch=0.5)
    m = x["mask"].double()
    cfg = types.SimpleNamespace(
        policy_loss_type=loss_type, eps_clip_low=0.2, eps_clip_high=0.28, clip_ratio_c=3.0, off_policy_correction=None
    )
    lp = x["logprobs"].clone().requires_grad_(True)
    adv = x["advantages"][:, None].expand_as(lp) / m.sum()
    peer, _ = ppo.PolicyLossRegistry.get(loss_type)(lp, x["old_logprobs"], adv, cfg, loss_mask=m)
    peer.backward()
    y = {k: v for k, v in x.items() if k not in ("ref_logprobs", "rollout_logprobs")}
    c = 3.0 if loss_type == "dual_clip" else None
    loss, _, grad = _run(y, "reference", preset="skyrl", clip_high=0.28, clip_ratio_c=c)
    torch.testing.assert_close(loss, peer.detach().double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, lp.grad.double(), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ slime, NeMo-RL, prime-rl (formulas)
def test_slime_low_var_kl_and_k3():
    """slime/utils/ppo_utils.py compute_approx_kl: "low_var_kl" is k3 with only its value
    clamped to ±10 (the preset); "k3" is unclamped (kl_clamp=False)."""
    x = _case(spread=3.0)
    d = x["logprobs"] - x["ref_logprobs"]
    k3 = torch.exp(-d) - 1 + d
    low_var = _kl_only(x, "reference", preset="slime", kl="k3")
    torch.testing.assert_close(low_var[0], k3.clamp(-10, 10) * x["mask"])
    expect_grad = torch.where((k3.abs() <= 10) & x["mask"], 1 - torch.exp(-d), 0.0)
    torch.testing.assert_close(low_var[2], expect_grad)
    y = dict(x, advantages=torch.zeros_like(x["advantages"]))
    y.pop("rollout_logprobs")
    opts = resolve_policy_loss_options("slime", kl="k3", kl_coef=1.0, agg="none", kl_clamp=False)
    unclamped = _run(y, "reference", options=opts)
    torch.testing.assert_close(unclamped[0], k3 * x["mask"])


def test_slime_policy_loss_formula():
    """slime compute_policy_loss (ratio exp(−ppo_kl), no δ clamp) summed per sample mean
    (get_sum_of_sample_mean), divided by the number of samples."""
    x = _case(mismatch=2.0)  # |δ| > 20 never arises; no clamp either way
    x["mask"][-1, :4] = True
    m = x["mask"].double()
    lp = x["logprobs"].clone().requires_grad_(True)
    a = x["advantages"][:, None]
    r = torch.exp(lp - x["old_logprobs"])
    pg = torch.maximum(-r * a, -r.clamp(0.8, 1.2) * a)
    peer = ((pg * m).sum(-1) / m.sum(-1)).mean()
    peer.backward()
    y = {k: v for k, v in x.items() if k not in ("ref_logprobs", "rollout_logprobs")}
    loss, _, grad = _run(y, "reference", preset="slime")
    torch.testing.assert_close(loss, peer.detach())
    torch.testing.assert_close(grad, lp.grad)


@pytest.mark.parametrize("kl", ["k1", "k2", "k3"])
def test_nemo_rl_calculate_kl(kl):
    """nemo_rl/algorithms/utils.py calculate_kl with ClippedPGLossFn's default weights
    w = exp(logp − sg(logp)): logr = ref − logp clamped to ±20 (w detached where clamped),
    kl·w clamped to ±10; the token-level masked mean."""
    x = _case(spread=12.0)
    lp = x["logprobs"].clone().requires_grad_(True)
    w = torch.exp(lp - lp.detach())
    logr = x["ref_logprobs"] - lp
    logr_c = logr.clamp(-20, 20)
    w = torch.where(logr == logr_c, w, w.detach())
    v = {"k1": -logr_c, "k2": logr_c.square() / 2, "k3": torch.exp(logr_c) - 1 - logr_c}[kl]
    peer = (w * v).clamp(-10, 10)
    (peer * x["mask"]).sum().backward()
    for backend, dtype in (("reference", torch.float64), ("cpu", torch.float32)):
        loss, _, grad = _kl_only(x, backend, dtype, preset="nemo_rl", kl=kl)
        torch.testing.assert_close(loss, peer.detach() * x["mask"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, lp.grad, rtol=1e-5, atol=1e-5)


def test_nemo_rl_clipped_pg_formula():
    """ClippedPGLossFn defaults: ratio exp(curr − prev) (no clamp), clip 0.2 / 0.2, no dual
    clip, token-level masked mean, plus β·k3 (reference_policy_kl_penalty = 0.01)."""
    x = _case(spread=2.0)
    m = x["mask"].double()
    lp = x["logprobs"].clone().requires_grad_(True)
    a = x["advantages"][:, None]
    r = torch.exp(lp - x["old_logprobs"])
    pg = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))
    logr = (x["ref_logprobs"] - lp).clamp(-20, 20)
    kl = ((torch.exp(logr) - 1 - logr) * torch.exp(lp - lp.detach())).clamp(-10, 10)
    peer = (pg * m).sum() / m.sum() + 0.01 * (kl * m).sum() / m.sum()
    peer.backward()
    y = {k: v for k, v in x.items() if k != "rollout_logprobs"}
    loss, _, grad = _run(y, "reference", preset="nemo_rl", kl="k3", kl_coef=0.01)
    torch.testing.assert_close(loss, peer.detach())
    torch.testing.assert_close(grad, lp.grad)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_prime_rl_default_loss(backend):
    """src/prime_rl/trainer/rl/loss.py default_loss_fn: −keep·A·ρ + kl_tau·(log ρ)² (ρ against
    the inference log-probs, kl_tau = 1e-3, dppo mask 0.2 / 0.2), summed and divided by the
    global token count. The preset's dppo_tv term is −A·sg(ρ)·logp·keep: the same gradient;
    its value differs by the surrogate (so the values are compared on the KL part)."""
    x = _case(mismatch=0.6)
    m = x["mask"]
    lp = x["logprobs"].clone().requires_grad_(True)
    inf = x["old_logprobs"]
    a = x["advantages"][:, None].expand_as(lp)
    log_r = lp - inf
    d = torch.exp(lp) - torch.exp(inf)
    keep = m & ~torch.where(a > 0, d > 0.2, d < -0.2)
    kl_part = (m * log_r.square()).sum() * 1e-3 / m.sum()
    peer = (-(keep * a * torch.exp(log_r))).sum() / m.sum() + kl_part
    peer.backward()
    y = dict(logprobs=x["logprobs"], old_logprobs=inf, advantages=x["advantages"], mask=m, ref_logprobs=inf)
    dtype = torch.float64 if backend == "reference" else torch.float32
    loss, met, grad = _run(y, backend, dtype, preset="prime_rl")
    torch.testing.assert_close(grad, lp.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(met.kl_loss.double() * 2e-3, kl_part.detach(), rtol=1e-5, atol=1e-8)
    pg_value = (-(keep * a * torch.exp(log_r).detach() * lp.detach())).sum() / m.sum()
    torch.testing.assert_close(met.pg_loss.double(), pg_value, rtol=1e-5, atol=1e-7)
