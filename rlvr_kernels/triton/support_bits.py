"""The CSR -> bitmap conversion of an explicit sampling support in Triton: the CUDA backend of
``support_bits`` (contract: the "Sampling support" section of :mod:`rlvr_kernels.ops.logprobs`).

One program per row walks its ids in blocks and or-s each id's bit into the row's words with
``tl.atomic_or`` (the bits of a word commute, so the result does not depend on the order).
O(nnz + N·V/32), no sort. Unchecked offsets are clamped to [0, nnz] before they address memory;
ids outside [0, V) set nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _support_bits_kernel(ids_ptr, off_ptr, bits_ptr, nnz, V, W, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.minimum(tl.maximum(tl.load(off_ptr + row), 0), nnz)
    e = tl.minimum(tl.maximum(tl.load(off_ptr + row + 1), 0), nnz)
    lanes = tl.arange(0, BLOCK)
    for start in range(b, e, BLOCK):
        j = start + lanes
        ok = j < e
        v = tl.load(ids_ptr + j, mask=ok, other=-1)
        ok = ok & (v >= 0) & (v < V)
        word = tl.where(ok, v >> 5, 0)
        bit = (tl.full((BLOCK,), 1, tl.int32) << (tl.where(ok, v, 0) & 31).to(tl.int32)).to(tl.int32)
        tl.atomic_or(bits_ptr + row * W + word, bit, mask=ok)


def support_bits(support_ids: torch.Tensor, support_offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """bits [N, ceil(V / 32)] int32 of int64 ``support_ids`` [nnz] and ``support_offsets`` [N + 1]."""
    n = support_offsets.shape[0] - 1
    words = (vocab + 31) // 32
    bits = torch.zeros((n, words), dtype=torch.int32, device=support_ids.device)
    if n > 0:
        ids = support_ids.contiguous()
        _support_bits_kernel[(n,)](ids, support_offsets.contiguous(), bits, ids.shape[0], vocab, words, BLOCK=_BLOCK)
    return bits
