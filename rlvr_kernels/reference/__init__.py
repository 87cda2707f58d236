"""Pure-PyTorch references: the SPEC in code, fp64-capable, never fast."""

from .advantages import group_advantages
from .policy_loss import policy_loss, shape_token_advantages

__all__ = ["group_advantages", "policy_loss", "shape_token_advantages"]
