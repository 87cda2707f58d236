"""``integrations.openrlhf.apply()`` inside OpenRLHF 0.11.2's own code: its ``Actor`` around a
tiny Qwen2 built from a config (no download), padded and packed (``packing_samples``, the
``flash_attn.bert_padding`` stand-ins of rlvr_kernels.testing.peers), at a temperature: the
logit-free forward gives stock's action log-probs, entropy and parameter gradients of the
actor loss (PolicyLoss + KL loss + entropy bonus, as ``ActorPPOTrainer.training_step`` forms
it); the names OpenRLHF looks up are ours while applied and the identical originals after
``unapply()``; version gate, strictness and call counting."""

from __future__ import annotations

import pytest
import torch
from _openrlhf import rollout, tiny_qwen

from rlvr_kernels.integrations import PatchError, call_counts, reset_call_counts, set_counting
from rlvr_kernels.integrations import openrlhf as ours
from rlvr_kernels.testing.peers import import_openrlhf_models

peer_loss, peer_utils = import_openrlhf_models()
import openrlhf.models as peer_models  # noqa: E402
import openrlhf.models.actor as peer_actor  # noqa: E402


@pytest.fixture(autouse=True)
def _unapplied():
    ours.unapply()
    yield
    ours.unapply()
    set_counting(False)


def actor_step(model, x, packing, temperature, entropy_coef=0.01):
    """Actor.forward + ppo_actor's loss (PolicyLoss with an ICEPOP correction, k3 KL loss,
    entropy bonus) + backward: (action log-probs, entropy, loss, {param: grad})."""
    actor = peer_actor.Actor(model, temperature=temperature)
    actor.packing_samples = packing
    model.zero_grad(set_to_none=True)
    logp, output = actor(
        x["sequences"],
        x["action_mask"],
        attention_mask=x["attention_mask"],
        return_output=True,
        return_entropy=True,
    )
    m = x["action_mask"]
    loss_fn = peer_models.PolicyLoss(clip_eps_high=0.28, is_correction_level="token", is_correction_threshold=(0.5, 2))
    adv = torch.randn(m.shape, generator=torch.Generator().manual_seed(5))
    loss, *_ = loss_fn(logp, x["old"], adv, action_mask=m, rollout_log_probs=x["old"] - 0.1)
    kl = peer_utils.compute_approx_kl(logp, x["ref"], kl_estimator="k3")
    loss = loss + 0.1 * peer_loss.aggregate_loss(kl, m)
    entropy = output.entropy[:, -m.shape[1] :]
    loss = loss - entropy_coef * peer_loss.aggregate_loss(entropy, m)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), output.entropy.detach(), loss.detach(), grads


