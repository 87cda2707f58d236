"""What the logit-free paths of the integrations share about the LM head they replace.

:data:`MODELS`: the transformers causal-LM classes whose forward is the decoder
(``self.model``) and then ``logits = self.lm_head(hidden_states[:, slice_indices, :])``, nothing
else (no logit scale, soft-cap or bias): the models whose logits the logit-free engine paths
(verl's ``transformer_impl``, AReaL's ``fsdp_engine``) reproduce from the hidden states and the
head. :data:`LOGITS_PRECISIONS`: the ``logits_precision`` settings of the ``apply()`` calls
whose fused head runs ``linear_logprobs`` (OpenRLHF's, AReaL's)."""

from __future__ import annotations

import functools
import importlib
from typing import Any, Dict, Tuple

__all__ = ["LOGITS_PRECISIONS", "MODELS", "check_logits_precision", "served_forwards"]

# linear_logprobs' precisions ("bf16": the logits of a bf16 LM head)
LOGITS_PRECISIONS = ("fp32", "tf32", "bf16")

# (module, class) pairs, resolved when the check runs (a class transformers lacks is skipped).
MODELS: Tuple[Tuple[str, str], ...] = (
    ("transformers.models.llama.modeling_llama", "LlamaForCausalLM"),
    ("transformers.models.mistral.modeling_mistral", "MistralForCausalLM"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3ForCausalLM"),
    ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeForCausalLM"),
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeForCausalLM"),
)


@functools.lru_cache(maxsize=None)
def served_forwards() -> Dict[Any, str]:
    """{the class's ``forward`` function: its class name} of :data:`MODELS`."""
    out = {}
    for module_name, cls_name in MODELS:
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError):
            continue
        out[cls.forward] = cls_name
    return out


def check_logits_precision(logits_precision: Any) -> str:
    if not isinstance(logits_precision, str) or logits_precision not in LOGITS_PRECISIONS:
        raise ValueError(f"logits_precision: expected one of {LOGITS_PRECISIONS}, got {logits_precision!r}")
    return logits_precision
