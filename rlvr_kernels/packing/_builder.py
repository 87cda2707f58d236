"""``TreeRowBuilder``: the incremental C++ trie with TRL 1.16's ``TreeRow`` interface, so
TRL's planners (``TokenBudgetBatcher``, ``FixedCountBatcher``) and collator use it unchanged."""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import torch

from .._core import dispatch as _dispatch
from ._tree import TreePack, _key, packs_from_layout


class TreeRowBuilder:
    """One row's trie, built a sample at a time.

    A sample is TRL's rollout dict: ``input_ids`` [L] (integer tensor, or numpy array as
    TRL's rollout worker sends it), ``completion_mask`` [L] (likewise), and for :meth:`pack`
    ``old_log_probs`` [L] and ``advantage``; ``group_id`` is recorded in :attr:`groups`.
    ``fits``/``add``/``pack``, ``samples``, ``groups``, ``trained``, ``load`` and
    ``len(tokens)`` behave as TRL's ``TreeRow``; :meth:`tree_pack` returns the full
    :class:`TreePack`.
    """

    def __init__(self, key: str = "token+next", separate_groups: bool = False):
        next_key = _key(key)
        if not isinstance(separate_groups, bool):
            raise TypeError(f"separate_groups: expected a bool, got {type(separate_groups).__name__}")
        if not _dispatch.load_extension():
            raise RuntimeError("TreeRowBuilder needs the C++ kernels, which are not built (see `rlvr-kernels info`)")
        self.key = key
        self._trie = torch.classes.rlvr_kernels_C.PrefixTrie(next_key)
        self.samples: List[Dict[str, Any]] = []
        self.groups: set = set()
        # With separate_groups, samples share tokens only within their group_id (the trees of
        # pack_prefix_tree(..., group_index=)); the trie keys each group's roots on its code.
        self.separate_groups = separate_groups
        self._group_codes: Dict[Any, int] = {}

    @property
    def load(self) -> int:
        """Attention cost of the row: sum over its unique tokens of (depth + 1)."""
        return self._trie.load()

    @property
    def trained(self) -> int:
        """Trained tokens of the row (the sum of its samples' completion masks)."""
        return self._trie.trained()

    @property
    def tokens(self) -> torch.Tensor:
        """The row's unique tokens in insertion order (TRL's ``TreeRow.tokens``)."""
        return self._trie.node_tokens()

    @property
    def num_tokens(self) -> int:
        return self._trie.num_nodes()

    def shared_prefix(self, sample: Dict[str, Any]) -> int:
        """How many leading tokens of ``sample`` the row already holds (adding it costs the rest)."""
        ids = _ids(sample)
        return self._trie.match(ids, self._group_code(sample, create=False))

    def fits(self, sample: Dict[str, Any], budget: int) -> bool:
        """Whether the row stays within ``budget`` unique tokens and ``budget`` trained tokens
        with ``sample`` added."""
        novel = sample["input_ids"].shape[0] - self.shared_prefix(sample)
        trained = int(sample["completion_mask"].sum())
        return self._trie.num_nodes() + novel <= budget and self._trie.trained() + trained <= budget

    def add(self, sample: Dict[str, Any]) -> None:
        ids = _ids(sample)
        mask = _tensor(sample["completion_mask"])
        if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
            raise ValueError(f"sample['completion_mask']: expected a tensor of shape {tuple(ids.shape)}")
        if "old_log_probs" in sample:  # a short one would shift every later sample's values
            old = sample["old_log_probs"]
            n = old.numel() if isinstance(old, torch.Tensor) else len(old)
            if n != ids.shape[0]:
                raise ValueError(f"sample['old_log_probs']: expected {ids.shape[0]} values (one per token), got {n}")
        self._trie.add(ids, mask, self._group_code(sample, create=True))
        self.samples.append(sample)
        self.groups.add(sample.get("group_id"))

    def _group_code(self, sample: Dict[str, Any], create: bool) -> int:
        """The trie's root key for the sample: -1 (shared roots), or its group's code."""
        if not self.separate_groups:
            return -1
        group = sample.get("group_id")
        if group not in self._group_codes:
            if not create:
                return len(self._group_codes)  # a group the row does not hold: matches nothing
            self._group_codes[group] = len(self._group_codes)
        return self._group_codes[group]

    def tree_pack(self) -> TreePack:
        """The row as a :class:`TreePack` (old log-probs and advantages when every sample has them)."""
        lengths = [s["input_ids"].shape[0] for s in self.samples]
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
        layout = self._trie.layout()
        old = adv = None
        if all("old_log_probs" in s and "advantage" in s for s in self.samples):
            tpos, seg = layout[11], layout[12]
            if self.samples:
                flat_old = torch.cat([torch.as_tensor(s["old_log_probs"]).reshape(-1) for s in self.samples])
                old = flat_old[cu[:-1][seg] + tpos].to(torch.float32)
                adv = torch.tensor([float(s["advantage"]) for s in self.samples], dtype=torch.float32)[seg]
            else:
                old = adv = torch.zeros(0, dtype=torch.float32)
        return packs_from_layout(layout, cu.diff(), torch.tensor([0, len(lengths)]), self.key, old, adv)[0]

    def pack(self) -> Dict[str, torch.Tensor]:
        """Exactly TRL's ``TreeRow.pack()`` dict (every sample needs ``old_log_probs`` and ``advantage``)."""
        return self.tree_pack().to_trl()


def _tensor(x: Any) -> Any:
    """A numpy array as a tensor (TRL's ``RolloutSample`` fields are numpy); anything else as is."""
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


def _ids(sample: Dict[str, Any]) -> torch.Tensor:
    ids = _tensor(sample["input_ids"])
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
        raise ValueError("sample['input_ids']: expected a 1-D integer tensor")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"sample['input_ids']: token ids must be integers, got dtype {ids.dtype}")
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"sample['input_ids']: token ids must be non-negative, got {int(ids.min())}")
    return ids
