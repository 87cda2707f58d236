"""Drop-ins for OpenRLHF (0.11.2), built on the fused ops, one module per OpenRLHF module:

==========================  ================================================================
``loss``                    ``openrlhf.models.loss``: ``PolicyLoss`` (every
                            ``policy_loss_type`` and importance-sampling correction)
``utils``                   ``openrlhf.models.utils``: ``compute_approx_kl``,
                            ``log_probs_from_logits``, ``compute_entropy``
``actor``                   ``openrlhf.models.actor.Actor.forward``, logit-free
                            (``make_forward`` builds it from OpenRLHF's)
``experience_maker``        ``openrlhf.trainer.ppo_utils.experience_maker``:
                            ``RemoteExperienceMaker.compute_advantages_and_returns``
``patch``                   :func:`apply` / :func:`unapply`
==========================  ================================================================

Each drop-in has OpenRLHF's signature and numbers (tests/integrations/test_openrlhf_*.py run
OpenRLHF's own functions, its ``Actor`` and its shipped tests). Importing this package does not
import OpenRLHF. Backend selection: the innermost ``with use_backend(...)`` block (as for every
integration).
"""

from .._backend import use_backend
from .loss import PolicyLoss
from .patch import applied_options, apply, is_applied, unapply
from .utils import compute_approx_kl, compute_entropy, log_probs_from_logits

__all__ = [
    "apply",
    "unapply",
    "is_applied",
    "applied_options",
    "PolicyLoss",
    "compute_approx_kl",
    "compute_entropy",
    "log_probs_from_logits",
    "use_backend",
]
