"""Group ids from arbitrary sample uids (verl keeps a uuid string per sample)."""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch


def uids_to_group_index(uids, *, device: Optional[Union[str, torch.device]] = None, return_num_groups: bool = False):
    """Map per-sample uids to dense int64 group ids, numbered in order of first appearance.

    Args:
        uids: ``[B]`` hashable labels: a numpy array (strings, ints, objects), a list or
            tuple, or an integer/bool tensor. Vectorised through ``np.unique``: no Python
            loop over rows for numeric or string arrays.
        device: where the result goes (default: the tensor's device, else CPU).
        return_num_groups: also return the number of distinct uids (known on the host, so
            passing it on to ``group_advantages(num_groups=...)`` avoids a device sync).

    Returns:
        ``group_index`` (``[B]`` int64), or ``(group_index, num_groups)``.
    """
    if isinstance(uids, torch.Tensor):
        if uids.dim() != 1:
            raise ValueError(f"uids: expected a 1-D tensor, got shape {tuple(uids.shape)}")
        if uids.is_floating_point() or uids.is_complex():
            raise TypeError(f"uids: expected an integer or bool tensor, got {uids.dtype}")
        device = uids.device if device is None else device
        values, inverse = torch.unique(uids, return_inverse=True)
        first = torch.full((values.numel(),), uids.numel(), dtype=torch.int64, device=uids.device)
        first.scatter_reduce_(0, inverse, torch.arange(uids.numel(), device=uids.device), reduce="amin")
        rank = torch.empty_like(first)
        rank[torch.argsort(first)] = torch.arange(values.numel(), device=uids.device)
        ids, n = rank[inverse].to(device), int(values.numel())
    else:
        arr = np.asarray(uids)
        if arr.ndim != 1:
            raise ValueError(f"uids: expected a 1-D sequence, got shape {arr.shape}")
        if arr.dtype == object and arr.size:
            # Fixed-width unicode sorts in C rather than through Python compares; keep it only
            # when every uid is a string (so 1 and "1" stay distinct).
            as_str = arr.astype(str)
            if bool(np.all(arr == as_str)):
                arr = as_str
        try:
            _, first, inverse = np.unique(arr, return_index=True, return_inverse=True)
        except TypeError:  # unorderable mix (e.g. ints and strings): order by (type, repr)
            keys = np.array([f"{type(u).__name__}:{u!r}" for u in arr])
            _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        rank = np.empty(first.size, dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(first.size)
        ids = torch.from_numpy(rank[inverse.reshape(-1)]).to(device or "cpu")
        n = int(first.size)
    return (ids, n) if return_num_groups else ids
