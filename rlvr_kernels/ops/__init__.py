"""Op layer: validation, torch.library custom ops and dispatch to the kernels."""

from .advantages import group_advantages
from .groups import uids_to_group_index
from .policy_loss import policy_loss, shape_token_advantages

__all__ = ["group_advantages", "policy_loss", "shape_token_advantages", "uids_to_group_index"]
