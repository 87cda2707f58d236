"""A real transformers model on a pack: tiny Llama (tied embeddings) and Qwen2 (untied, q/k/v
biases), both with GQA, fp32, random weights. Through every tree attention path, each
sample's per-token log-probs and entropies equal running that sample alone, and a loss over
them gives the same parameter gradients; both key modes. Gemma 2 checks sliding windows and
attention soft-capping on a real model."""

from __future__ import annotations

import pytest
import torch

from rlvr_kernels.packing import attention as A
from rlvr_kernels.packing import forward_packed, pack_prefix_tree, packed_logprobs

from .test_attention import _varlen_stand_in

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")

VOCAB = 61


def _model(name: str):
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed({"llama": 0, "qwen2": 1, "gemma2": 2}[name])
    if name == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    elif name == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **common))
    else:
        common["attn_implementation"] = "eager"  # transformers' SDPA path has no soft-capping
        cfg = Gemma2Config(
            head_dim=8,
            sliding_window=3,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=0.5,  # small enough to bend these random logits
            query_pre_attn_scalar=8,
            **common,
        )
        model = Gemma2ForCausalLM(cfg)
        with torch.no_grad():  # scores of order one, where the soft-cap bends them
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(30.0)
    return model.float().eval()


def _samples():
    """A group prompt with nested sharing, a duplicate, a sample that is a prefix of another,
    a second group on the same system prompt, one sharing nothing; multi-turn masks."""
    g = torch.Generator().manual_seed(11)

    def r(n):
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    system, p1, p2, mid = r(3), r(4), r(5), r(3)
    ids = [system + p1 + mid + r(4), system + p1 + mid + r(3), system + p1 + r(5), list(system + p1 + mid)]
    ids += [list(ids[0]), ids[2][:9], system + p2 + r(4), system + p2 + r(1), r(7)]
    mask = []
    for s in ids:
        m = [0] * min(len(s), 7) + [1] * max(len(s) - 7, 0)
        if len(s) > 12:
            m[10] = 0  # an untrained (tool) token inside the completion
        mask.append(m)
    return ids, mask


_REFERENCE = {}


def _reference(name: str, temperature: float):
    """Each sample alone through the model's own attention: per-target log-probs, entropies,
    and the gradients of a seeded loss over them."""
    if (name, temperature) in _REFERENCE:
        return _REFERENCE[(name, temperature)]
    model = _model(name)
    ids, mask = _samples()
    logp, ent = [], []
    for s, m in zip(ids, mask):
        z = model(input_ids=torch.tensor([s])).logits[0].float() / temperature
        lsm = torch.log_softmax(z, -1)
        pos = [p for p in range(1, len(s)) if m[p]]
        logp.append(lsm[[p - 1 for p in pos], [s[p] for p in pos]])
        ent.append(-(lsm.exp() * lsm).sum(-1)[[p - 1 for p in pos]])
    logp, ent = torch.cat(logp), torch.cat(ent)
    grads = _grads(model, logp, ent)
    out = (logp.detach(), ent.detach(), grads)
    _REFERENCE[(name, temperature)] = out
    return out


def _grads(model, logp, ent):
    g = torch.Generator().manual_seed(12)
    w, u = torch.randn(logp.shape, generator=g), torch.randn(ent.shape, generator=g)
    loss = (w * logp).sum() + 0.1 * (u * ent).sum()
    params = [p for p in model.parameters()]
    return [x if x is not None else torch.zeros_like(p) for x, p in zip(torch.autograd.grad(loss, params), params)]


