"""Pure-PyTorch references: the SPEC in code, fp64-capable, never fast."""

from .advantages import group_advantages

__all__ = ["group_advantages"]
