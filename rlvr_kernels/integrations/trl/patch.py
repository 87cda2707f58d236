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

Opt-in, off by default: ``logits_precision`` and ``match_sampling`` (the head;
``match_sampling`` also wraps ``GRPOTrainer._get_per_token_logps_and_entropies`` and
``grpo_trainer.use_adapter`` to bring the trainer's filters to it), ``mismatch_metrics``
(the sampling-metric statements of ``_generate_and_score_completions``, rewritten like the
advantage block). See ``_grpo_patch``.

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
from ._grpo_patch import generate_and_score_targets, logprobs_targets, loss_targets
from .kernels import configured

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
    logits_precision: str = "fp32",
    match_sampling: bool = False,
    mismatch_metrics: bool = False,
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

    Opt-in (the defaults are TRL's numbers; docs/integrations-trl.md):
    ``logits_precision``: "fp32" | "tf32" | "bf16", how the fused head forms the logits
    (``linear_logprobs``'s). ``match_sampling``: the log-probs (and entropy) of the policy are
    those of the distribution the completions were sampled from, restricted to the kept set
    of the trainer's ``top_k`` / ``top_p`` / ``min_p`` (after ``temperature``), a target
    outside it −inf; the reference model keeps the full vocabulary. Needs ``logprobs``.
    A setting the head cannot reproduce (``repetition_penalty`` != 1, a sampling key in
    ``generation_kwargs``, top-p with min-p under transformers' generate) raises
    NotImplementedError naming it at the first log-prob call, a bad value ValueError.
    ``mismatch_metrics``: TRL's ``sampling/sampling_logp_difference/mean`` and ``/max`` (vLLM
    importance-sampling correction) from one ``rollout_mismatch`` call (the same tokens and
    reductions; the mean summed in another order, so not bit for bit).
    """
    configured(logits_precision=logits_precision, match_sampling=match_sampling)  # checks both
    if not isinstance(mismatch_metrics, bool):
        raise TypeError(f"mismatch_metrics: expected a bool, got {type(mismatch_metrics).__name__}")
    if not logprobs and (match_sampling or logits_precision != "fp32"):
        name = "match_sampling" if match_sampling else "logits_precision"
        raise ValueError(f"{name}: acts on the fused log-prob head, which apply(logprobs=False) does not install")

    def plan():
        head = dict(compact=compact_logprobs, logits_precision=logits_precision, match_sampling=match_sampling)
        return (
            (logprobs_targets(**head) if logprobs else [])
            + generate_and_score_targets(advantages=advantages, sampling_metrics=mismatch_metrics)
            + (loss_targets(strict=strict) if loss else [])
            + (async_targets(strict=strict, loss=loss) if async_grpo else [])
        )

    options = dict(
        logprobs=logprobs,
        advantages=advantages,
        loss=loss,
        async_grpo=async_grpo,
        compact_logprobs=compact_logprobs,
        logits_precision=logits_precision,
        match_sampling=match_sampling,
        mismatch_metrics=mismatch_metrics,
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
