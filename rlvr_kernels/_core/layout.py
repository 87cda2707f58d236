"""The packed layout's rules, written once for every layer (the reference, the Triton
launchers, the op layer, the integrations, ``rlvr_kernels.distributed``).

A packed batch is ``[T]`` tokens with B + 1 offsets ``cu_seqlens``; sequence i covers
``[cu'[i], cu'[i+1])`` under the one cu_seqlens rule of ``csrc/spans.h``
(:func:`sanitized_offsets`). Also the compute dtype of the kernels and a division that
gives 0 for a count of 0.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def sanitized_offsets(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The rule every kernel applies to ``cu_seqlens`` (``csrc/spans.h``), as torch ops with
    no host sync: c'[0] = clamp(cu[0], 0, T), c'[i+1] = clamp(cu[i+1], c'[i], T). Sequence i
    covers [c'[i], c'[i+1]): in bounds, in order and disjoint whatever the input; equal to
    ``cu_seqlens`` when it is valid. Returns int64."""
    return torch.cummax(cu_seqlens.long().clamp(0, num_tokens), dim=0).values


def packed_mask(mask: Optional[torch.Tensor], cu_seqlens: torch.Tensor, num_tokens: int, device) -> torch.Tensor:
    """The ``[T]`` validity of the packed layout: tokens inside a sequence (before
    ``cu_seqlens[-1]``), and where the mask, if given, is set."""
    inside = torch.arange(num_tokens, device=device) < cu_seqlens[-1]
    return inside if mask is None else inside & (mask != 0)


def local_counts(
    mask: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor] = None, num_tokens: Optional[int] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """This process's ``(valid tokens, sequences with a valid token)`` as 0-d int64 tensors
    (no host sync), counted as the ``policy_loss`` kernels count them (``PolicyLossSum.NTOK``
    and ``NSEQ``): padded ``[B, L]`` mask rows, or the packed ``[T]`` spans of ``cu_seqlens``
    under the one cu_seqlens rule (``mask`` None: every token of a span is valid).
    ``num_tokens``: T when the packed mask is None."""
    if cu_seqlens is None:
        if mask is None or mask.dim() != 2:
            raise ValueError("mask: the padded layout needs a [B, L] token mask")
        per_seq = (mask != 0).sum(-1)
    else:
        if mask is not None:
            if mask.dim() != 1:
                raise ValueError(f"mask: with cu_seqlens expected a packed 1-D [T] mask, got shape {tuple(mask.shape)}")
            num_tokens = mask.shape[0]
        elif num_tokens is None:
            raise ValueError("num_tokens: needed with cu_seqlens and no mask")
        cu = sanitized_offsets(cu_seqlens, num_tokens)
        if mask is None:
            per_seq = cu[1:] - cu[:-1]
        else:
            csum = torch.nn.functional.pad((mask != 0).long().cumsum(0), (1, 0))
            per_seq = csum[cu[1:]] - csum[cu[:-1]]
    return per_seq.sum(), (per_seq > 0).sum()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels' accumulation dtype for inputs of ``dtype``: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def safe_div(num: torch.Tensor, den) -> torch.Tensor:
    """num / den, and 0 where den == 0, with a finite gradient. ``den``: a tensor
    (broadcast with ``num`` and promoted as torch's division promotes) or a Python number
    (divided as such: ``num / den``, or ``num · 0`` for 0)."""
    if not isinstance(den, torch.Tensor):
        return num / den if den != 0 else num * 0.0
    nonzero = den != 0
    return torch.where(nonzero, num / torch.where(nonzero, den, torch.ones_like(den)), torch.zeros_like(num))
