"""Moving per-token values between the samples' layout and a pack's targets.

A pack scores M targets (the trained tokens, sample-major); sample b's target m is the token at
position ``pack.token_pos[m]`` of sample ``pack.segment_id[m]``. :func:`pack_values` gathers
values given per sample token (old, reference or rollout log-probs, per-token advantages) into
that target order, and :func:`unpack` scatters per-target results (log-probs, entropies, loss
terms) back to ``[B, L_max]``. Both are a gather/scatter in torch: they run on the pack's device
and carry gradients.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np
import torch

from ._tree import TreePack


def unpack(values: torch.Tensor, pack: TreePack, *, fill: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scatter per-target ``values [M, ...]`` to ``[B, L_max, ...]``.

    Target m goes to ``out[pack.segment_id[m], pack.token_pos[m]]``, which is where the token it
    scores sits in its sample; every other place holds ``fill``. ``L_max`` is the longest
    sample. Returns ``(out, mask)`` with ``mask [B, L_max]`` bool, True at the targets (a
    sample's trained tokens, less a trained first token, which has no predecessor to score
    it). Differentiable in ``values``.
    """
    _check_pack(pack)
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values: expected a torch.Tensor of per-target values, got {type(values).__name__}")
    if isinstance(fill, bool) or not isinstance(fill, (int, float)):
        raise TypeError(f"fill: expected a number, got {type(fill).__name__}")
    M = pack.num_targets
    if values.dim() == 0 or values.shape[0] != M:
        raise ValueError(
            f"values: expected shape [M, ...] with M = {M} (the pack's targets), got {tuple(values.shape)}"
        )
    _check_device("values", values, pack)
    B, L = pack.num_samples, _max_length(pack)
    flat = pack.segment_id * L + pack.token_pos
    rest = tuple(values.shape[1:])
    out = values.new_full((B * L,) + rest, fill).index_put((flat,), values)
    mask = torch.zeros(B * L, dtype=torch.bool, device=values.device).index_fill(0, flat, True)
    return out.reshape((B, L) + rest), mask.reshape(B, L)


def pack_values(values, pack: TreePack) -> torch.Tensor:
    """Gather per-token values aligned with the samples' tokens into the pack's target order.

    ``values`` is a padded ``[B, L, ...]`` tensor (L at least the longest sample; padding is
    never read), a list of B per-sample sequences (tensors, numpy arrays or lists, each as long
    as its sample), or a ``[B]`` tensor of one value per sample (e.g. GRPO advantages). Returns
    ``[M, ...]``: the value at each target's token, for old, reference or rollout log-probs and
    per-token advantages. Differentiable in ``values``.
    """
    _check_pack(pack)
    B, lengths = pack.num_samples, pack.sample_lengths
    if isinstance(values, torch.Tensor):
        _check_device("values", values, pack)
        if values.dim() == 1:
            if values.shape[0] != B:
                raise ValueError(
                    f"values: a 1-D tensor holds one value per sample: expected [{B}], got [{values.shape[0]}]"
                )
            return values[pack.segment_id]
        L = _max_length(pack)
        if values.dim() == 0 or values.shape[0] != B or values.shape[1] < L:
            raise ValueError(
                f"values: a padded tensor must be [B, L, ...] with B = {B} (the pack's samples) and L >= {L} "
                f"(its longest sample), got {tuple(values.shape)}"
            )
        return values[pack.segment_id, pack.token_pos]
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(
            "values: expected a padded [B, L] tensor, a [B] tensor or a list of B sequences, "
            f"got {type(values).__name__}"
        )
    if len(values) != B:
        raise ValueError(f"values: expected {B} per-sample sequences (one per sample of the pack), got {len(values)}")
    device = pack.token_index.device
    parts = []
    for b, (v, n) in enumerate(zip(values, lengths.tolist())):
        if isinstance(v, torch.Tensor):
            _check_device(f"values[{b}]", v, pack)
            t = v
        else:
            try:
                t = torch.as_tensor(np.asarray(v), device=device)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(f"values[{b}]: expected a sequence of numbers") from None
        if t.dim() == 0 or t.shape[0] != n:
            raise ValueError(f"values[{b}]: expected {n} values (the sample's length), got shape {tuple(t.shape)}")
        parts.append(t)
    if parts and len({p.shape[1:] for p in parts}) != 1:
        raise ValueError("values: every sample's values must have the same trailing shape")
    if not parts:
        return torch.zeros(0, device=device)
    dtype = parts[0].dtype
    for p in parts[1:]:
        dtype = torch.promote_types(dtype, p.dtype)
    flat = torch.cat([p.to(dtype) for p in parts])
    return flat[pack.cu_tokens[pack.segment_id] + pack.token_pos]


def _check_pack(pack) -> None:
    if not isinstance(pack, TreePack):
        raise TypeError(f"pack: expected a TreePack (from pack_prefix_tree), got {type(pack).__name__}")


def _check_device(name: str, x: torch.Tensor, pack: TreePack) -> None:
    if x.device != pack.token_index.device:
        raise ValueError(
            f"{name}: expected a tensor on {pack.token_index.device} (where the pack lives), got {x.device}; "
            "move the pack with pack.to(device)"
        )


def _max_length(pack: TreePack) -> int:
    lengths = pack.sample_lengths
    return int(lengths.max()) if lengths.numel() else 0
