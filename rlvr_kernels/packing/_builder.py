"""``TreeRowBuilder``: the incremental C++ trie with TRL 1.16's ``TreeRow`` interface, so
TRL's planners (``TokenBudgetBatcher``, ``FixedCountBatcher``) and collator use it unchanged."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

import numpy as np
import torch

from .._core import dispatch as _dispatch
from .._core.validation import check_has_data, check_int, numpy_to_tensor
from ._tree import TreePack, _key, _numbers, packs_from_layout


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
        return self._match(sample, _ids(sample))

    def _match(self, sample: Dict[str, Any], ids: torch.Tensor) -> int:
        return self._trie.match(ids, self._group_code(sample, create=False))

    def fits(self, sample: Dict[str, Any], budget: int) -> bool:
        """Whether the row stays within ``budget`` unique tokens and ``budget`` trained tokens
        with ``sample`` added."""
        ids, mask = _checked(sample)
        budget = check_int("budget", budget, minimum=0, maximum=torch.iinfo(torch.int64).max)
        novel = ids.shape[0] - self._match(sample, ids)
        trained = int(torch.count_nonzero(mask))  # the trie's count: the tokens with mask != 0
        return self._trie.num_nodes() + novel <= budget and self._trie.trained() + trained <= budget

    def add(self, sample: Dict[str, Any]) -> None:
        ids, mask = _checked(sample)
        if "old_log_probs" in sample:  # a short one would shift every later sample's values
            n = _numbers("sample['old_log_probs']", sample["old_log_probs"]).numel()
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


def _field(sample: Dict[str, Any], key: str) -> torch.Tensor:
    """``sample[key]``: a 1-D tensor with data, or a numpy array (TRL's ``RolloutSample``
    fields are numpy) as one."""
    name = f"sample[{key!r}]"
    if not isinstance(sample, Mapping):
        raise TypeError(f"sample: expected a dict of the sample's fields, got {type(sample).__name__}")
    if key not in sample:
        raise ValueError(f"{name}: missing (a sample needs 'input_ids' and 'completion_mask')")
    x = sample[key]
    x = numpy_to_tensor(name, x) if isinstance(x, np.ndarray) else x
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a 1-D tensor or numpy array, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(x.shape)}")
    return check_has_data(name, x)


def _ids(sample: Dict[str, Any]) -> torch.Tensor:
    ids = _field(sample, "input_ids")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"sample['input_ids']: token ids must be integers, got dtype {ids.dtype}")
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"sample['input_ids']: token ids must be non-negative, got {int(ids.min())}")
    return ids


def _checked(sample: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, completion_mask) of a sample, the check :meth:`TreeRowBuilder.fits` and
    :meth:`TreeRowBuilder.add` share: integer ids >= 0 and a 0/1 mask of the same length."""
    ids = _ids(sample)
    mask = _field(sample, "completion_mask")
    if mask.shape != ids.shape:
        raise ValueError(
            f"sample['completion_mask']: expected shape {tuple(ids.shape)} (like input_ids), got {tuple(mask.shape)}"
        )
    if mask.dtype.is_complex:
        raise TypeError(f"sample['completion_mask']: expected a bool, integer or float mask, got dtype {mask.dtype}")
    if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("sample['completion_mask']: expected 0/1 values")
    return ids, mask
