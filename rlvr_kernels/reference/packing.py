"""Reference prefix-tree packing: docs/packing.md as a readable Python trie.

Slow on purpose (a dict per node, one token at a time). ``prefix_tree_build`` takes and
returns exactly what the C++ builder (``csrc/packing.cpp``) takes and returns, so the two are
compared output for output; the layout is TRL 1.16's ``TreeRow.pack()``.
"""

from __future__ import annotations

from typing import List, Optional

import torch

__all__ = ["prefix_tree_build"]

END = object()  # the "next token" of a sample's last token under key="token+next" (TRL's None)
IGNORE = -100


class _Node:
    __slots__ = ("token", "children", "ends")

    def __init__(self, token: int):
        self.token = token
        self.children = {}  # key -> _Node, in insertion order
        self.ends = False  # a sample ends here


def _row(ids: List[List[int]], trained: List[List[bool]], groups, next_key: bool):
    """One row: the trie of its samples, laid out in DFS pre-order."""
    roots = {}
    sample_nodes = []
    load = 0
    for b, seq in enumerate(ids):
        children, nodes = roots, []
        for p, token in enumerate(seq):
            nxt = (seq[p + 1] if p + 1 < len(seq) else END) if next_key else None
            key = (token, nxt) if nodes else (groups[b] if groups is not None else None, token, nxt)
            if key not in children:
                children[key] = _Node(token)
                load += p + 1
            nodes.append(children[key])
            children = nodes[-1].children
        if nodes:
            nodes[-1].ends = True
        sample_nodes.append(nodes)

    # Segments: a unary chain ends at a branch, a leaf or a sample end.
    input_ids, position_ids, cu_q, parent, kv, cu_k = [], [], [0], [], [], [0]
    packed, segment_of, paths = {}, {}, []
    stack = [(node, -1, 0) for node in reversed(list(roots.values()))]
    while stack:
        node, par, depth = stack.pop()
        segment, start = len(parent), len(input_ids)
        while True:
            packed[id(node)] = len(input_ids)
            segment_of[id(node)] = segment
            input_ids.append(node.token)
            position_ids.append(depth)
            depth += 1
            if len(node.children) != 1 or node.ends:
                break
            node = next(iter(node.children.values()))
        cu_q.append(len(input_ids))
        parent.append(par)
        paths.append((paths[par] if par >= 0 else []) + list(range(start, len(input_ids))))
        kv.extend(paths[-1])
        cu_k.append(len(kv))
        stack.extend((child, segment, depth) for child in reversed(list(node.children.values())))

    # q sees k iff k is an ancestor-or-self of q: in pre-order, k <= q < end of k's subtree.
    subtree_end = cu_q[1:]
    for g in reversed(range(len(parent))):
        if parent[g] >= 0:
            subtree_end[parent[g]] = max(subtree_end[parent[g]], subtree_end[g])
    leave = [0] * len(input_ids)
    for key, pos in packed.items():
        leave[pos] = subtree_end[segment_of[key]]

    labels = {}  # position -> set of targets
    gather = [packed[id(n)] for nodes in sample_nodes for n in nodes]
    token_index, target_ids, token_pos, segment_id, cu_m = [], [], [], [], [0]
    for b, (seq, mask, nodes) in enumerate(zip(ids, trained, sample_nodes)):
        for p in range(1, len(seq)):
            if mask[p]:
                q = packed[id(nodes[p - 1])]
                labels.setdefault(q, set()).add(seq[p])
                token_index.append(q)
                target_ids.append(seq[p])
                token_pos.append(p)
                segment_id.append(b)
        cu_m.append(len(token_index))
    shift_labels = [IGNORE] * len(input_ids)
    for q, targets in labels.items():
        if len(targets) == 1:  # several different targets: no single label
            shift_labels[q] = next(iter(targets))
    lengths = [cu_q[i + 1] - cu_q[i] for i in range(len(parent))]
    path_lengths = [cu_k[i + 1] - cu_k[i] for i in range(len(parent))]
    sizes = [len(input_ids), len(parent), len(kv), len(token_index), load, max(lengths, default=0)]
    sizes.append(max(path_lengths, default=0))
    return dict(
        input_ids=input_ids,
        position_ids=position_ids,
        shift_labels=shift_labels,
        leave=leave,
        cu_q=cu_q,
        parent=parent,
        kv=kv,
        cu_k=cu_k,
        gather=gather,
        token_index=token_index,
        target_ids=target_ids,
        token_pos=token_pos,
        segment_id=segment_id,
        cu_m=cu_m,
        sizes=sizes,
    )


