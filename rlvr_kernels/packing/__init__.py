"""Prefix-tree packing: the samples of a row folded into a trie so every shared prefix (a
group's prompt, a multi-turn history) is forwarded once."""

from ._builder import TreeRowBuilder
from ._tree import TreePack, pack_prefix_tree, pack_rows

__all__ = ["TreePack", "TreeRowBuilder", "pack_prefix_tree", "pack_rows"]
