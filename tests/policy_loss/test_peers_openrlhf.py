"""``preset="openrlhf"`` against OpenRLHF 0.11.2's own ``openrlhf/models/loss.py``
``PolicyLoss`` (and ``aggregate_loss``, ``openrlhf/models/utils.py`` ``compute_approx_kl``)
on the same random inputs: every ``policy_loss_type`` (ppo, gspo), every importance-sampling
correction (``is_correction_level`` × ``_mode`` × ``_gating`` with their thresholds, through
``RolloutCorrection.from_openrlhf``), both aggregations (token-level or per-sample, with and
without the global batch totals), the dual clip and the KL loss: the loss, its gradient with
respect to the log-probs and the metrics we share (clip ratio, ppo_kl, is_filter_ratio)
(docs/presets.md)."""

import pytest
import torch
from _backends import FAST

import rlvr_kernels as rk
from rlvr_kernels.options import RolloutCorrection, resolve_policy_loss_options
from rlvr_kernels.testing.peers import import_openrlhf_models

# (is_correction_level, is_correction_mode, is_correction_gating, is_correction_threshold)
CORRECTIONS = [
    ("off", "mask", "ratio", (0.5, 5.0)),
    ("token", "clip", "ratio", (0.8, 1.2)),  # TIS with a lower bound
    ("token", "clip", "ratio", (1.2,)),  # TIS, upper bound only (LOW 0)
    ("token", "mask", "ratio", (0.8, 1.2)),  # ICEPOP
    ("token", "mask", "ratio", (1.2,)),
    ("seq", "mask", "ratio", (0.96, 1.05)),  # seq-mask-tis
    ("token", "mask", "binary_kl", (0.03,)),
    ("token", "mask", "tv", (0.0, 0.1)),
    ("seq", "mask", "binary_kl", (0.012,)),  # FlashREINFORCE's trust region
    ("seq", "mask", "tv", (0.045,)),
]
IDS = ["-".join(str(v) for v in c[:3]) + f"-{c[3]}" for c in CORRECTIONS]
# (token_level_loss, with the global batch totals and dp_size)
AGGS = [(True, False), (False, False), (True, True), (False, True)]


def _case(B=6, L=17, seed=0):
    """Padded fp64 inputs: old = logp + 0.4·N, ref = logp + 3·N, rollout = old + 0.2·N, no
    fully masked row (OpenRLHF's means over a row divide by its count)."""
    g = torch.Generator().manual_seed(seed)

    def normal(scale):
        return scale * torch.randn(B, L, generator=g, dtype=torch.float64)

    lp = -3 * torch.rand(B, L, generator=g, dtype=torch.float64)
    x = dict(logprobs=lp, old_logprobs=lp + normal(0.4), ref_logprobs=lp + normal(3.0))
    x["rollout_logprobs"] = x["old_logprobs"] + normal(0.2)
    x["advantages"] = torch.randn(B, generator=g, dtype=torch.float64)
    x["mask"] = torch.rand(B, L, generator=g) > 0.2
    x["mask"][:, 0] = True
    return x


def _peer(x, correction, token_level, global_totals, loss_type="ppo", dual_clip=None, kl=None, kl_coef=0.0):
    """OpenRLHF's actor loss as ppo_actor.py forms it: PolicyLoss, plus kl_coef ×
    aggregate_loss(compute_approx_kl) with the same batch info; (loss, grad, metrics)."""
    loss_mod, utils = import_openrlhf_models()
    level, mode, gating, thr = correction
    fn = loss_mod.PolicyLoss(
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        dual_clip=dual_clip,
        token_level_loss=token_level,
        policy_loss_type=loss_type,
        is_correction_level=level,
        is_correction_mode=mode,
        is_correction_gating=gating,
        is_correction_threshold=thr if len(thr) == 2 else (0.0, thr[0]),
    )
    m = x["mask"].double()
    info = _batch_info(x) if global_totals else {}
    lp = x["logprobs"].clone().requires_grad_(True)
    adv = x["advantages"][:, None].expand_as(lp)
    loss, clip_ratio, ppo_kl, vllm_kl, filt = fn(
        lp, x["old_logprobs"], adv, action_mask=m, rollout_log_probs=x["rollout_logprobs"], **info
    )
    if kl is not None:
        k = utils.compute_approx_kl(lp, x["ref_logprobs"], kl_estimator=kl)
        loss = loss + kl_coef * loss_mod.aggregate_loss(k, m, token_level_loss=token_level, **info)
    loss.backward()
    return loss.detach(), lp.grad, dict(clip_ratio=clip_ratio, ppo_kl=ppo_kl, is_filter_ratio=filt)


