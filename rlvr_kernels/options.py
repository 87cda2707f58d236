"""Option dataclasses and result types shared by the reference and the fast backends.

Keeping them here (not in ``ops/``) lets the reference stay free of backend imports
while every backend resolves presets the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Optional

import torch

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "opo", "gpg", "passk", "reinforce_pp_baseline", "gdpo")
PRESETS = ("verl", "trl", "trl_async")
STD_KINDS = ("unbiased", "population")
SCALES = ("group", "batch", "none")
SINGLETONS = ("zero", "raw")
NAN_POLICIES = ("error", "unscorable")
WHITEN_OVER = ("tokens", "samples")

Estimator = Literal["grpo", "dr_grpo", "rloo", "opo", "gpg", "passk", "reinforce_pp_baseline", "gdpo"]


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


def _check_eps(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0.0) or value == float("inf"):
        raise ValueError(f"{name}: expected a finite float >= 0, got {value!r}")


@dataclass(frozen=True)
class Whitening:
    """Batch whitening used by ``reinforce_pp_baseline`` and ``gdpo``.

    ``over="tokens"`` weights each sample by its number of valid tokens (verl
    ``masked_whiten`` over ``response_mask``); ``over="samples"`` weights every valid
    sample once (TRL ``multi_objective_aggregation="normalize_then_sum"``). The variance is
    always the unbiased one. ``eps_in_sqrt=True``: (x − mean)/sqrt(var + eps);
    otherwise (x − mean)/(sqrt(var) + eps).
    """

    over: Literal["tokens", "samples"] = "tokens"
    eps: float = 1e-8
    eps_in_sqrt: bool = True

    def __post_init__(self):
        _check_choice("whitening.over", self.over, WHITEN_OVER)
        _check_eps("whitening.eps", self.eps)


@dataclass(frozen=True)
class AdvantageOptions:
    """Everything that decides the numbers ``group_advantages`` returns (SPEC §1).

    ``scale`` applies to ``grpo`` and to ``gdpo``'s per-term normalisation;
    ``singleton`` applies to the mean-baseline estimators (all but ``passk``);
    ``k`` is the pass@k size, required for ``passk``.
    """

    estimator: Estimator = "grpo"
    std: Literal["unbiased", "population"] = "unbiased"
    eps: float = 1e-6
    eps_in_sqrt: bool = False
    scale: Literal["group", "batch", "none"] = "group"
    singleton: Literal["zero", "raw"] = "zero"
    nan_policy: Literal["error", "unscorable"] = "error"
    k: Optional[int] = None
    # A factory, not a shared default instance: torch.compile traces the construction.
    whitening: Whitening = field(default_factory=Whitening)

    def __post_init__(self):
        _check_choice("estimator", self.estimator, ESTIMATORS)
        _check_choice("std", self.std, STD_KINDS)
        _check_choice("scale", self.scale, SCALES)
        _check_choice("singleton", self.singleton, SINGLETONS)
        _check_choice("nan_policy", self.nan_policy, NAN_POLICIES)
        _check_eps("eps", self.eps)
        if not isinstance(self.whitening, Whitening):
            raise TypeError(f"whitening: expected a rlvr_kernels.Whitening, got {type(self.whitening).__name__}")
        if self.estimator == "passk":
            if self.k is None:
                raise ValueError("k: estimator='passk' needs the pass@k size k (an int >= 1)")
            if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
                raise ValueError(f"k: expected an int >= 1, got {self.k!r}")
        elif self.k is not None:
            raise ValueError(f"k: only used by estimator='passk', got k={self.k!r} with estimator={self.estimator!r}")


# What each preset fixes; explicit keyword arguments still override it.
_PRESET_FIELDS = {
    None: {},
    # verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage and friends: torch.std
    # (Bessel), eps outside the sqrt, singleton groups use mean 0 / std 1 (the loop rule),
    # masked_whiten over tokens with rsqrt(var + 1e-8).
    "verl": dict(std="unbiased", eps=1e-6, eps_in_sqrt=False, singleton="raw", nan_policy="error",
                 whitening=Whitening("tokens", 1e-8, True)),
    # trl GRPOTrainer._generate_and_score_completions: nanmean / nanstd (Bessel) per
    # contiguous group, advantages / (std + 1e-4); all-NaN rows are unscorable (A = 0);
    # normalize_then_sum whitens per sample with (x - mean)/(std + 1e-4).
    "trl": dict(std="unbiased", eps=1e-4, eps_in_sqrt=False, singleton="zero", nan_policy="unscorable",
                whitening=Whitening("samples", 1e-4, False)),
    # trl.experimental.async_grpo rollout worker: numpy std (population), eps 1e-8.
    "trl_async": dict(std="population", eps=1e-8, eps_in_sqrt=False, singleton="zero", nan_policy="unscorable",
                      whitening=Whitening("samples", 1e-8, False)),
}


@torch.compiler.assume_constant_result
def resolve_advantage_options(preset: Optional[str] = None, **overrides) -> AdvantageOptions:
    """Merge a preset's fields with explicit overrides (``None`` means "not given").

    Pure Python on constants: torch.compile runs it once while tracing and keeps the result.
    """
    if preset not in _PRESET_FIELDS:
        raise ValueError(f"preset: expected one of {PRESETS} or None, got {preset!r}")
    fields = dict(_PRESET_FIELDS[preset])
    fields.update({k: v for k, v in overrides.items() if v is not None})
    estimator = fields.get("estimator", "grpo")
    if estimator == "dr_grpo":
        if fields.get("scale", "none") != "none":
            raise ValueError(f"scale: dr_grpo never divides by a std; got scale={fields['scale']!r}")
        fields["scale"] = "none"
    elif "scale" in overrides and overrides["scale"] is not None and estimator not in ("grpo", "gdpo"):
        raise ValueError(f"scale: only used by the grpo and gdpo estimators, got estimator={estimator!r}")
    return AdvantageOptions(**fields)



class GroupAdvantages(NamedTuple):
    """What ``group_advantages`` returns (SPEC §1). Gn = num_groups, K = reward terms (gdpo).

    advantages        [B]        per-sample advantage (0 for excluded samples)
    token_advantages  [B, L]/[T] A_i · m_{i,t}, or None when no token layout was given
    group_mean        [Gn] ([Gn, K] for gdpo) mean of the valid scores (0 for empty groups)
    group_std         [Gn] ([Gn, K]) std of the valid scores, of the chosen kind (0 if undefined)
    group_count       [Gn] int64  number of valid samples
    group_degenerate  [Gn] bool   no valid sample, or all valid scores equal (DAPO filter)
    sample_keep       [B]  bool   valid and in a non-degenerate group
    """

    advantages: torch.Tensor
    token_advantages: Optional[torch.Tensor]
    group_mean: torch.Tensor
    group_std: torch.Tensor
    group_count: torch.Tensor
    group_degenerate: torch.Tensor
    sample_keep: torch.Tensor
