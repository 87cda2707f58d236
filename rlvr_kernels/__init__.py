"""rlvr_kernels: fused, exact, drop-in PyTorch ops for RL with verifiable rewards."""

from . import async_rollout, distributed, dynamics
from ._core.cache import cpu_cache_stats, empty_cpu_cache
from .ops.advantages import group_advantages
from .ops.groups import uids_to_group_index
from .ops.logprobs import (
    OPTIONAL_OUTPUTS,
    LinearLogprobs,
    LogprobsFromLogits,
    linear_logprobs,
    logprobs_from_logits,
)
from .ops.policy_loss import policy_loss, rollout_correction, shape_token_advantages
from .ops.rollout_mismatch import RolloutMismatch, rollout_mismatch
from .options import (
    AdvantageOptions,
    GroupAdvantages,
    PolicyLossMetrics,
    PolicyLossOptions,
    RolloutCorrection,
    TokenShaping,
    Whitening,
)

__version__ = "0.1.0"

__all__ = [
    "AdvantageOptions",
    "GroupAdvantages",
    "PolicyLossMetrics",
    "PolicyLossOptions",
    "RolloutCorrection",
    "TokenShaping",
    "Whitening",
    "async_rollout",
    "cpu_cache_stats",
    "distributed",
    "dynamics",
    "empty_cpu_cache",
    "group_advantages",
    "linear_logprobs",
    "logprobs_from_logits",
    "LinearLogprobs",
    "LogprobsFromLogits",
    "OPTIONAL_OUTPUTS",
    "policy_loss",
    "rollout_correction",
    "rollout_mismatch",
    "RolloutMismatch",
    "shape_token_advantages",
    "uids_to_group_index",
]
