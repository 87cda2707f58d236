"""The OpenRLHF drop-ins against OpenRLHF 0.11.2's own functions on the same random inputs:
``PolicyLoss`` (every ``policy_loss_type``, every importance-sampling correction, both
aggregations with and without the global totals, the dual clip: the five outputs and the
gradient), ``compute_approx_kl`` (every estimator, ``unbiased_gradient``), and
``log_probs_from_logits`` / ``compute_entropy`` (fp32 and bf16 logits, temperature, the in-place
scaling); their errors name OpenRLHF's arguments."""

from __future__ import annotations

import pytest
import torch

from rlvr_kernels.integrations import openrlhf as ours
from rlvr_kernels.testing.peers import import_openrlhf_models

peer_loss, peer_utils = import_openrlhf_models()

# (is_correction_level, _mode, _gating, _threshold) as OpenRLHF's constructor takes them
CORRECTIONS = [
    ("off", "mask", "ratio", (0.5, 5.0)),
    ("token", "clip", "ratio", (0.8, 1.2)),
    ("token", "clip", "ratio", (0.0, 1.2)),
    ("token", "mask", "ratio", (0.8, 1.2)),
    ("token", "mask", "ratio", (0.0, 1.2)),
    ("seq", "mask", "ratio", (0.96, 1.05)),
    ("token", "mask", "binary_kl", (0.0, 0.03)),
    ("token", "mask", "tv", (0.0, 0.1)),
    ("seq", "mask", "binary_kl", (0.0, 0.012)),
    ("seq", "mask", "tv", (-1.0, 0.045)),
]
IDS = ["-".join(map(str, c)) for c in CORRECTIONS]


def batch(seed=0, B=6, T=13, dtype=torch.float32):
    """Per-token advantages (as OpenRLHF's experience), a ragged action mask with no empty row."""
    g = torch.Generator().manual_seed(seed)
    lp = -3 * torch.rand(B, T, generator=g, dtype=dtype)
    old = lp + 0.4 * torch.randn(B, T, generator=g, dtype=dtype)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[:, 0] = 1.0
    return dict(
        log_probs=lp,
        old_log_probs=old,
        rollout_log_probs=old + 0.2 * torch.randn(B, T, generator=g, dtype=dtype),
        advantages=torch.randn(B, 1, generator=g, dtype=dtype).expand(B, T).contiguous(),
        action_mask=mask,
        base=lp + torch.randn(B, T, generator=g, dtype=dtype),
    )


def run_loss(cls, x, totals, **ctor):
    fn = cls(**ctor)
    lp = x["log_probs"].clone().requires_grad_(True)
    kw = dict(dp_size=2, batch_num_tokens=1.5 * float(x["action_mask"].sum()), global_batch_size=9.0) if totals else {}
    out = fn(lp, x["old_log_probs"], x["advantages"], x["action_mask"], x["rollout_log_probs"], **kw)
    out[0].backward()
    return out, lp.grad


