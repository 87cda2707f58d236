"""``apply()`` / ``unapply()``: the fused ops inside AReaL 1.0.4's own trainer.

One call, ``rlvr_kernels.integrations.areal.apply()``, in every process that runs AReaL's
actor (its training workers), before the first ``ppo_update``:

=================  ==========================================================================
``policy_loss``    ``areal.utils.functional.ppo_actor_loss_fn`` / ``sapo_loss_fn`` (and the
                   names ``areal.trainer.ppo.actor`` imports, so AReaL's ``grpo_loss_fn``, the
                   ``loss_fn`` ``PPOActor`` gives ``engine.train_batch``, runs the fused loss)
``logprobs``       ``areal.utils.functional.gather_logprobs`` / ``gather_logprobs_entropy`` (and
                   ``areal.engine.fsdp_engine``'s by-name imports): the engine's logits path,
                   one fused pass over each row of the logits
``logit_free``     ``areal.engine.fsdp_engine.FSDPEngine.forward_backward_batch`` (and the two
                   methods that read its output): the log-probs and entropy from the hidden
                   states and the LM head, never the ``[tokens, vocab]`` logits (``.fsdp_engine``)
=================  ==========================================================================

Every loaded ``areal.*`` module is swept for attributes that are the replaced objects (``is``),
so a module that imported one by name is patched too; ``unapply()`` puts back the identical
objects.

``loss_rows_only`` (with AReaL's ``grpo_loss_fn`` as the ``loss_fn``, as ``PPOActor`` binds it):
only the rows of the loss mask go through the fused head, log-prob and entropy 0 elsewhere
(every loss term and statistic of ``grpo_loss_fn`` is masked by it); False scores every packed
row, as AReaL. ``forward_batch`` (``compute_logp``) and any other ``loss_fn`` always score every row.
``grad_in_forward`` (``train_batch`` with a ``grpo_loss_fn`` separable over tokens: token-level
importance sampling, no M2PO, recomputed proximal log-probs): the head's gradient is formed in
the forward, three GEMMs instead of four (exact whatever the loss: ``integrations/_head_grad.py``):
True always, False never, None (the default) where that was measured faster (rows on the CPU, at
least ``_head_grad.MIN_MACS`` multiply-adds per GEMM).

``strict=True`` (the default): AReaL outside the tested range raises PatchError, and an engine
call the logit-free path cannot serve raises NotImplementedError naming the reason;
``strict=False``: a warning, and AReaL's logits path for that call. ``logits_precision``
("fp32" | "tf32" | "bf16"): how the fused head forms the logits (``linear_logprobs``'s);
"bf16" gives the logits of AReaL's bf16 LM head.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import rlvr_kernels.integrations.areal._head as _ours_head

from ..._core.validation import check_bools
from .._head_grad import check_setting as check_grad_in_forward
from .._lm_head import check_logits_precision
from .._patch import Build, Integration, Target
from .fsdp_engine import make_compute_forward_result, make_compute_logprobs_and_loss, make_forward_backward_batch
from .functional import gather_logprobs, gather_logprobs_entropy, ppo_actor_loss_fn, sapo_loss_fn

__all__ = ["apply", "unapply", "is_applied", "applied_options", "TESTED_VERSIONS"]

TESTED_VERSIONS = ("1.0.4", "1.1.0")  # low <= areal's version < high

_FUNCTIONAL = "areal.utils.functional.functional"
_VOCAB_PARALLEL = "areal.utils.functional.vocab_parallel"
_ENGINE = "areal.engine.fsdp_engine:FSDPEngine"

_AREAL = Integration("areal", TESTED_VERSIONS, sweep=("areal",))


def apply(
    *,
    policy_loss: bool = True,
    logprobs: bool = True,
    logit_free: bool = True,
    logits_precision: str = "fp32",
    loss_rows_only: bool = True,
    grad_in_forward: Optional[bool] = None,
    strict: bool = True,
    count_calls: Optional[bool] = None,
) -> None:
    """Put the fused ops into AReaL (module docstring). ``count_calls``: True/False turns the
    debug call counting on/off (``call_counts()``); None leaves it."""
    check_bools(
        policy_loss=policy_loss,
        logprobs=logprobs,
        logit_free=logit_free,
        loss_rows_only=loss_rows_only,
        strict=strict,
    )
    check_grad_in_forward(grad_in_forward)
    check_logits_precision(logits_precision)
    if not logit_free and logits_precision != "fp32":
        raise ValueError(
            "logits_precision: acts on the logit-free engine, which apply(logit_free=False) does not install"
        )
    # their non-defaults act on the logit-free engine only
    for name, value in (
        ("loss_rows_only", loss_rows_only is not True),
        ("grad_in_forward", grad_in_forward is not None),
    ):
        if not logit_free and value:
            raise ValueError(f"{name}: acts on the logit-free engine, which apply(logit_free=False) does not install")

    def plan():
        targets = []
        if policy_loss:
            for owner in (_FUNCTIONAL, "areal.utils.functional"):
                targets += [
                    Target(owner, "ppo_actor_loss_fn", ppo_actor_loss_fn),
                    Target(owner, "sapo_loss_fn", sapo_loss_fn),
                ]
        if logprobs:
            for owner in (_VOCAB_PARALLEL, "areal.utils.functional"):
                targets += [
                    Target(owner, "gather_logprobs", gather_logprobs),
                    Target(owner, "gather_logprobs_entropy", gather_logprobs_entropy),
                ]
        if logit_free:
            targets += [
                Target(
                    _ENGINE,
                    "forward_backward_batch",
                    Build(lambda original: make_forward_backward_batch(original, strict)),
                ),
                Target(_ENGINE, "_compute_logprobs_and_loss", Build(make_compute_logprobs_and_loss)),
                Target(_ENGINE, "_compute_forward_result", Build(make_compute_forward_result)),
                Target(_ours_head, "LOGITS_PRECISION", logits_precision),
                Target(_ours_head, "LOSS_ROWS_ONLY", loss_rows_only),
                Target(_ours_head, "GRAD_IN_FORWARD", grad_in_forward),
            ]
        return targets

    options = dict(
        policy_loss=policy_loss,
        logprobs=logprobs,
        logit_free=logit_free,
        logits_precision=logits_precision,
        loss_rows_only=loss_rows_only,
        grad_in_forward=grad_in_forward,
        strict=strict,
    )
    _AREAL.apply(plan, strict=strict, count_calls=count_calls, options=options)


def unapply() -> bool:
    """Restore every object apply() replaced (the identical originals). False when nothing
    was applied."""
    return _AREAL.unapply()


def is_applied() -> bool:
    return _AREAL.is_applied()


def applied_options() -> Optional[Dict[str, Any]]:
    """The switches of the active apply(), or None."""
    return _AREAL.applied_options()
