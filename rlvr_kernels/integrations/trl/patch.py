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
TRL untouched.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional

from .._patch import Patcher, PatchError, check_version, set_counting
from ._async_patch import install as install_async
from ._grpo_patch import prepare_advantages, prepare_logprobs, prepare_loss

__all__ = ["apply", "unapply", "is_applied", "applied_options", "TESTED_TRL"]

TESTED_TRL = ("1.16.0", "1.17.0")  # low <= version < high

_lock = threading.Lock()
_patcher: Optional[Patcher] = None
_options: Optional[Dict[str, Any]] = None


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
    ``GRPOTrainer`` whose settings the fused loss does not support (e.g. ``beta`` > 0 with
    TRL's default ``use_bias_correction_kl=True``, ``loss_type="vespo"``) raises
    NotImplementedError naming the option when it is built (or at its first loss call).
    ``strict=False``: a warning instead, and such a trainer runs TRL's own ``_compute_loss``
    (warned once per trainer; never silently different).
    ``count_calls``: True/False turns the debug call counting on/off (``call_counts()``);
    None leaves it as it is.
    """
    global _patcher, _options
    with _lock:
        if _patcher is not None:
            _unapply_locked()
        try:
            import trl
        except ImportError as e:  # pragma: no cover - TRL is a test dependency
            raise PatchError(f"integrations.trl.apply(): TRL is not installed ({e})") from e
        check_version("trl", trl.__version__, *TESTED_TRL, strict=strict)
        replacements = []
        if logprobs:
            replacements += prepare_logprobs(compact=compact_logprobs)
        if advantages:
            replacements += prepare_advantages()
        if loss:
            replacements += prepare_loss(strict=strict)
        patcher = Patcher("trl")
        try:
            for owner, attr, new in replacements:
                patcher.replace(owner, attr, new)
            if async_grpo:
                install_async(patcher, strict=strict, loss=loss)
        except BaseException:
            patcher.restore()
            raise
        if count_calls is not None:
            set_counting(count_calls)
        _patcher = patcher
        _options = dict(
            logprobs=logprobs,
            advantages=advantages,
            loss=loss,
            async_grpo=async_grpo,
            compact_logprobs=compact_logprobs,
            strict=strict,
        )


def unapply() -> bool:
    """Restore every object apply() replaced (the identical originals). Returns False when
    nothing was applied."""
    with _lock:
        return _unapply_locked()


def _unapply_locked() -> bool:
    global _patcher, _options
    if _patcher is None:
        return False
    _patcher.restore()
    _patcher, _options = None, None
    return True


def is_applied() -> bool:
    return _patcher is not None


def applied_options() -> Optional[Dict[str, Any]]:
    """The switches of the active apply(), or None."""
    return None if _options is None else dict(_options)
