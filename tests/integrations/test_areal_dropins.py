"""The AReaL drop-ins against AReaL 1.0.4's own functions on the same random inputs:
``ppo_actor_loss_fn`` (token and sequence ratios, the dual clip, every rejection-sampling level,
action, metric and aggregation, padded and packed layouts, an empty mask: the loss, its
gradient and every ``stat``), ``sapo_loss_fn`` (both levels), and ``grpo_loss_fn`` (decoupled
PPO against the recomputed and the log-linear proximal log-probs, M2PO, SAPO, the distillation
term: the loss, its gradient and everything it logs to ``stats_tracker``); the errors name
AReaL's arguments."""

from __future__ import annotations

import itertools
import types

import pytest
import torch
from _backends import ALL
from areal.api.cli_args import RejectionSamplingConfig as RS
from areal.utils import functional as peer
from areal.utils import stats_tracker

from rlvr_kernels.integrations import areal as ours
from rlvr_kernels.testing.peers import import_areal_actor

peer_actor = import_areal_actor()

LENGTHS = [5, 0, 9, 3, 12, 1]  # packed: an empty sequence and a one-token one

REJECTIONS = [
    None,
    RS(),
    RS(upper=1.5, lower=0.7),
    RS(action="clamp", upper=1.5, lower=0.7),
    RS(action="clamp", upper=1.3),
    RS(metric="kl_k1", upper=0.3, lower=-0.3),
    RS(metric="kl_k2", upper=0.05),
    RS(metric="kl_k3", upper=0.05),
    RS(level="sequence", upper=1.3, lower=0.8),
    RS(level="sequence", agg="sum", upper=2.0),
    RS(level="sequence", agg="max", upper=1.5),
    RS(level="sequence", agg="max", metric="kl_k2", upper=0.2),
    RS(level="sequence", agg="mean", metric="kl_k3", upper=0.03),
    RS(level="sequence", agg="sum", metric="kl_k1", upper=0.5, lower=-0.5),
    RS(level="sequence", action="clamp", upper=1.2, lower=0.9),
]


def _rs_id(rs):
    if rs is None:
        return "no-rs"
    return f"{rs.level}-{rs.action}-{rs.metric}-{rs.agg}-{rs.lower}-{rs.upper}"


def batch(packed: bool, seed=0, dtype=torch.float64):
    """log π_θ, π_prox, π_behave (each a perturbation of the one before), token advantages, a
    ragged mask; packed: [T] with cu_seqlens, else [B, L]."""
    g = torch.Generator().manual_seed(seed)
    if packed:
        shape = (sum(LENGTHS),)
        cu = torch.tensor([0, *itertools.accumulate(LENGTHS)], dtype=torch.int32)
    else:
        shape, cu = (5, 11), None
    lp = -2 * torch.rand(shape, generator=g, dtype=dtype) - 0.1
    prox = lp + 0.3 * torch.randn(shape, generator=g, dtype=dtype)
    old = prox + 0.5 * torch.randn(shape, generator=g, dtype=dtype)
    adv = torch.randn(shape, generator=g, dtype=dtype)
    mask = torch.rand(shape, generator=g) > 0.25
    if not packed:
        mask[2] = False  # an empty row
    return lp, prox, old, adv, mask, cu


def assert_stats_match(theirs: dict, mine: dict, mask: torch.Tensor, atol: float):
    """Every stat AReaL returns, on the valid tokens (what stats_tracker reads them over)."""
    assert set(mine) == set(theirs)
    for key, a in theirs.items():
        b = mine[key]
        if not isinstance(a, torch.Tensor):
            assert b == pytest.approx(a, abs=1e-12), key
            continue
        assert b.shape == a.shape and b.dtype == a.dtype, key
        if a.dtype == torch.bool:
            assert torch.equal(a & mask, b & mask), key
        else:
            torch.testing.assert_close(torch.where(mask, b, 0), torch.where(mask, a, 0), atol=atol, rtol=0, msg=key)


def run(fn, lp, *args, **kwargs):
    x = lp.clone().requires_grad_(True)
    loss, stat = fn(x, *args, **kwargs)
    loss.backward()
    return loss.detach(), x.grad, stat


