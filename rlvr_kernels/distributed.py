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

from ._core import collectives
from ._core.layout import local_counts
from .packing.plan import DEFAULT_ATTENTION_COEFFICIENTS, RankAssignment, balance_groups

__all__ = ["global_counts", "local_counts", "balance_groups", "RankAssignment", "DEFAULT_ATTENTION_COEFFICIENTS"]


# ------------------------------------------------------------------ global counts
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
    if process_group is not None:
        collectives.check_eager("global_counts")
    if cu_seqlens is not None and mask is None:
        T = int(cu_seqlens[-1].clamp(min=0)) if cu_seqlens.numel() else 0
        ntok, nseq = local_counts(None, cu_seqlens, T)
    else:
        ntok, nseq = local_counts(mask, cu_seqlens)
    if process_group is None:
        return ntok, nseq
    both = collectives.all_reduce(torch.stack([ntok, nseq]), process_group, "sum")
    return both[0], both[1]
