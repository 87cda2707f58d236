"""slime's plug-in hooks (docs/integrations-slime.md): functions with the signatures slime
calls through its ``--custom-*-path`` flags, reproducing slime's defaults with the fused ops.
slime itself is not imported (it is not a package on the registry); ``args`` is slime's
argument namespace, read by attribute.

- ``--custom-reward-post-process-path rlvr_kernels.integrations.slime.reward_post_process``
- ``--custom-pg-loss-reducer-function-path rlvr_kernels.integrations.slime.pg_loss_reducer``
"""

from .hooks import pg_loss_reducer, reward_post_process

__all__ = ["pg_loss_reducer", "reward_post_process"]
