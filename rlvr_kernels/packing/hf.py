"""A ``transformers`` causal LM on a ``TreePack``: the packed forward and its log-probs.

    hidden = forward_packed(model, pack)                       # [N, H]
    logp, entropy = packed_logprobs(model, pack)               # [M], [M]

``forward_packed`` runs the model's base (decoder) on ``pack.input_ids[None]`` with
``pack.position_ids[None]`` (each token's position in its samples) and one of the tree
attention paths of ``rlvr_kernels.packing.attention``. ``packed_logprobs`` scores every
target off the hidden state that predicts it, without the ``[N, V]`` logits:
``linear_logprobs(hidden, lm_head.weight, pack.target_ids, row_index=pack.token_index)``,
with the model's logit transform read from its config as TRL's ``add_fused_lm_head`` reads
it (``final_logit_softcapping``: Gemma 2/3; ``logit_scale`` / ``output_multiplier`` /
``lm_head_multiplier`` / ``logits_scaling``: Cohere, Falcon-H1, Granite, ...).
Each sample's log-probs, entropies and gradients equal running that sample alone.

Layer kinds (:func:`check_tree_model`): full and sliding attention run the tree attention;
Gated DeltaNet linear attention (Qwen3.5 dense and MoE, Qwen3-Next) runs the tree
recurrence of ``rlvr_kernels.packing.linear`` (:func:`enable_tree_linear_layers`, keyword
``tree_linear_backend=``); any other recurrent or convolutional layer raises, naming it.

The model's attention implementation: ``forward_packed`` switches the model to the requested
tree attention with ``model.set_attn_implementation`` (transformers' own setter, which also
updates sub-configs) and leaves it there. Restoring it on return would be wrong under
gradient checkpointing, whose backward re-runs the forward after the call returned: the
re-run would take the restored attention over the packed row. A tree attention reached
without a pack raises, so a later unpacked call on the model cannot silently attend across
samples: switch back with ``model.set_attn_implementation("sdpa")`` (or the previous name,
``model.config._attn_implementation`` before the call) for unpacked use.
"""

from __future__ import annotations

import functools
from typing import Iterable, List, NamedTuple, Optional, Tuple

import torch

from ..ops.logprobs import linear_logprobs
from .attention import NAMES, SDPA, check_attn_implementation, register_tree_attention
from .linear import segment_tree, tree_causal_conv1d, tree_gated_delta_rule

# The linear-attention mixers the tree recurrence routes (transformers 5.10): Qwen3.5 dense
# and MoE, Qwen3-Next. Each takes its causal convolution and its chunked gated delta rule
# through the attributes ``causal_conv1d_fn`` and ``chunk_gated_delta_rule``.
TREE_LINEAR_LAYERS = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet")
_RUNS_ON_A_TREE = "a tree runs full_attention, sliding_attention and Gated DeltaNet linear_attention layers"


def forward_packed(model, pack, *, attn_implementation: str = SDPA, **attention_kwargs) -> torch.Tensor:
    """Hidden states ``[N, H]`` of the packed row (after the model's final norm).

    Args:
        model: a ``transformers`` causal LM (``...ForCausalLM``) or its base model.
        pack: a ``TreePack`` on the model's device.
        attn_implementation: ``"rk_tree_sdpa"``, ``"rk_tree_flex"`` or ``"rk_tree_varlen"``;
            the model is left on it (see the module docstring).
        attention_kwargs: passed through the model to the attention (e.g.
            ``tree_sdpa_path="segments"``, ``tree_block_size=64``) and the Gated DeltaNet
            layers (``tree_linear_backend="auto"`` / ``"torch"`` / ``"fla"``).
    """
    linear = check_tree_model(model)
    device = _model_device(model)
    if not hasattr(pack, "input_ids") or not hasattr(pack, "enter"):
        raise TypeError(f"pack: expected a TreePack, got {type(pack).__name__}")
    if pack.input_ids.device != device:
        raise ValueError(f"pack: on {pack.input_ids.device}, the model is on {device}; use pack.to(device)")
    check_attn_implementation(attn_implementation, device)
    vocab = model.get_input_embeddings().num_embeddings
    if pack.input_ids.numel() and int(pack.input_ids.max()) >= vocab:
        raise ValueError(f"pack: token id {int(pack.input_ids.max())} is outside the model's vocabulary of {vocab}")
    register_tree_attention()
    if model.config._attn_implementation != attn_implementation:
        model.set_attn_implementation(attn_implementation)
    enable_tree_linear_layers(model, linear)
    if pack.num_tokens == 0:  # an empty row (a rank with nothing this micro-batch): no forward
        weight = model.get_input_embeddings().weight
        return weight.new_zeros(0, weight.shape[1]) + 0 * weight.sum()  # keeps the graph: backward works
    out = model.base_model(
        input_ids=pack.input_ids[None],
        position_ids=pack.position_ids[None],
        tree_pack=pack,
        use_cache=False,
        **attention_kwargs,
    )
    return out.last_hidden_state[0]


