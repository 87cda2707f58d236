"""Prefix-tree packing checks for ``rlvr-kernels check``: the C++ builder against the
reference trie, and both against TRL 1.16's ``TreeRow`` where its layout applies. Packing is
exact (integer layouts, gathered values), so every comparison is equality."""

from __future__ import annotations

import warnings
from typing import Callable, List, Optional

import torch

from ._checks import CheckRow, CheckSuite, check_row
from ._compare import Comparison


def random_forest(gen: torch.Generator, *, groups: int, group_size: int, vocab: int, multi_turn: bool):
    """Samples of ``groups`` prompts (with a common system prompt), completions of varied
    length (some empty), duplicates, and multi-turn masks with untrained tool turns."""
    system = torch.randint(0, vocab, (int(torch.randint(0, 4, (), generator=gen)),), generator=gen)
    ids, masks, old, adv, group = [], [], [], [], []
    for g in range(groups):
        prompt = torch.cat(
            [system, torch.randint(0, vocab, (int(torch.randint(1, 9, (), generator=gen)),), generator=gen)]
        )
        for i in range(group_size):
            if i and int(torch.randint(0, 6, (), generator=gen)) == 0:
                seq, m = ids[-1].clone(), masks[-1].clone()  # a duplicate
            else:
                comp = torch.randint(0, vocab, (int(torch.randint(0, 12, (), generator=gen)),), generator=gen)
                seq = torch.cat([prompt, comp])
                m = torch.cat([torch.zeros(len(prompt), dtype=torch.bool), torch.ones(len(comp), dtype=torch.bool)])
                if multi_turn and len(comp) > 3:
                    cut = len(prompt) + int(torch.randint(1, len(comp) - 1, (), generator=gen))
                    m[cut : cut + 2] = False
            ids.append(seq)
            masks.append(m)
            old.append(-torch.rand(len(seq), generator=gen))
            adv.append(float(torch.randn((), generator=gen)))
            group.append(g)
    return dict(samples=ids, completion_mask=masks, old_log_probs=old, advantages=adv), group


def check_cases() -> List[tuple]:
    return [
        ("token+next, GRPO groups", dict(groups=6, group_size=8, vocab=5, multi_turn=False), dict()),
        ("token+next, multi-turn masks", dict(groups=4, group_size=6, vocab=3, multi_turn=True), dict()),
        ("token, GRPO groups", dict(groups=6, group_size=8, vocab=5, multi_turn=False), dict(key="token")),
        (
            "token, groups kept apart",
            dict(groups=5, group_size=4, vocab=3, multi_turn=True),
            dict(key="token", grouped=True),
        ),
        ("token+next, wide vocab", dict(groups=3, group_size=16, vocab=1000, multi_turn=False), dict()),
    ]


def _fields(pack) -> dict:
    return {k: v for k, v in vars(pack).items() if isinstance(v, torch.Tensor)}


def _equal(name: str, a, b) -> Comparison:
    ok = a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    return Comparison(name, 0.0 if ok else 1.0, 0.0 if ok else 1.0, ok)


def _trl_pack(inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.async_grpo.packing import TreeRow
    row = TreeRow()
    for ids, m, o, a in zip(*(inputs[k] for k in ("samples", "completion_mask", "old_log_probs", "advantages"))):
        if len(ids):
            row.add(dict(input_ids=ids, completion_mask=m.long(), old_log_probs=o, advantage=a, group_id=0))
    return row.pack()


def check_packing(
    backends: List[str], device: str = "cpu", seed: int = 0, progress: Optional[Callable] = None
) -> List[CheckRow]:
    """Each backend's pack against the reference's; with TRL's key and no groups, the
    reference's ``to_trl()`` against TRL's own ``TreeRow``."""
    from ..packing import pack_prefix_tree

    rows = []
    gen = torch.Generator().manual_seed(seed)
    for name, forest_kw, opts in check_cases():
        inputs, group = random_forest(gen, **forest_kw)
        kw = dict(key=opts.get("key", "token+next"), group_index=group if opts.get("grouped") else None)
        ref = pack_prefix_tree(**inputs, **kw, backend="reference")
        for backend in backends:
            if backend == "reference" and kw["key"] == "token+next" and kw["group_index"] is None:

                def against_trl():
                    trl = _trl_pack(inputs)
                    ours = ref.to_trl()
                    return [_equal(f"to_trl {k} vs TRL TreeRow", ours[k], trl[k]) for k in trl]

                rows.append(check_row("packing", backend, name, against_trl))
            elif backend == "cpu":

                def against_reference():
                    fast = pack_prefix_tree(**inputs, **kw, backend="cpu")
                    ref_fields = _fields(ref)
                    return [_equal(k, v, ref_fields[k]) for k, v in _fields(fast).items()]

                rows.append(check_row("packing", backend, name, against_reference))
            if progress:
                progress()
    return rows


SUITE = CheckSuite("packing", check_cases, check_packing)
