"""``apply()`` / ``unapply()``: the fused ops inside TRL's own ``GRPOTrainer`` (and
``AsyncGRPOTrainer``), one call, no trainer subclass.

    from rlvr_kernels.integrations import trl as rk_trl
    rk_trl.apply()                  # before or after building the trainer
    trainer = trl.GRPOTrainer(...)  # unchanged user code
    ...
    rk_trl.unapply()                # the stock trainer again, the identical objects

What each switch replaces (TRL 1.16; the details are in ``_grpo_patch``):

==============  =============================================================================
``logprobs``    ``trl.trainer.utils._ChunkedLogProbFunction`` (TRL's fused LM head) becomes
                ``linear_logprobs``; with ``compact_logprobs`` the head scores only the
                completion positions on the CPU too (``trl.trainer.utils._use_triton``)
``advantages``  the advantage block of ``GRPOTrainer._generate_and_score_completions``
                becomes one ``group_advantages`` call (the method's source, rewritten)
``loss``        ``GRPOTrainer._compute_loss`` becomes one ``policy_loss`` call
                (``grpo_loss_trl``) with TRL's metric set; ``GRPOTrainer.__init__`` checks
                the settings
``async_grpo``  ``trl.experimental.async_grpo`` (tree packing, tree attention, its loss)
==============  =============================================================================

Semantics of repeated calls: ``apply()`` while applied first undoes the previous
``apply()`` and then applies the new switches (so the last call wins; the same switches
twice is a no-op in effect). ``unapply()`` when nothing is applied does nothing and
returns False. Every name is looked up, and every replacement built, before the first one
is set: a failure (PatchError, version outside the tested range with ``strict``) leaves
TRL untouched (``integrations._patch.Integration``, the same for every integration).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from .._patch import Integration
from ._async_patch import async_targets
from ._grpo_patch import advantages_targets, logprobs_targets, loss_targets

__all__ = ["apply", "unapply", "is_applied", "applied_options", "TESTED_TRL"]

TESTED_TRL = ("1.16.0", "1.17.0")  # low <= version < high

_TRL = Integration("trl", TESTED_TRL)


def apply(
    *,
    logprobs: bool = True,
    advantages: bool = True,
    loss: bool = True,
    async_grpo: bool = True,
    compact_logprobs: bool = True,
    strict: bool = True,
    count_calls: Optional[bool] = None,
) -> None:
    """Put the fused ops into TRL's trainers (see the module docstring for each switch).

    ``strict=True``: TRL outside the tested range (1.16.x) raises PatchError, and a
    ``GRPOTrainer`` whose settings the fused loss does not support (``delta`` < 1, or
    ``delta`` <= 1 + ``epsilon_high`` with ``epsilon_high`` = 0: see ``grpo_loss_trl``)
    raises NotImplementedError naming the option when it is built (or at its first loss
    call). Every loss type, the bias-corrected KL and ``top_entropy_quantile`` across
    processes (the patched loss passes the process group) run fused.
    ``strict=False``: a warning instead, and such a trainer runs TRL's own ``_compute_loss``
    (warned once per trainer; never silently different).
    ``count_calls``: True/False turns the debug call counting on/off (``call_counts()``);
    None leaves it as it is.
    """

    def plan():
        return (
            (logprobs_targets(compact=compact_logprobs) if logprobs else [])
            + (advantages_targets() if advantages else [])
            + (loss_targets(strict=strict) if loss else [])
            + (async_targets(strict=strict, loss=loss) if async_grpo else [])
        )

    options = dict(
        logprobs=logprobs,
        advantages=advantages,
        loss=loss,
        async_grpo=async_grpo,
        compact_logprobs=compact_logprobs,
        strict=strict,
    )
    _TRL.apply(plan, strict=strict, count_calls=count_calls, options=options)


def unapply() -> bool:
    """Restore every object apply() replaced (the identical originals). Returns False when
    nothing was applied."""
    return _TRL.unapply()


def is_applied() -> bool:
    return _TRL.is_applied()


def applied_options() -> Optional[Dict[str, Any]]:
    """The switches of the active apply(), or None."""
    return _TRL.applied_options()