class PackedLogprobs(NamedTuple):
    """What :func:`packed_logprobs` returns: ``[M]`` each, sample-major (``pack.cu_seqlens``)."""

    logp: torch.Tensor  # log-prob of each target
    entropy: Optional[torch.Tensor]  # entropy of the distribution each target was drawn from; None unless asked


def packed_logprobs(
    model,
    pack,
    *,
    temperature: float = 1.0,
    return_entropy: bool = True,
    attn_implementation: str = SDPA,
    **attention_kwargs,
) -> PackedLogprobs:
    """Per-target log-probs ``[M]`` (sample-major, ``pack.cu_seqlens``), and with
    ``return_entropy`` the entropy ``[M]`` of the distribution each target was drawn from,
    both at ``temperature``, as a :class:`PackedLogprobs` (``entropy`` None without
    ``return_entropy``). fp32 (fp64 for an fp64 model); differentiable.

    logp_m = log softmax(lm_head(hidden[token_index[m]]) / T)[target_ids[m]].
    """
    check_tree_model(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise TypeError(f"model: {type(model).__name__} has no output embeddings (lm_head); pass a ...ForCausalLM")
    softcap, logit_scale = logit_transform(model)
    hidden = forward_packed(model, pack, attn_implementation=attn_implementation, **attention_kwargs)
    out = linear_logprobs(
        hidden,
        head.weight,
        pack.target_ids,
        row_index=pack.token_index,
        temperature=temperature,
        bias=getattr(head, "bias", None),
        return_entropy=return_entropy,
        logit_scale=logit_scale,
        softcap=softcap,
    )
    # The entropy is per hidden row; each target reads the row that predicts it.
    return PackedLogprobs(out.logp, out.entropy[pack.token_index] if return_entropy else None)


def check_tree_model(model) -> List[torch.nn.Module]:
    """Raise unless every layer of the model can run on a tree; the linear-attention
    mixers that need the tree recurrence (:data:`TREE_LINEAR_LAYERS`), in model order."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "base_model") or not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__}")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = type(model).__name__
    # Attention layers are routed along each sample's own path, Gated DeltaNet layers run their
    # recurrence on the tree; any other recurrent or convolutional layer would scan across
    # the samples of the packed row.
    layer_types = list(getattr(text, "layer_types", None) or [])
    other = set(layer_types) - {"full_attention", "sliding_attention", "linear_attention"}
    if other:
        raise ValueError(f"model: {name} has {sorted(other)} layers, which cannot run on a tree ({_RUNS_ON_A_TREE})")
    linear = [m for m in model.modules() if type(m).__name__ in TREE_LINEAR_LAYERS]
    if "linear_attention" in layer_types:
        mixers = [
            getattr(layer, "linear_attn", None)
            for layer in model.modules()
            if getattr(layer, "layer_type", None) == "linear_attention"
        ]
        bad = sorted({type(m).__name__ for m in mixers if type(m).__name__ not in TREE_LINEAR_LAYERS})
        if bad or not mixers:
            raise ValueError(
                f"model: {name} has linear_attention layers of {bad or 'an unknown kind'}, which cannot run on a "
                f"tree ({_RUNS_ON_A_TREE})"
            )
    for m in linear:
        missing = [a for a in ("causal_conv1d_fn", "chunk_gated_delta_rule", "conv1d") if not hasattr(m, a)]
        if missing:
            raise ValueError(
                f"model: {type(m).__name__} (layer {getattr(m, 'layer_idx', '?')}) has no {', '.join(missing)}: "
                "this transformers version's Gated DeltaNet is not the one the tree path routes"
            )
    inside = {id(c) for m in linear for c in m.modules()}
    for mod_name, m in model.named_modules():
        if isinstance(m, torch.nn.Conv1d) and id(m) not in inside:
            raise ValueError(
                f"model: {name} has a 1-D convolution over the sequence ({mod_name}), which would run across the "
                f"samples of a packed row ({_RUNS_ON_A_TREE})"
            )
    if any(n.endswith(".sinks") for n, _ in model.named_parameters()):
        raise ValueError(f"model: {name} uses attention sinks, which tree attention does not support")
    return linear


def logit_transform(model) -> Tuple[Optional[float], float]:
    """(softcap, logit_scale) of the model's logits, z = softcap·tanh(logit_scale·y/softcap),
    read from its (text) config as TRL 1.16's ``add_fused_lm_head`` reads them:
    ``final_logit_softcapping`` (None: no cap); the scale from ``logit_scale``, else
    ``output_multiplier``, else ``lm_head_multiplier``, else ``logits_scaling`` (a divisor,
    a multiplier for HyperCLOVA X); 1.0 when none is set."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text, "final_logit_softcapping", None)
    scale = getattr(text, "logit_scale", None)
    for field in ("output_multiplier", "lm_head_multiplier"):
        if scale is None:
            scale = getattr(text, field, None)
    scaling = getattr(text, "logits_scaling", None)
    if scale is None and scaling is not None:
        scale = scaling if getattr(text, "model_type", None) == "hyperclovax" else 1 / scaling
    return softcap, 1.0 if scale is None else float(scale)


def _model_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    raise ValueError(f"model: {type(model).__name__} has no parameters")


# ----------------------------------------------------------------------------- linear-attention layers


def enable_tree_linear_layers(model, layers=None, *, attention_names: Iterable[str] = ()) -> None:
    """Route the model's Gated DeltaNet layers through the tree recurrence when a call carries
    a tree (``tree_pack=`` or TRL's keywords). Idempotent; the layers stay routed, as the
    attention implementation stays set (see the module docstring).

    Each layer's ``forward`` is wrapped on the instance. With a tree in the call, the layer's
    own forward runs with its ``causal_conv1d_fn`` and ``chunk_gated_delta_rule`` taken by
    :func:`~rlvr_kernels.packing.linear.tree_causal_conv1d` and
    :func:`~rlvr_kernels.packing.linear.tree_gated_delta_rule` for that call (the projections,
    gate and norm are per token). Without one, while the model's attention implementation is
    a tree attention (ours, or one of ``attention_names``), the layer raises: it would scan
    across the samples of the packed row. Otherwise it runs as before."""
    layers = check_tree_model(model) if layers is None else layers
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for layer in layers:
        names = layer.__dict__.get("_rk_tree_attention_names")
        if names is None:
            names = set(NAMES)
            layer._rk_tree_attention_names = names
            layer.forward = _tree_linear_forward(layer, layer.forward, config, names)
        names.update(attention_names)


def _tree_linear_forward(layer, original, config, names):
    def forward(hidden_states, cache_params=None, attention_mask=None, **kwargs):
        tree = segment_tree(kwargs)
        where = f"{type(layer).__name__} (layer {getattr(layer, 'layer_idx', '?')})"
        if tree is None:
            if config._attn_implementation in names:
                raise ValueError(
                    f"tree_pack: {where} is reached without the tree layout while the model is on the tree attention "
                    f"{config._attn_implementation!r}; its recurrence would run across the samples of the packed row. "
                    "Call with tree_pack=<TreePack> (or TRL's tree keywords), or switch back with "
                    'model.set_attn_implementation("sdpa") for unpacked use'
                )
            return original(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
        # A cache the call created (use_cache defaults to True, as in TRL's call) holds nothing
        # to continue from; the tree's states are per segment, so none is written to it.
        if cache_params is not None and cache_params.has_previous_state(getattr(layer, "layer_idx", None)):
            raise ValueError(f"past_key_values: {where} cannot continue a cached sequence on a tree")
        if attention_mask is not None:
            raise ValueError(f"attention_mask: {where} on a tree reads its visibility from the tree; pass none")
        if hidden_states.dim() != 3 or hidden_states.shape[0] != 1 or hidden_states.shape[1] != tree.num_tokens:
            raise ValueError(
                f"tree_pack: {where} runs one packed row of {tree.num_tokens} tokens, got hidden states of shape "
                f"{tuple(hidden_states.shape)}"
            )
        backend = kwargs.get("tree_linear_backend", "auto")
        missing = object()
        saved = {a: layer.__dict__.get(a, missing) for a in ("causal_conv1d_fn", "chunk_gated_delta_rule")}
        layer.causal_conv1d_fn = functools.partial(_conv_on_tree, tree)
        layer.chunk_gated_delta_rule = functools.partial(_rule_on_tree, tree, backend)
        try:
            return original(hidden_states, cache_params=None, attention_mask=None, **kwargs)
        finally:
            for a, v in saved.items():
                if v is missing:  # a class attribute: drop the instance's
                    delattr(layer, a)
                else:
                    setattr(layer, a, v)

    forward.__wrapped__ = original
    return forward


def _conv_on_tree(tree, x, weight, bias=None, activation=None, seq_idx=None, **kwargs):
    """``causal_conv1d_fn``'s call as the layer makes it: x [1, C, N] -> [1, C, N]."""
    if seq_idx is not None:
        raise ValueError("seq_idx: a tree row takes its sequence boundaries from the tree, not seq_idx")
    return tree_causal_conv1d(x[0].t(), weight, bias, tree, activation).t()[None]


def _rule_on_tree(
    tree,
    backend,
    query,
    key,
    value,
    g,
    beta,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    scale=None,
    **kwargs,
):
    """``chunk_gated_delta_rule``'s call as the layer makes it: q, k [1, N, H, Dk], v
    [1, N, H, Dv], g, beta [1, N, H] -> (o [1, N, H, Dv], final states or None)."""
    if initial_state is not None or cu_seqlens is not None:
        raise ValueError("initial_state, cu_seqlens: a tree row takes its segments and states from the tree")
    o, states = tree_gated_delta_rule(
        query[0],
        key[0],
        value[0],
        g[0],
        beta[0],
        tree,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        backend=backend,
    )
    return o[None], states if output_final_state else None
