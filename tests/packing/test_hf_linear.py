"""Hybrid models on a pack: tiny Qwen3.5 (dense and MoE) and Qwen3-Next (dense and MoE),
built from configs, fp32, random weights, three Gated DeltaNet layers and one full-attention
layer, GQA on both. Each sample's hidden states, log-probs, entropies and every parameter's
gradient equal running that sample alone (transformers' own PyTorch recurrence), on a forest
with shared prompts, nested sharing, a duplicate, a prefix, a sample sharing nothing and
multi-turn masks, in both key modes; under gradient checkpointing too. Two samples sharing
nothing in one row give their separate results; other recurrent or convolutional layers raise,
naming the layer."""

from __future__ import annotations

import warnings

import pytest
import torch

from rlvr_kernels.packing import forward_packed, pack_prefix_tree, packed_logprobs

from .test_hf import VOCAB, _grads, _samples, _trl_call

MODELS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_next_moe")
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,  # transformers' default pattern: three linear layers, then full attention
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads per key head
    attn_implementation="sdpa",
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)


def _model(name: str):
    import transformers as T

    torch.manual_seed(MODELS.index(name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fast-path-not-available notice
        if name == "qwen3_5":
            model = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**COMMON))
        elif name == "qwen3_5_moe":
            model = T.Qwen3_5MoeForCausalLM(T.Qwen3_5MoeTextConfig(**COMMON, **MOE))
        elif name == "qwen3_next":  # dense: every layer a plain MLP
            model = T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**COMMON, **MOE, mlp_only_layers=[0, 1, 2, 3]))
        else:
            model = T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**COMMON, **MOE))
    assert model.config.layer_types.count("linear_attention") == 3
    slow_decays(model)
    return model.float().eval()


def slow_decays(model) -> None:
    """Decays of exp(g) ≈ 0.5-0.99 a step rather than the init's ~1e-4, so that a token's
    state carries far along its path and a parent's state matters to its children."""
    with torch.no_grad():
        for layer in model.model.layers:
            if getattr(layer, "layer_type", None) == "linear_attention":
                layer.linear_attn.A_log.copy_(torch.empty_like(layer.linear_attn.A_log).uniform_(0.01, 0.3).log())
                layer.linear_attn.dt_bias.normal_(-1.0, 0.5)


_REFERENCE = {}


def _reference(name: str, temperature: float):
    """Each sample alone through the unpacked model: hidden states, per-target log-probs and
    entropies, the gradients of a seeded loss over them."""
    if (name, temperature) in _REFERENCE:
        return _REFERENCE[(name, temperature)]
    model = _model(name)
    ids, mask = _samples()
    hidden, logp, ent = [], [], []
    for s, m in zip(ids, mask):
        out = model(input_ids=torch.tensor([s]), output_hidden_states=True)
        hidden.append(out.hidden_states[-1][0].detach())
        lsm = torch.log_softmax(out.logits[0].float() / temperature, -1)
        pos = [p for p in range(1, len(s)) if m[p]]
        logp.append(lsm[[p - 1 for p in pos], [s[p] for p in pos]])
        ent.append(-(lsm.exp() * lsm).sum(-1)[[p - 1 for p in pos]])
    logp, ent = torch.cat(logp), torch.cat(ent)
    out = (hidden, logp.detach(), ent.detach(), _grads(model, logp, ent))
    _REFERENCE[(name, temperature)] = out
    return out


def _assert_grads_match(model, got_grads, want_grads):
    for (pname, _), got, want in zip(model.named_parameters(), got_grads, want_grads):
        err = (got - want).abs().max().item()
        assert err <= 1e-5 * max(want.abs().max().item(), 1e-6), (pname, err)


@pytest.mark.parametrize("key", ["token+next", "token"])
@pytest.mark.parametrize("name", MODELS)
def test_packed_equals_each_sample_alone(name, key):
    temperature = 0.7
    want_hidden, want_logp, want_ent, want_grads = _reference(name, temperature)
    model = _model(name)
    ids, mask = _samples()
    pack = pack_prefix_tree(ids, completion_mask=mask, key=key)
    assert pack.num_tokens < pack.num_tokens_unpacked and int(pack.segment_parent.max()) >= 1  # nested sharing
    with torch.no_grad():
        hidden = forward_packed(model, pack)
    cu = pack.cu_tokens.tolist()
    for b, want in enumerate(want_hidden):
        torch.testing.assert_close(hidden[pack.gather_index[cu[b] : cu[b + 1]]], want, rtol=1e-5, atol=1e-5)
    logp, ent = packed_logprobs(model, pack, temperature=temperature)
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)
    _assert_grads_match(model, _grads(model, logp, ent), want_grads)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next_moe"])
