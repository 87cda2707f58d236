"""The README's path end to end: pack -> tree forward -> log-probs -> group advantages and the
fused policy loss on the pack's sample-major layout, against the same loss on the padded
unpacked batch: equal loss and parameter gradients."""

from __future__ import annotations

import pytest
import torch

import rlvr_kernels as rk
from rlvr_kernels.packing import pack_prefix_tree, pack_values, packed_logprobs, unpack


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=53,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(cfg).float().eval()


def _batch():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 53, (n,), generator=g) for n in (9, 5)]
    samples, start, group = [], [], []
    for gi, p in enumerate(prompts):
        for _ in range(4):
            samples.append(
                torch.cat([p, torch.randint(0, 53, (int(torch.randint(1, 8, (), generator=g)),), generator=g)])
            )
            start.append(len(p))
            group.append(gi)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    return samples, start, torch.tensor(group), rewards


@pytest.mark.parametrize("key", ["token+next", "token"])
def test_packed_grpo_step_equals_unpacked(key):
    samples, start, group, rewards = _batch()
    old = [-torch.rand(len(s), generator=torch.Generator().manual_seed(i)) for i, s in enumerate(samples)]
    adv = rk.group_advantages(rewards, group, num_groups=2).advantages  # one value per sample
    opts = rk.PolicyLossOptions(loss_type="ppo", clip_low=0.2, clip_high=0.28, agg="seq-mean-token-mean")

    # packed: the pack's targets are sample-major, so cu_seqlens is the loss's packed layout
    model = _model()
    pack = pack_prefix_tree(samples, completion_start=start, old_log_probs=old, advantages=adv, key=key)
    logp, _ = packed_logprobs(model, pack)
    loss_p, _ = rk.policy_loss(logp, pack.old_log_probs, pack.advantages, cu_seqlens=pack.cu_seqlens, options=opts)
    loss_p.backward()
    grads_p = {n: p.grad.clone() for n, p in model.named_parameters()}

    # unpacked: each sample alone, padded [B, L] log-probs of its completion tokens
    model = _model()
    model.set_attn_implementation("sdpa")
    L = max(len(s) for s in samples)
    logp_u = torch.zeros(len(samples), L)
    mask = torch.zeros(len(samples), L, dtype=torch.bool)
    for b, s in enumerate(samples):
        logits = model(input_ids=s[None]).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, s[1:, None])[:, 0]
        logp_u[b, 1 : len(s)] = lp
        mask[b, start[b] : len(s)] = True
    old_u = torch.zeros(len(samples), L)
    for b, o in enumerate(old):
        old_u[b, : len(o)] = o
    loss_u, _ = rk.policy_loss(logp_u, old_u, adv[:, None].expand(-1, L), mask=mask, options=opts)
    loss_u.backward()
    grads_u = {n: p.grad for n, p in model.named_parameters()}

    assert torch.allclose(loss_p, loss_u, atol=1e-6, rtol=0), (float(loss_p), float(loss_u))
    for n, gp in grads_p.items():
        scale = grads_u[n].abs().max().clamp_min(1e-12)
        assert float((gp - grads_u[n]).abs().max() / scale) <= 1e-4, n
    # the values move between layouts: packed log-probs land on the unpacked positions
    back, where = unpack(logp.detach(), pack)
    assert torch.equal(where, mask[:, : where.shape[1]])
    assert torch.allclose(back[where], logp_u[:, : where.shape[1]][where].detach(), atol=1e-5)
    assert torch.equal(pack_values(old_u, pack), pack.old_log_probs)
