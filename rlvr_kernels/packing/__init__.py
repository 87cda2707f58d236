"""Prefix-tree packing: the samples of a row folded into a trie so every shared prefix (a
group's prompt, a multi-turn history) is forwarded once."""

from ._builder import TreeRowBuilder
from ._tree import TreePack, pack_prefix_tree, pack_rows
from .attention import block_mask, dense_mask, mask_mod, register_tree_attention
from .hf import PackedLogprobs, forward_packed, packed_logprobs
from .plan import RowPlan, plan_rows
from .values import pack_values, unpack

__all__ = ["TreePack", "TreeRowBuilder", "pack_prefix_tree", "pack_rows"]

__all__ += ["dense_mask", "mask_mod", "block_mask", "register_tree_attention", "forward_packed", "packed_logprobs"]
__all__ += ["PackedLogprobs"]
__all__ += ["RowPlan", "plan_rows", "pack_values", "unpack"]
