"""Drop-ins for TRL (1.16), built on the fused ops, one module per TRL module:

==========================  ================================================================
``trainer_utils``           ``trl.trainer.utils``: ``selective_log_softmax``,
                            ``entropy_from_logits``, ``selective_log_softmax_and_entropy``
``grpo_trainer``            ``trl.trainer.grpo_trainer.GRPOTrainer``: the advantages of
                            ``_generate_and_score_completions``
                            (:func:`compute_grpo_advantages`) and the loss of
                            ``_compute_loss`` (:func:`grpo_loss_trl`)
``async_rollout_worker``    ``trl.experimental.async_grpo.async_rollout_worker``: the
                            rollout worker's advantages (:func:`compute_async_grpo_advantages`)
==========================  ================================================================

The ``trainer_utils`` functions are drop-ins: TRL's signatures (names, order, defaults;
tests/integrations/test_signatures_trl.py) and TRL's numbers, dtypes and masking
(tests/logprobs/test_peers.py, tests/integrations/test_trl_suite.py: TRL's own test cases).
TRL computes advantages and the loss inline, with no function to replace: the other three
take the tensors TRL has there and the ``GRPOConfig`` fields under TRL's names, and match
TRL's code (tests/advantages/test_peers_trl.py, tests/policy_loss/test_peers_trl.py run
TRL's own source). Everything is importable from here: ``from rlvr_kernels.integrations
import trl as rk_trl; rk_trl.selective_log_softmax(...)``.

:func:`apply` / :func:`unapply` (``patch``) put these ops into TRL's own ``GRPOTrainer``
(and ``AsyncGRPOTrainer``): one call, no subclass; see :mod:`.patch`.

Backend selection (the same for every integration): a drop-in's signature has no room
for a ``backend`` argument, so the drop-ins run on the backend of the innermost
``with use_backend("reference" | "cpu" | "triton" | "auto"):`` block (a process-wide
setting that torch.compile traces; "auto" outside any block). :func:`grpo_loss_trl`, our own
function, also takes ``backend=`` (None: the ``use_backend`` one).
"""

from .._backend import use_backend
from .async_rollout_worker import compute_async_grpo_advantages
from .grpo_trainer import TRL_LOSS_TYPES as TRL_LOSS_TYPES  # the loss types grpo_loss_trl fuses
from .grpo_trainer import TrlMetric, compute_grpo_advantages, grpo_loss_trl, reduce_trl_metrics, trl_entropy_threshold
from .patch import applied_options, apply, is_applied, unapply
from .trainer_utils import entropy_from_logits, selective_log_softmax, selective_log_softmax_and_entropy

__all__ = [
    "apply",
    "unapply",
    "is_applied",
    "applied_options",
    "compute_grpo_advantages",
    "compute_async_grpo_advantages",
    "grpo_loss_trl",
    "reduce_trl_metrics",
    "trl_entropy_threshold",
    "TrlMetric",
    "selective_log_softmax",
    "entropy_from_logits",
    "selective_log_softmax_and_entropy",
    "use_backend",
]
