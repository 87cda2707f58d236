"""Op layer: validation, torch.library custom ops and dispatch to the kernels."""

from .advantages import group_advantages
from .groups import uids_to_group_index
from .logprobs import linear_logprobs, logprobs_from_logits
from .policy_loss import policy_loss, shape_token_advantages

__all__ = [
    "group_advantages",
    "linear_logprobs",
    "logprobs_from_logits",
    "policy_loss",
    "shape_token_advantages",
    "uids_to_group_index",
]
