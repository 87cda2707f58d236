"""Option dataclasses and result types shared by the reference and the fast backends.

Keeping them here (not in ``ops/``) lets the reference stay free of backend imports
while every backend resolves presets the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Optional, Union

import torch

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "opo", "gpg", "passk", "reinforce_pp_baseline", "gdpo")
PRESETS = ("verl", "trl", "trl_async", "openrlhf", "slime", "areal", "nemo_rl", "skyrl", "prime_rl")
STD_KINDS = ("unbiased", "population")
SCALES = ("group", "batch", "none")
SINGLETONS = ("zero", "raw")
NAN_POLICIES = ("error", "unscorable")
WHITEN_OVER = ("tokens", "samples")

Estimator = Literal["grpo", "dr_grpo", "rloo", "opo", "gpg", "passk", "reinforce_pp_baseline", "gdpo"]


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def _check_eps(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0.0) or value == float("inf"):
        raise ValueError(f"{name}: expected a finite float >= 0, got {value!r}")


@dataclass(frozen=True)
class Whitening:
    """Batch whitening W: after ``reinforce_pp_baseline`` and ``gdpo``, and after any other
    estimator with ``batch_whiten=True``.

    ``over="tokens"`` weights each sample by its number of valid tokens (verl
    ``masked_whiten`` over ``response_mask``); ``over="samples"`` weights every valid
    sample once (TRL ``multi_objective_aggregation="normalize_then_sum"``). ``std``: the
    variance v = Σ w (x − x̄)² / (Σ w − 1) (``"unbiased"``) or / Σ w (``"population"``,
    OpenRLHF). The divisor is sqrt(v + eps) (``eps_in_sqrt=True``) or sqrt(v) + eps; with
    ``clamp=True`` eps is a floor instead of an addend: sqrt(max(v, eps)) or
    max(sqrt(v), eps) (OpenRLHF's ``var.clamp(min=1e-8).rsqrt()``).
    """

    over: Literal["tokens", "samples"] = "tokens"
    eps: float = 1e-8
    eps_in_sqrt: bool = True
    std: Literal["unbiased", "population"] = "unbiased"
    clamp: bool = False

    def __post_init__(self):
        _check_choice("whitening.over", self.over, WHITEN_OVER)
        _check_eps("whitening.eps", self.eps)
        _check_choice("whitening.std", self.std, STD_KINDS)
        _check_bool("whitening.clamp", self.clamp)


@dataclass(frozen=True)
class AdvantageOptions:
    """Everything that decides the numbers ``group_advantages`` returns (docs/advantages.md).

    ``scale`` applies to ``grpo`` and to ``gdpo``'s per-term normalisation;
    ``singleton`` applies to the mean-baseline estimators (all but ``passk``);
    ``k`` is the pass@k size, required for ``passk``;
    ``batch_whiten`` applies ``whitening`` after the estimator (``reinforce_pp_baseline``
    and ``gdpo`` always whiten; AReaL's ``adv_norm`` after its group ``reward_norm``);
    ``leave_one_out`` (``grpo``): sample i's mean and std are those of the other valid
    samples of its group, μ₋ᵢ and σ₋ᵢ (NeMo-RL); ``skip_zero_std`` (with ``leave_one_out``):
    where σ₋ᵢ = 0 the advantage r_i − μ₋ᵢ is not divided (NeMo-RL).
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
    batch_whiten: bool = False
    leave_one_out: bool = False
    skip_zero_std: bool = False

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
        _check_bool("batch_whiten", self.batch_whiten)
        _check_bool("leave_one_out", self.leave_one_out)
        _check_bool("skip_zero_std", self.skip_zero_std)
        if self.leave_one_out:
            if self.estimator != "grpo":
                raise ValueError(f"leave_one_out: only used by estimator='grpo', got estimator={self.estimator!r}")
            if self.scale == "batch":
                raise ValueError("leave_one_out: needs scale='group' (σ₋ᵢ) or 'none', got scale='batch'")
        if self.skip_zero_std and not self.leave_one_out:
            raise ValueError(
                "skip_zero_std: only used with leave_one_out=True (a group's own σ is 0 only when its "
                "advantages are 0 already)"
            )


def options_or_resolve(cls, resolve, preset: Optional[str], options, **overrides):
    """``options`` itself when given (an instance of ``cls``, and then neither ``preset`` nor
    any keyword option may be given), else ``resolve(preset, **overrides)``: the one rule of
    the ``options=`` argument of ``group_advantages`` and ``policy_loss``."""
    if options is None:
        return resolve(preset, **overrides)
    if not isinstance(options, cls):
        raise TypeError(f"options: expected a rlvr_kernels.{cls.__name__}, got {type(options).__name__}")
    given = [k for k, v in overrides.items() if v is not None]
    if given or preset is not None:
        raise ValueError(f"options: give either options= or preset/keyword options, not both (got {given or preset})")
    return options


# What each preset fixes; explicit keyword arguments still override it.
_PRESET_FIELDS = {
    None: {},
    # verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage and friends: torch.std
    # (Bessel), eps outside the sqrt, singleton groups use mean 0 / std 1 (the loop rule),
    # masked_whiten over tokens with rsqrt(var + 1e-8).
    "verl": dict(
        std="unbiased",
        eps=1e-6,
        eps_in_sqrt=False,
        singleton="raw",
        nan_policy="error",
        whitening=Whitening("tokens", 1e-8, True),
    ),
    # trl GRPOTrainer._generate_and_score_completions: nanmean / nanstd (Bessel) per
    # contiguous group, advantages / (std + 1e-4); all-NaN rows are unscorable (A = 0);
    # normalize_then_sum whitens per sample with (x - mean)/(std + 1e-4).
    "trl": dict(
        std="unbiased",
        eps=1e-4,
        eps_in_sqrt=False,
        singleton="zero",
        nan_policy="unscorable",
        whitening=Whitening("samples", 1e-4, False),
    ),
    # trl.experimental.async_grpo rollout worker: numpy std (population), eps 1e-8.
    "trl_async": dict(
        std="population",
        eps=1e-8,
        eps_in_sqrt=False,
        singleton="zero",
        nan_policy="unscorable",
        whitening=Whitening("samples", 1e-8, False),
    ),
    # OpenRLHF 0.11.2 openrlhf/trainer/ppo_utils/experience_maker.py
    # RemoteExperienceMaker.compute_advantages_and_returns: group_norm divides by torch.std
    # (Bessel) + 1e-9; reinforce_baseline whitens over the action tokens with the population
    # variance and var.clamp(min=1e-8).rsqrt() (a floor, not an addend). n = 1 is refused by
    # its CLI (A = 0 here).
    "openrlhf": dict(
        std="unbiased",
        eps=1e-9,
        eps_in_sqrt=False,
        singleton="zero",
        nan_policy="error",
        whitening=Whitening("tokens", 1e-8, True, std="population", clamp=True),
    ),
    # slime 0.3.1 slime/ray/rollout.py RolloutManager._post_process_rewards: contiguous
    # groups, (r − mean)/(torch.std + 1e-6), std division off for n = 1 (A = 0);
    # slime/utils/distributed_utils.py distributed_masked_whiten: tokens, Bessel,
    # rsqrt(var + 1e-8).
    "slime": dict(
        std="unbiased",
        eps=1e-6,
        eps_in_sqrt=False,
        singleton="zero",
        nan_policy="error",
        whitening=Whitening("tokens", 1e-8, True),
    ),
    # AReaL 1.0.4 areal/utils/data.py Normalization (eps 1e-5, std_unbiased=True, eps added
    # to σ) as reward_norm (group level) and then adv_norm (batch level over the loss-mask
    # tokens) in areal/trainer/ppo/actor.py PPOActor._compute_advantages.
    "areal": dict(
        std="unbiased",
        eps=1e-5,
        eps_in_sqrt=False,
        singleton="zero",
        nan_policy="error",
        whitening=Whitening("tokens", 1e-5, False),
        batch_whiten=True,
    ),
    # NeMo-RL 0.6.0 nemo_rl/algorithms/utils.py calculate_baseline_and_std_per_prompt and
    # advantage_estimator.py GRPOAdvantageEstimator.compute_advantage: leave-one-out mean
    # and std (Bessel over the n − 1 others), divided by σ₋ᵢ + 1e-6 only where σ₋ᵢ > 0;
    # a prompt with at most one valid sample gets A = 0.
    "nemo_rl": dict(
        std="unbiased",
        eps=1e-6,
        eps_in_sqrt=False,
        singleton="zero",
        nan_policy="error",
        leave_one_out=True,
        skip_zero_std=True,
    ),
    # SkyRL 0.3.0 skyrl/backends/skyrl_train/utils/ppo_utils.py
    # compute_grpo_outcome_advantage: verl's rule (Bessel, 1e-6 outside, a lone sample
    # against mean 0 / std 1); masked_whiten: tokens, rsqrt(var + 1e-8).
    "skyrl": dict(
        std="unbiased",
        eps=1e-6,
        eps_in_sqrt=False,
        singleton="raw",
        nan_policy="error",
        whitening=Whitening("tokens", 1e-8, True),
    ),
    # prime-rl 0.8.0 src/prime_rl/orchestrator/algo/grpo.py GRPOAlgorithm.score_group:
    # A = r − group mean, no std (a lone sample gets 0).
    "prime_rl": dict(
        scale="none",
        std="unbiased",
        eps=1e-6,
        eps_in_sqrt=False,
        singleton="zero",
        nan_policy="error",
    ),
}

# Preset fields that only apply to some estimators: dropped (not refused) for the others.
_PRESET_ONLY_GRPO = ("leave_one_out", "skip_zero_std")


@torch.compiler.assume_constant_result
def resolve_advantage_options(preset: Optional[str] = None, **overrides) -> AdvantageOptions:
    """Merge a preset's fields with explicit overrides (``None`` means "not given").

    Pure Python on constants: torch.compile runs it once while tracing and keeps the result.
    """
    if preset not in _PRESET_FIELDS:
        raise ValueError(f"preset: expected one of {PRESETS} or None, got {preset!r}")
    fields = dict(_PRESET_FIELDS[preset])
    given = {k: v for k, v in overrides.items() if v is not None}
    estimator = given.get("estimator", fields.get("estimator", "grpo"))
    if estimator != "grpo":
        for name in _PRESET_ONLY_GRPO:
            fields.pop(name, None)
    fields.update(given)
    if estimator == "dr_grpo":
        if fields.get("scale", "none") != "none":
            raise ValueError(f"scale: dr_grpo never divides by a std; got scale={fields['scale']!r}")
        fields["scale"] = "none"
    elif "scale" in overrides and overrides["scale"] is not None and estimator not in ("grpo", "gdpo"):
        raise ValueError(f"scale: only used by the grpo and gdpo estimators, got estimator={estimator!r}")
    return AdvantageOptions(**fields)


class GroupAdvantages(NamedTuple):
    """What ``group_advantages`` returns (docs/advantages.md). Gn = num_groups, K = reward terms (gdpo).

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


# ---------------------------------------------------------------------------------------
# policy_loss and shape_token_advantages (docs/token-shaping.md, docs/policy-loss.md)

LOSS_TYPES = (
    "ppo",
    "gspo",
    "cispo",
    "sapo",
    "reinforce",
    "gpg",
    "dppo_tv",
    "dppo_kl",
    "geo_mean",
    "dro",
    "clip_cov",
    "kl_cov",
)
KL_TYPES = ("k1", "k2", "k3", "k3+")
ROLLOUT_CORRECTIONS = ("token_tis", "seq_tis", "token_mis", "seq_mis", "decoupled")
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "none")
A3PO_METRICS = ("prob", "entropy")
LOSS_PRESETS = ("verl", "trl", "openrlhf", "slime", "areal", "nemo_rl", "skyrl", "prime_rl")
# Which KL estimators the input / output clamps apply to: "k3" (k3 and k3+, verl; True is
# "k3", False none) or "all" (every estimator).
KL_CLAMP_SCOPES = ("k3", "all")


def _check_float(name, value, lo=None, hi=None, lo_open=False, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        raise ValueError(f"{name}: expected a finite float, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise ValueError(f"{name}: expected a value {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}: expected a value <= {hi}, got {value!r}")


def _check_knob(name, knob):
    if not (isinstance(knob, tuple) and len(knob) == 2):
        raise ValueError(f"{name}: expected a (ratio, scale) tuple, got {knob!r}")
    _check_float(f"{name}[0] (ratio)", knob[0], 0.0, 1.0)
    _check_float(f"{name}[1] (scale)", knob[1], 0.0)


@dataclass(frozen=True)
class TokenShaping:
    """Token-level asymmetric advantage shaping (docs/token-shaping.md); the defaults change nothing.

    Per token, with A the (sequence or token) advantage and p = exp(old_logprobs):
      w_pos, w_neg        polarity weights: Ã = w_pos·A for A > 0, w_neg·A for A < 0
                          (W-REINFORCE: w_pos = 0.1, w_neg = 1).
      probability = λ     Ã ·= (1 − λ) + λ·w with w = 1 − p (A > 0), p (A < 0): the seed's
                          teaching model at λ = 1; decay λ with any schedule outside.
      a3po_*              A3PO rank selection: per sequence (its polarity is the sign of
                          Σ_t A·m), metric = ``a3po_metric`` (old-policy prob or the given
                          entropy) over valid tokens whose metric is ≠ 0; each knob
                          (ratio, scale) with ratio > 0 scales the k = max(1, ⌊n·ratio⌋)
                          highest / lowest metric tokens (ties: lower index first) by scale.
                          Knobs apply in the order pos-high, pos-low, neg-high, neg-low.
      entropy_quantile=ρ  keep the policy-gradient term only on tokens whose entropy is ≥
                          the batch's (1 − ρ) quantile over valid tokens (80/20: ρ = 0.2,
                          torch.quantile's linear interpolation, as TRL); KL and entropy
                          terms are not masked (TRL masks its entropy bonus).
    All weights are constants (no gradient); they multiply the policy-gradient term after
    the loss type's clipping, so clip metrics see the unshaped advantage.
    """

    w_pos: float = 1.0
    w_neg: float = 1.0
    probability: float = 0.0
    a3po_metric: Literal["prob", "entropy"] = "prob"
    a3po_pos_high: tuple = (0.0, 1.0)
    a3po_pos_low: tuple = (0.0, 1.0)
    a3po_neg_high: tuple = (0.0, 1.0)
    a3po_neg_low: tuple = (0.0, 1.0)
    entropy_quantile: Optional[float] = None
    # Derived in __post_init__ (plain fields, not properties, so torch.compile reads them):
    # the (ratio, scale) knobs in application order; whether a knob is on (ratio > 0 and
    # scale != 1); whether any shaping is on.
    a3po_knobs: tuple = field(init=False, repr=False, compare=False)
    a3po_active: bool = field(init=False, repr=False, compare=False)
    active: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        _check_float("shaping.w_pos", self.w_pos, 0.0)
        _check_float("shaping.w_neg", self.w_neg, 0.0)
        _check_float("shaping.probability", self.probability, 0.0, 1.0)
        _check_choice("shaping.a3po_metric", self.a3po_metric, A3PO_METRICS)
        for name in ("a3po_pos_high", "a3po_pos_low", "a3po_neg_high", "a3po_neg_low"):
            _check_knob(f"shaping.{name}", getattr(self, name))
        _check_float("shaping.entropy_quantile", self.entropy_quantile, 0.0, 1.0, lo_open=True, allow_none=True)
        knobs = (self.a3po_pos_high, self.a3po_pos_low, self.a3po_neg_high, self.a3po_neg_low)
        a3po = any(r > 0 and s != 1 for r, s in knobs)
        active = (
            self.w_pos != 1 or self.w_neg != 1 or self.probability != 0 or a3po or self.entropy_quantile is not None
        )
        object.__setattr__(self, "a3po_knobs", knobs)
        object.__setattr__(self, "a3po_active", a3po)
        object.__setattr__(self, "active", active)


# verl 0.9.1 trainer/ppo/rollout_corr_helper.py: SUPPORTED_ROLLOUT_RS_OPTIONS, in the kernels'
# bit order (PolicyLossParams.rs_options: bit j is RS_OPTIONS[j]).
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "icepop", "mask", "decoupled", "clamp", "gate")
# What is_mode="gate" reads (OpenRLHF's is_correction_gating).
IS_GATES = ("ratio", "binary_kl", "tv")
LOG_RATIO_BASES = ("old", "current")
# The 14 rejection bounds the kernels read, in PolicyLossParams order; k1 bounds are in log
# space, the others are upper bounds of the statistic (+inf: option off).
RS_BOUND_FIELDS = (
    "rs_token_k1_low",
    "rs_token_k1_high",
    "rs_token_k2",
    "rs_token_k3",
    "rs_seq_sum_k1_low",
    "rs_seq_sum_k1_high",
    "rs_seq_sum_k2",
    "rs_seq_sum_k3",
    "rs_seq_mean_k1_low",
    "rs_seq_mean_k1_high",
    "rs_seq_mean_k2",
    "rs_seq_mean_k3",
    "rs_seq_max_k2",
    "rs_seq_max_k3",
)


def _rs_thresholds(options, spec):
    """verl's ``_parse_rollout_rs_thresholds``: one spec shared by all options or one per
    option, comma separated; k1 options take ``"lower_upper"`` or an upper u (lower 1/u),
    the others a single upper bound; every bound > 0, lower <= upper. Returns
    {option: (lower or None, upper)}."""
    name = "rollout_correction.rs_threshold"
    if spec is None:
        raise ValueError(f"{name}: rs needs a threshold (verl's rollout_rs_threshold)")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"{name}: expected a float or a string, got {type(spec).__name__}")
    raw = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if not raw:
        raise ValueError(f"{name}: expected at least one threshold, got {spec!r}")
    if len(raw) not in (1, len(options)):
        raise ValueError(f"{name}: expected 1 or {len(options)} thresholds (one per rs option), got {len(raw)}")
    raw = raw * len(options) if len(raw) == 1 else raw
    out = {}
    for opt, part in zip(options, raw):
        try:
            if opt.endswith("k1"):
                lo_s, hi_s = part.split("_", 1) if "_" in part else (None, part)
                hi = float(hi_s)
                lo = float(lo_s) if lo_s is not None else 1.0 / hi
            else:
                if "_" in part:
                    raise ValueError(f"{name}: option {opt!r} takes a single upper bound, got {part!r}")
                lo, hi = None, float(part)
        except (ValueError, ZeroDivisionError) as exc:
            if str(exc).startswith(name):
                raise
            raise ValueError(f"{name}: invalid threshold {part!r} for option {opt!r}") from exc
        if not (hi > 0 and hi != float("inf")) or (lo is not None and not (0 < lo <= hi)):
            raise ValueError(f"{name}: option {opt!r} needs 0 < lower <= upper < inf, got {part!r}")
        out[opt] = (lo, hi)
    return out


@dataclass(frozen=True)
class RolloutCorrection:
    """Rollout correction (docs/policy-loss.md, "Rollout correction"): verl 0.9.1's
    ``rollout_corr_helper`` one to one, fused into ``policy_loss``. With x = base − rollout
    (base = old_logprobs, or the detached current logprobs with ``log_ratio="current"``,
    verl's bypass mode):

    is_level          None | token | sequence: the IS weight w = exp(clamp(x, ±20)) per token,
                      or exp(clamp(Σ_t x·m, ±20)) per sequence (verl ``rollout_is``)
    is_threshold      the upper bound C; ``is_threshold_low`` the lower bound
    is_mode           truncate (TIS: min(w, C)) | icepop (w inside [low, C], else 0: verl's
                      ``"low_high"`` threshold) | mask (1 inside [low, C], else 0; low
                      defaults to 1/C) | decoupled (w <= C kept, else 0; token level).
                      Default: icepop when ``is_threshold_low`` is given, else truncate
    is_batch_normalize  w / mean(w) (verl ``rollout_is_batch_normalize``): the mean over
                      the call's valid tokens (token level) or over its sequences with a
                      valid token (sequence level), before rejection; skipped when
                      mean <= 1e-8. The call is the batch (no collective)
    rs, rs_threshold  verl ``rollout_rs`` / ``rollout_rs_threshold``: a comma separated
                      chain of RS_OPTIONS (every one must pass), thresholds as verl parses
                      them. With k1 = −x, k2 = x²/2, k3 = eˣ − 1 − x (x clamped to ±20):
                      token_kj per token; seq_sum_kj / seq_mean_kj / seq_max_kj the sum /
                      mean / max over the sequence's valid tokens. k1 options keep
                      log(lower) <= stat <= log(upper), the others stat <= upper
    geo_mean          (low, high): reject a sequence when exp(mean_t x) leaves [low, high].
                      This is verl's seq_mean_k1 with bounds (1/high, 1/low) (k1 = −x), and
                      is fused as that option (intersected with an explicit seq_mean_k1)
    log_ratio         old (default) | current (verl's bypass mode: the IS weights and the
                      rejection against the current policy, without gradient)
    is_gate           ratio | binary_kl | tv: the statistic of is_mode="gate"

    Rejection removes tokens from the loss exactly as verl's modified ``response_mask``
    does: from the pg, KL and entropy terms and from every aggregation count. IS weights
    multiply the pg term only.

    OpenRLHF's ``is_correction`` (``from_openrlhf``) keeps every token in the loss and its
    counts and zeroes the weight instead; two modes carry what the others cannot express,
    both with the token weight w = exp(clamp(x, ±20)) at either level:

    - ``clamp`` (token level): clamp(w, low, C), low = ``is_threshold_low`` (none when
      None or <= 0); the tokens outside [low, C] count in ``is_masked_frac``.
    - ``gate``: w where a statistic lies in [low, C] (low = ``is_threshold_low``, any
      value; none when None), else 0 (and counted in ``is_masked_frac``). The statistic
      (``is_gate``): ``ratio`` w; ``binary_kl`` p·log(p/q) + (1 − p)·log((1 − p)/(1 − q))
      and ``tv`` |p − q| with p = exp(rollout), q = exp(base), both clamped to
      [1e-6, 1 − 1e-6]. ``is_level="sequence"`` gates a whole sequence on its statistic
      over the valid tokens: exp(clamp(mean x, ±20)) for ``ratio``, the mean for the
      divergences; the weights stay per token.
    """

    is_level: Optional[Literal["token", "sequence"]] = None
    is_threshold: float = 2.0
    is_threshold_low: Optional[float] = None
    is_mode: Optional[Literal["truncate", "icepop", "mask", "decoupled"]] = None
    is_batch_normalize: bool = False
    rs: Optional[str] = None
    rs_threshold: Optional[object] = None
    geo_mean: Optional[tuple] = None
    log_ratio: Literal["old", "current"] = "old"
    is_gate: Literal["ratio", "binary_kl", "tv"] = "ratio"
    # Derived: the resolved mode, the IS lower bound the kernels read, the normalised rs
    # chain, the kernels' rejection bit mask and 14 bounds (RS_BOUND_FIELDS), and whether
    # anything is on.
    mode: str = field(init=False, repr=False, compare=False)
    low: float = field(init=False, repr=False, compare=False)
    rs_options: tuple = field(init=False, repr=False, compare=False)
    rs_mask: int = field(init=False, repr=False, compare=False)
    rs_bounds: tuple = field(init=False, repr=False, compare=False)
    active: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        import math

        pre = "rollout_correction."
        if self.is_level is not None:
            _check_choice(pre + "is_level", self.is_level, IS_LEVELS)
        _check_float(pre + "is_threshold", self.is_threshold, 0.0, lo_open=True)
        mode = self.is_mode
        if mode is None:
            mode = "icepop" if self.is_threshold_low is not None else "truncate"
        _check_choice(pre + "is_mode", mode, IS_MODES)
        # (clamp and gate bound a statistic that may be a divergence: any lower bound, <= 0 is none)
        openrlhf = mode in ("clamp", "gate")
        _check_float(
            pre + "is_threshold_low",
            self.is_threshold_low,
            None if openrlhf else 0.0,
            lo_open=not openrlhf,
            allow_none=True,
        )
        if self.is_threshold_low is not None and self.is_threshold_low > self.is_threshold:
            raise ValueError(
                f"{pre}is_threshold_low: expected <= is_threshold = {self.is_threshold}, got {self.is_threshold_low}"
            )
        if mode == "icepop" and self.is_threshold_low is None:
            raise ValueError(f"{pre}is_threshold_low: is_mode='icepop' needs a lower bound")
        if mode in ("decoupled", "clamp") and self.is_level == "sequence":
            raise ValueError(f"{pre}is_mode: {mode!r} is token level, got is_level='sequence'")
        _check_choice(pre + "is_gate", self.is_gate, IS_GATES)
        if self.is_gate != "ratio" and mode != "gate":
            raise ValueError(f"{pre}is_gate: {self.is_gate!r} is read by is_mode='gate' only, got is_mode={mode!r}")
        if not isinstance(self.is_batch_normalize, bool):
            raise TypeError(f"{pre}is_batch_normalize: expected a bool, got {type(self.is_batch_normalize).__name__}")
        if openrlhf and self.is_batch_normalize:
            raise ValueError(f"{pre}is_batch_normalize: not supported with is_mode={mode!r}")
        _check_choice(pre + "log_ratio", self.log_ratio, LOG_RATIO_BASES)
        chain = []
        if self.rs is not None:
            if not isinstance(self.rs, str):
                raise TypeError(f"{pre}rs: expected a comma separated string, got {type(self.rs).__name__}")
            for opt in (o.strip() for o in self.rs.split(",")):
                if opt and opt not in chain:
                    _check_choice(pre + "rs", opt, RS_OPTIONS)
                    chain.append(opt)
            if not chain:
                raise ValueError(f"{pre}rs: expected at least one of {RS_OPTIONS}, got {self.rs!r}")
            thresholds = _rs_thresholds(chain, self.rs_threshold)
        else:
            if self.rs_threshold is not None:
                raise ValueError(f"{pre}rs_threshold: given without rs")
            thresholds = {}
        inf = float("inf")
        bounds = dict.fromkeys(RS_BOUND_FIELDS, inf)
        for f in RS_BOUND_FIELDS:
            if f.endswith("_low"):
                bounds[f] = -inf
        for opt, (lo, hi) in thresholds.items():
            if opt.endswith("k1"):
                bounds[f"rs_{opt}_low"] = math.log(lo)
                bounds[f"rs_{opt}_high"] = math.log(hi)
            else:
                bounds[f"rs_{opt}"] = hi
        mask = sum(1 << j for j, o in enumerate(RS_OPTIONS) if o in thresholds)
        if self.geo_mean is not None:
            g = self.geo_mean
            if not (isinstance(g, tuple) and len(g) == 2):
                raise ValueError(f"{pre}geo_mean: expected a (low, high) tuple, got {g!r}")
            _check_float(pre + "geo_mean[0] (low)", g[0], 0.0, lo_open=True)
            _check_float(pre + "geo_mean[1] (high)", g[1], g[0])
            # exp(mean x) in [low, high]  <=>  mean k1 = −mean x in [−log high, −log low]
            bounds["rs_seq_mean_k1_low"] = max(bounds["rs_seq_mean_k1_low"], -math.log(g[1]))
            bounds["rs_seq_mean_k1_high"] = min(bounds["rs_seq_mean_k1_high"], -math.log(g[0]))
            mask |= 1 << RS_OPTIONS.index("seq_mean_k1")
        if openrlhf:
            low = self.is_threshold_low if self.is_threshold_low is not None else -inf
        else:
            low = self.is_threshold_low if self.is_threshold_low is not None else 1.0 / self.is_threshold
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "low", float(low))
        object.__setattr__(self, "rs_options", tuple(chain))
        object.__setattr__(self, "rs_mask", mask)
        object.__setattr__(self, "rs_bounds", tuple(float(bounds[f]) for f in RS_BOUND_FIELDS))
        object.__setattr__(self, "active", self.is_level is not None or mask != 0)

    @classmethod
    def from_openrlhf(
        cls,
        is_correction_level: str = "off",
        is_correction_mode: str = "mask",
        is_correction_gating: str = "ratio",
        is_correction_threshold=(0.5, 5.0),
    ) -> Optional["RolloutCorrection"]:
        """OpenRLHF 0.11.2's ``PolicyLoss`` importance-sampling correction
        (``--algo.advantage.is_correction_*``; a one-element threshold is HIGH with LOW 0, as
        its CLI); None for level "off". Token-level ratio masking is ``icepop`` (LOW > 0) or
        ``decoupled`` (LOW <= 0); clipping is ``clamp``; the sequence level and the
        divergences are ``gate``. For ``policy_loss_type="gspo"`` OpenRLHF applies no weight
        and forms the ratio against the rollout log-probs instead: pass them as
        ``old_logprobs`` without a correction."""
        pre = "is_correction_"
        _check_choice(pre + "level", is_correction_level, ("off", "token", "seq"))
        _check_choice(pre + "mode", is_correction_mode, ("mask", "clip"))
        _check_choice(pre + "gating", is_correction_gating, IS_GATES)
        thr = tuple(is_correction_threshold)
        if len(thr) == 1:
            thr = (0.0, thr[0])
        if len(thr) != 2:
            raise ValueError(f"{pre}threshold: expected HIGH or (LOW, HIGH), got {is_correction_threshold!r}")
        low, high = (float(t) for t in thr)
        if is_correction_mode == "clip" and (is_correction_level == "seq" or is_correction_gating != "ratio"):
            raise ValueError(f"{pre}mode: 'clip' needs level 'token' and gating 'ratio'")
        if is_correction_gating != "ratio" and is_correction_level != "off" and low > 0:
            raise ValueError(
                f"{pre}threshold: gating {is_correction_gating!r} takes an upper bound only, got LOW={low}"
            )
        if is_correction_level == "off":
            return None
        level = "token" if is_correction_level == "token" else "sequence"
        if is_correction_mode == "clip":
            return cls(is_level="token", is_threshold=high, is_threshold_low=low if low > 0 else None, is_mode="clamp")
        if level == "token" and is_correction_gating == "ratio":
            if low > 0:
                return cls(is_level="token", is_threshold=high, is_threshold_low=low, is_mode="icepop")
            return cls(is_level="token", is_threshold=high, is_mode="decoupled")
        return cls(
            is_level=level, is_threshold=high, is_threshold_low=low, is_mode="gate", is_gate=is_correction_gating
        )

    @classmethod
    def from_verl(
        cls,
        rollout_is: Optional[str] = None,
        rollout_is_threshold=2.0,
        rollout_is_batch_normalize: bool = False,
        rollout_rs: Optional[str] = None,
        rollout_rs_threshold=None,
        *,
        log_ratio: str = "old",
    ) -> "RolloutCorrection":
        """From verl's ``RolloutCorrectionConfig`` fields (``rollout_is_threshold``: a float
        for TIS or a ``"lower_upper"`` string for IcePop, as verl's
        ``_parse_rollout_is_threshold``)."""
        low = None
        thr = rollout_is_threshold
        if rollout_is is not None:
            if isinstance(thr, bool) or not isinstance(thr, (int, float, str)):
                raise TypeError(f"rollout_is_threshold: expected a float or a string, got {type(thr).__name__}")
            if isinstance(thr, str):
                try:
                    if "_" in thr.strip():
                        lo_s, hi_s = thr.strip().split("_", 1)
                        low, thr = float(lo_s), float(hi_s)
                    else:
                        thr = float(thr)
                except ValueError as exc:
                    raise ValueError(f"rollout_is_threshold: invalid threshold {rollout_is_threshold!r}") from exc
        else:
            thr = 2.0
        return cls(
            is_level=rollout_is,
            is_threshold=float(thr),
            is_threshold_low=low,
            is_batch_normalize=bool(rollout_is_batch_normalize),
            rs=rollout_rs,
            rs_threshold=rollout_rs_threshold,
            log_ratio=log_ratio,
        )


# The rollout_correction shorthands of PolicyLossOptions: (is_level, is_mode).
_RC_SHORTHANDS = {
    "token_tis": ("token", "truncate"),
    "seq_tis": ("sequence", "truncate"),
    "token_mis": ("token", "mask"),
    "seq_mis": ("sequence", "mask"),
    "decoupled": ("token", "decoupled"),
}


@dataclass(frozen=True)
class PolicyLossOptions:
    """Everything that decides the numbers ``policy_loss`` returns (docs/policy-loss.md).

    loss_type         ppo | gspo | cispo | sapo | reinforce | gpg | dppo_tv | dppo_kl |
                      geo_mean | dro | clip_cov | kl_cov (gpg is reinforce: the field reads
                      "reinforce" after construction)
    clip_low/high     ε_low, ε_high of the ratio clip (ppo, gspo, cispo, clip_cov); for dppo_tv /
                      dppo_kl the divergence thresholds δ_low, δ_high (>= 0) of the trust
                      region: p − p_old (TV) or the binary KL (KL); for geo_mean the
                      log-ratio bounds (>= 0): δ clipped to [−ε_low, ε_high]
    clip_ratio_c      dual-clip bound c > 1 for A < 0 (ppo); dppo: the truncation cap of
                      the (constant) ratio, > 0; None = off
    gspo_dual_clip    apply clip_ratio_c to GSPO's sequence ratio too (TRL's ``delta`` at
                      sequence level); verl's GSPO has no dual clip, hence off by default
    log_ratio_clamp   δ clamped to ±this before exp (ppo, cispo, sapo, dppo, clip_cov, kl_cov);
                      None = off. The rollout-correction log-weights are always clamped to
                      ±20 (verl); geo_mean and dro use the raw δ (verl)
    gspo_log_clamp    upper clamp of log s_i (gspo); None = off (TRL)
    tau_pos/tau_neg   SAPO temperatures
    kl                None | k1 | k2 | k3 | k3+ to ``ref_logprobs``, times ``kl_coef``
    kl_clamp          which estimators the KL clamps apply to: True or "k3" (k3 and k3+, as
                      verl), "all" (every estimator), False / None (none; TRL)
    kl_clamp_input    x = logp − ref clamped to ±this before the estimator; None = off
    kl_clamp_output   the estimate clamped to ±this; None = off (defaults: verl's 20 and 10)
    kl_score_grad     the KL term times w = exp(logp − sg(logp)) (value 1) inside the clamps:
                      the gradient gains kl·∇logp where no clamp is active (NeMo-RL's
                      default ``calculate_kl`` importance weights)
    kl_ratio_correction  the KL term times the loss type's importance ratio r with its
                      gradient (TRL's ``use_bias_correction_kl``): r = exp(δ) (δ after
                      ``log_ratio_clamp``), GSPO's token-form s_{i,t} (its value s_i, the
                      gradient through the token's own log-prob, as GSPO's pg term)
    rollout_correction None | a RolloutCorrection | a shorthand for one: token_tis | seq_tis |
                      token_mis | seq_mis | decoupled (is_level token / sequence, is_mode
                      truncate / mask / decoupled)
    rollout_threshold C (upper bound / cap), rollout_threshold_low the MIS lower bound
                      (default 1/C) of the shorthands (a RolloutCorrection carries its own)
    entropy_coef      coefficient of the entropy bonus (needs ``entropy``)
    agg               token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean |
                      seq-mean-token-sum-norm | none (per-token loss, no reduction)
    dro_beta          β > 0 of dro's quadratic penalty ½·β·δ² (required for dro)
    cov_ratio         clip_cov / kl_cov: the fraction r of the call's N valid tokens selected
                      by covariance, k = max(1, ⌊r·N⌋) (0 < r <= 1; verl's clip_cov_ratio /
                      kl_cov_ratio, 2e-4)
    cov_lb/cov_ub     clip_cov: the candidates' covariance range lb < cov < ub (verl's
                      clip_cov_lb / clip_cov_ub, 1 and 5)
    kl_cov_coef       kl_cov: the coefficient of |δ| on the selected tokens (verl's
                      ppo_kl_coef, 1)
    cov_seed          clip_cov: the seed (an int) of the counter-based hash that picks k of
                      the candidates (contracts.policy_loss.cov_selection)
    """

    loss_type: Literal[
        "ppo",
        "gspo",
        "cispo",
        "sapo",
        "reinforce",
        "gpg",
        "dppo_tv",
        "dppo_kl",
        "geo_mean",
        "dro",
        "clip_cov",
        "kl_cov",
    ] = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: Optional[float] = None
    log_ratio_clamp: Optional[float] = 20.0
    gspo_log_clamp: Optional[float] = 10.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    kl: Optional[str] = None
    kl_coef: float = 0.0
    kl_clamp: Union[bool, str, None] = True
    rollout_correction: Optional[object] = None
    rollout_threshold: float = 2.0
    rollout_threshold_low: Optional[float] = None
    entropy_coef: float = 0.0
    agg: str = "token-mean"
    shaping: TokenShaping = field(default_factory=TokenShaping)
    kl_ratio_correction: bool = False
    gspo_dual_clip: bool = False
    kl_clamp_input: Optional[float] = 20.0
    kl_clamp_output: Optional[float] = 10.0
    kl_score_grad: bool = False
    dro_beta: Optional[float] = None
    cov_ratio: float = 2e-4
    cov_lb: float = 1.0
    cov_ub: float = 5.0
    kl_cov_coef: float = 1.0
    cov_seed: int = 0
    mis_low: float = field(init=False, repr=False, compare=False)  # rollout_threshold_low or 1/C
    # kl_clamp as None | "k3" | "all" (True is "k3")
    kl_clamp_scope: Optional[str] = field(init=False, repr=False, compare=False)
    rc: Optional[RolloutCorrection] = field(init=False, repr=False, compare=False)  # the resolved correction

    def __post_init__(self):
        _check_choice("loss_type", self.loss_type, LOSS_TYPES)
        if self.loss_type == "gpg":  # one name per loss: the kernels and the reference know "reinforce"
            object.__setattr__(self, "loss_type", "reinforce")
        dppo = self.loss_type in ("dppo_tv", "dppo_kl")
        # (a ratio clip needs 1 − ε_low >= 0; DPPO's thresholds are divergences and
        # geo_mean's bounds of the log-ratio, any >= 0)
        _check_float("clip_low", self.clip_low, 0.0, None if dppo or self.loss_type == "geo_mean" else 1.0)
        _check_float("clip_high", self.clip_high, 0.0)
        if self.clip_ratio_c is not None:
            _check_float("clip_ratio_c", self.clip_ratio_c)
            if dppo and not self.clip_ratio_c > 0.0:
                raise ValueError(f"clip_ratio_c: the truncation cap must be > 0, got {self.clip_ratio_c!r}")
            if not dppo and not self.clip_ratio_c > 1.0:
                raise ValueError(f"clip_ratio_c: the dual-clip bound must be > 1, got {self.clip_ratio_c!r}")
        _check_float("log_ratio_clamp", self.log_ratio_clamp, 0.0, lo_open=True, allow_none=True)
        _check_float("gspo_log_clamp", self.gspo_log_clamp, allow_none=True)
        _check_float("tau_pos", self.tau_pos, 0.0, lo_open=True)
        _check_float("tau_neg", self.tau_neg, 0.0, lo_open=True)
        if self.kl is not None:
            _check_choice("kl", self.kl, KL_TYPES)
        _check_float("kl_coef", self.kl_coef)
        if isinstance(self.kl_clamp, str):
            _check_choice("kl_clamp", self.kl_clamp, KL_CLAMP_SCOPES)
        elif self.kl_clamp is not None and not isinstance(self.kl_clamp, bool):
            raise TypeError(f"kl_clamp: expected a bool, None or one of {KL_CLAMP_SCOPES}, got {self.kl_clamp!r}")
        _check_float("kl_clamp_input", self.kl_clamp_input, 0.0, lo_open=True, allow_none=True)
        _check_float("kl_clamp_output", self.kl_clamp_output, 0.0, lo_open=True, allow_none=True)
        if not isinstance(self.kl_score_grad, bool):
            raise TypeError(f"kl_score_grad: expected a bool, got {type(self.kl_score_grad).__name__}")
        if self.kl_score_grad and self.kl_ratio_correction:
            raise ValueError("kl_score_grad: cannot be combined with kl_ratio_correction (both weight the KL term)")
        if isinstance(self.rollout_correction, str) or self.rollout_correction is None:
            if self.rollout_correction is not None:
                _check_choice("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        elif not isinstance(self.rollout_correction, RolloutCorrection):
            raise TypeError(
                "rollout_correction: expected a str or a rlvr_kernels.RolloutCorrection, "
                f"got {type(self.rollout_correction).__name__}"
            )
        _check_float("rollout_threshold", self.rollout_threshold, 0.0, lo_open=True)
        _check_float("rollout_threshold_low", self.rollout_threshold_low, 0.0, allow_none=True)
        if self.rollout_threshold_low is not None and self.rollout_threshold_low > self.rollout_threshold:
            raise ValueError(
                f"rollout_threshold_low: expected <= rollout_threshold = {self.rollout_threshold}, "
                f"got {self.rollout_threshold_low}"
            )
        _check_float("entropy_coef", self.entropy_coef)
        _check_float("dro_beta", self.dro_beta, 0.0, lo_open=True, allow_none=True)
        if self.loss_type == "dro" and self.dro_beta is None:
            raise ValueError("dro_beta: loss_type='dro' needs the penalty coefficient β > 0, got None")
        if not isinstance(self.gspo_dual_clip, bool):
            raise TypeError(f"gspo_dual_clip: expected a bool, got {type(self.gspo_dual_clip).__name__}")
        if not isinstance(self.kl_ratio_correction, bool):
            raise TypeError(f"kl_ratio_correction: expected a bool, got {type(self.kl_ratio_correction).__name__}")
        _check_choice("agg", self.agg, AGG_MODES)
        _check_float("cov_ratio", self.cov_ratio, 0.0, 1.0, lo_open=True)
        _check_float("cov_lb", self.cov_lb)
        _check_float("cov_ub", self.cov_ub)
        if not self.cov_lb < self.cov_ub:
            raise ValueError(f"cov_lb: expected < cov_ub = {self.cov_ub}, got {self.cov_lb}")
        _check_float("kl_cov_coef", self.kl_cov_coef)
        if isinstance(self.cov_seed, bool) or not isinstance(self.cov_seed, int):
            raise TypeError(f"cov_seed: expected an int, got {type(self.cov_seed).__name__}")
        if not 0 <= self.cov_seed < 2**64:
            raise ValueError(f"cov_seed: expected 0 <= cov_seed < 2**64, got {self.cov_seed}")
        if not isinstance(self.shaping, TokenShaping):
            raise TypeError(f"shaping: expected a rlvr_kernels.TokenShaping, got {type(self.shaping).__name__}")
        low = self.rollout_threshold_low if self.rollout_threshold_low is not None else 1.0 / self.rollout_threshold
        object.__setattr__(self, "mis_low", low)
        scope = "k3" if self.kl_clamp is True else (self.kl_clamp or None)
        object.__setattr__(self, "kl_clamp_scope", scope)
        rc = self.rollout_correction
        if isinstance(rc, str):
            level, mode = _RC_SHORTHANDS[rc]
            rc = RolloutCorrection(level, self.rollout_threshold, self.rollout_threshold_low, mode)
        elif rc is not None:
            if self.rollout_threshold != 2.0 or self.rollout_threshold_low is not None:
                raise ValueError(
                    "rollout_threshold: belongs to the string shorthands; a RolloutCorrection carries its own"
                )
            if not rc.active:
                rc = None
            elif rc.rs_mask and (self.shaping.a3po_active or self.shaping.entropy_quantile is not None):
                raise ValueError(
                    "rollout_correction: rejection (rs / geo_mean) with A3PO or the entropy quantile is not supported"
                )
        if self.loss_type == "geo_mean" and rc is not None and rc.is_level == "token":
            # A sequence-level term takes a sequence weight; verl's geo_mean forms it as the
            # geometric mean of the token weights, which the kernels do not compute.
            raise ValueError(
                "rollout_correction: loss_type='geo_mean' takes a sequence-level IS weight (seq_tis, seq_mis, "
                f"is_level='sequence'), got {self.rollout_correction!r}; for verl's geometric mean of token "
                "weights pass rollout_is_weights to the verl drop-in"
            )
        object.__setattr__(self, "rc", rc)


_LOSS_PRESET_FIELDS = {
    None: {},
    # verl core_algos: compute_policy_loss_vanilla (dual clip c = 3.0, δ clamp ±20),
    # kl_penalty (k3 clamps), agg_loss.
    "verl": dict(clip_ratio_c=3.0, log_ratio_clamp=20.0, kl_clamp=True),
    # trl GRPOTrainer._compute_loss: no δ clamp, k3 without clamps, no clamp of the
    # sequence log-ratio. TRL's two-sided clipping `delta` equals clip_ratio_c when
    # delta >= 1 + ε_high.
    "trl": dict(clip_ratio_c=None, log_ratio_clamp=None, gspo_log_clamp=None, kl_clamp=False),
    # OpenRLHF 0.11.2 openrlhf/models/loss.py PolicyLoss (δ clamp ±20, dual clip off, GSPO
    # without a clamp of log s_i, aggregate_loss token-mean) and openrlhf/models/utils.py
    # compute_approx_kl (every estimate clamped to ±10; k3's input clamp x >= −10 gives the same
    # values and gradients as ±20 under the ±10 output clamp).
    "openrlhf": dict(
        clip_ratio_c=None,
        log_ratio_clamp=20.0,
        gspo_log_clamp=None,
        kl_clamp="all",
        kl_clamp_input=20.0,
        kl_clamp_output=10.0,
        agg="token-mean",
    ),
    # slime slime/utils/ppo_utils.py compute_policy_loss (no δ clamp, dual clip off),
    # compute_approx_kl (only low_var_kl clamped, its value to ±10), cp_utils.py
    # get_sum_of_sample_mean (per-sample token mean; calculate_per_token_loss off).
    "slime": dict(
        clip_ratio_c=None,
        log_ratio_clamp=None,
        gspo_log_clamp=None,
        kl_clamp="k3",
        kl_clamp_input=None,
        kl_clamp_output=10.0,
        agg="seq-mean-token-mean",
    ),
    # AReaL 1.0.4 areal/utils/functional/functional.py ppo_actor_loss_fn (no δ clamp, c_clip
    # None, token mean over the loss mask) and areal/utils/data.py KLEstimator (every estimate
    # clamped to ±10, no input clamp).
    "areal": dict(
        clip_ratio_c=None,
        log_ratio_clamp=None,
        gspo_log_clamp=None,
        kl_clamp="all",
        kl_clamp_input=None,
        kl_clamp_output=10.0,
        agg="token-mean",
    ),
    # NeMo-RL nemo_rl/algorithms/loss/loss_functions.py ClippedPGLossFn (no δ clamp,
    # ratio_clip_c None, token_level_loss) and nemo_rl/algorithms/utils.py calculate_kl (input
    # ±20 and output ±10 on every estimator, the exp(logp − sg(logp)) importance weight).
    "nemo_rl": dict(
        clip_ratio_c=None,
        log_ratio_clamp=None,
        gspo_log_clamp=None,
        kl_clamp="all",
        kl_clamp_input=20.0,
        kl_clamp_output=10.0,
        kl_score_grad=True,
        agg="token-mean",
    ),
    # SkyRL 0.3.0 skyrl/backends/skyrl_train/utils/ppo_utils.py ppo_policy_loss ("regular": δ
    # clamp ±20 in safe_exp_delta, no dual clip), compute_approx_kl (k3 clamps as verl),
    # token_mean reduction.
    "skyrl": dict(
        clip_ratio_c=None,
        log_ratio_clamp=20.0,
        kl_clamp="k3",
        kl_clamp_input=20.0,
        kl_clamp_output=10.0,
        agg="token-mean",
    ),
    # prime-rl src/prime_rl/trainer/rl/loss.py default_loss_fn: DPPO-Binary-TV (mask 0.2 / 0.2,
    # no truncation, no δ clamp) plus kl_tau·(log ρ)² with kl_tau = 1e-3, i.e. k2 with
    # β = 2·kl_tau to ref_logprobs = the inference log-probs; the sum over the global tokens.
    "prime_rl": dict(
        loss_type="dppo_tv",
        clip_low=0.2,
        clip_high=0.2,
        clip_ratio_c=None,
        log_ratio_clamp=None,
        kl="k2",
        kl_coef=2e-3,
        kl_clamp=False,
        agg="token-mean",
    ),
}


# What a preset fixes for one loss type only (below the explicit keyword options): OpenRLHF's
# PolicyLoss turns token_level_loss off for GSPO (the per-sample mean).
_LOSS_PRESET_BY_TYPE = {("openrlhf", "gspo"): dict(agg="seq-mean-token-mean")}


@torch.compiler.assume_constant_result
def resolve_policy_loss_options(preset: Optional[str] = None, **overrides) -> PolicyLossOptions:
    """Merge a loss preset's fields with explicit overrides (``None`` means "not given").

    Note ``clip_ratio_c=None`` cannot override the verl preset's 3.0 (None means "not
    given"); pass ``preset=None`` for PPO without dual clip.
    """
    if preset not in _LOSS_PRESET_FIELDS:
        raise ValueError(f"preset: expected one of {LOSS_PRESETS} or None, got {preset!r}")
    fields = dict(_LOSS_PRESET_FIELDS[preset])
    given = {k: v for k, v in overrides.items() if v is not None}
    fields.update(_LOSS_PRESET_BY_TYPE.get((preset, given.get("loss_type", fields.get("loss_type"))), {}))
    fields.update(given)
    return PolicyLossOptions(**fields)


class PolicyLossMetrics(NamedTuple):
    """Metrics of ``policy_loss`` as 0-d fp32 device tensors (detached; no host sync).
    Means are over the valid tokens of this call (micro-batch); an empty call gives zeros,
    never NaN.

    The clip sides (ppo, gspo, cispo; 0 for sapo / reinforce / dppo): ρ is the ratio the loss type
    clips (exp(δ) after ``log_ratio_clamp``; GSPO's sequence ratio s_i), A the unshaped
    advantage; low_t = [ρ < 1 − clip_low and A < 0], high_t = [ρ > 1 + clip_high and A > 0].
    For ppo / gspo, ``pg_clipfrac`` (the clipped branch active) = low + high; for cispo
    it counts ρ outside the range whatever the sign of A; for dppo_tv / dppo_kl the tokens
    outside the trust region (masked out), and ``pg_clipfrac_lower`` the kept tokens whose
    ratio exceeds the truncation cap. f_low_i, f_high_i: the mean of
    low_t / high_t over the valid tokens of sequence i; the ``seq_*`` metrics are over the
    sequences with a valid token (0 when there is none)."""

    pg_loss: torch.Tensor  # the policy-gradient part of the loss, aggregated like the loss
    kl_loss: torch.Tensor  # the KL part (before kl_coef), aggregated like the loss
    pg_clipfrac: torch.Tensor  # fraction of tokens where the clipped branch is active
    pg_clipfrac_lower: torch.Tensor  # fraction of tokens where the dual clip is active
    ppo_kl: torch.Tensor  # mean(−δ)
    kl: torch.Tensor  # mean per-token KL term (times r with kl_ratio_correction; 0 without kl)
    is_weight_mean: torch.Tensor  # mean rollout-correction weight (1 without correction)
    is_weight_max: torch.Tensor
    is_masked_frac: torch.Tensor  # fraction of tokens a MIS / IcePop / decoupled / gate bound rejected (clamp: outside)
    shaped_frac: torch.Tensor  # fraction of tokens whose shaping weight is not 1
    entropy_mean: torch.Tensor  # mean entropy (0 without entropy)
    num_tokens: torch.Tensor  # valid tokens in this call
    num_seqs: torch.Tensor  # sequences with at least one valid token
    pg_clipfrac_low: torch.Tensor  # mean of low_t over valid tokens
    pg_clipfrac_high: torch.Tensor  # mean of high_t over valid tokens
    seq_clipfrac_low_mean: torch.Tensor  # mean over sequences of f_low_i
    seq_clipfrac_high_mean: torch.Tensor  # mean over sequences of f_high_i
    seq_clipfrac_low_min: torch.Tensor  # min over sequences of f_low_i
    seq_clipfrac_high_max: torch.Tensor  # max over sequences of f_high_i
    # Rollout correction's rejection and batch normalisation (RolloutCorrection; 0 / 0 / 1
    # without, and 0 / 0 / 0 for a call without a kept valid token): verl's
    # rollout_corr/rollout_rs_masked_fraction (removed / valid tokens before
    # rejection), rollout_rs_seq_masked_fraction (sequences with a removed token / rows B)
    # and rollout_is_batch_norm_factor. The other metrics above are over the kept tokens.
    rs_masked_frac: torch.Tensor
    rs_seq_masked_frac: torch.Tensor
    is_batch_norm_factor: torch.Tensor
