"""The AsyncGRPOTrainer part of ``integrations.trl.apply()`` (TRL 1.16's
``trl.experimental.async_grpo``)."""

from __future__ import annotations

from .._patch import Patcher


def install(patcher: Patcher, *, strict: bool, loss: bool) -> None:
    raise NotImplementedError("integrations.trl.apply(async_grpo=True): AsyncGRPOTrainer patching is not available")