def _batch_info(x):
    """Global totals of a (pretend) larger step: 1.5× this call's tokens and sequences, dp 2."""
    m = x["mask"]
    return dict(dp_size=2, batch_num_tokens=1.5 * float(m.sum()), global_batch_size=1.5 * m.shape[0])


def _ours(x, backend, correction, token_level, global_totals, dtype=torch.float64, **kw):
    level, mode, gating, thr = correction
    rc = RolloutCorrection.from_openrlhf(level, mode, gating, thr)
    info = {}
    if global_totals:
        b = _batch_info(x)
        info = dict(
            dp_size=b["dp_size"], global_num_tokens=b["batch_num_tokens"], global_num_seqs=b["global_batch_size"]
        )
    lp = x["logprobs"].to(dtype).detach().requires_grad_(True)
    roll = x["rollout_logprobs"].to(dtype)
    loss, met = rk.policy_loss(
        lp,
        x["old_logprobs"].to(dtype),
        x["advantages"],
        x["mask"],
        preset="openrlhf",
        clip_high=0.28,
        agg="token-mean" if token_level else "seq-mean-token-mean",
        rollout_correction=rc,
        rollout_logprobs=roll if rc is not None else None,
        backend=backend,
        **info,
        **kw,
    )
    loss.backward()
    return loss.detach().double(), lp.grad.double(), met


