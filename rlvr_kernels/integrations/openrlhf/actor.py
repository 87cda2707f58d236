"""Drop-in for ``openrlhf.models.actor.Actor.forward`` (OpenRLHF 0.11.2): the log-probs (and
entropy) of the action tokens straight from the last hidden states and the LM head through
``linear_logprobs``, never forming the ``[B, S, V]`` logits.

OpenRLHF's forward runs the whole causal LM, casts the logits to fp32, divides them by the
actor's temperature in place, and then takes ``compute_entropy`` and ``log_probs_from_logits``
of them (``openrlhf/models/actor.py``, ``Actor.forward``). The drop-in runs the model's decoder
(``get_decoder()``), takes the LM head's weight (``get_output_embeddings()``) and gets the
log-probs of the next tokens and the entropies at the same temperature in one fused call. The
rest is OpenRLHF's: the position ids, the packed layout (``packing_samples``: its
``unpad_and_slice_tensor`` / ``gather_and_pad_tensor``, ring attention included), the
``[:, :-1]`` shift, the action slice times the mask, ``output.entropy``.

Which path runs (each counted under its own name with call counting on):

- ``openrlhf.Actor.forward``: the fused head, whenever log-probs are asked for
  (``action_mask`` or ``return_logprobs``) of a transformers causal LM whose LM head is a
  plain ``nn.Linear``. With an ``action_mask`` in the padded layout only the rows that predict
  a valid action token go through the head (``_action_rows``: the action log-probs are
  OpenRLHF's, masked tokens 0 as there; ``output.entropy`` is 0 outside them) unless
  ``apply(action_rows_only=False)``;
- ``openrlhf.Actor.forward[logits]``: OpenRLHF's own forward, whose ``compute_entropy`` and
  ``log_probs_from_logits`` are the drop-ins once applied, when the caller asks for the logits
  (no log-probs requested) or the model has no LM head to fuse (any ``nn.Module`` returning
  logits);
- a model with a head the fused path cannot reproduce (a soft-capped or scaled head, LoRA on
  the head, a VLM's multimodal inputs, MoE router logits, ZeRO-3 partitioned weights) raises
  NotImplementedError naming it under ``apply(strict=True)``; ``strict=False`` warns once and
  runs the logits path.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Optional, Tuple

import torch
import torch.nn as nn

from ...ops.logprobs import linear_logprobs
from .._backend import current_backend
from .._patch import record
from . import _head

__all__ = ["make_forward"]

# config fields of heads linear_logprobs is not told about here (soft-cap, logit scales)
_HEAD_CONFIG_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _unfusable(actor: nn.Module, mm_inputs: dict) -> Optional[str]:
    """Why the fused head cannot reproduce this actor's logits, or None."""
    model = actor.model
    if mm_inputs or getattr(actor, "is_vlm", False):
        return "a vision-language actor (multimodal inputs)"
    config = getattr(model, "config", None)
    for name in _HEAD_CONFIG_FIELDS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            return f"config.{name}={value!r} (a head the fused path does not scale)"
    if getattr(config, "output_router_logits", False):
        return "config.output_router_logits=True (the MoE auxiliary loss is computed from the full model's output)"
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        return f"the LM head is a {type(head).__name__}, not an nn.Linear (e.g. LoRA on lm_head)"
    if hasattr(head.weight, "ds_id"):
        return "ZeRO-3 partitioned LM-head weight"
    return None


def _has_head(model: nn.Module) -> bool:
    """A transformers causal LM with a separate decoder and LM head (else: the logits path)."""
    get_head, get_decoder = getattr(model, "get_output_embeddings", None), getattr(model, "get_decoder", None)
    if not callable(get_head) or not callable(get_decoder):
        return False
    head = get_head()
    return head is not None and get_decoder() is not model


