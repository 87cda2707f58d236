"""verl's FSDP actor engine (``verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead``)
without the ``[tokens, vocab]`` logits.

Stock, the engine's ``forward_step`` runs ``prepare_model_inputs``, the whole model (the
Hugging Face ``*ForCausalLM.forward``: the decoder, then ``logits = lm_head(hidden)``), and
``prepare_model_outputs``, which divides the logits by the per-token temperature and calls
``logprobs_from_logits`` / ``entropy_from_logits`` on them. verl's own logit-free path
(``use_fused_kernels``: ``verl/models/transformers/monkey_patch.py``,
``patch_forward_with_backends``, replaces the model class's forward with
``verl/models/transformers/dense_common.py``'s ``forward_with_triton_backend``: the decoder,
then ``linear_cross_entropy(hidden, lm_head.weight, labels, temperature)``) needs that flag,
a CUDA kernel and a scalar temperature.

The replacement ``forward_step`` (:func:`make_forward_step`) keeps verl's ``forward_step``
(autocast, the loss call, the detached outputs) and, for the one call, swaps three things on
the engine and its model instance (restored after, also on error):

- ``prepare_model_inputs``: verl's, its ``output_args`` (the rolled labels, the per-token
  temperature, the padding of the packed layout) kept for the model;
- the model's ``forward`` (an instance attribute, so the FSDP hooks of the root module still
  run around it and the LM head's weight is the unsharded one, as in verl's fused path): the
  decoder (``self.model``) with the arguments verl gives the model, then
  :func:`rlvr_kernels.linear_logprobs` on the hidden states and ``lm_head.weight``;
- ``prepare_model_outputs``: verl's layout of the results (the Ulysses gather and the
  removal of the packed padding by ``_gather_and_unpad_packed``, the jagged nesting by the
  input's offsets), from per-token log-probs instead of logits.

The numbers are those of verl's logits path, each at its place: the labels are verl's
``input_ids_rmpad_rolled`` in both layouts (remove-padding and padded), the temperature is
verl's per token (``temperature.clamp(min=1e-8)``, in the logits' dtype, which is what
``_scale_logits_by_temperature`` divides by), the head runs in the dtype ``lm_head`` would
(the autocast dtype inside autocast), and ``apply(logits_precision=..., match_sampling=...)``
reach the op through ``_head.head_kwargs()``. Log-probs come back in fp32 (as verl's
flash-attn cross-entropy and its fused kernel return them), entropies in the logits' dtype
(as ``entropy_from_logits``). ``entropy_checkpointing`` and ``entropy_from_logits_with_chunking``
are memory options of the logits path: here there are no logits, and the entropy is the same.

Served where the head is known to be ``lm_head(hidden)`` and nothing else (:data:`MODELS`, shared
with AReaL's logit-free engine in ``rlvr_kernels/integrations/_lm_head.py``),
and where verl's logits path computes only log-probs and entropy; anything else raises
``NotImplementedError`` naming the reason (:func:`unserved_reason`): ``apply(logit_free=False)``
keeps verl's logits path (with the log-prob drop-ins), never chosen behind the caller's back.
Run as they are: ``use_fused_kernels`` (verl's own logit-free path; under apply() its
``linear_cross_entropy`` is the fused op) and an engine subclass with its own
``prepare_model_inputs`` / ``prepare_model_outputs`` (the value-head engine: not a log-prob
step, nothing of it is replaced).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Dict, Iterator, Optional

import torch

from ...ops.logprobs import linear_logprobs
from .._backend import current_backend
from .._lm_head import MODELS
from .._lm_head import served_forwards as _served_forwards
from .._patch import record
from . import _head

__all__ = ["MODELS", "make_forward_step", "unserved_reason"]

# Non-tensor settings of a micro-batch under which verl's logits path computes more than
# log-probs and entropy from the logits.
_LOGIT_USERS = ("calculate_sum_pi_squared", "distillation_use_topk", "distillation_only")
# The reason given for an engine subclass with its own inputs or outputs (the value-head
# engine, other backends): another engine, which runs its own step without a warning.
_OVERRIDE = "the engine class overrides FSDPEngineWithLMHead."


def _inner(engine) -> torch.nn.Module:
    """The Hugging Face model inside the engine's module (FSDP1 wraps it, ``.module``; under
    FSDP2 and unwrapped the module is the model itself)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    module = engine.module
    return module.module if isinstance(module, FullyShardedDataParallel) else module


def _non_tensor(micro_batch, key: str, default: Any) -> Any:
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=micro_batch, key=key, default=default)


def unserved_reason(engine, micro_batch, originals: Dict[str, Callable]) -> Optional[str]:
    """Why this forward step must run verl's logits path (None: it is served logit-free).
    ``originals``: verl's ``FSDPEngineWithLMHead`` methods the replacement relies on."""
    cls = type(engine)
    for name, fn in originals.items():
        if getattr(cls, name) is not fn:
            return f"{_OVERRIDE}{name}"
    for key in _LOGIT_USERS:
        if _non_tensor(micro_batch, key, False):
            return f"{key}=True needs the logits"
    multi_modal = micro_batch.get("multi_modal_inputs", None)
    if multi_modal is not None and len(multi_modal):
        return "multi_modal_inputs: the served model classes are text-only"
    model = _inner(engine)
    forward = getattr(type(model), "forward", None)
    if forward not in _served_forwards() or "forward" in vars(model):
        return (
            f"the model's forward ({type(model).__name__}) is not one whose head is known to be lm_head(hidden) "
            f"(transformers' own forward of {', '.join(c for _, c in MODELS)})"
        )
    head = getattr(model, "lm_head", None)
    if type(head) is not torch.nn.Linear or head.bias is not None or not hasattr(model, "model"):
        return f"the LM head ({type(head).__name__}) is not a bias-free torch.nn.Linear under model.lm_head"
    if head._forward_hooks or head._forward_pre_hooks:
        return "the LM head has forward hooks (they would not run)"
    return None