def prefix_tree_build(
    tokens: torch.Tensor,
    cu_tokens: torch.Tensor,
    trained: torch.Tensor,
    group: torch.Tensor,
    order: torch.Tensor,
    row_cu: torch.Tensor,
    token_values: Optional[torch.Tensor],
    sample_values: Optional[torch.Tensor],
    next_key: bool,
) -> List[torch.Tensor]:
    """The builder's contract: samples ``tokens[cu_tokens[b]:cu_tokens[b+1]]``; ``trained`` a
    bool mask [T] or each sample's first trained position (int64 [B]); ``group`` [B] or empty;
    row r packs samples ``order[row_cu[r]:row_cu[r+1]]`` in that order. Returns the rows'
    layouts laid end to end; the N-sized outputs have room for every token of the rows and
    row r's nodes start at its first token (the tokens of the rows before it). The targets
    carry ``token_values`` [T, C] at their token and ``sample_values`` [B, C'] of their sample."""
    cu = cu_tokens.tolist()
    flat = tokens.tolist()
    B = len(cu) - 1
    if trained.dtype == torch.bool:
        mask = trained.tolist()
    else:
        start = trained.tolist()
        mask = [p - cu[b] >= start[b] for b in range(B) for p in range(cu[b], cu[b + 1])]
    ordered = order.tolist()
    T = sum(cu[b + 1] - cu[b] for b in ordered)
    n_arrays = [[0] * T for _ in range(4)] + [[0] * T]
    parts = {k: [] for k in ("cu_q", "parent", "kv", "cu_k", "token_index", "target_ids", "token_pos")}
    parts.update(segment_id=[], cu_m=[], sizes=[])
    rc = row_cu.tolist()
    groups = group.tolist() if group.numel() else None
    t0 = 0
    for r in range(len(rc) - 1):
        samples = ordered[rc[r] : rc[r + 1]]
        ids = [flat[cu[b] : cu[b + 1]] for b in samples]
        masks = [mask[cu[b] : cu[b + 1]] for b in samples]
        row = _row(ids, masks, [groups[b] for b in samples] if groups is not None else None, next_key)
        row["sizes"].append(t0)
        for a, name in enumerate(("input_ids", "position_ids", "shift_labels", "leave")):
            n_arrays[a][t0 : t0 + len(row[name])] = row[name]
        n_arrays[4][t0 : t0 + len(row["gather"])] = row["gather"]
        for name in parts:
            if name == "sizes":
                parts[name].append(row[name])
            else:
                parts[name].extend(row[name])
        t0 += sum(len(s) for s in ids)
    i64, i32 = torch.int64, torch.int32
    # the targets' samples and tokens, in the order the rows list them
    sample_of, src = [], []
    for r in range(len(rc) - 1):
        samples = ordered[rc[r] : rc[r + 1]]
        for b in samples:
            for p in range(1, cu[b + 1] - cu[b]):
                if mask[cu[b] + p]:
                    sample_of.append(b)
                    src.append(cu[b] + p)
    carried = []
    for values, at in ((token_values, src), (sample_values, sample_of)):
        if values is None:
            carried.append(torch.zeros(0, 0, dtype=torch.float32))
        else:
            carried.append(values[torch.tensor(at, dtype=i64)].reshape(len(at), values.shape[1]))
    return [
        torch.tensor(n_arrays[0], dtype=i64),
        torch.tensor(n_arrays[1], dtype=i64),
        torch.tensor(n_arrays[2], dtype=i64),
        torch.tensor(n_arrays[3], dtype=i32),
        torch.tensor(parts["cu_q"], dtype=i32),
        torch.tensor(parts["parent"], dtype=i32),
        torch.tensor(parts["kv"], dtype=i64),
        torch.tensor(parts["cu_k"], dtype=i32),
        torch.tensor(n_arrays[4], dtype=i64),
        torch.tensor(parts["token_index"], dtype=i64),
        torch.tensor(parts["target_ids"], dtype=i64),
        torch.tensor(parts["token_pos"], dtype=i64),
        torch.tensor(parts["segment_id"], dtype=i64),
        torch.tensor(parts["cu_m"], dtype=i32),
        torch.tensor(parts["sizes"], dtype=i64).reshape(-1, 8),
    ] + carried
