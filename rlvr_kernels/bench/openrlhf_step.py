"""One actor step of OpenRLHF 0.11.2, stock vs ``integrations.openrlhf.apply()``.

The step is what ``ActorPPOTrainer.training_step`` (``openrlhf/trainer/ray/ppo_actor.py``)
computes on one micro-batch, without its strategy: OpenRLHF's ``Actor.forward`` (action
log-probs and, for the entropy bonus, the entropies; temperature 0.8), its ``PolicyLoss``
(ppo, clip 0.2 / 0.28, a token-level ICEPOP correction), the KL loss (``compute_approx_kl`` k3,
``aggregate_loss``), the entropy bonus, and ``loss.backward()``. Model and sizes are those of
the GRPOTrainer step (:mod:`.trainer`): a config-built Qwen2, vocab 32k, hidden 512, 2 layers,
8 responses of up to 256 tokens after prompts of up to 64 (``quick``: a smoke-test size), fp32.

Rows: OpenRLHF stock (the fp32 ``[B, S, V]`` logits, ``compute_entropy`` and
``log_probs_from_logits`` of them); applied (the logit-free forward: ``linear_logprobs`` on the
last hidden states, the fused loss). Peak memory: each row once in a fresh process.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch

from .timing import peak_extra_gb
from .trainer import MEMORY_NOTE, model_note, qwen2_config, run_methods, shape, step_result, switch_to

# key -> (label, apply() switches or None for stock)
METHODS: Dict[str, Tuple[str, Any]] = {
    "openrlhf": ("OpenRLHF 0.11.2 Actor.forward + PolicyLoss + KL + entropy, stock", None),
    "fused": ("the same after rlvr_kernels.integrations.openrlhf.apply()", {}),
}


def _peer():
    from ..testing.peers import import_openrlhf_models

    loss, utils = import_openrlhf_models()
    import openrlhf.models.actor as actor

    return loss, utils, actor


def build(device: str, quick: bool, seed: int = 0):
    """(actor, batch): OpenRLHF's Actor around a config-built Qwen2 and one micro-batch in
    its experience layout (left-padded prompts, right-padded responses of random lengths,
    old log-probs off the current ones so that ratios clip)."""
    from transformers import Qwen2ForCausalLM

    _, _, peer_actor = _peer()
    s = shape(quick)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(qwen2_config(s)).to(device)
    actor = peer_actor.Actor(model, temperature=0.8)
    actor.packing_samples = False
    g = torch.Generator().manual_seed(seed)
    B, P, C = s["B"], s["P"], s["C"]
    seq = torch.randint(3, s["V"], (B, P + C), generator=g)
    prompt = torch.randint(P // 2, P + 1, (B,), generator=g)
    resp = torch.randint(C // 4, C + 1, (B,), generator=g)
    pos = torch.arange(P + C)
    attn = ((pos[None] >= P - prompt[:, None]) & (pos[None] < P + resp[:, None])).long()
    action_mask = attn[:, P:].clone()
    with torch.no_grad():
        lp = actor(seq.to(device), action_mask.to(device), attention_mask=attn.to(device)).cpu()
    old = lp + 0.05 * torch.randn(lp.shape, generator=g)
    batch = dict(
        sequences=seq,
        attention_mask=attn,
        action_mask=action_mask,
        old=old,
        rollout=old + 0.02 * torch.randn(lp.shape, generator=g),
        ref=lp + 0.1 * torch.randn(lp.shape, generator=g),
        advantages=torch.randn(B, 1, generator=g).expand(B, C).contiguous(),
    )
    return actor, {k: v.to(device) for k, v in batch.items()}


def step_fn(actor, b) -> Callable[[], float]:
    """The step (module docstring), binding OpenRLHF's names as its trainer does: looked up in
    its modules when the step is made."""
    peer_loss, peer_utils, _ = _peer()
    loss_fn = peer_loss.PolicyLoss(
        clip_eps_low=0.2, clip_eps_high=0.28, is_correction_level="token", is_correction_threshold=(0.5, 5.0)
    )
    kl_fn, aggregate = peer_utils.compute_approx_kl, peer_loss.aggregate_loss

    def step():
        actor.model.zero_grad(set_to_none=True)
        m = b["action_mask"]
        logp, output = actor(
            b["sequences"], m, attention_mask=b["attention_mask"], return_output=True, return_entropy=True
        )
        loss, *_ = loss_fn(logp, b["old"], b["advantages"], action_mask=m, rollout_log_probs=b["rollout"])
        loss = loss + 0.01 * aggregate(kl_fn(logp, b["ref"], kl_estimator="k3"), m)
        loss = loss - 0.01 * aggregate(output.entropy[:, -m.shape[1] :], m)
        loss.backward()
        return float(loss.detach())

    return step


def _switch(key: str) -> None:
    from ..integrations import openrlhf as rk_openrlhf

    _peer()  # the flash_attn stand-ins first: apply() imports openrlhf.models
    switch_to(METHODS[key][1], rk_openrlhf.apply, rk_openrlhf.unapply)


def measure_memory(key: str, device: str, quick: bool) -> Dict:
    """Peak extra memory of one step of ``key`` (a fresh process, see ``trainer.memory_rows``)."""
    _switch(key)
    actor, batch = build(device, quick)
    return {"extra_gb": peak_extra_gb(step_fn(actor, batch), device)}


def workload(device: str, quick: bool = False) -> Dict:
    from ..integrations import openrlhf as rk_openrlhf

    s = shape(quick)
    was_applied = rk_openrlhf.applied_options()
    actor, batch = build(device, quick)

    def restore():
        rk_openrlhf.unapply()
        if was_applied:
            rk_openrlhf.apply(**was_applied)

    rows, losses, rounds = run_methods(
        METHODS, _switch, lambda: step_fn(actor, batch), restore, device, quick, __name__
    )
    step = (
        f"{s['B']} responses of up to {s['C']} tokens after prompts of up to {s['P']}; ppo + ICEPOP, k3 KL loss, "
        f"entropy bonus, temperature 0.8, fp32; one step = Actor.forward + losses + backward; median of "
        f"{rounds} interleaved rounds"
    )
    title = (
        "one OpenRLHF actor step (forward, log-probs, entropy, PolicyLoss, backward), "
        f"V={s['V']}, H={s['H']}, B={s['B']}, responses"
    )
    return step_result(title, quick, rows, losses, [model_note(s) + step, MEMORY_NOTE], stock="openrlhf")


WORKLOADS: Dict[str, Callable] = {"openrlhf_actor_step": workload}