def _head_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype ``lm_head(hidden)`` computes in: the autocast dtype inside autocast."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def _logit_free_forward(model, state: Dict[str, Any], *args, **kwargs):
    """The model's forward for one call: the decoder, then the fused head."""
    if args:
        raise TypeError("the engine calls the model with keyword arguments only")
    kwargs.pop("logits_to_keep", None)
    out = model.model(**kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    weight = model.lm_head.weight
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        DTensor = ()
    if isinstance(weight, DTensor) or isinstance(hidden, DTensor):
        raise NotImplementedError("rlvr_kernels' verl forward_step: a tensor-parallel (DTensor) LM head")
    args_ = state["output_args"]
    labels = args_["input_ids_rmpad_rolled"]
    if state["use_remove_padding"]:
        rows = hidden.squeeze(0)  # [1, tokens (+ pad), H]
        temperature = args_["temperature_rmpad"]  # [tokens (+ pad)]
    else:
        # padded [bsz, seqlen, H], each sequence left-aligned: its first seq_len positions, in
        # the order of input_ids.values() (verl's labels are rolled over those)
        lengths = state["seq_lengths"]
        valid = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lengths[:, None]
        rows = hidden[valid]
        temperature = args_["temperature"].repeat_interleave(lengths)
    dtype = _head_dtype(rows)
    rows, weight = rows.to(dtype), weight.to(dtype)
    if args_.get("temperature_is_one", False):
        temperature = 1.0
    else:  # what verl's _scale_logits_by_temperature divides the logits by
        temperature = temperature.clamp(min=1e-8).to(dtype).to(torch.float32)
    with torch.autocast(rows.device.type, enabled=False):
        res = linear_logprobs(
            rows,
            weight,
            labels,
            temperature=temperature,
            return_entropy=state["calculate_entropy"],
            backend=current_backend(),
            **_head.head_kwargs(),
        )
    entropy = res.entropy.to(dtype) if state["calculate_entropy"] else None
    return {"log_probs": res.logp.to(torch.float32), "entropy": entropy}


def _prepare_model_outputs(engine, state, output, output_args, micro_batch, logits_processor_func):
    """verl's layout of the per-token results (``prepare_model_outputs`` less the logits)."""
    cu_seqlens = micro_batch["input_ids"].offsets()
    log_probs, entropy = output["log_probs"], output["entropy"]
    if state["use_remove_padding"]:
        pad_size = output_args["pad_size"]
        log_probs = engine._gather_and_unpad_packed(log_probs, pad_size)
        if entropy is not None:
            entropy = engine._gather_and_unpad_packed(entropy, pad_size)
    model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(log_probs, cu_seqlens)}
    if entropy is not None:
        model_output["entropy"] = torch.nested.nested_tensor_from_jagged(entropy, cu_seqlens)
    return model_output


@contextlib.contextmanager
def _swapped(engine, model, state) -> Iterator[None]:
    """The three swaps of one forward step (instance attributes, deleted after)."""
    cls = type(engine)

    def prepare_model_inputs(micro_batch):
        model_inputs, output_args = cls.prepare_model_inputs(engine, micro_batch=micro_batch)
        state["output_args"] = output_args
        if not state["use_remove_padding"]:
            state["seq_lengths"] = micro_batch["input_ids"].offsets().diff()
        return model_inputs, output_args

    swaps = [
        (engine, "prepare_model_inputs", prepare_model_inputs),
        (engine, "prepare_model_outputs", functools.partial(_prepare_model_outputs, engine, state)),
        (model, "forward", functools.partial(_logit_free_forward, model, state)),
    ]
    done = []
    try:
        for obj, name, value in swaps:
            setattr(obj, name, value)
            done.append((obj, name))
        yield
    finally:
        for obj, name in reversed(done):
            delattr(obj, name)


def make_forward_step(original: Callable) -> Callable:
    """``FSDPEngineWithLMHead.forward_step`` that serves the step logit-free where it can
    (:func:`unserved_reason`), else runs ``original`` (verl's)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    originals = {
        name: getattr(FSDPEngineWithLMHead, name)
        for name in ("prepare_model_inputs", "prepare_model_outputs", "_gather_and_unpad_packed")
    }

    @functools.wraps(original)
    def forward_step(self, micro_batch, loss_function, forward_only):
        if _non_tensor(micro_batch, "use_fused_kernels", False):
            record("verl.forward_step[verl]")  # verl's own logit-free path
            return original(self, micro_batch, loss_function, forward_only)
        reason = unserved_reason(self, micro_batch, originals)
        if reason is not None and reason.startswith(_OVERRIDE):
            record("verl.forward_step[verl]")  # another engine's step: not replaced
            return original(self, micro_batch, loss_function, forward_only)
        if reason is not None:
            raise NotImplementedError(
                f"rlvr_kernels.integrations.verl.apply(logit_free=True): {reason}; apply(logit_free=False) "
                "keeps verl's forward_step with the logits (and the log-prob drop-ins)"
            )
        record("verl.forward_step")
        state = {
            "use_remove_padding": bool(_non_tensor(micro_batch, "use_remove_padding", True)),
            "calculate_entropy": bool(_non_tensor(micro_batch, "calculate_entropy", False)),
        }
        with _swapped(self, _inner(self), state):
            return original(self, micro_batch, loss_function, forward_only)

    forward_step.__wrapped_verl__ = original
    return forward_step
