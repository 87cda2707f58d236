"""Drop-in for ``areal.trainer.ppo.actor.grpo_loss_fn`` (AReaL 1.0.4): the ``loss_fn`` that
``PPOActor._ppo_update`` passes to ``engine.train_batch``, on the fused loss.

AReaL's ``grpo_loss_fn`` resolves the proximal log-probs (``prox_logp`` as recomputed, or its
log-linear approximation from the ``versions``), applies M2PO's mask (``m2_threshold``), calls
``sapo_loss_fn`` (``use_sapo_loss``; refused with ``use_decoupled_loss``) or
``ppo_actor_loss_fn``, adds the distillation KL term (``teacher_logp``) and logs its statistics
to ``stats_tracker``. The drop-in is that same function, run with the fused
``ppo_actor_loss_fn`` / ``sapo_loss_fn`` (:mod:`.functional`) in place of AReaL's: everything
around the policy loss (the proximal resolution, M2PO, the distillation term, the logging
and its keys) is AReaL's own code, so it stays exactly AReaL's. AReaL is imported at the
first call (``areal.trainer.ppo.actor`` needs AReaL's logging backends).

``PPOActor`` takes ``grpo_loss_fn`` from its module at each update: once :func:`apply` has
replaced the two losses there, AReaL's own ``grpo_loss_fn`` is this one.
"""

from __future__ import annotations

import functools
import types
from typing import Callable, Optional

import torch

from .._patch import record
from . import functional

__all__ = ["grpo_loss_fn"]

_PEER = "areal.trainer.ppo.actor"
_built: Optional[Callable] = None


def _fused(original: Callable) -> Callable:
    """``original`` (AReaL's ``grpo_loss_fn``) reading our two losses instead of its module's."""
    scope = dict(original.__globals__)
    scope.update(ppo_actor_loss_fn=functional.ppo_actor_loss_fn, sapo_loss_fn=functional.sapo_loss_fn)
    fn = types.FunctionType(original.__code__, scope, original.__name__, original.__defaults__, original.__closure__)
    fn.__kwdefaults__ = original.__kwdefaults__
    return functools.wraps(original)(fn)


def _peer_loss() -> Callable:
    global _built
    if _built is None:
        import importlib

        peer = importlib.import_module(_PEER)
        original = peer.grpo_loss_fn
        _built = _fused(getattr(original, "__wrapped__", original))
    return _built


def grpo_loss_fn(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    input_data: dict,
    eps_clip: float,
    eps_clip_higher: float | None,
    c_clip: float | None,
    rejection_sampling=None,
    m2_threshold: float | None = None,
    importance_sampling_level: str = "token",
    current_version: int | None = None,
    prox_logp_method: str = "recompute",
    use_sapo_loss: bool = False,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    use_decoupled_loss: bool = False,
    vocab_min_logits: torch.Tensor | None = None,
    vocab_max_logits: torch.Tensor | None = None,
):
    """AReaL ``grpo_loss_fn`` with the fused losses (module docstring)."""
    record("areal.grpo_loss_fn")
    return _peer_loss()(
        logprobs,
        entropy,
        input_data,
        eps_clip,
        eps_clip_higher,
        c_clip,
        rejection_sampling=rejection_sampling,
        m2_threshold=m2_threshold,
        importance_sampling_level=importance_sampling_level,
        current_version=current_version,
        prox_logp_method=prox_logp_method,
        use_sapo_loss=use_sapo_loss,
        sapo_tau_pos=sapo_tau_pos,
        sapo_tau_neg=sapo_tau_neg,
        use_decoupled_loss=use_decoupled_loss,
        vocab_min_logits=vocab_min_logits,
        vocab_max_logits=vocab_max_logits,
    )
