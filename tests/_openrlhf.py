"""What the OpenRLHF integration tests share: a tiny Qwen2 from a config (no download) and a
rollout in OpenRLHF's experience layout."""

from __future__ import annotations

import torch

V = 97


def tiny_qwen(tie=False, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    return Qwen2ForCausalLM(cfg)


def rollout(seed=1, B=3, P=5, A=7):
    """Left-padded prompts + right-padded responses, OpenRLHF's experience layout."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(3, V, (B, P + A), generator=g)
    attn = torch.ones(B, P + A, dtype=torch.long)
    attn[0, :2] = 0  # a shorter prompt
    attn[1, -3:] = 0  # a shorter response
    action_mask = attn[:, P:].clone()
    seq = seq * attn  # pad id 0
    old = -3 * torch.rand(B, A, generator=g)
    return dict(sequences=seq, attention_mask=attn, action_mask=action_mask, old=old, ref=old + 0.3, adv=old * 0 + 1.0)
