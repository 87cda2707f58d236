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
# (the choices: linear_logprobs' precisions, rlvr_kernels/integrations/_lm_head.py; the logits
# drop-ins, given logits and no GEMM, take fp32 / bf16)


def head_kwargs() -> Dict[str, Any]:
    """What the logit-free forward passes to ``linear_logprobs``."""
    return {"logits_precision": LOGITS_PRECISION}


def logits_kwargs() -> Dict[str, Any]:
    """What the logits drop-ins pass to ``logprobs_from_logits`` ("tf32" rounds GEMM operands:
    given logits have none, so they stay as given)."""
    return {"logits_precision": "bf16" if LOGITS_PRECISION == "bf16" else "fp32"}