@pytest.mark.parametrize("rs", REJECTIONS, ids=_rs_id)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_ppo_actor_loss_fn_matches_areal(packed, level, rs):
    """Decoupled PPO (π_θ / π_prox, rejection on π_prox / π_behave), dual clip on half the
    seeds, asymmetric clipping: values and gradients to fp32 rounding (AReaL forms the
    rejection weights in fp32), the stats on the valid tokens."""
    for seed, c_clip in ((0, None), (1, 3.0)):
        lp, prox, old, adv, mask, cu = batch(packed, seed)
        kw = dict(
            eps_clip=0.2,
            loss_mask=mask,
            eps_clip_higher=0.28,
            c_clip=c_clip,
            rejection_sampling=rs,
            importance_sampling_level=level,
            cu_seqlens=cu,
        )
        l1, g1, s1 = run(peer.ppo_actor_loss_fn, lp, prox, old, adv, **kw)
        l2, g2, s2 = run(ours.ppo_actor_loss_fn, lp, prox, old, adv, **kw)
        assert l2.dtype == l1.dtype
        torch.testing.assert_close(l2, l1, atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(g2, g1, atol=1e-7, rtol=1e-6)
        assert_stats_match(s1, s2, mask, atol=1e-6)


def test_rejection_keeps_the_pre_rejection_count():
    """Rejected tokens leave the numerator only: the loss is Σ_kept / N_valid, the gradient
    of a kept token the same as without rejection."""
    lp, prox, old, adv, mask, cu = batch(packed=True, seed=3)
    kw = dict(eps_clip=0.2, loss_mask=mask, cu_seqlens=cu)
    rs = RS(upper=1.2, lower=0.8)
    _, g_all, _ = run(ours.ppo_actor_loss_fn, lp, prox, prox, adv, **kw)  # π_prox = π_behave: w = 1
    _, g_rs, stat = run(ours.ppo_actor_loss_fn, lp, prox, old, adv, rejection_sampling=rs, **kw)
    kept = stat["behave_mask"]
    assert 0 < kept.sum() < mask.sum()
    torch.testing.assert_close(g_rs[kept], g_all[kept] * stat["behave_imp_weight"][kept])
    assert torch.all(g_rs[mask & ~kept] == 0)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_empty_mask_gives_zero(packed):
    lp, prox, old, adv, mask, cu = batch(packed)
    mask = torch.zeros_like(mask)
    for level in ("token", "sequence"):
        kw = dict(eps_clip=0.2, loss_mask=mask, importance_sampling_level=level, cu_seqlens=cu)
        l1, g1, _ = run(peer.ppo_actor_loss_fn, lp, prox, old, adv, rejection_sampling=RS(), **kw)
        l2, g2, _ = run(ours.ppo_actor_loss_fn, lp, prox, old, adv, rejection_sampling=RS(), **kw)
        assert float(l2) == float(l1) == 0.0
        assert torch.equal(g2, g1)


@pytest.mark.parametrize("taus", [(1.0, 1.05), (3.0, 0.5)])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_sapo_loss_fn_matches_areal(packed, level, taus):
    lp, _, old, adv, mask, cu = batch(packed, seed=4)
    args = (old, adv, *taus, mask, level, cu)
    l1, g1, s1 = run(peer.sapo_loss_fn, lp, *args)
    l2, g2, s2 = run(ours.sapo_loss_fn, lp, *args)
    torch.testing.assert_close(l2, l1, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(g2, g1, atol=1e-12, rtol=1e-10)
    assert_stats_match(s1, s2, mask, atol=1e-12)


# ---------------------------------------------------------------------------------------
# grpo_loss_fn: AReaL's loss_fn of engine.train_batch
# ---------------------------------------------------------------------------------------


def input_data(seed=0, versions=False, teacher=False):
    """A packed micro-batch as ``FSDPEngine`` hands it to ``loss_fn`` (fp32, as AReaL logs)."""
    lp, prox, old, adv, mask, cu = batch(packed=True, seed=seed, dtype=torch.float32)
    data = dict(logprobs=old, advantages=adv, loss_mask=mask.int(), prox_logp=prox, cu_seqlens=cu)
    if versions:
        g = torch.Generator().manual_seed(seed + 100)
        data["versions"] = torch.randint(3, 6, lp.shape, generator=g)
        data["versions"][~mask] = -1
        data["prox_logp"] = None
    if teacher:
        data["teacher_logp"] = lp + 0.2
    return lp, data


GRPO_CASES = {
    "decoupled": dict(use_decoupled_loss=True, c_clip=3.0),
    "decoupled-rs-token": dict(use_decoupled_loss=True, rejection_sampling=RS(upper=1.5, lower=0.6)),
    "decoupled-rs-seq-gspo": dict(
        use_decoupled_loss=True,
        rejection_sampling=RS(level="sequence", action="clamp", upper=1.2),
        importance_sampling_level="sequence",
    ),
    "loglinear": dict(use_decoupled_loss=True, prox_logp_method="loglinear", current_version=6),
    "m2po": dict(use_decoupled_loss=True, m2_threshold=0.04),
    "sapo": dict(use_sapo_loss=True, sapo_tau_pos=1.0, sapo_tau_neg=1.05),
    "sapo-seq": dict(use_sapo_loss=True, importance_sampling_level="sequence"),
    "distill": dict(use_decoupled_loss=True, teacher=True),
}


@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_grpo_loss_fn_matches_areal(case):
    """The loss, its gradient and every statistic AReaL's ``grpo_loss_fn`` logs."""
    kw = dict(GRPO_CASES[case])
    teacher = kw.pop("teacher", False)
    c_clip = kw.pop("c_clip", None)
    lp, data = input_data(seed=5, versions=kw.get("prox_logp_method") == "loglinear", teacher=teacher)
    entropy = torch.rand_like(lp)
    vmin, vmax = -torch.rand_like(lp), torch.rand_like(lp)
    results = []
    for fn in (peer_actor.grpo_loss_fn, ours.grpo_loss_fn):
        stats_tracker.export_all()  # reset
        x = lp.clone().requires_grad_(True)
        loss = fn(x, entropy, dict(data), 0.2, 0.28, c_clip, **kw, vocab_min_logits=vmin, vocab_max_logits=vmax)
        loss.backward()
        results.append((loss.detach(), x.grad, stats_tracker.export_all()))
    (l1, g1, s1), (l2, g2, s2) = results
    torch.testing.assert_close(l2, l1, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g2, g1, atol=1e-7, rtol=1e-5)
    assert set(s2) == set(s1)
    for key in s1:
        assert s2[key] == pytest.approx(s1[key], rel=1e-5, abs=1e-6), key


def test_signatures_are_areal():
    """The parameter names and defaults of AReaL's functions."""
    import inspect

    for mine, theirs in (
        (ours.grpo_loss_fn, peer_actor.grpo_loss_fn),
        (ours.ppo_actor_loss_fn, peer.ppo_actor_loss_fn),
        (ours.sapo_loss_fn, peer.sapo_loss_fn),
    ):
        a, b = inspect.signature(mine).parameters, inspect.signature(theirs).parameters
        assert list(a) == list(b), mine.__name__
        assert {k: p.default for k, p in a.items()} == {k: p.default for k, p in b.items()}, mine.__name__


def test_sapo_with_decoupled_loss_raises_as_areal():
    lp, data = input_data()
    with pytest.raises(ValueError, match="use_decoupled_loss"):
        ours.grpo_loss_fn(lp, torch.zeros_like(lp), data, 0.2, None, None, use_sapo_loss=True, use_decoupled_loss=True)


# ---------------------------------------------------------------------------------------
# errors name AReaL's arguments
# ---------------------------------------------------------------------------------------


def test_errors_name_areal_arguments():
    lp, prox, old, adv, mask, cu = batch(packed=True)
    kw = dict(eps_clip=0.2, loss_mask=mask, cu_seqlens=cu)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        ours.ppo_actor_loss_fn(lp, prox, old, adv, importance_sampling_level="seq", **kw)
    with pytest.raises(ValueError, match="c_clip"):
        ours.ppo_actor_loss_fn(lp, prox, old, adv, c_clip=1.0, **kw)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ours.ppo_actor_loss_fn(lp, prox, old, adv, 0.2, mask, importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="cu_seqlens"):
        ours.ppo_actor_loss_fn(lp, prox, old, adv, 0.2, mask, rejection_sampling=RS(level="sequence"))
    with pytest.raises(ValueError, match="eps_clip"):
        ours.ppo_actor_loss_fn(lp, prox, old, adv, eps_clip=1.5, loss_mask=mask, cu_seqlens=cu)
    with pytest.raises(ValueError, match="proximal_logprobs"):
        ours.ppo_actor_loss_fn(lp, prox[:-1], old, adv, **kw)
    with pytest.raises(ValueError, match="loss_mask"):
        ours.ppo_actor_loss_fn(lp, prox, old, adv, eps_clip=0.2, loss_mask=mask[:-1], cu_seqlens=cu)
    bad = types.SimpleNamespace(level="token", action="mask", metric="kl_k4", agg="mean", upper=1.0, lower=None)
    with pytest.raises(ValueError, match="rejection_sampling.metric"):
        ours.ppo_actor_loss_fn(lp, prox, old, adv, rejection_sampling=bad, **kw)
    with pytest.raises(ValueError, match="tau_pos"):
        ours.sapo_loss_fn(lp, old, adv, 0.0, 1.0, mask, "token", cu)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        ours.sapo_loss_fn(lp, old, adv, 1.0, 1.0, mask, "tokens", cu)


@pytest.mark.parametrize("backend,device", ALL)
def test_every_backend(backend, device):
    """The drop-ins on each backend (``use_backend``): GSPO with sequence rejection, the dual
    clip and token PPO with clamped weights, and SAPO, against AReaL's."""
    lp, prox, old, adv, mask, cu = (t if t is None else t.to(device) for t in batch(packed=True, seed=7))
    cases = [
        (peer.ppo_actor_loss_fn, ours.ppo_actor_loss_fn, (prox, old, adv), dict(
            eps_clip=0.2, loss_mask=mask, c_clip=3.0, rejection_sampling=RS(level="sequence", upper=1.4, lower=0.7),
            importance_sampling_level="sequence", cu_seqlens=cu)),
        (peer.ppo_actor_loss_fn, ours.ppo_actor_loss_fn, (prox, old, adv), dict(
            eps_clip=0.2, loss_mask=mask, eps_clip_higher=0.3, rejection_sampling=RS(action="clamp", upper=1.3),
            cu_seqlens=cu)),
        (peer.sapo_loss_fn, ours.sapo_loss_fn, (old, adv, 1.0, 1.05, mask, "token", cu), {}),
    ]  # fmt: skip
    for theirs, mine, args, kw in cases:
        l1, g1, _ = run(theirs, lp, *args, **kw)
        with ours.use_backend(backend):
            l2, g2, _ = run(mine, lp, *args, **kw)
        torch.testing.assert_close(l2, l1, atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(g2, g1, atol=1e-7, rtol=1e-6)


# ---------------------------------------------------------------------------------------
# gather_logprobs / gather_logprobs_entropy: the engine's logits path
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_matches_areal(dtype, temperature):
    """AReaL's functions eager (it wraps the per-chunk math in torch.compile: the same numbers);
    log-probs, entropies and the logits' gradient of a loss that reads both."""
    from areal.utils.functional import vocab_parallel as vp

    eager = {n: getattr(vp, n)._torchdynamo_orig_callable for n in ("_gather_logprobs", "_gather_logprobs_entropy")}
    g = torch.Generator().manual_seed(8)
    logits = (3 * torch.randn(2, 19, 503, generator=g)).to(dtype)
    labels = torch.randint(0, 503, (2, 19), generator=g)
    results = []
    for entropy_fn, logp_fn in (
        (vp.gather_logprobs_entropy, vp.gather_logprobs),
        (ours.gather_logprobs_entropy, ours.gather_logprobs),
    ):
        x = logits.clone().requires_grad_(True)
        saved = {n: getattr(vp, n) for n in eager}
        try:
            for n, f in eager.items():
                setattr(vp, n, f)
            logp, ent = entropy_fn(x, labels, temperature)
            only = logp_fn(logits, labels, temperature=temperature)
        finally:
            for n, f in saved.items():
                setattr(vp, n, f)
        (logp.sum() + 0.3 * ent.sum()).backward()
        results.append((logp, ent, only, x.grad))
    for a, b in zip(*results):
        assert b.dtype == a.dtype
        torch.testing.assert_close(b.float(), a.float(), atol=5e-6, rtol=1e-5)


def test_gather_refuses_a_vocabulary_parallel_group(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)  # a 2-rank tp_group
    with pytest.raises(NotImplementedError, match="tp_group"):
        ours.gather_logprobs(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), tp_group=object())