def test_gradient_checkpointing_reruns_the_tree_path(name):
    """The checkpointed backward re-runs each layer after forward_packed returned: the tree
    still routes it (the layout rides in the call), and the gradients are the samples' own."""
    _, want_logp, want_ent, want_grads = _reference(name, 0.7)
    model = _model(name)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # checkpointing runs in training mode only; the tiny models have no dropout
    ids, mask = _samples()
    logp, ent = packed_logprobs(model, pack_prefix_tree(ids, completion_mask=mask), temperature=0.7)
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    _assert_grads_match(model, _grads(model, logp, ent), want_grads)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_two_samples_sharing_nothing_keep_their_own_state(name):
    """One row, two samples with no common token: each gets its own results, and changing one
    sample's tokens leaves the other's hidden states bit for bit. Run as one sequence (the
    recurrence across the row, what a tree-unaware layer does) the second sample's states
    would differ by far more than the tolerance."""
    model = _model(name)
    a, b = [3, 5, 7, 11, 13, 17, 19], [2, 4, 6, 8, 10]
    with torch.no_grad():
        alone = [model.model(input_ids=torch.tensor([s])).last_hidden_state[0] for s in (a, b)]
        leaked = model.model(input_ids=torch.tensor([a + b])).last_hidden_state[0, len(a) :]
        pack = pack_prefix_tree([a, b], completion_start=1)
        assert pack.num_tokens == len(a) + len(b) and pack.segment_parent.tolist() == [-1, -1]
        hidden = forward_packed(model, pack)
        other = forward_packed(model, pack_prefix_tree([a, [1, 9, 1, 9, 1]], completion_start=1))
    torch.testing.assert_close(hidden[: len(a)], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden[len(a) :], alone[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(other[: len(a)], hidden[: len(a)])
    assert (leaked - alone[1]).abs().max() > 1e-2


def test_model_stays_routed_and_refuses_unpacked_calls():
    model = _model("qwen3_5")
    ids, mask = _samples()
    pack = pack_prefix_tree(ids, completion_mask=mask)
    with torch.no_grad():
        hidden = forward_packed(model, pack)
        with pytest.raises(ValueError, match=r"tree_pack: Qwen3_5GatedDeltaNet \(layer 0\)"):
            model(input_ids=torch.tensor([[1, 2, 3]]))
        trl = _trl_call(model, pack)
        assert torch.equal(trl, hidden)  # TRL's keywords give the same tree
        model.set_attn_implementation("sdpa")
        unpacked = model.model(input_ids=torch.tensor([ids[0]])).last_hidden_state[0]
        torch.testing.assert_close(unpacked, _reference("qwen3_5", 0.7)[0][0], rtol=0, atol=0)
        assert torch.equal(forward_packed(model.model, pack), hidden)  # the base model alone, routed again
        with pytest.raises(ValueError, match="tree_linear_backend='fla'.*CUDA"):
            forward_packed(model, pack, tree_linear_backend="fla")


def test_other_recurrent_and_convolutional_layers_raise_naming_the_layer(monkeypatch):
    import transformers as T

    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
    pack = pack_prefix_tree([[1, 2, 3], [1, 2, 4]], completion_start=1)
    lfm2 = T.Lfm2ForCausalLM(T.Lfm2Config(**small, num_attention_heads=4, num_key_value_heads=2, full_attn_idxs=[1]))
    with pytest.raises(ValueError, match=r"Lfm2ForCausalLM has \['conv'\] layers, which cannot run on a tree"):
        forward_packed(lfm2, pack)
    mamba2 = T.Mamba2ForCausalLM(
        T.Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_heads=4, head_dim=16, n_groups=1)
    )
    with pytest.raises(ValueError, match=r"Mamba2ForCausalLM has \['mamba'\] layers"):
        forward_packed(mamba2, pack)
    # a model that declares no layer kinds is still looked at
    monkeypatch.setattr(type(mamba2.config), "layer_types", property(lambda self: None))
    with pytest.raises(ValueError, match=r"Mamba2ForCausalLM has a 1-D convolution over the sequence \(backbone"):
        forward_packed(mamba2, pack)
    olmo = T.OlmoHybridForCausalLM(
        T.OlmoHybridConfig(
            **small,
            num_attention_heads=4,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            pad_token_id=0,
        )
    )
    with pytest.raises(ValueError, match=r"linear_attention layers of \['OlmoHybridGatedDeltaNet'\]"):
        forward_packed(olmo, pack)
