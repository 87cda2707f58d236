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

Two opt-in settings of ``apply()`` (:func:`configured` makes the class that carries them;
the default class is TRL's numbers): ``logits_precision`` (passed to ``linear_logprobs``)
and ``match_sampling``: the log-probs and entropy of the distribution the rollout engine
sampled from, restricted to its kept set (top-k / top-p / min-p). TRL's head is called
with no trainer in reach, so the trainer's filters come from :func:`sampling_support`, a
process-wide block the patched ``GRPOTrainer._get_per_token_logps_and_entropies`` opens
around the policy's forward (``_grpo_patch``); outside such a block (the reference model,
another caller of the fused head) the head scores the full vocabulary.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch

from ...ops.logprobs import linear_logprobs
from .._backend import current_backend
from .._patch import record

__all__ = ["ChunkedLogProbFunction", "OPTIONAL_OUTPUTS", "configured", "sampling_support", "active_sampling"]

OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
LOGITS_PRECISIONS = ("fp32", "tf32", "bf16")

# The sampling support of the innermost sampling_support() block: linear_logprobs keyword
# arguments (top_k / top_p / min_p / sampling_convention), None (the full vocabulary, said
# so by the caller: the reference model), or _UNSET outside every block, where a
# match_sampling head refuses to guess. A plain module global, like the backend setting
# (integrations/_backend.py): process-wide.
_UNSET: Any = object()
_SAMPLING: Any = _UNSET


@contextlib.contextmanager
def sampling_support(kwargs: Optional[Dict[str, Any]]) -> Iterator[None]:
    """Inside the block, a head whose class has ``match_sampling`` scores with the sampling
    support ``kwargs`` (None or empty: the full vocabulary); the previous one is restored on
    exit."""
    global _SAMPLING
    previous, _SAMPLING = _SAMPLING, (dict(kwargs) if kwargs else None)
    try:
        yield
    finally:
        _SAMPLING = previous


def active_sampling() -> Optional[Dict[str, Any]]:
    """The sampling support of the innermost :func:`sampling_support` block (None: the full
    vocabulary, or outside every block)."""
    return None if _SAMPLING is None or _SAMPLING is _UNSET else dict(_SAMPLING)


class ChunkedLogProbFunction:
    """``trl.kernels.ChunkedLogProbFunction`` on :func:`linear_logprobs` (no ``[N, V]``
    logits, forward and backward). ``chunk_size`` is TRL's tiling knob and is ignored: the
    op picks its own tiles. The class attributes are apply()'s opt-in settings (see
    :func:`configured`); these defaults are TRL's numbers."""

    logits_precision = "fp32"
    match_sampling = False

    @classmethod
    def apply(
        cls,
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
            logits_precision=cls.logits_precision,
            backend=current_backend(),
        )
        sampling = _SAMPLING if cls.match_sampling else None
        if sampling is _UNSET:
            raise NotImplementedError(
                "apply(match_sampling=True): this call of TRL's fused LM head is not under GRPOTrainer's "
                "_get_per_token_logps_and_entropies (e.g. AsyncGRPOTrainer, or a direct "
                "model(..., fused_lm_head=True) call), so the trainer's top_k / top_p / min_p are not in reach; "
                "apply(match_sampling=False) scores the full vocabulary"
            )
        if sampling is not None:
            extra = [o for o in wanted if o != "entropy"]
            if extra:
                raise ValueError(
                    f"outputs: {extra} are not defined on the sampling support (apply(match_sampling=True)); "
                    "only 'log_probs' and 'entropy' are"
                )
            # A sampled token was in the engine's kept set: it joins the trainer's recomputed
            # one where that misses it at the boundary (never a −inf log-prob, a NaN ratio).
            kwargs.update(sampling, keep_targets=True)
        out = linear_logprobs(hidden, weight, targets, outputs=wanted, **kwargs)
        return (
            _fp32(out.logp),
            _fp32(out.entropy),
            _fp32(out.log_sum_sq_probs),
            _fp32(out.mean_logits),
            out.is_top1,
        )


def configured(*, logits_precision: str = "fp32", match_sampling: bool = False) -> type:
    """The head apply() installs: :class:`ChunkedLogProbFunction` itself for the defaults,
    else a subclass carrying the settings (ValueError / TypeError naming a bad one)."""
    if not isinstance(logits_precision, str) or logits_precision not in LOGITS_PRECISIONS:
        raise ValueError(f"logits_precision: expected one of {LOGITS_PRECISIONS}, got {logits_precision!r}")
    if not isinstance(match_sampling, bool):
        raise TypeError(f"match_sampling: expected a bool, got {type(match_sampling).__name__}")
    if logits_precision == "fp32" and not match_sampling:
        return ChunkedLogProbFunction
    return type(
        "ChunkedLogProbFunction",
        (ChunkedLogProbFunction,),
        {
            "logits_precision": logits_precision,
            "match_sampling": match_sampling,
            "__module__": __name__,
            "__doc__": ChunkedLogProbFunction.__doc__,
        },
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
