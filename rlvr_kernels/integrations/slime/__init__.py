"""slime's plug-in hooks (docs/integrations-slime.md): functions with the signatures slime
calls through its ``--custom-*-path`` flags, reproducing slime's defaults with the fused ops.
slime itself is not imported (it is not a package on the registry); ``args`` is slime's
argument namespace, read by attribute.

- ``--custom-reward-post-process-path rlvr_kernels.integrations.slime.reward_post_process``
- ``--custom-advantage-function-path rlvr_kernels.integrations.slime.compute_advantages_and_returns``
- ``--custom-tis-function-path rlvr_kernels.integrations.slime.vanilla_tis_function``
  (or ``icepop_function``)
- ``--custom-pg-loss-reducer-function-path rlvr_kernels.integrations.slime.pg_loss_reducer``
- ``--loss-type custom_loss --custom-loss-function-path rlvr_kernels.integrations.slime.policy_loss_function``
"""

from .advantages import compute_advantages_and_returns
from .hooks import pg_loss_reducer, reward_post_process
from .loss import policy_loss_function
from .tis import icepop_function, vanilla_tis_function

__all__ = [
    "compute_advantages_and_returns",
    "icepop_function",
    "pg_loss_reducer",
    "policy_loss_function",
    "reward_post_process",
    "vanilla_tis_function",
]
