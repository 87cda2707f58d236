"""Pure-PyTorch references: the docs in code, fp64-capable, never fast."""

from .advantages import group_advantages
from .logprobs import linear_logprobs, logprobs_from_logits
from .policy_loss import policy_loss, shape_token_advantages
from .rollout_mismatch import rollout_mismatch

__all__ = [
    "group_advantages",
    "linear_logprobs",
    "logprobs_from_logits",
    "policy_loss",
    "rollout_mismatch",
    "shape_token_advantages",
]