PATHS = {
    "sdpa-dense": ("rk_tree_sdpa", {"tree_sdpa_path": "dense"}),
    "sdpa-segments": ("rk_tree_sdpa", {"tree_sdpa_path": "segments"}),
    "flex": ("rk_tree_flex", {"tree_block_size": 8}),
    "varlen": ("rk_tree_varlen", {}),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("key", ["token+next", "token"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_packed_equals_each_sample_alone(name, key, path, monkeypatch):
    temperature = 0.7 if path == "sdpa-segments" else 1.0
    ref_logp, ref_ent, ref_grads = _reference(name, temperature)
    model = _model(name)
    ids, mask = _samples()
    pack = pack_prefix_tree(ids, completion_mask=mask, key=key)
    assert pack.num_tokens < pack.num_tokens_unpacked
    impl, kw = PATHS[path]
    if path == "varlen":  # no flash_attn here: its varlen contract in plain torch
        monkeypatch.setattr(A, "_flash_attn_varlen", lambda device: _varlen_stand_in)
    with torch.set_grad_enabled(path != "flex"):  # FlexAttention has no CPU backward
        logp, ent = packed_logprobs(model, pack, temperature=temperature, attn_implementation=impl, **kw)
    assert model.config._attn_implementation == impl
    assert logp.shape == ent.shape == (pack.num_targets,)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    if path == "flex":
        return
    for (pname, _), got, want in zip(model.named_parameters(), _grads(model, logp, ent), ref_grads):
        err = (got - want).abs().max().item()
        assert err <= 1e-4 * max(want.abs().max().item(), 1e-6), (pname, err)


@pytest.mark.parametrize("path", ["sdpa-dense", "sdpa-segments", "flex"])
def test_sliding_window_and_softcap_on_gemma2(path):
    """Gemma 2 alternates sliding-window and full layers and soft-caps attention scores and
    its final logits: the packed hidden states equal each sample's own (transformers' eager
    attention), and so do the log-probs and entropies, read through its final soft-cap."""
    model = _model("gemma2")
    ids, mask = _samples()
    pack = pack_prefix_tree(ids, completion_mask=mask)
    with torch.no_grad():
        want = [model.model(input_ids=torch.tensor([s])).last_hidden_state[0] for s in ids]
        impl, kw = PATHS[path]
        hidden = forward_packed(model, pack, attn_implementation=impl, **kw)
    cu = pack.cu_tokens.tolist()
    for b, w in enumerate(want):
        torch.testing.assert_close(hidden[pack.gather_index[cu[b] : cu[b + 1]]], w, atol=1e-5, rtol=0)
    ref_logp, ref_ent, ref_grads = _reference("gemma2", 0.7)
    with torch.set_grad_enabled(path != "flex"):  # FlexAttention has no CPU backward
        logp, ent = packed_logprobs(model, pack, temperature=0.7, attn_implementation=impl, **kw)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    if path != "flex":
        for (pname, _), got, want in zip(model.named_parameters(), _grads(model, logp, ent), ref_grads):
            err = (got - want).abs().max().item()
            assert err <= 1e-4 * max(want.abs().max().item(), 1e-6), (pname, err)
    # Without the cap's bend the log-probs would differ: the test sees the soft-cap.
    model.config.final_logit_softcapping = None
    with torch.no_grad():
        uncapped, _ = packed_logprobs(model, pack, temperature=0.7, attn_implementation=impl, **kw)
    model.config.final_logit_softcapping = 0.5
    assert (uncapped - ref_logp).abs().max() > 1e-2


@pytest.mark.parametrize(
    "fields,want",
    [
        ({}, (None, 1.0)),
        ({"final_logit_softcapping": 30.0}, (30.0, 1.0)),
        ({"logit_scale": 0.0625}, (None, 0.0625)),  # Cohere
        ({"logit_scale": None, "output_multiplier": 2.0}, (None, 2.0)),
        ({"lm_head_multiplier": 0.5}, (None, 0.5)),  # Falcon-H1
        ({"logits_scaling": 8.0}, (None, 0.125)),  # Granite divides
        ({"logits_scaling": 8.0, "model_type": "hyperclovax"}, (None, 8.0)),  # HyperCLOVA X multiplies
        ({"final_logit_softcapping": 10.0, "logit_scale": 3.0}, (10.0, 3.0)),
    ],
)
def test_logit_transform_is_read_like_trl(fields, want):
    """The fields TRL 1.16's add_fused_lm_head reads, with its precedence."""
    from types import SimpleNamespace

    from rlvr_kernels.packing.hf import logit_transform

    config = SimpleNamespace(**{"model_type": "test", **fields})
    assert logit_transform(SimpleNamespace(config=config)) == want


def test_trl_keywords_through_the_model():
    """TRL's trainer calls model(..., tree_kv_index=..., tree_max_seqlen_k=...): with our
    attention registered under the model, that call equals forward_packed."""
    model = _model("qwen2")
    ids, mask = _samples()
    pack = pack_prefix_tree(ids, completion_mask=mask)
    with torch.no_grad():
        hidden = forward_packed(model, pack)
        trl = _trl_call(model, pack)
    assert torch.equal(hidden, trl)


def _trl_call(model, pack):
    """The decoder's last hidden states of ``pack`` called with TRL's tree keywords."""
    return model.model(
        input_ids=pack.input_ids[None],
        position_ids=pack.position_ids[None],
        tree_kv_index=pack.tree_kv_index,
        tree_cu_seqlens_q=pack.tree_cu_seqlens_q,
        tree_cu_seqlens_k=pack.tree_cu_seqlens_k,
        tree_max_seqlen_q=int(pack.tree_max_seqlens[0]),
        tree_max_seqlen_k=int(pack.tree_max_seqlens[1]),
    ).last_hidden_state[0]


def test_model_stays_on_tree_attention_and_refuses_unpacked_calls():
    """forward_packed leaves the model on the tree attention (a restore would break a
    gradient-checkpointing backward); an unpacked call then raises instead of attending
    across samples, and set_attn_implementation switches back."""
    model = _model("llama")
    pack = pack_prefix_tree(_samples()[0], completion_start=1)
    with torch.no_grad():
        hidden = forward_packed(model, pack)
        assert model.config._attn_implementation == "rk_tree_sdpa"
        with pytest.raises(ValueError, match="tree_pack"):
            model(input_ids=torch.tensor([[1, 2, 3]]))
        model.set_attn_implementation("sdpa")
        model(input_ids=torch.tensor([[1, 2, 3]]))
        # the base model alone gives the same hidden states
        assert torch.equal(forward_packed(model.model, pack), hidden)


def test_bad_arguments_name_themselves():
    model = _model("llama")
    pack = pack_prefix_tree(_samples()[0], completion_start=1)
    with pytest.raises(ValueError, match="attn_implementation"):
        forward_packed(model, pack, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="attn_implementation='rk_tree_varlen'"):
        forward_packed(model, pack, attn_implementation="rk_tree_varlen")
    with pytest.raises(ValueError, match="pack: on meta"):
        forward_packed(model, pack.to("meta"))
    with pytest.raises(TypeError, match="pack"):
        forward_packed(model, {"input_ids": pack.input_ids})
    with pytest.raises(TypeError, match="model"):
        forward_packed(torch.nn.Linear(2, 2), pack)
    with pytest.raises(TypeError, match="model: LlamaModel has no output embeddings"):
        packed_logprobs(model.model, pack)
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="linear_attention"):
        forward_packed(model, pack)


def test_empty_pack_and_out_of_vocabulary_ids():
    model = _model("qwen2")
    logp, entropy = packed_logprobs(model, pack_prefix_tree([], completion_start=0))
    assert logp.shape == (0,) and entropy.shape == (0,)
    logp.sum().backward()  # an empty rank still takes part in the backward
    only = packed_logprobs(model, pack_prefix_tree([[1, 2, 3]], completion_start=1), return_entropy=False)
    assert only.entropy is None and only.logp.shape == (2,) and torch.isfinite(only.logp).all()
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        packed_logprobs(model, pack_prefix_tree([[1, 2, VOCAB]], completion_start=0))
