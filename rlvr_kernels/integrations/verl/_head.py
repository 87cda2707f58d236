"""The opt-in settings of verl's ``apply()`` that the log-prob drop-ins read at call time:
``logits_precision`` and the sampling support of ``match_sampling`` (docs/integrations-verl.md).

verl's actor calls ``logprobs_from_logits(logits, labels)`` (and ``entropy_from_logits``,
``linear_cross_entropy``) with the temperature-scaled logits and nothing else: neither the
rollout config nor the engine name is in reach there (``verl/workers/engine/fsdp/
transformer_impl.py``, ``FSDPEngineWithLMHead.prepare_model_outputs``). So ``apply()`` takes
verl's ``actor_rollout_ref.rollout`` config itself, reads it once (:func:`rollout_sampling`),
and sets these module attributes through its patcher (``unapply()`` puts the defaults back).
The defaults are the drop-ins' stock numbers.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

LOGITS_PRECISION = "fp32"
# The logit-free engine step (transformer_impl): only the rows the actor loss reads through the
# head, and, for a loss separable over tokens, the head's gradient formed in the forward (None:
# where measured faster, integrations/_head_grad.chosen).
LOSS_ROWS_ONLY = True
GRAD_IN_FORWARD: Optional[bool] = None
# linear_logprobs / logprobs_from_logits keyword arguments of the rollout's kept set (top_k,
# top_p, sampling_convention), or None: the full vocabulary.
SAMPLING: Optional[Dict[str, Any]] = None

# verl's rollout engine names -> the op's sampling_convention.
CONVENTIONS = {"vllm": "vllm", "sglang": "sglang"}
# Logits precisions of the drop-ins: "tf32" rounds GEMM operands, and verl's
# logprobs_from_logits receives logits (no GEMM to round).
LOGITS_PRECISIONS = ("fp32", "bf16")


def head_kwargs() -> Dict[str, Any]:
    """What the drop-ins pass to the op besides verl's arguments."""
    out: Dict[str, Any] = {"logits_precision": LOGITS_PRECISION}
    if SAMPLING is not None:
        # A sampled token was in the engine's kept set: it joins the recomputed one where
        # that misses it at the boundary (never a −inf log-prob, a NaN ratio).
        out.update(SAMPLING, keep_targets=True)
    return out


def _get(config: Any, key: str, default: Any) -> Any:
    if isinstance(config, dict) or (hasattr(config, "keys") and hasattr(config, "get")):
        return config.get(key, default)
    return getattr(config, key, default)


def check_logits_precision(logits_precision: Any) -> str:
    if not isinstance(logits_precision, str) or logits_precision not in LOGITS_PRECISIONS:
        raise ValueError(
            f"logits_precision: expected one of {LOGITS_PRECISIONS} (verl's logprobs_from_logits gets logits, "
            f"so there are no GEMM operands for 'tf32' to round), got {logits_precision!r}"
        )
    return logits_precision


def rollout_sampling(rollout_config: Any) -> Optional[Dict[str, Any]]:
    """The sampling support of verl's rollout config (``actor_rollout_ref.rollout``: a
    mapping, an OmegaConf ``DictConfig`` or verl's ``RolloutConfig``): ``top_k`` (verl's -1:
    off), ``top_p`` (1.0: off), and ``name`` ("vllm" / "sglang") as the convention; None when
    no filter is on. ValueError / TypeError naming a bad field, NotImplementedError naming
    a setting the fused head cannot reproduce (another engine, greedy decoding, a repetition
    penalty)."""
    if rollout_config is None:
        raise ValueError(
            "rollout_config: match_sampling=True needs verl's actor_rollout_ref.rollout config (verl calls "
            "logprobs_from_logits with the logits only, so the rollout's top_k / top_p are not in reach there)"
        )
    name = _get(rollout_config, "name", None)
    if name not in CONVENTIONS:
        raise NotImplementedError(
            f"rollout_config.name: match_sampling supports the rollout engines {tuple(CONVENTIONS)}, got {name!r}"
        )
    if not _get(rollout_config, "do_sample", True):
        raise NotImplementedError("rollout_config.do_sample=False (greedy decoding): there is no sampled distribution")
    penalty = _get(rollout_config, "repetition_penalty", 1.0)
    if penalty not in (None, 1.0):
        raise NotImplementedError(
            f"rollout_config.repetition_penalty={penalty!r}: the fused head reproduces top_k and top_p only"
        )
    top_k = _get(rollout_config, "top_k", -1)
    top_p = _get(rollout_config, "top_p", 1.0)
    if top_k is None:
        top_k = -1
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"rollout_config.top_k: expected an int, got {top_k!r}")
    if top_p is None:
        top_p = 1.0
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
        raise TypeError(f"rollout_config.top_p: expected a number, got {top_p!r}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"rollout_config.top_p: expected a value in (0, 1], got {top_p!r}")
    out: Dict[str, Any] = {}
    if top_k > 0:
        out["top_k"] = int(top_k)
    if top_p < 1.0:
        out["top_p"] = float(top_p)
    if not out:
        return None
    out["sampling_convention"] = CONVENTIONS[name]
    return out
