"""The roundings of ``logits_precision`` (docs/logprobs.md, "Logits precision") as torch
functions: the fp64 reference applies them, and the ops layer forms the few logits it computes
outside the kernels (``keep_targets``) with them."""

from __future__ import annotations

import torch


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
