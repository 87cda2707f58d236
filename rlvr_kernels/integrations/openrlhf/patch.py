"""``apply()`` / ``unapply()``: the fused ops inside OpenRLHF 0.11.2's own actor.

One call, ``rlvr_kernels.integrations.openrlhf.apply()``, in every process that runs
OpenRLHF's actor or experience maker (its Ray workers included), before the PPO actor is built
(``ActorPPOTrainer.__init__`` builds its ``PolicyLoss`` then):

=====================  ====================================================================
``policy_loss``        ``openrlhf.models.loss.PolicyLoss`` (and ``openrlhf.models.PolicyLoss``,
                       the name ``openrlhf/trainer/ray/ppo_actor.py`` imports)
``kl``                 ``openrlhf.models.utils.compute_approx_kl`` (the actor's KL loss and
                       the experience maker's KL reward import it by name)
``logprobs``           ``openrlhf.models.utils.log_probs_from_logits`` / ``compute_entropy``
                       (and ``openrlhf.models.actor``'s by-name imports), and
                       ``openrlhf.models.actor.Actor.forward``: logit-free (``.actor``)
``advantages``         ``openrlhf.trainer.ppo_utils.experience_maker.RemoteExperienceMaker.
                       compute_advantages_and_returns`` (``.experience_maker``); off by
                       default: that module imports Ray and vLLM, which a process that only
                       trains may lack
=====================  ====================================================================

Every loaded ``openrlhf.*`` module is swept for attributes that are the replaced objects
(``is``), so a module that imported one by name (``ppo_actor``, ``experience_maker``) is
patched too; ``unapply()`` puts back the identical objects.

``strict=True`` (the default): OpenRLHF outside the tested range raises PatchError, and an
actor whose head the fused forward cannot reproduce raises NotImplementedError naming it;
``strict=False``: a warning, and OpenRLHF's forward (the logits, through the drop-ins) for that
actor. ``logits_precision`` ("fp32" | "tf32" | "bf16"): how the fused head forms the logits
(``linear_logprobs``'s); "bf16" gives the logits of OpenRLHF's bf16 LM head.
``action_rows_only`` (padded layout, with an action mask): only the rows that predict a valid
action token go through the head, ``output.entropy`` 0 elsewhere (OpenRLHF's trainer reads it
over the action mask); False scores every position, as OpenRLHF.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import rlvr_kernels.integrations.openrlhf._head as _ours_head

from ..._core.validation import check_bools
from .._lm_head import check_logits_precision
from .._patch import Build, Integration, Target
from .actor import make_forward
from .experience_maker import compute_advantages_and_returns
from .loss import PolicyLoss
from .utils import compute_approx_kl, compute_entropy, log_probs_from_logits

__all__ = ["apply", "unapply", "is_applied", "applied_options", "TESTED_VERSIONS"]

TESTED_VERSIONS = ("0.11.2", "0.12.0")  # low <= openrlhf's version < high

_LOSS = "openrlhf.models.loss"
_UTILS = "openrlhf.models.utils"
_ACTOR = "openrlhf.models.actor"
_EXPERIENCE_MAKER = "openrlhf.trainer.ppo_utils.experience_maker:RemoteExperienceMaker"

_OPENRLHF = Integration("openrlhf", TESTED_VERSIONS, sweep=("openrlhf",))


def apply(
    *,
    policy_loss: bool = True,
    kl: bool = True,
    logprobs: bool = True,
    advantages: bool = False,
    logits_precision: str = "fp32",
    action_rows_only: bool = True,
    strict: bool = True,
    count_calls: Optional[bool] = None,
) -> None:
    """Put the fused ops into OpenRLHF (module docstring). ``count_calls``: True/False turns the
    debug call counting on/off (``call_counts()``); None leaves it."""
    check_bools(
        policy_loss=policy_loss,
        kl=kl,
        logprobs=logprobs,
        advantages=advantages,
        strict=strict,
        action_rows_only=action_rows_only,
    )
    check_logits_precision(logits_precision)
    if not logprobs and logits_precision != "fp32":
        raise ValueError(
            "logits_precision: acts on the log-prob drop-ins, which apply(logprobs=False) does not install"
        )

    def plan():
        targets = []
        if policy_loss:
            targets += [Target(_LOSS, "PolicyLoss", PolicyLoss), Target("openrlhf.models", "PolicyLoss", PolicyLoss)]
        if kl:
            targets.append(Target(_UTILS, "compute_approx_kl", compute_approx_kl))
        if logprobs:
            targets += [
                Target(_UTILS, "log_probs_from_logits", log_probs_from_logits),
                Target(_UTILS, "compute_entropy", compute_entropy),
                Target(_ACTOR, "log_probs_from_logits", log_probs_from_logits),
                Target(_ACTOR, "compute_entropy", compute_entropy),
                Target(f"{_ACTOR}:Actor", "forward", Build(lambda original: make_forward(original, strict))),
                Target(_ours_head, "LOGITS_PRECISION", logits_precision),
                Target(_ours_head, "ACTION_ROWS_ONLY", action_rows_only),
            ]
        if advantages:
            targets.append(Target(_EXPERIENCE_MAKER, "compute_advantages_and_returns", compute_advantages_and_returns))
        return targets

    options = dict(
        policy_loss=policy_loss,
        kl=kl,
        logprobs=logprobs,
        advantages=advantages,
        logits_precision=logits_precision,
        action_rows_only=action_rows_only,
        strict=strict,
    )
    _OPENRLHF.apply(plan, strict=strict, count_calls=count_calls, options=options)


def unapply() -> bool:
    """Restore every object apply() replaced (the identical originals). False when nothing
    was applied."""
    return _OPENRLHF.unapply()


def is_applied() -> bool:
    return _OPENRLHF.is_applied()


def applied_options() -> Optional[Dict[str, Any]]:
    """The switches of the active apply(), or None."""
    return _OPENRLHF.applied_options()
