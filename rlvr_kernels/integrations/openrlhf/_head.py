"""The opt-in setting of OpenRLHF's ``apply()`` that the log-prob drop-ins read at call time:
``logits_precision`` (how the logit-free ``Actor.forward`` forms the logits from the hidden
states and the LM head). ``apply()`` sets it through its patcher, so ``unapply()`` restores
the default, the drop-ins' stock numbers."""

from __future__ import annotations

from typing import Any, Dict

LOGITS_PRECISION = "fp32"
# Only the rows that predict a valid action token through the head (padded layout, with an
# action mask); False: every position, as OpenRLHF (output.entropy everywhere).
ACTION_ROWS_ONLY = True
# linear_logprobs' precisions; logprobs_from_logits (given logits, no GEMM) takes fp32 / bf16.
LOGITS_PRECISIONS = ("fp32", "tf32", "bf16")


def check_logits_precision(logits_precision: Any) -> str:
    if not isinstance(logits_precision, str) or logits_precision not in LOGITS_PRECISIONS:
        raise ValueError(f"logits_precision: expected one of {LOGITS_PRECISIONS}, got {logits_precision!r}")
    return logits_precision


def head_kwargs() -> Dict[str, Any]:
    """What the logit-free forward passes to ``linear_logprobs``."""
    return {"logits_precision": LOGITS_PRECISION}


def logits_kwargs() -> Dict[str, Any]:
    """What the logits drop-ins pass to ``logprobs_from_logits`` ("tf32" rounds GEMM operands:
    given logits have none, so they stay as given)."""
    return {"logits_precision": "bf16" if LOGITS_PRECISION == "bf16" else "fp32"}
