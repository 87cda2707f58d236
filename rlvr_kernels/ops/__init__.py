"""Op layer: validation, torch.library custom ops and dispatch to the kernels."""

from .advantages import group_advantages
from .groups import uids_to_group_index

__all__ = ["group_advantages", "uids_to_group_index"]
