"""AReaL 1.0.4's FSDP engine (``areal.engine.fsdp_engine.FSDPEngine``) without the
``[tokens, vocab]`` logits.

Stock, ``FSDPEngine.forward_backward_batch`` runs the whole model on each packed micro-batch
(the Hugging Face ``*ForCausalLM.forward``: the decoder, then ``logits = lm_head(hidden)``) and
hands ``outputs.logits`` to the step's ``process_output``: ``train_batch`` and ``eval_batch``
go to ``_compute_logprobs_and_loss`` (``gather_logprobs_entropy`` of the logits at the labels
``torch.roll(input_ids, -1)`` and the engine's temperature, the per-token vocabulary extremes,
the padding removed, then ``loss_fn(logprobs, entropy, mb_input, vocab_min_logits=...,
vocab_max_logits=...)`` scaled by ``loss_weight_fn``), ``forward_batch`` (``compute_logp``) to
``_compute_forward_result`` (``gather_logprobs``).

The replacement ``forward_backward_batch`` (:func:`make_forward_backward_batch`) runs AReaL's
own loop with, for the call, the model's ``forward`` an instance attribute (so the FSDP2 hooks
of the root module still run around it and ``lm_head.weight`` is the unsharded one): the
decoder (``model.model``) with the engine's inputs, then :func:`rlvr_kernels.linear_logprobs`
on the hidden states, the head and the same labels and temperature. Its "logits" are the
``[tokens, 2]`` (log-prob, entropy) columns (``[tokens, 1]`` for ``forward_batch``), which
``_compute_logprobs_and_loss`` / ``_compute_forward_result`` (replaced too, AReaL's own outside
such a call) read instead of gathering from logits: the scaling by the loss weight and the
padding removal are AReaL's. ``vocab_min_logits`` / ``vocab_max_logits`` are None (they read
every logit), so ``grpo_loss_fn`` does not log those two statistics. With AReaL's
``grpo_loss_fn`` as the step's ``loss_fn`` (:func:`reads_loss_rows_only`) and
``apply(loss_rows_only=True)``, only the rows of the micro-batch's loss mask go through the head
(log-prob and entropy 0 elsewhere): ``grpo_loss_fn`` reads nothing else.

Served: a text model of :data:`rlvr_kernels.integrations._lm_head.MODELS` with a bias-free
``nn.Linear`` head at ``model.lm_head``, without tree training, Ulysses sequence parallelism or
tensor parallelism (:func:`unserved_reason`); anything else raises NotImplementedError naming
it under ``apply(strict=True)`` (``strict=False``: a warning, and AReaL's logits path). A critic,
an engine subclass with its own steps and any other ``process_output`` run AReaL's code as is.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from .._backend import current_backend
from .._head_grad import loss_gradient, step_head
from .._lm_head import MODELS, served_forwards
from .._patch import record
from . import _head

__all__ = ["make_forward_backward_batch", "make_compute_logprobs_and_loss", "make_compute_forward_result"]

# the step closures of FSDPEngine whose process_output reads only log-probs (and entropy)
_STEPS = {
    "FSDPEngine.train_batch.<locals>.process_output": True,
    "FSDPEngine.eval_batch.<locals>.process_output": True,
    "FSDPEngine.forward_batch.<locals>.process_output": False,  # no entropy
}
# the methods the served path relies on (an engine subclass overriding one runs AReaL's loop)
_METHODS = ("_compute_logprobs_and_loss", "_compute_forward_result", "_prepare_mb_inputs")
# The reason given where AReaL's code runs as it is, without a warning.
_OTHER = "not a log-prob step of FSDPEngine: "
# the instance attribute that marks a served call (its value: whether entropy is computed)
_STATE = "_rlvr_kernels_logit_free"


def unserved_reason(engine, process_output_fn, base) -> Optional[str]:
    """Why this call must run AReaL's logits path (None: served logit-free); ``base``:
    AReaL's ``FSDPEngine`` (its methods as applied)."""
    cls = type(engine)
    for name in _METHODS:
        if getattr(cls, name) is not getattr(base, name):
            return f"{_OTHER}the engine class overrides {name}"
    if getattr(engine.config, "is_critic", False):
        return f"{_OTHER}a critic (value head)"
    if getattr(process_output_fn, "__qualname__", None) not in _STEPS:
        return f"{_OTHER}another process_output_fn"
    if engine.enable_tree_training:
        return "enable_tree_training=True (the logits of a packed prefix tree)"
    helper = engine.parallel_helper
    if helper.sp_size > 1:
        return f"Ulysses sequence parallelism (sp_size={helper.sp_size})"
    if helper.tp_size > 1:
        return f"tensor parallelism (tp_size={helper.tp_size}: a vocabulary-parallel LM head)"
    if engine.is_vision_model:
        return "a vision-language model (the served model classes are text-only)"
    model = engine.model
    if getattr(type(model), "forward", None) not in served_forwards() or "forward" in vars(model):
        return (
            f"the model's forward ({type(model).__name__}) is not one whose head is known to be lm_head(hidden) "
            f"(transformers' own forward of {', '.join(c for _, c in MODELS)})"
        )
    head = getattr(model, "lm_head", None)
    if (
        not isinstance(head, nn.Linear)
        or type(head).forward is not nn.Linear.forward
        or head.bias is not None
        or not hasattr(model, "model")
    ):
        return f"the LM head ({type(head).__name__}) is not a bias-free torch.nn.Linear under model.lm_head"
    if head._forward_hooks or head._forward_pre_hooks:
        return "the LM head has forward hooks of its own (they would not run)"
    return None


