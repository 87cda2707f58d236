"""Helpers for data-parallel training with the rlvr_kernels ops (``torch.distributed``).

Sections (each self-contained):

- Global counts: :func:`global_counts`, the valid-token and sequence counts of the whole
  data-parallel batch (one all-reduce), for trainers that aggregate the loss themselves and
  for gradient accumulation with :func:`rlvr_kernels.policy_loss`.
- Balancing: :func:`balance_groups` assigns whole GRPO groups to data-parallel ranks
  (Karmarkar–Karp or LPT on an attention-cost model, or the prefix-tree pack's unique
  tokens and score pairs) and never splits a group; :class:`RankAssignment` is its result.

Gradient accumulation (micro-batches) with ``policy_loss``: count the whole optimizer step
once, over every micro-batch of the rank and every rank, then pass the counts to each
micro-batch's call::

    num_tokens, num_seqs = global_counts(step_mask, cu_seqlens=step_cu, process_group=pg)
    for mb in micro_batches:
        loss, _ = policy_loss(..., global_num_tokens=num_tokens, global_num_seqs=num_seqs,
                              process_group=pg)      # or dp_size=pg.size() without the group
        loss.backward()                              # accumulates

The accumulated gradient is then the whole rank batch's gradient for every aggregation mode
(``seq-mean-token-mean``'s per-sequence weights 1/n_i are per sequence, so a micro-batch
boundary between sequences changes nothing), and DDP/FSDP's average over ranks the
full-batch gradient. (A sequence must not be split across micro-batches.)
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .packing.plan import DEFAULT_ATTENTION_COEFFICIENTS, RankAssignment, balance_groups
from .contracts import sanitized_offsets

__all__ = ["global_counts", "local_counts", "balance_groups", "RankAssignment", "DEFAULT_ATTENTION_COEFFICIENTS"]


# ------------------------------------------------------------------ global counts
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


def global_counts(
    mask: Optional[torch.Tensor],
    *,
    cu_seqlens: Optional[torch.Tensor] = None,
    process_group=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(num_tokens, num_seqs)``: the valid tokens and the sequences with at least one valid
    token over every rank of ``process_group`` (0-d int64 tensors on ``mask``'s device, equal
    on every rank), with one all-reduce; without a group, this process's counts.

    ``mask``: padded ``[B, L]`` token mask, or packed ``[T]`` with ``cu_seqlens`` (None: every
    token inside the spans is valid; then the count of tokens is ``cu_seqlens[-1]``). These are
    the counts ``policy_loss`` normalises by (``global_num_tokens`` / ``global_num_seqs``;
    verl's ``batch_num_tokens`` / ``global_batch_size``): compute them over the whole optimizer
    step (all micro-batches) to accumulate micro-batch gradients. Eager only (the collective is
    not traced by torch.compile)."""
    if torch.compiler.is_compiling() and process_group is not None:
        raise RuntimeError("global_counts(process_group=...): eager only (the all-reduce is not traced)")
    if cu_seqlens is not None and mask is None:
        T = int(cu_seqlens[-1].clamp(min=0)) if cu_seqlens.numel() else 0
        ntok, nseq = local_counts(None, cu_seqlens, T)
    else:
        ntok, nseq = local_counts(mask, cu_seqlens)
    if process_group is None:
        return ntok, nseq
    import torch.distributed as dist

    both = torch.stack([ntok, nseq])
    dist.all_reduce(both, op=dist.ReduceOp.SUM, group=process_group)
    return both[0], both[1]
