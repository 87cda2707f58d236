"""``TreeRowBuilder``: the incremental C++ trie with TRL 1.16's ``TreeRow`` interface, so
TRL's planners (``TokenBudgetBatcher``, ``FixedCountBatcher``) and collator use it unchanged."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

import torch

from .._core import dispatch as _dispatch
from .._core.validation import check_int
from ._tree import TreePack, _key, packs_from_layout


class TreeRowBuilder:
    """One row's trie, built a sample at a time.

    A sample is TRL's rollout dict: ``input_ids`` [L] (integers >= 0) and ``completion_mask`` [L]
    (0/1), each a list, a numpy array (as TRL's rollout worker sends them) or a tensor, and for
    :meth:`pack` ``old_log_probs`` [L] and ``advantage``; ``group_id`` is recorded in
    :attr:`groups`. The C++ trie reads the fields in one pass (no tensor made per sample) and
    holds the sample dicts by reference; :meth:`pack` reads their log-probs and advantages.
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
        self._trie = _dispatch.extension_module().PrefixTrie(next_key)
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
        return self._trie.match(sample, self._group_code(sample, create=False))

    def fits(self, sample: Dict[str, Any], budget: int) -> bool:
        """Whether the row stays within ``budget`` unique tokens and ``budget`` trained tokens
        with ``sample`` added."""
        if type(budget) is not int:  # check_int's message, without its cost on the common path
            budget = check_int("budget", budget, minimum=0, maximum=torch.iinfo(torch.int64).max)
        elif budget < 0:
            check_int("budget", budget, minimum=0)
        return self._trie.fits(sample, self._group_code(sample, create=False), budget)

    def add(self, sample: Dict[str, Any]) -> None:
        """Adds ``sample`` (checked first: a refused sample leaves the row as it was)."""
        self._trie.add(sample, self._group_code(sample, create=True) if self.separate_groups else -1)
        self.samples.append(sample)
        self.groups.add(sample.get("group_id"))

    def _group_code(self, sample: Dict[str, Any], create: bool) -> int:
        """The trie's root key for the sample: -1 (shared roots), or its group's code."""
        if not self.separate_groups:
            return -1
        if not isinstance(sample, Mapping):
            raise TypeError(f"sample: expected a dict of the sample's fields, got {type(sample).__name__}")
        group = sample.get("group_id")
        if group not in self._group_codes:
            if not create:
                return len(self._group_codes)  # a group the row does not hold: matches nothing
            self._group_codes[group] = len(self._group_codes)
        return self._group_codes[group]

    def tree_pack(self) -> TreePack:
        """The row as a :class:`TreePack` (old log-probs and advantages when every sample has them)."""
        cu = self._trie.cu()
        layout = self._trie.layout()
        old = adv = None
        if all("old_log_probs" in s and "advantage" in s for s in self.samples):
            old, adv = self._trie.target_values(self.samples, layout[11], layout[12])
        return packs_from_layout(layout, cu.diff(), torch.tensor([0, len(self.samples)]), self.key, old, adv)[0]

    def pack(self) -> Dict[str, torch.Tensor]:
        """Exactly TRL's ``TreeRow.pack()`` dict (every sample needs ``old_log_probs`` and ``advantage``)."""
        return self.tree_pack().to_trl()