@pytest.mark.parametrize("packing,rows_only", [(False, True), (False, False), (True, True)])
@pytest.mark.parametrize("temperature,tie", [(1.0, False), (0.7, True)])
def test_logit_free_actor_step_matches_stock(packing, rows_only, temperature, tie):
    """The action log-probs, the loss and every gradient are stock's; the entropy too, at the
    action tokens (``action_rows_only``: 0 elsewhere) or everywhere (``False``, and packed)."""
    x = rollout()
    stock = actor_step(tiny_qwen(tie), x, packing, temperature)
    ours.apply(count_calls=True, action_rows_only=rows_only)
    reset_call_counts()
    fused = actor_step(tiny_qwen(tie), x, packing, temperature)
    counts = call_counts()
    assert counts.get("openrlhf.Actor.forward") == 1 and "openrlhf.Actor.forward[logits]" not in counts
    assert counts.get("openrlhf.PolicyLoss") == 1 and counts.get("openrlhf.compute_approx_kl") == 1
    for a, b in zip(fused[:3], stock[:3]):
        assert a.shape == b.shape
    torch.testing.assert_close(fused[0], stock[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[2], stock[2], rtol=1e-5, atol=1e-5)
    m = x["action_mask"].bool()
    A = m.shape[1]
    if rows_only and not packing:
        torch.testing.assert_close(fused[1][:, -A:][m], stock[1][:, -A:][m], rtol=1e-5, atol=1e-5)
        assert bool((fused[1][:, :-A] == 0).all()) and bool((fused[1][:, -A:][~m] == 0).all())
    else:
        torch.testing.assert_close(fused[1], stock[1], rtol=1e-5, atol=1e-5)
    assert fused[3].keys() == stock[3].keys() and len(stock[3]) > 0
    for name, g in stock[3].items():
        torch.testing.assert_close(fused[3][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_forward_variants_match_stock():
    """return_logprobs without an action mask, no return_output; the logits path when the
    caller asks for logits (no log-probs)."""
    x = rollout(seed=3)
    model = tiny_qwen()
    actor = peer_actor.Actor(model, temperature=0.9)
    actor.packing_samples = False
    args = (x["sequences"],)
    kw = dict(attention_mask=x["attention_mask"])
    with torch.no_grad():
        stock_lp = actor(*args, return_logprobs=True, **kw)
        stock_act = actor(*args, x["action_mask"], **kw)
        stock_logits = actor(*args, return_output=True, **kw)["logits"]
        ours.apply(count_calls=True)
        reset_call_counts()
        torch.testing.assert_close(actor(*args, return_logprobs=True, **kw), stock_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(actor(*args, x["action_mask"], **kw), stock_act, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(actor(*args, return_output=True, **kw)["logits"], stock_logits)
    assert call_counts() == {"openrlhf.Actor.forward": 2, "openrlhf.Actor.forward[logits]": 1}


def test_unfusable_head_raises_or_warns():
    x = rollout()
    model = tiny_qwen()
    model.config.final_logit_softcapping = 30.0
    actor = peer_actor.Actor(model)
    actor.packing_samples = False
    ours.apply()
    with pytest.raises(NotImplementedError, match="final_logit_softcapping"):
        actor(x["sequences"], x["action_mask"], attention_mask=x["attention_mask"])
    ours.apply(strict=False)
    with pytest.warns(RuntimeWarning, match="final_logit_softcapping"):
        lp = actor(x["sequences"], x["action_mask"], attention_mask=x["attention_mask"])
    assert lp.shape == x["action_mask"].shape


def test_apply_replaces_and_unapply_restores_identical_objects():
    names = [
        (peer_loss, "PolicyLoss"),
        (peer_models, "PolicyLoss"),
        (peer_utils, "compute_approx_kl"),
        (peer_utils, "log_probs_from_logits"),
        (peer_utils, "compute_entropy"),
        (peer_actor, "log_probs_from_logits"),
        (peer_actor, "compute_entropy"),
    ]
    before = [getattr(o, a) for o, a in names]
    forward = peer_actor.Actor.forward
    ours.apply()
    assert ours.is_applied() and ours.applied_options()["logits_precision"] == "fp32"
    assert peer_loss.PolicyLoss is ours.PolicyLoss and peer_models.PolicyLoss is ours.PolicyLoss
    assert peer_utils.compute_approx_kl is ours.compute_approx_kl
    assert peer_actor.log_probs_from_logits is ours.log_probs_from_logits
    assert peer_actor.Actor.forward.__wrapped_openrlhf__ is forward
    ours.apply(policy_loss=False, logits_precision="bf16")  # the last call wins
    assert peer_loss.PolicyLoss is before[0]
    from rlvr_kernels.integrations.openrlhf import _head

    assert _head.LOGITS_PRECISION == "bf16"
    assert ours.unapply() and not ours.unapply()
    assert [getattr(o, a) for o, a in names] == before and peer_actor.Actor.forward is forward
    assert _head.LOGITS_PRECISION == "fp32"


def test_bf16_logits_precision_is_openrlhfs_bf16_head():
    """logits_precision="bf16": the log-probs of OpenRLHF's bf16 LM head (logits rounded to bf16,
    then fp32) on a bf16 model."""
    x = rollout(seed=4)
    model = tiny_qwen().to(torch.bfloat16)
    actor = peer_actor.Actor(model)
    actor.packing_samples = False
    with torch.no_grad():
        stock = actor(x["sequences"], x["action_mask"], attention_mask=x["attention_mask"])
        ours.apply(logits_precision="bf16")
        fused = actor(x["sequences"], x["action_mask"], attention_mask=x["attention_mask"])
    assert fused.dtype == stock.dtype == torch.float32
    torch.testing.assert_close(fused, stock, rtol=1e-5, atol=1e-5)


def test_apply_arguments_and_version_gate(monkeypatch):
    with pytest.raises(ValueError, match="logits_precision"):
        ours.apply(logits_precision="fp16")
    with pytest.raises(ValueError, match="logits_precision"):
        ours.apply(logprobs=False, logits_precision="bf16")
    with pytest.raises(TypeError, match="strict"):
        ours.apply(strict=1)
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda p: "0.13.0" if p == "openrlhf" else real(p))
    with pytest.raises(PatchError, match="0.13.0"):
        ours.apply()
    assert not ours.is_applied()
    with pytest.warns(RuntimeWarning, match="0.13.0"):
        ours.apply(strict=False)
    assert ours.is_applied()
