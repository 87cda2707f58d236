"""The setting of AReaL's ``apply()`` that the logit-free engine reads at call time:
``logits_precision`` (how ``linear_logprobs`` forms the logits from the hidden states and the
LM head; the choices: rlvr_kernels/integrations/_lm_head.py). ``apply()`` sets it through its
patcher, so ``unapply()`` restores the default."""

from __future__ import annotations

from typing import Any, Dict

LOGITS_PRECISION = "fp32"


def head_kwargs() -> Dict[str, Any]:
    """What the logit-free forward passes to ``linear_logprobs``."""
    return {"logits_precision": LOGITS_PRECISION}