def make_forward(original: Callable, strict: bool = True) -> Callable:
    """``Actor.forward`` with the fused head (module docstring); ``original`` is OpenRLHF's
    (its module's ``unpad_and_slice_tensor`` / ``gather_and_pad_tensor`` are the packing
    helpers used, looked up when called)."""
    peer = original.__globals__
    warned: set = set()

    @functools.wraps(original)
    def forward(
        self,
        sequences: torch.LongTensor,
        action_mask: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        return_output=False,
        allgather_logits=False,
        return_logprobs=False,
        ring_attn_group=None,
        packed_seq_lens: Optional[list] = None,
        return_entropy=False,
        **mm_inputs,
    ):
        args = (sequences, action_mask, attention_mask, return_output, allgather_logits, return_logprobs)
        kwargs = dict(ring_attn_group=ring_attn_group, packed_seq_lens=packed_seq_lens, return_entropy=return_entropy)
        wants_logprobs = action_mask is not None or return_logprobs
        # the logits asked for, or no LM head to fuse: OpenRLHF's forward (on the drop-ins)
        reason = _unfusable(self, mm_inputs) if wants_logprobs and _has_head(self.model) else None
        if reason is not None:
            message = f"rlvr_kernels' Actor.forward: {reason}"
            if strict:
                raise NotImplementedError(
                    message + "; apply(strict=False) runs OpenRLHF's forward (the logits) for such actors"
                )
            if reason not in warned:
                warned.add(reason)
                warnings.warn(message + "; running OpenRLHF's forward (the logits)", RuntimeWarning, stacklevel=2)
        if reason is not None or not wants_logprobs or not _has_head(self.model):
            record("openrlhf.Actor.forward[logits]")
            return original(self, *args, **kwargs, **mm_inputs)
        if return_entropy and not return_output:
            raise ValueError("return_entropy: needs return_output=True (OpenRLHF asserts it)")
        record("openrlhf.Actor.forward")
        return _fused_forward(self, peer, sequences, action_mask, attention_mask, return_output,
                              return_logprobs, ring_attn_group, return_entropy)  # fmt: skip

    forward.__wrapped_openrlhf__ = original
    return forward


def _inputs(actor, peer: dict, sequences, attention_mask, ring_attn_group) -> Tuple[Any, ...]:
    """(model inputs, next tokens, packing state) exactly as OpenRLHF's forward forms them."""
    if actor.packing_samples:
        sequences, position_ids, rolled, pad_len, indices = peer["unpad_and_slice_tensor"](
            sequences, attention_mask, ring_attn_group
        )
        return sequences, None, position_ids, rolled, (pad_len, indices)
    rolled = torch.roll(sequences, shifts=-1, dims=1)
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    return sequences, attention_mask, position_ids, rolled, None


def _fused_forward(
    actor, peer, sequences, action_mask, attention_mask, return_output, return_logprobs, ring_attn_group, return_entropy
):
    batch, seqlen = sequences.size()
    ids, mask, position_ids, rolled, packing = _inputs(actor, peer, sequences, attention_mask, ring_attn_group)
    model = actor.model
    output = model.get_decoder()(ids, attention_mask=mask, position_ids=position_ids)
    hidden = output[0]
    head = model.get_output_embeddings()

    def score(h, targets):
        return linear_logprobs(
            h,
            head.weight,
            targets,
            temperature=actor.temperature,
            bias=head.bias,
            return_entropy=return_entropy,
            backend=current_backend(),
            **_head.head_kwargs(),
        )

    if action_mask is not None and packing is None and _head.ACTION_ROWS_ONLY:
        return _action_rows(output, hidden, sequences, action_mask, score, return_output, return_entropy)
    res = score(hidden.reshape(-1, hidden.shape[-1]), rolled.reshape(-1))
    log_probs = res.logp.view(rolled.shape)

    def unpack(t):
        if packing is None:
            return t
        return peer["gather_and_pad_tensor"](t, ring_attn_group, packing[0], packing[1], batch, seqlen)

    if return_entropy:
        output.entropy = unpack(res.entropy.view(rolled.shape))[:, :-1]
    log_probs = unpack(log_probs)[:, :-1]
    if action_mask is None:  # return_logprobs
        return (log_probs, output) if return_output else log_probs
    action_log_probs = log_probs[:, -action_mask.shape[1] :] * action_mask.float()
    return (action_log_probs, output) if return_output else action_log_probs


def _action_rows(output, hidden, sequences, action_mask, score, return_output, return_entropy):
    """Only the rows that predict an action token through the head (padded layout): action j
    (token S − A + j) is predicted by hidden row S − A − 1 + j, and OpenRLHF multiplies the
    rest by the mask. The entropy is 0 outside those rows (``ActorPPOTrainer`` aggregates it over
    the action mask); ``apply(action_rows_only=False)`` scores every position, as OpenRLHF."""
    batch, seqlen = sequences.shape
    A = action_mask.shape[1]
    if not 0 < A < seqlen:
        raise ValueError(f"action_mask: expected 0 < {A} (its length) < {seqlen} (the sequence length)")
    keep = action_mask.bool()
    where = keep.nonzero(as_tuple=True)
    h = hidden[:, seqlen - A - 1 : seqlen - 1][where]
    res = score(h, sequences[:, seqlen - A :][where])
    action_log_probs = res.logp.new_zeros(batch, A).index_put(where, res.logp)
    if return_entropy:
        entropy = res.entropy.new_zeros(batch, seqlen - 1)
        output.entropy = entropy.index_put((where[0], where[1] + (seqlen - 1 - A)), res.entropy)
    return (action_log_probs, output) if return_output else action_log_probs
