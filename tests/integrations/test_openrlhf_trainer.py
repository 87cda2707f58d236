"""OpenRLHF 0.11.2's PPO actor training step, ``ActorPPOTrainer.training_step``
(``openrlhf/trainer/ray/ppo_actor.py``), run for real on the CPU with and without
``integrations.openrlhf.apply()``: its ``__init__`` builds the ``PolicyLoss`` by the name it
imported, its step runs the ``Actor`` (tiny Qwen2 from a config), the loss, the KL loss
(``compute_approx_kl``), the entropy bonus, backward and an optimizer step. Two steps with
the fused ops give stock's metrics and parameters.

What does not run here: OpenRLHF's ``DeepspeedStrategy`` (its ``setup_distributed`` builds a
``"cuda"`` device mesh), so the strategy is a stand-in with its interface (``backward``,
``optimizer_step``, ``get_grad_norm``, ``args``), and its replay buffer (which asks for the CUDA
device; the step reads it only with dynamic batching) is left out; Ray and vLLM are not started (``vllm`` is a
placeholder module: the step never calls it)."""

from __future__ import annotations

import copy
from types import SimpleNamespace as NS

import pytest
import torch
from _openrlhf import rollout, tiny_qwen

from rlvr_kernels.integrations import call_counts, reset_call_counts, set_counting
from rlvr_kernels.integrations import openrlhf as ours
from rlvr_kernels.testing.peers import import_openrlhf_models, stubbed_modules

import_openrlhf_models()
# vLLM's placeholders for the import only: left in sys.modules they would make TRL's
# is_vllm_available() see a vLLM without a version in the tests collected after this one.
with stubbed_modules({"vllm": (), "vllm.inputs": ("TokensPrompt",), "vllm.utils": ("random_uuid",)}):
    import openrlhf.trainer.ray.ppo_actor as ppo_actor  # noqa: E402
from openrlhf.models import Actor  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402


def args(policy_loss_type="ppo", correction="token", entropy_coef=0.01):
    return NS(
        actor=NS(
            eps_clip_low_high=(0.2, 0.28),
            dual_clip=None,
            loss_agg_mode="token-mean",
            policy_loss_type=policy_loss_type,
            aux_loss_coef=0.0,
            entropy_coef=entropy_coef,
        ),
        algo=NS(
            advantage=NS(
                is_correction_level=correction,
                is_correction_mode="mask",
                is_correction_gating="ratio",
                is_correction_threshold=(0.5, 2.0),
            ),
            kl=NS(use_loss=True, init_coef=0.1, estimator="k3", unbiased_gradient=False),
        ),
        ds=NS(packing_samples=False, tensor_parallel_size=1),
        train=NS(dynamic_batch_enable=False, colocate_all=False, async_enable=False, max_epochs=1),
        vllm=NS(sync_backend="gloo"),
    )


class Strategy:
    """DeepspeedStrategy's interface for one process: plain backward, an AdamW step."""

    def __init__(self, args, model):
        self.args, self.ring_attn_group, self.ds_device_mesh = args, None, None
        self.optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def backward(self, loss, model, optimizer, **kw):
        loss.backward()

    def optimizer_step(self, optimizer, model, scheduler, name="model", **kw):
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        scheduler.step()

    def get_grad_norm(self, model):
        return 0.0


def train(model, a, experiences, monkeypatch):
    monkeypatch.setattr(ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)
    # (its buffer asks for the CUDA device; training_step reads it only with dynamic batching)
    monkeypatch.setattr(ppo_actor, "NaiveReplayBuffer", lambda *a, **k: None)
    actor = Actor(model, temperature=0.8)
    actor.packing_samples = False
    strategy = Strategy(a, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(strategy.optim, lambda s: 1.0)
    trainer = ppo_actor.ActorPPOTrainer(strategy, actor, None, strategy.optim, scheduler, micro_train_batch_size=3)
    out = []
    for e in experiences:
        status = trainer.training_step(copy.copy(e), kl_ctl=0.1, step=0)
        out.append({k: float(v.float().mean()) for k, v in status["metrics"].items() if torch.is_tensor(v)})
    return out, {n: p.detach().clone() for n, p in model.named_parameters()}, type(trainer.actor_loss_fn)


def experiences():
    out = []
    for seed in (1, 2):
        x = rollout(seed=seed)
        g = torch.Generator().manual_seed(seed)
        m = x["action_mask"].bool()
        out.append(
            Experience(
                sequences=x["sequences"],
                attention_mask=x["attention_mask"],
                action_mask=m,
                action_log_probs=x["old"],
                base_action_log_probs=x["ref"],
                rollout_log_probs=x["old"] + 0.1 * torch.randn(m.shape, generator=g),
                advantages=torch.randn(m.shape, generator=g),
                info={},
            )
        )
    return out


@pytest.mark.parametrize("policy_loss_type,correction", [("ppo", "token"), ("ppo", "seq"), ("gspo", "off")])
def test_training_step_matches_stock(policy_loss_type, correction, monkeypatch):
    a = args(policy_loss_type, correction)
    exps = experiences()
    stock, stock_params, stock_cls = train(tiny_qwen(), a, exps, monkeypatch)
    ours.apply(count_calls=True)
    try:
        reset_call_counts()
        fused, params, cls = train(tiny_qwen(), a, exps, monkeypatch)
        counts = call_counts()
    finally:
        ours.unapply()
        set_counting(False)
    assert stock_cls is not ours.PolicyLoss and cls is ours.PolicyLoss
    assert counts["openrlhf.Actor.forward"] == 2 and counts["openrlhf.PolicyLoss"] == 2
    assert counts["openrlhf.compute_approx_kl"] == 2
    for s, f in zip(stock, fused):
        assert s.keys() == f.keys() and "policy_loss" in s and "entropy_loss" in s
        for k in s:
            assert f[k] == pytest.approx(s[k], rel=1e-4, abs=1e-6), k
    for n, p in stock_params.items():
        torch.testing.assert_close(params[n], p, rtol=1e-4, atol=1e-5, msg=n)
    assert any(not torch.equal(p, tiny_qwen().state_dict()[n]) for n, p in params.items())  # it trained
