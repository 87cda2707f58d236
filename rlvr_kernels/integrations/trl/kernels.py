"""``trl.kernels`` (TRL 1.16) on the fused ops: :class:`ChunkedLogProbFunction`, the
signature-compatible replacement of TRL's chunked LM-head log-prob function, built on
:func:`rlvr_kernels.linear_logprobs`.

TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) calls
``_ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, chunk_size,
final_logit_softcapping, logit_scale, outputs)`` and unpacks five per-token outputs
``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, ``None`` for those not
in ``outputs``. ``integrations.trl.apply()`` puts this class in its place.

Behaviour kept from TRL, on purpose:
- the transform z = softcap·tanh(logit_scale·y/softcap)/T (scale, soft-cap, temperature),
  with TRL's reading of ``final_logit_softcapping``: None is no cap, and a falsy value
  (0.0) caps at 1.0, as TRL's ``final_logit_softcapping or 1.0`` does;
- the compute dtype: the autocast dtype when autocast is on for the inputs' device, else
  hidden's dtype; weight and bias are cast to it (differentiably, so their gradients come
  back in their own dtypes, as TRL returns them). The op accumulates in fp32 whatever the
  operand dtype, like TRL's fp32 tiles statistics;
- the outputs' dtypes: fp32 values (fp64 inputs included: TRL keeps its statistics in
  fp32), ``is_top1`` bool; the entropy carries a gradient, the other three do not.
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
        if isinstance(outputs, str):
            raise TypeError(f"outputs: expected a tuple of names, got the string {outputs!r}")
        unknown = [o for o in outputs if o not in OPTIONAL_OUTPUTS + ("log_probs",)]
        if unknown:
            raise ValueError(f"outputs: unknown output(s) {unknown}; TRL's are {('log_probs',) + OPTIONAL_OUTPUTS}")
        wanted = tuple(o for o in OPTIONAL_OUTPUTS if o in outputs)
        hidden, weight, bias = _to_compute_dtype(hidden, weight, bias)
        softcap = None if final_logit_softcapping is None else (final_logit_softcapping or 1.0)
        kwargs = dict(
            bias=bias,
            temperature=temperature,
            logit_scale=logit_scale,
            softcap=softcap,
            backend=current_backend(),
        )
        out = linear_logprobs(hidden, weight, targets, outputs=wanted, **kwargs)
        return (
            _fp32(out.logp),
            _fp32(out.entropy),
            _fp32(out.log_sum_sq_probs),
            _fp32(out.mean_logits),
            out.is_top1,
        )


def _to_compute_dtype(hidden, weight, bias):
    """hidden, weight and bias in TRL's compute dtype: the autocast dtype of the inputs'
    device when autocast is on there, else hidden's."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = hidden.dtype
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _fp32(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None else x.float()
