"""Random sample forests for the packing tests: shared prompts, nested sharing, duplicates, a
sample that is a prefix of another, a common system prompt across groups, multi-turn masks
and empty completions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
from hypothesis import strategies as st


@dataclass
class Forest:
    ids: List[List[int]]
    mask: List[List[int]]
    group: List[int]
    old: List[List[float]]
    adv: List[float]

    def nonempty(self) -> "Forest":
        """Without zero-length samples, which TRL's TreeRow cannot add (its zip is strict)."""
        keep = [i for i, s in enumerate(self.ids) if s]
        return Forest(*([getattr(self, f)[i] for i in keep] for f in ("ids", "mask", "group", "old", "adv")))

    def trl_samples(self):
        return [
            dict(
                input_ids=torch.tensor(ids, dtype=torch.int64),
                completion_mask=torch.tensor(mask, dtype=torch.int64),
                old_log_probs=torch.tensor(old, dtype=torch.float32),
                advantage=adv,
                group_id=g,
            )
            for ids, mask, old, adv, g in zip(self.ids, self.mask, self.old, self.adv, self.group)
        ]


@st.composite
def forests(draw, max_samples: int = 10, vocab: int = 4):
    """Samples built from a few shared pieces so that sharing, nesting, duplicates and prefixes
    are common; small vocabularies make accidental sharing common too."""
    tok = st.integers(0, vocab - 1)
    system = draw(st.lists(tok, max_size=3))
    n_groups = draw(st.integers(1, 3))
    ids, mask, group = [], [], []
    for g in range(n_groups):
        prompt = system + draw(st.lists(tok, max_size=4))
        turns = [draw(st.lists(tok, max_size=3)) for _ in range(2)]
        for _ in range(draw(st.integers(1, max(1, max_samples // n_groups)))):
            kind = draw(st.sampled_from(["plain", "multi", "prefix", "empty"]))
            seq, m = list(prompt), [0] * len(prompt)
            if kind == "multi":  # completion, a tool turn (untrained), another completion
                for j, turn in enumerate(turns):
                    seq += turn
                    m += [j % 2 == 0] * len(turn)
                    c = draw(st.lists(tok, max_size=3))
                    seq += c
                    m += [1] * len(c)
            elif kind != "empty":
                c = draw(st.lists(tok, max_size=5))
                seq += c
                m += [1] * len(c)
            if kind == "prefix" and ids:  # a prefix of an earlier sample
                j = draw(st.integers(0, len(ids) - 1))
                cut = draw(st.integers(0, len(ids[j])))
                seq, m = ids[j][:cut], mask[j][:cut]
            if not seq and draw(st.booleans()):
                seq, m = [draw(tok)], [1]
            ids.append(seq)
            mask.append([int(v) for v in m])
            group.append(g)
            if ids and draw(st.integers(0, 5)) == 0:  # an exact duplicate
                ids.append(list(ids[-1]))
                mask.append(list(mask[-1]))
                group.append(g)
    old = [[draw(st.floats(-5, 0, width=32)) for _ in s] for s in ids]
    adv = [draw(st.floats(-2, 2, width=32)) for _ in ids]
    return Forest(ids, mask, group, old, adv)


def ancestors(forest_ids: List[List[int]], pack):
    """Brute force: for every packed position, the set of packed positions on its root path
    (itself included), read off the samples through gather_index."""
    seen = {}
    cu = pack.cu_tokens.tolist()
    gather = pack.gather_index.tolist()
    for b in range(len(cu) - 1):
        path = gather[cu[b] : cu[b + 1]]
        for p, q in enumerate(path):
            seen.setdefault(q, set()).update(path[: p + 1])
    return seen
