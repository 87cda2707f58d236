"""The settings of AReaL's ``apply()`` that the logit-free engine reads at call time:
``logits_precision`` (how ``linear_logprobs`` forms the logits from the hidden states and the
LM head; the choices: rlvr_kernels/integrations/_lm_head.py), ``loss_rows_only`` and
``grad_in_forward``. ``apply()``
sets them through its patcher, so ``unapply()`` restores the defaults."""

from __future__ import annotations

from typing import Any, Dict, Optional

LOGITS_PRECISION = "fp32"
# With AReaL's grpo_loss_fn as the loss (which reads the loss-mask rows only), only those rows
# through the head, log-prob and entropy 0 elsewhere; False: every packed row, as AReaL.
LOSS_ROWS_ONLY = True
# With a grpo_loss_fn separable over tokens (fsdp_engine.forms_grad_in_forward), the head's
# gradient formed in the forward (integrations/_head_grad.py): True always, False never
# (linear_logprobs' backward), None where measured faster (_head_grad.chosen).
GRAD_IN_FORWARD: Optional[bool] = None


def head_kwargs() -> Dict[str, Any]:
    """What the logit-free forward passes to ``linear_logprobs``."""
    return {"logits_precision": LOGITS_PRECISION}