def _head_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype ``lm_head(hidden)`` computes in: the autocast dtype inside autocast."""
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return hidden.dtype


class _Call:
    """One served ``forward_backward_batch``: whether the step reads entropy, and, where the
    loss reads only the loss-mask rows, those rows of the micro-batch being run; with the head's
    gradient formed in the forward, the step's ``process_output`` and the micro-batch's context."""

    def __init__(self, entropy: bool, loss_rows_only: bool, process_output: Optional[Callable] = None):
        self.entropy = entropy
        self.loss_rows_only = loss_rows_only
        self.process_output = process_output
        self.rows: Optional[torch.Tensor] = None
        self.ctx: Any = None


def _logit_free_forward(model, engine, call: _Call, *args, **kwargs):
    """The model's forward for one micro-batch: the decoder, then the fused head; ``logits``
    are the (log-prob, entropy) columns of the packed tokens, ``[1, T, 2]`` (``[1, T, 1]``)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if args:
        raise TypeError("AReaL's engine calls the model with keyword arguments only")
    if kwargs.get("labels") is not None:
        raise NotImplementedError("rlvr_kernels' AReaL FSDPEngine: a model call with labels (its own loss)")
    kwargs.pop("labels", None)
    kwargs.pop("logits_to_keep", None)
    input_ids = kwargs["input_ids"]
    out = model.model(**kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    rows = hidden.reshape(-1, hidden.shape[-1])
    # AReaL's labels: the packed ids rolled by one (the next token; the last position of each
    # sequence reads the next one's first, outside the loss mask)
    labels = torch.roll(input_ids, shifts=-1, dims=-1).reshape(-1)
    where = None
    if call.rows is not None:  # only the rows the loss reads through the head, 0 elsewhere
        where = call.rows.nonzero(as_tuple=True)[0]
        rows, labels = rows[where], labels[where]
    dtype = _head_dtype(rows)
    n = hidden.shape[0] * hidden.shape[1]
    temperature = float(engine.config.temperature)
    with torch.autocast(rows.device.type, enabled=False):
        logp, entropy = step_head(
            rows.to(dtype),
            model.lm_head.weight.to(dtype),
            labels,
            temperature=temperature,
            entropy=call.entropy,
            probe=functools.partial(_probe, call, n, where) if call.process_output is not None else None,
            setting=_head.GRAD_IN_FORWARD,
            head=_head.head_kwargs(),
            backend=current_backend(),
            counted_as="areal.FSDPEngine.forward_backward_batch.grad_in_forward",
        )
    # a ModelOutput, a fresh tensor (not a view): FSDP2 hooks the backward of the root's outputs
    return CausalLMOutputWithPast(logits=_columns(logp, entropy if call.entropy else None, n, where))


def _columns(logp, entropy, n: int, where) -> torch.Tensor:
    """The (log-prob, entropy) columns ``[1, T, 2]`` (``[1, T, 1]``) over every packed row from the
    head rows' values (0 on a row the loss does not read)."""
    cols = [logp.float()] + ([entropy.float()] if entropy is not None else [])
    if where is not None:
        cols = [c.new_zeros(n).index_put((where,), c) for c in cols]
    return torch.stack([c[None] for c in cols], dim=-1)


def _probe(call: _Call, n: int, where, logp, entropy):
    """The step's loss at these head-row values and its gradient with respect to them: AReaL's
    path from the model's output to the loss (``process_output`` of ``train_batch``: the loss
    function, its weight), as ``forward_backward_batch`` runs it after the model, with AReaL's
    statistics left as they were (see ``_head_grad``)."""

    def loss_of(lp, ent):
        return call.process_output(_columns(lp, ent, n, where).squeeze(0), call.ctx.to_dict())

    return loss_gradient(logp, entropy, loss_of, _stats_untouched())


@contextlib.contextmanager
def _stats_untouched() -> Iterator[None]:
    """AReaL's statistics trackers (``areal.utils.stats_tracker``) as they were before the block:
    what a probe of the loss records is dropped."""
    from areal.utils import stats_tracker

    saved = {
        name: (
            list(t.scope_stack),
            dict(t.denominators),
            dict(t.reduce_types),
            {k: list(v) for k, v in t.stats.items()},
        )
        for name, t in stats_tracker.TRACKERS.items()
    }
    try:
        yield
    finally:
        for name in [k for k in stats_tracker.TRACKERS if k not in saved]:
            del stats_tracker.TRACKERS[name]
        for name, (scopes, denominators, reduce_types, stats) in saved.items():
            tracker = stats_tracker.TRACKERS[name]
            tracker.scope_stack[:] = scopes
            tracker.denominators = denominators
            tracker.reduce_types = reduce_types
            tracker.stats = collections.defaultdict(list, stats)


def forms_grad_in_forward(loss_fn) -> bool:
    """Whether ``loss_fn`` (AReaL's ``grpo_loss_fn`` or ours, bound as ``PPOActor`` binds it) is
    separable over tokens: token-level importance sampling, no M2PO token selection, the proximal
    log-probs recomputed (data of the step); its rejection sampling compares the proximal and
    behaviour log-probs, also data."""
    if not reads_loss_rows_only(loss_fn):
        return False
    keywords: dict = {}
    fn = loss_fn
    while isinstance(fn, functools.partial):
        keywords = {**fn.keywords, **keywords}
        fn = fn.func
    return (
        keywords.get("m2_threshold") is None
        and keywords.get("importance_sampling_level", "token") == "token"
        and keywords.get("prox_logp_method", "recompute") == "recompute"
    )


def _loss_fn_of(process_output_fn) -> Any:
    """The ``loss_fn`` that AReaL's ``train_batch`` / ``eval_batch`` closure calls, or None."""
    code, cells = getattr(process_output_fn, "__code__", None), getattr(process_output_fn, "__closure__", None)
    if code is None or not cells or "loss_fn" not in code.co_freevars:
        return None
    return cells[code.co_freevars.index("loss_fn")].cell_contents


def reads_loss_rows_only(loss_fn) -> bool:
    """Whether ``loss_fn`` is AReaL's ``grpo_loss_fn`` (or ours; as ``PPOActor`` binds it, a
    ``functools.partial``), which reads the log-probs and entropy on the loss mask only (its
    loss and every statistic it logs are masked by it)."""
    fn = loss_fn
    while isinstance(fn, functools.partial):
        fn = fn.func
    from .actor import grpo_loss_fn

    peer = sys.modules.get("areal.trainer.ppo.actor")
    return fn is grpo_loss_fn or (peer is not None and fn is getattr(peer, "grpo_loss_fn", None))


@contextlib.contextmanager
def _swapped(engine, call: _Call) -> Iterator[None]:
    model = engine.model
    prepare = engine._prepare_mb_inputs

    def prepare_mb_inputs(mb_item):
        inputs, ctx = prepare(mb_item)
        call.ctx = ctx
        if call.loss_rows_only:  # the loss mask over the packed tokens and the padding after them
            mask = ctx.mb_input["loss_mask"].reshape(-1) != 0
            call.rows = torch.cat([mask, mask.new_zeros(ctx.pad_length)])
        return inputs, ctx

    model.forward = functools.partial(_logit_free_forward, model, engine, call)
    engine._prepare_mb_inputs = prepare_mb_inputs
    setattr(engine, _STATE, call)
    try:
        yield
    finally:
        delattr(engine, _STATE)
        del engine._prepare_mb_inputs
        del model.forward


def make_forward_backward_batch(original: Callable, strict: bool = True) -> Callable:
    """``FSDPEngine.forward_backward_batch`` served logit-free where it can (module docstring)."""
    from areal.engine.fsdp_engine import FSDPEngine as base

    warned: set = set()

    @functools.wraps(original)
    def forward_backward_batch(self, mb_list, process_output_fn, forward_only: bool = False):
        reason = unserved_reason(self, process_output_fn, base)
        if reason is not None and not reason.startswith(_OTHER):
            message = f"rlvr_kernels' AReaL FSDPEngine.forward_backward_batch: {reason}"
            if strict:
                raise NotImplementedError(message + "; apply(strict=False) runs AReaL's logits path for it")
            if reason not in warned:
                warned.add(reason)
                warnings.warn(message + "; running AReaL's logits path", RuntimeWarning, stacklevel=2)
        if reason is not None:
            record("areal.FSDPEngine.forward_backward_batch[logits]")
            return original(self, mb_list, process_output_fn, forward_only)
        entropy = _STEPS[process_output_fn.__qualname__]
        loss_fn = _loss_fn_of(process_output_fn)
        rows_only = _head.LOSS_ROWS_ONLY and entropy and reads_loss_rows_only(loss_fn)
        record("areal.FSDPEngine.forward_backward_batch" + ("[loss rows]" if rows_only else ""))
        probed = (  # the head decides (_head_grad.chosen)
            not forward_only and entropy and _head.GRAD_IN_FORWARD is not False and not self.parallel_helper.sp_size > 1
        ) and forms_grad_in_forward(loss_fn)
        with _swapped(self, _Call(entropy, rows_only, process_output_fn if probed else None)):
            return original(self, mb_list, process_output_fn, forward_only)

    forward_backward_batch.__wrapped_areal__ = original
    return forward_backward_batch


def make_compute_logprobs_and_loss(original: Callable) -> Callable:
    """``FSDPEngine._compute_logprobs_and_loss`` reading the served columns (AReaL's outside a
    served call)."""

    @functools.wraps(original)
    def _compute_logprobs_and_loss(
        self, logits, ctx, loss_fn, loss_weight_fn, total_loss_weight, loss_multiplier: float = 1.0
    ):
        if _STATE not in self.__dict__:
            return original(self, logits, ctx, loss_fn, loss_weight_fn, total_loss_weight, loss_multiplier)
        local_weight = loss_weight_fn(ctx.mb_input)
        if local_weight == 0:
            return logits.mean() * 0.0  # AReaL's zero loss, connected to the graph
        logprobs, entropy = logits[:, 0], logits[:, 1]
        if ctx.pad_length > 0:
            logprobs, entropy = logprobs[: -ctx.pad_length], entropy[: -ctx.pad_length]
        loss = loss_fn(logprobs, entropy, ctx.mb_input, vocab_min_logits=None, vocab_max_logits=None)
        return loss * (local_weight / total_loss_weight * loss_multiplier)

    return _compute_logprobs_and_loss


def make_compute_forward_result(original: Callable) -> Callable:
    """``FSDPEngine._compute_forward_result`` reading the served log-probs (AReaL's outside a
    served call)."""

    @functools.wraps(original)
    def _compute_forward_result(self, logits, ctx) -> Any:
        if _STATE not in self.__dict__:
            return original(self, logits, ctx)
        result = logits[:, 0]
        return result[: -ctx.pad_length] if ctx.pad_length > 0 else result

    return _compute_forward_result
