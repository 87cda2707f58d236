"""Drop-ins for AReaL (1.0.4), built on the fused ops, one module per AReaL module:

==================  ======================================================================
``functional``      ``areal.utils.functional``: ``ppo_actor_loss_fn`` (decoupled PPO against
                    the proximal log-probs, rejection sampling, GSPO, dual clip),
                    ``sapo_loss_fn``, ``gather_logprobs`` / ``gather_logprobs_entropy``
``actor``           ``areal.trainer.ppo.actor``: ``grpo_loss_fn``, the ``loss_fn`` of
                    ``engine.train_batch``
``data``            ``areal.utils.data``: ``Normalization`` (reward / advantage normalisation)
``fsdp_engine``     ``areal.engine.fsdp_engine.FSDPEngine``: the logit-free micro-batch step
``patch``           :func:`apply` / :func:`unapply`
==================  ======================================================================

Each drop-in has AReaL's signature and numbers (tests/integrations/test_areal_*.py run AReaL's
own functions and its FSDP engine). Importing this package does not import AReaL. Backend
selection: the innermost ``with use_backend(...)`` block (as for every integration).
"""

from .._backend import use_backend
from .actor import grpo_loss_fn
from .data import Normalization
from .functional import gather_logprobs, gather_logprobs_entropy, ppo_actor_loss_fn, sapo_loss_fn
from .patch import applied_options, apply, is_applied, unapply

__all__ = [
    "apply",
    "unapply",
    "is_applied",
    "applied_options",
    "grpo_loss_fn",
    "ppo_actor_loss_fn",
    "sapo_loss_fn",
    "gather_logprobs",
    "gather_logprobs_entropy",
    "Normalization",
    "use_backend",
]
