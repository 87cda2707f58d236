"""Reference for docs/logprobs.md: log-probs and entropy from hidden states and the LM head, or
from logits. It materialises the ``[N, V]`` logits (small sizes only) and leaves the
gradients to autograd, so it is the formula and nothing else. Everything is computed in
fp64 when the inputs are fp64, else in fp32 from the inputs upcast."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from .._core.layout import compute_dtype as _compute_dtype

# The optional per-row / per-target statistics of ``linear_logprobs`` (``outputs=``).
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 (to nearest, ties to even; fp64 through fp32, as the kernels do),
    returned in x's dtype."""
    return x.to(torch.float32).to(torch.bfloat16).to(x.dtype)


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """x rounded to tf32 (fp32 with a 10-bit mantissa: to nearest, ties away from zero, the
    ``cvt.rna.tf32.f32`` rounding; ±inf and NaN kept; fp64 through fp32), in x's dtype."""
    f = x.to(torch.float32)
    bits = (f.view(torch.int32) + 0x1000) & -0x2000  # sign-magnitude: the carry rounds |x| up
    return torch.where(torch.isfinite(f), bits.view(torch.float32), f).to(x.dtype)


def _head(hidden, weight, bias, dt, logits_precision: str) -> torch.Tensor:
    """y = hidden·Wᵀ + b in dt after the rounding steps of ``logits_precision``; the gradient
    is that of the unrounded y (straight through every rounding: d hidden = dy·W with the
    operands as given)."""

    def linear(h, w, b):
        y = h.to(dt) @ w.to(dt).T
        return y if b is None else y + b.to(dt)

    y = linear(hidden, weight, bias)
    if logits_precision == "fp32":
        return y
    if logits_precision == "bf16":
        rounded = round_bf16(linear(round_bf16(hidden), round_bf16(weight), None if bias is None else round_bf16(bias)))
    else:
        rounded = linear(round_tf32(hidden), round_tf32(weight), bias)
    return y + (rounded - y).detach()


def _per_row(temperature, n: int, like: torch.Tensor) -> torch.Tensor:
    if isinstance(temperature, torch.Tensor):
        return temperature.to(device=like.device, dtype=like.dtype).reshape(-1).expand(n)
    return torch.full((n,), float(temperature), device=like.device, dtype=like.dtype)


def _from_scaled_logits(z, targets, row_index, ignore_index, return_entropy):
    """log p of each target and the entropy of each row, from temperature-scaled logits z."""
    log_p = torch.log_softmax(z, dim=-1)
    rows = torch.arange(z.shape[0], device=z.device) if row_index is None else row_index.long()
    ignored = targets == ignore_index
    safe = torch.where(ignored, torch.zeros_like(targets), targets).long()
    logp = log_p[rows, safe].masked_fill(ignored, 0.0)
    if not return_entropy:
        return logp
    entropy = -(log_p.exp() * log_p).sum(-1)
    return logp, entropy


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    row_index: Optional[torch.Tensor] = None,
    temperature: Union[float, torch.Tensor] = 1.0,
    bias: Optional[torch.Tensor] = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    outputs: Sequence[str] = (),
    logits_precision: str = "fp32",
) -> Union[torch.Tensor, tuple]:
    """y = hidden·Wᵀ + b; z_n = softcap·tanh(logit_scale·y_n / softcap) / T_n (without a
    softcap: logit_scale·y_n / T_n); logp_m = z_{row(m), t_m} − logsumexp(z_{row(m)}) (0 for
    ignored targets); entropy_n = logsumexp(z_n) − Σ_v softmax(z_n)_v z_{n,v}.

    With ``outputs`` (names from :data:`OPTIONAL_OUTPUTS`) the result is the 5-tuple
    (logp, entropy, log_sum_sq_probs, mean_logits, is_top1), None where not requested:
    log_sum_sq_probs_n = log Σ_v softmax(z_n)_v², mean_logits_n = mean_v z_{n,v}, is_top1_m =
    (t_m is the first argmax of z_{row(m)}) and t_m is not ignored.

    ``logits_precision``: "tf32" rounds hidden and W to tf32 first (:func:`round_tf32`);
    "bf16" rounds hidden, W and b to bf16 and then y itself (:func:`round_bf16`). The
    gradient passes straight through every rounding (that of the unrounded y)."""
    dt = _compute_dtype(hidden.dtype)
    z = _head(hidden, weight, bias, dt, logits_precision)
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / _per_row(temperature, hidden.shape[0], z)[:, None]
    if not outputs:
        return _from_scaled_logits(z, targets, row_index, ignore_index, return_entropy)
    logp, entropy = _from_scaled_logits(z, targets, row_index, ignore_index, True)
    log_p = torch.log_softmax(z, dim=-1)
    rows = torch.arange(z.shape[0], device=z.device) if row_index is None else row_index.long()
    top1 = (z.argmax(-1)[rows] == targets.long()) & (targets != ignore_index)
    return (
        logp,
        entropy if "entropy" in outputs else None,
        torch.logsumexp(2 * log_p, dim=-1).detach() if "log_sum_sq_probs" in outputs else None,
        z.mean(-1).detach() if "mean_logits" in outputs else None,
        top1 if "is_top1" in outputs else None,
    )


def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: Union[float, torch.Tensor] = 1.0,
    return_entropy: bool = False,
    *,
    ignore_index: int = -100,
    logits_precision: str = "fp32",
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """The same from logits ``[..., V]`` with targets ``[...]``; outputs are shaped like
    ``targets``. A per-row temperature tensor is shaped like ``targets`` (or broadcastable).
    ``logits_precision`` "bf16" rounds the logits to bf16 first (straight-through)."""
    dt = _compute_dtype(logits.dtype)
    lead = targets.shape
    z = logits.to(dt).reshape(-1, logits.shape[-1])
    if logits_precision == "bf16":
        z = z + (round_bf16(z) - z).detach()
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(dt).expand(lead).reshape(-1)
    z = z / _per_row(temperature, z.shape[0], z)[:, None]
    out = _from_scaled_logits(z, targets.reshape(-1), None, ignore_index, return_entropy)
    if not return_entropy:
        return out.reshape(lead)
    return out[0].reshape(lead), out[1].reshape(lead)