TOL = {"reference": dict(rtol=1e-6, atol=1e-8), "cpu": dict(rtol=2e-5, atol=1e-6)}


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("correction", CORRECTIONS, ids=IDS)
@pytest.mark.parametrize("token_level,global_totals", AGGS)
def test_ppo_is_correction_matches_openrlhf(backend, correction, token_level, global_totals):
    """PolicyLoss("ppo") with every IS correction and aggregation: loss, gradient, clip ratio,
    ppo_kl and (token level) is_filter_ratio."""
    x = _case()
    peer, peer_grad, pm = _peer(x, correction, token_level, global_totals)
    dtype = torch.float64 if backend == "reference" else torch.float32
    loss, grad, met = _ours(x, backend, correction, token_level, global_totals, dtype)
    tol = TOL[backend]
    torch.testing.assert_close(loss, peer.double(), **tol)
    torch.testing.assert_close(grad, peer_grad.double(), **tol)
    torch.testing.assert_close(met.pg_clipfrac.double(), pm["clip_ratio"].double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(met.ppo_kl.double(), pm["ppo_kl"].double(), **tol)
    level = correction[0]
    if level == "token":
        torch.testing.assert_close(met.is_masked_frac.double(), pm["is_filter_ratio"].double(), rtol=1e-6, atol=1e-7)
    elif level == "off":
        assert pm["is_filter_ratio"] is None and float(met.is_masked_frac) == 0.0


@pytest.mark.parametrize("correction", CORRECTIONS[1:], ids=IDS[1:])
def test_correction_rejects_something(correction):
    """The thresholds above are live on these inputs: each correction changes the loss (so the
    comparisons test the bound, not a no-op)."""
    x = _case()
    off = _ours(x, "reference", CORRECTIONS[0], True, False)
    on = _ours(x, "reference", correction, True, False)
    assert not torch.allclose(off[1], on[1])
    if correction[1] == "mask":
        assert 0.0 < float(on[2].is_masked_frac) < 1.0


@pytest.mark.parametrize("correction", [c for c in CORRECTIONS if c[0] == "seq"], ids=lambda c: "-".join(c[:3]))
def test_seq_gate_filters_whole_sequences(correction):
    """At sequence level OpenRLHF's is_filter_ratio is the fraction of sequences gated out;
    ours (is_masked_frac) is the fraction of valid tokens: the same gate, counted per token."""
    x = _case()
    _, _, pm = _peer(x, correction, True, False)
    _, grad, met = _ours(x, "reference", correction, True, False)
    dropped = (grad == 0).all(-1) & x["mask"].any(-1)  # a gated-out sequence has no gradient
    m = x["mask"].double()
    torch.testing.assert_close(float(dropped.double().mean()), float(pm["is_filter_ratio"]), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        float(met.is_masked_frac), float((m * dropped[:, None]).sum() / m.sum()), rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("token_level,global_totals", AGGS[:3])
def test_ppo_dual_clip_matches_openrlhf(backend, dual_clip, token_level, global_totals):
    x = _case(seed=1)
    corr = ("token", "mask", "ratio", (0.5, 5.0))
    peer, peer_grad, pm = _peer(x, corr, token_level, global_totals, dual_clip=dual_clip)
    dtype = torch.float64 if backend == "reference" else torch.float32
    loss, grad, met = _ours(x, backend, corr, token_level, global_totals, dtype, clip_ratio_c=dual_clip)
    torch.testing.assert_close(loss, peer.double(), **TOL[backend])
    torch.testing.assert_close(grad, peer_grad.double(), **TOL[backend])
    torch.testing.assert_close(met.pg_clipfrac.double(), pm["clip_ratio"].double(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("level", ["off", "token", "seq"])
@pytest.mark.parametrize("token_level,global_totals", [(False, False), (False, True)])
def test_gspo_matches_openrlhf(backend, level, token_level, global_totals):
    """PolicyLoss("gspo"): the per-sample mean is forced (the preset picks it for gspo); with
    any correction level OpenRLHF weights nothing and takes the sequence ratio against the
    rollout log-probs: ours with ``old_logprobs=rollout_logprobs``, no correction. ppo_kl is
    OpenRLHF's logp − old either way."""
    x = _case()
    corr = (level, "mask", "ratio", (0.5, 5.0))
    peer, peer_grad, pm = _peer(x, corr, token_level, global_totals, loss_type="gspo")
    dtype = torch.float64 if backend == "reference" else torch.float32
    y = dict(x, old_logprobs=x["rollout_logprobs"]) if level != "off" else x
    loss, grad, met = _ours(y, backend, CORRECTIONS[0], False, global_totals, dtype, loss_type="gspo")
    torch.testing.assert_close(loss, peer.double(), **TOL[backend])
    torch.testing.assert_close(grad, peer_grad.double(), **TOL[backend])
    torch.testing.assert_close(met.pg_clipfrac.double(), pm["clip_ratio"].double(), rtol=1e-6, atol=1e-7)
    if level == "off":
        torch.testing.assert_close(met.ppo_kl.double(), pm["ppo_kl"].double(), **TOL[backend])
    assert resolve_policy_loss_options("openrlhf", loss_type="gspo").agg == "seq-mean-token-mean"
    assert resolve_policy_loss_options("openrlhf", loss_type="gspo", agg="token-mean").agg == "token-mean"


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("kl", ["k1", "k2", "k3"])
@pytest.mark.parametrize("token_level,global_totals", AGGS[:3])
def test_kl_loss_matches_openrlhf(backend, kl, token_level, global_totals):
    """The actor's KL loss (--algo.kl.use_loss): compute_approx_kl (every estimate clamped to
    ±10, k3's input x >= −10) aggregated like the policy loss, times kl_coef, with an ICEPOP
    correction on."""
    x = _case()
    corr = ("token", "mask", "ratio", (0.8, 1.2))
    peer, peer_grad, _ = _peer(x, corr, token_level, global_totals, kl=kl, kl_coef=0.05)
    dtype = torch.float64 if backend == "reference" else torch.float32
    loss, grad, met = _ours(
        x,
        backend,
        corr,
        token_level,
        global_totals,
        dtype,
        kl=kl,
        kl_coef=0.05,
        ref_logprobs=x["ref_logprobs"].to(dtype),
    )
    torch.testing.assert_close(loss, peer.double(), **TOL[backend])
    torch.testing.assert_close(grad, peer_grad.double(), **TOL[backend])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("correction", CORRECTIONS[1:], ids=IDS[1:])
def test_all_rejected_and_all_masked_give_zeros(backend, correction):
    """Every token rejected: the loss is OpenRLHF's 0 (the tokens stay counted, weight 0) with
    a zero gradient; every token masked: zeros, never NaN (OpenRLHF divides 0 by 0 there)."""
    level, mode, gating, thr = correction
    x = _case()
    x["old_logprobs"] = x["old_logprobs"].clamp(max=-0.01)
    x["rollout_logprobs"] = x["old_logprobs"] - 1.0  # every ratio e, every divergence > 0
    tight = {"ratio": (1e6, 2e6), "binary_kl": (1e-12,), "tv": (1e-12,)}[gating]
    corr = (level, mode, gating, tight)
    dtype = torch.float64 if backend == "reference" else torch.float32
    if mode == "mask":
        peer, peer_grad, _ = _peer(x, corr, True, False)
        loss, grad, met = _ours(x, backend, corr, True, False, dtype)
        assert float(loss) == 0.0 and float(peer) == 0.0
        assert bool((grad == 0).all()) and bool((peer_grad == 0).all())
        assert float(met.is_masked_frac) == 1.0 and float(met.num_tokens) == float(x["mask"].sum())
    y = dict(x, mask=torch.zeros_like(x["mask"]))
    for token_level in (True, False):
        loss, grad, met = _ours(y, backend, corr, token_level, False, dtype)
        assert float(loss) == 0.0 and bool((grad == 0).all())
        for name, v in met._asdict().items():
            assert torch.isfinite(v).all(), name
            assert float(v) == 0.0 or name == "is_batch_norm_factor", name


# Every is_mode / is_gate / level combination from_openrlhf forms (clip ratio: clamp; mask
# ratio: icepop, or decoupled without a lower bound; the divergences: gate).
FAST_KINDS = [
    ("token", "mask", "ratio", (1.2,)),
    ("token", "mask", "ratio", (0.8, 1.2)),
    ("token", "clip", "ratio", (0.8, 1.2)),
    ("token", "mask", "binary_kl", (0.03,)),
    ("token", "mask", "tv", (0.0, 0.1)),
    ("seq", "mask", "ratio", (0.96, 1.05)),
    ("seq", "mask", "binary_kl", (0.012,)),
    ("seq", "mask", "tv", (0.045,)),
]


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("corr", FAST_KINDS, ids=lambda c: "-".join(map(str, c[:3])))
def test_fast_backends_against_reference(backend, device, corr):
    """The fp64 reference against each fast backend (|fast − ref64| <= 2·|same − ref64| +
    atol): the loss, its gradient, is_masked_frac and the rollout_correction token outputs
    (IS weights, keep), on a batch with an all-masked row and an all-rejected row; an
    all-masked batch gives zeros, never NaN."""
    x = _case(B=4, L=9)
    x["mask"][2] = False
    x["old_logprobs"][3] = x["old_logprobs"][3].clamp(-1.0, -0.01)
    x["rollout_logprobs"][3] = x["old_logprobs"][3] - 1.0  # every bound rejects row 3
    rc = RolloutCorrection.from_openrlhf(*corr)
    r64 = _run_dev(x, "reference", "cpu", torch.float64, rc)
    same = _run_dev(x, "reference", "cpu", torch.float32, rc)
    fast = _run_dev(x, backend, device, torch.float32, rc)
    for a, r, s in zip(fast, r64, same):
        atol = 1e-5 * (1.0 + r.abs().max().item())
        assert bool(((a.cpu() - r).abs() <= 2 * (s - r).abs() + atol).all()), corr
    assert 0.0 < float(r64[2]) < 1.0, corr  # the bound is live
    assert bool((r64[3][3] == 0).all()) or corr[1] == "clip", corr  # row 3's weights: 0
    y = dict(x, mask=torch.zeros_like(x["mask"]))
    loss, grad, frac, w, keep = _run_dev(y, backend, device, torch.float32, rc)
    for v in (loss, grad, frac, w, keep):
        assert bool((v == 0).all()), corr


def _run_dev(x, backend, device, dtype, rc):
    """(loss, its gradient, is_masked_frac, the IS weights, keep) of ``backend``."""
    lp = x["logprobs"].to(device, dtype).detach().requires_grad_(True)
    old, roll, mask = x["old_logprobs"].to(device, dtype), x["rollout_logprobs"].to(device, dtype), x["mask"].to(device)
    loss, met = rk.policy_loss(
        lp,
        old,
        x["advantages"].to(device),
        mask,
        rollout_logprobs=roll,
        preset="openrlhf",
        rollout_correction=rc,
        backend=backend,
    )
    loss.backward()
    w, keep, _ = rk.rollout_correction(rc, old, roll, mask, backend=backend)
    return tuple(t.detach().double().cpu() for t in (loss, lp.grad, met.is_masked_frac, w, keep))


def test_from_openrlhf_validation():
    """OpenRLHF's constructor checks, raised naming the argument; the new modes' own checks."""
    assert RolloutCorrection.from_openrlhf("off") is None
    with pytest.raises(ValueError, match="is_correction_level"):
        RolloutCorrection.from_openrlhf("sequence")
    with pytest.raises(ValueError, match="is_correction_mode"):
        RolloutCorrection.from_openrlhf("seq", "clip")
    with pytest.raises(ValueError, match="is_correction_mode"):
        RolloutCorrection.from_openrlhf("token", "clip", "tv", (0.1,))
    with pytest.raises(ValueError, match="is_correction_threshold"):
        RolloutCorrection.from_openrlhf("token", "mask", "binary_kl", (0.5, 5.0))
    with pytest.raises(ValueError, match="is_correction_threshold"):
        RolloutCorrection.from_openrlhf("token", "mask", "ratio", (0.1, 0.2, 0.3))
    with pytest.raises(ValueError, match="is_correction_gating"):
        RolloutCorrection.from_openrlhf("token", "mask", "kl")
    assert RolloutCorrection.from_openrlhf("token", "mask", "ratio", (0.5, 2.0)).mode == "icepop"
    assert RolloutCorrection.from_openrlhf("token", "mask", "ratio", (2.0,)).mode == "decoupled"
    with pytest.raises(ValueError, match="is_mode"):
        RolloutCorrection(is_level="sequence", is_mode="clamp")
    with pytest.raises(ValueError, match="is_gate"):
        RolloutCorrection(is_level="token", is_mode="icepop", is_threshold_low=0.5, is_gate="tv")
    with pytest.raises(ValueError, match="is_gate"):
        RolloutCorrection(is_level="token", is_mode="gate", is_gate="kl")
    with pytest.raises(ValueError, match="is_batch_normalize"):
        RolloutCorrection(is_level="token", is_mode="gate", is_batch_normalize=True)
    with pytest.raises(ValueError, match="is_threshold_low"):
        RolloutCorrection(is_level="token", is_mode="icepop", is_threshold_low=-1.0)
    # a divergence's lower bound may be 0 or negative
    assert RolloutCorrection(is_level="token", is_mode="gate", is_gate="tv", is_threshold_low=0.0).low == 0.0
    assert RolloutCorrection(is_level="token", is_mode="gate", is_gate="tv").low == float("-inf")
