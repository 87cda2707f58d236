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

from typing import NamedTuple, Optional, Tuple

import torch

from ..ops.logprobs import linear_logprobs
from .attention import SDPA, check_attn_implementation, register_tree_attention


def forward_packed(model, pack, *, attn_implementation: str = SDPA, **attention_kwargs) -> torch.Tensor:
    """Hidden states ``[N, H]`` of the packed row (after the model's final norm).

    Args:
        model: a ``transformers`` causal LM (``...ForCausalLM``) or its base model.
        pack: a ``TreePack`` on the model's device.
        attn_implementation: ``"rk_tree_sdpa"``, ``"rk_tree_flex"`` or ``"rk_tree_varlen"``;
            the model is left on it (see the module docstring).
        attention_kwargs: passed through the model to the attention (e.g.
            ``tree_sdpa_path="segments"``, ``tree_block_size=64``).
    """
    _check_model(model)
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
    _check_model(model)
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


def _check_model(model) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "base_model") or not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__}")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    # Only attention layers can be routed along each sample's own path; a recurrent or
    # convolutional layer would scan across the samples of the packed row.
    other = set(getattr(text, "layer_types", None) or []) - {"full_attention", "sliding_attention"}
    if other:
        raise ValueError(f"model: {type(model).__name__} has {sorted(other)} layers, which cannot run on a tree")
    if any(name.endswith(".sinks") for name, _ in model.named_parameters()):
        raise ValueError(f"model: {type(model).__name__} uses attention sinks, which tree attention does not support")


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