def assert_outputs_match(a, b, ga, gb):
    for name, u, v in zip(("loss", "clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio"), a, b):
        if v is None:
            assert u is None, name
            continue
        torch.testing.assert_close(u.detach().float(), v.detach().float(), rtol=2e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(ga, gb, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("correction", CORRECTIONS, ids=IDS)
@pytest.mark.parametrize("token_level_loss", [True, False])
@pytest.mark.parametrize("totals", [False, True])
def test_policy_loss_ppo_matches_openrlhf(correction, token_level_loss, totals):
    x = batch()
    level, mode, gating, thr = correction
    ctor = dict(
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        token_level_loss=token_level_loss,
        is_correction_level=level,
        is_correction_mode=mode,
        is_correction_gating=gating,
        is_correction_threshold=thr,
    )
    peer, peer_grad = run_loss(peer_loss.PolicyLoss, x, totals, **ctor)
    mine, grad = run_loss(ours.PolicyLoss, x, totals, **ctor)
    assert_outputs_match(mine, peer, grad, peer_grad)


@pytest.mark.parametrize("level", ["off", "token", "seq"])
@pytest.mark.parametrize("totals", [False, True])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_gspo_and_dual_clip_match_openrlhf(level, totals, dual_clip):
    x = batch(seed=1)
    # token-level advantages that vary along a row (OpenRLHF's returns with a KL reward): GSPO's
    # gradient goes through the row's mean log-ratio
    x["advantages"] = x["advantages"] + 0.5 * torch.randn(
        x["advantages"].shape, generator=torch.Generator().manual_seed(9)
    )
    for loss_type in ("gspo", "ppo"):
        ctor = dict(clip_eps_high=0.28, dual_clip=dual_clip, policy_loss_type=loss_type, is_correction_level=level)
        peer, peer_grad = run_loss(peer_loss.PolicyLoss, x, totals, **ctor)
        mine, grad = run_loss(ours.PolicyLoss, x, totals, **ctor)
        assert_outputs_match(mine, peer, grad, peer_grad)


def test_policy_loss_is_a_module_with_openrlhf_attributes():
    fn = ours.PolicyLoss(policy_loss_type="gspo", token_level_loss=True)
    assert isinstance(fn, torch.nn.Module) and fn.token_level_loss is False  # GSPO: per-sample mean
    assert ours.PolicyLoss().clip_eps_high == peer_loss.PolicyLoss().clip_eps_high


def test_policy_loss_errors_name_openrlhf_arguments():
    with pytest.raises(ValueError, match="policy_loss_type"):
        ours.PolicyLoss(policy_loss_type="cispo")
    with pytest.raises(ValueError, match="dual_clip"):
        ours.PolicyLoss(dual_clip=0.5)
    with pytest.raises(ValueError, match="is_correction_mode"):
        ours.PolicyLoss(is_correction_level="seq", is_correction_mode="clip")
    with pytest.raises(ValueError, match="is_correction_threshold"):
        ours.PolicyLoss(is_correction_level="token", is_correction_gating="tv", is_correction_threshold=(0.5, 5.0))
    x = batch()
    fn = ours.PolicyLoss(is_correction_level="token")
    with pytest.raises(ValueError, match="rollout_log_probs"):
        fn(x["log_probs"], x["old_log_probs"], x["advantages"], x["action_mask"])
    with pytest.raises(ValueError, match="action_mask"):
        ours.PolicyLoss()(x["log_probs"], x["old_log_probs"], x["advantages"])
    with pytest.raises(ValueError, match=r"\bold_log_probs\b"):
        ours.PolicyLoss()(x["log_probs"], x["old_log_probs"][:, :-1], x["advantages"], x["action_mask"])


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("unbiased,with_old", [(False, False), (True, False), (True, True)])
def test_compute_approx_kl_matches_openrlhf(estimator, unbiased, with_old):
    x = batch(seed=2)
    base = x["base"].clone()
    base[0, :3] = torch.tensor([40.0, -40.0, 12.0])  # every clamp live
    old = x["old_log_probs"] if with_old else None
    out = []
    for fn in (peer_utils.compute_approx_kl, ours.compute_approx_kl):
        lp = x["log_probs"].clone().requires_grad_(True)
        kl = fn(lp, base, log_probs_old=old, kl_estimator=estimator, unbiased_gradient=unbiased)
        (kl * torch.linspace(0.5, 1.5, kl.numel()).view_as(kl)).sum().backward()
        out.append((kl.detach(), lp.grad))
    assert out[1][0].dtype == out[0][0].dtype == torch.float32
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="kl_estimator"):
        ours.compute_approx_kl(x["log_probs"], base, kl_estimator="k4")


def _peer_entropy(logits):
    # OpenRLHF wraps compute_entropy in torch.compile; its eager function is the same formula.
    fn = getattr(peer_utils.compute_entropy, "_torchdynamo_orig_callable", peer_utils.compute_entropy)
    return fn(logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_entropy_match_openrlhf(dtype, temperature):
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(3, 7, 131, generator=g)).to(dtype)
    labels = torch.randint(0, 131, (3, 7), generator=g)
    a, b = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    # OpenRLHF scales the logits in place: on a non-leaf view, as its Actor's logits are.
    pa = peer_utils.log_probs_from_logits(a * 1, labels, temperature=temperature)
    pb = ours.log_probs_from_logits(b * 1, labels, temperature=temperature)
    assert pb.dtype == pa.dtype == dtype and pb.shape == labels.shape
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=4e-2)
    torch.testing.assert_close(pb, pa, **tol)
    up = torch.linspace(-1, 1, pa.numel()).view_as(pa).to(dtype)
    pa.backward(up), pb.backward(up)
    torch.testing.assert_close(b.grad.float(), a.grad.float(), **tol)
    ea, eb = _peer_entropy(logits.float()), ours.compute_entropy(logits.float())
    torch.testing.assert_close(eb, ea, rtol=1e-5, atol=1e-5)
    scaled = logits.clone()
    ours.log_probs_from_logits(scaled, labels, temperature=temperature)
    torch.testing.assert_close(scaled, (logits.float() / temperature).to(dtype))  # in place, as OpenRLHF


def test_log_prob_errors_name_openrlhf_arguments():
    with pytest.raises(ValueError, match="labels"):
        ours.log_probs_from_logits(torch.randn(2, 5, 7), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises((ValueError, TypeError), match="labels"):
        ours.log_probs_from_logits(torch.randn(2, 7), torch.zeros(2))
    with pytest.raises(ValueError, match="logits"):
        ours.compute_entropy(torch.tensor(1.0))


def _params(fn, **kw):
    import inspect

    return [(p.name, p.kind, p.default) for p in inspect.signature(fn, **kw).parameters.values()]


def test_signatures_are_openrlhfs():
    """Names, order, kinds and defaults of every drop-in (Actor.forward: the function itself,
    not the original it wraps)."""
    import openrlhf.models.actor as peer_actor

    from rlvr_kernels.integrations.openrlhf.actor import make_forward

    pairs = [
        (ours.PolicyLoss.__init__, peer_loss.PolicyLoss.__init__),
        (ours.PolicyLoss.forward, peer_loss.PolicyLoss.forward),
        (ours.compute_approx_kl, peer_utils.compute_approx_kl),
        (ours.log_probs_from_logits, peer_utils.log_probs_from_logits),
    ]
    for mine, theirs in pairs:
        assert _params(mine) == _params(theirs), mine.__qualname__
    assert [p[0] for p in _params(ours.compute_entropy)] == ["logits"]
    forward = peer_actor.Actor.forward
    assert _params(make_forward(forward), follow_wrapped=False) == _params(forward)
