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

from .._backend import current_backend
from .._head_grad import loss_gradient, step_head
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
# verl's loss modes whose pg term is separable over tokens (each token's gradient depends on its
# own log-prob; the aggregations are linear): their gradient is formed in the forward.
SEPARABLE_LOSS_MODES = ("vanilla", "cispo", "gpg", "sapo", "dppo_tv", "dppo_kl")


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
    n = rows.shape[0]
    where = state.get("loss_rows")
    if where is not None:  # only the rows the loss reads go through the head (0 elsewhere)
        rows, labels = rows[where], labels[where]
        if isinstance(temperature, torch.Tensor):
            temperature = temperature[where]
    entropy_on = state["calculate_entropy"]
    device_type = rows.device.type
    # forward_step's autocast, under which verl runs the loss (and so the probe does)
    autocast = (device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type))
    with torch.autocast(device_type, enabled=False):
        separable = state.get("loss_function") is not None
        logp, entropy = step_head(
            rows,
            weight,
            labels,
            temperature=temperature,
            entropy=entropy_on,
            probe=functools.partial(_probe, state, n, where, dtype, autocast) if separable else None,
            setting=_head.GRAD_IN_FORWARD,
            head=_head.head_kwargs(),
            backend=current_backend(),
            counted_as="verl.forward_step.grad_in_forward",
        )
    return _head_output(logp, entropy if entropy_on else None, n, where, dtype)


def _head_output(logp, entropy, n: int, where, dtype) -> Dict[str, Any]:
    """The model's output from the head rows' results: log-probs in fp32 (as verl's fused kernel
    and flash-attn cross-entropy give them), entropies in the logits' dtype (as
    ``entropy_from_logits``), over every packed row (0 on a row the loss does not read)."""

    def spread(x):
        return x if where is None else x.new_zeros(n).index_copy(0, where, x)

    return {
        "log_probs": spread(logp.to(torch.float32)),
        "entropy": None if entropy is None else spread(entropy.to(dtype)),
    }


def _probe(state, n: int, where, dtype, autocast, logp, entropy):
    """The step's loss at these head-row values, and its gradient with respect to them: verl's
    path from the model's output to the loss (``prepare_model_outputs``, the bound loss), as
    ``forward_step`` runs it after the model (see ``_head_grad``)."""
    engine = state["engine"]

    def loss_of(lp, ent):
        out = _head_output(lp, ent, n, where, dtype)
        model_output = _prepare_model_outputs(engine, state, out, state["output_args"], state["micro_batch"], None)
        loss, _ = state["loss_function"](
            model_output=model_output, data=state["micro_batch"], dp_group=engine.get_data_parallel_group()
        )
        return loss

    device_type, autocast_dtype, enabled = autocast
    return loss_gradient(logp, entropy, loss_of, torch.autocast(device_type, dtype=autocast_dtype, enabled=enabled))


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


def response_rows(micro_batch) -> torch.Tensor:
    """The packed rows whose log-probs ``no_padding_2_padding`` reads (a sequence's last
    ``response_len`` positions before its final one: those that score its response tokens), as
    indices into the packed tokens (any padding after them is not read)."""
    offsets = micro_batch["input_ids"].offsets()
    if micro_batch["prompts"].is_nested:  # the response lengths as no_padding_2_padding takes them
        response_lens = micro_batch["responses"].offsets().diff()
    else:
        response_lens = micro_batch["attention_mask"][:, micro_batch["prompts"].shape[1] :].sum(dim=1)
    ends = offsets[1:].to(response_lens.device)
    lengths = response_lens.to(torch.long)
    starts = ends - lengths - 1
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    within = torch.arange(int(lengths.sum()), device=lengths.device) - first[seq]
    return (starts[seq] + within).to(offsets.device)


def _reads_response_rows_only(loss_function) -> Optional[Any]:
    """The ``config`` of ``loss_function`` when it is verl's engine actor loss, ours or verl's
    (``ppo_loss`` bound with ``functools.partial`` as verl's worker binds it), which reads the
    log-probs and entropies of the response rows only; None otherwise."""
    import verl.workers.utils.losses as verl_losses

    fn, keywords = loss_function, {}
    while isinstance(fn, functools.partial):
        keywords = {**fn.keywords, **keywords}
        fn = fn.func
    # verl's function, or a patched one of ours around it (also one bound before a later apply())
    original = getattr(verl_losses.ppo_loss, "__wrapped_verl__", verl_losses.ppo_loss)
    if fn is not original and getattr(fn, "__wrapped_verl__", None) is not original:
        return None
    return keywords.get("config")


def _separable(config) -> bool:
    """Whether the actor loss ``config`` describes is separable over tokens (``_head_grad``)."""
    policy_loss = getattr(config, "policy_loss", None)
    mode = policy_loss.get("loss_mode", "vanilla") if policy_loss is not None else "vanilla"
    return mode in SEPARABLE_LOSS_MODES


@contextlib.contextmanager
def _swapped(engine, model, state) -> Iterator[None]:
    """The three swaps of one forward step (instance attributes, deleted after)."""
    cls = type(engine)

    def prepare_model_inputs(micro_batch):
        model_inputs, output_args = cls.prepare_model_inputs(engine, micro_batch=micro_batch)
        state["output_args"] = output_args
        state["micro_batch"] = micro_batch
        if not state["use_remove_padding"]:
            state["seq_lengths"] = micro_batch["input_ids"].offsets().diff()
        if state["rows_only"]:
            state["loss_rows"] = response_rows(micro_batch)
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
        state = {
            "engine": self,
            "use_remove_padding": bool(_non_tensor(micro_batch, "use_remove_padding", True)),
            "calculate_entropy": bool(_non_tensor(micro_batch, "calculate_entropy", False)),
            "rows_only": False,
            "loss_function": None,
        }
        config = None
        if not forward_only and not self.use_ulysses_sp and not _non_tensor(micro_batch, "return_model_output", False):
            config = _reads_response_rows_only(loss_function)
        if config is not None:
            state["rows_only"] = _head.LOSS_ROWS_ONLY
            if _head.GRAD_IN_FORWARD is not False and _separable(config) and getattr(self, "scaler", None) is None:
                state["loss_function"] = loss_function  # the head decides (_head_grad.chosen)
        record("verl.forward_step")
        if state["rows_only"]:
            record("verl.forward_step.loss_rows")
        with _swapped(self, _inner(self), state):
            return original(self, micro_batch, loss_function, forward_only)

    forward_step.__wrapped_verl__ = original
    return forward_step
