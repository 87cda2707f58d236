"""``trl.kernels`` (TRL 1.16) on the fused ops: :class:`ChunkedLogProbFunction`, the
signature-compatible replacement of TRL's chunked LM-head log-prob function, built on
:func:`rlvr_kernels.linear_logprobs`.

TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) calls
``_ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, chunk_size,
final_logit_softcapping, logit_scale, outputs)`` and unpacks five per-token outputs
``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, ``None`` for those not
in ``outputs``. ``integrations.trl.apply()`` puts this class in its place.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ...ops.logprobs import linear_logprobs
from .._backend import current_backend
from .._patch import record

__all__ = ["ChunkedLogProbFunction", "OPTIONAL_OUTPUTS"]

OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class ChunkedLogProbFunction:
    """``trl.kernels.ChunkedLogProbFunction`` on :func:`linear_logprobs` (no ``[N, V]``
    logits, forward and backward). ``chunk_size`` is TRL's tiling knob and is ignored: the
    op picks its own tiles."""

    @staticmethod
    def apply(
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: Optional[float] = None,
        logit_scale: float = 1.0,
        outputs: Sequence[str] = OPTIONAL_OUTPUTS,
    ) -> Tuple[Optional[torch.Tensor], ...]:
        record("trl.kernels.ChunkedLogProbFunction")
        unknown = [o for o in outputs if o not in OPTIONAL_OUTPUTS + ("log_probs",)]
        if unknown:
            raise ValueError(f"outputs: unknown output(s) {unknown}; TRL's are {('log_probs',) + OPTIONAL_OUTPUTS}")
        unsupported = [o for o in outputs if o in ("log_sum_sq_probs", "mean_logits", "is_top1")]
        if unsupported:
            raise NotImplementedError(f"outputs: {unsupported} not supported yet")
        if final_logit_softcapping is not None:
            raise NotImplementedError("final_logit_softcapping: not supported yet")
        if float(logit_scale) != 1.0:
            raise NotImplementedError("logit_scale: not supported yet")
        want_entropy = "entropy" in outputs
        out = linear_logprobs(
            hidden,
            weight,
            targets,
            bias=bias,
            temperature=temperature,
            return_entropy=want_entropy,
            backend=current_backend(),
        )
        logp, entropy = out if want_entropy else (out, None)
        return logp, entropy, None, None, None
