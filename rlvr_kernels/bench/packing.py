"""Benchmark of prefix-tree packing.

- build: 512 GRPO groups of 16 samples (prompt 1024 + completion 1024 tokens, one group per
  row), packed by ``pack_rows`` (the C++ builder, rows in parallel) against TRL 1.16's
  ``TreeRow`` (``add`` each sample, then ``pack()``) on the same samples, old log-probs and
  advantages. TRL's pure-Python trie takes seconds here, so it is timed once per run; ours is
  the median of several calls.
- forward: a small Llama (hidden 512, 4 layers, vocab 32k), G = 8, prompt 512, completion
  128: forward + ``linear_logprobs`` + backward on the packed row (``rk_tree_sdpa``) against
  the padded batch (SDPA), when the tree attention is available.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable, Dict

import torch

from ..packing import pack_rows
from .timing import time_fn

BUILD_SPEEDUP_TARGET = 30.0
BUILD_SECONDS_TARGET = 1.0


def build_inputs(quick: bool = False) -> Dict:
    R, G, P, C = (32, 16, 1024, 1024) if quick else (512, 16, 1024, 1024)
    gen = torch.Generator().manual_seed(0)
    samples, old, adv = [], [], []
    for _ in range(R):
        prompt = torch.randint(0, 32000, (P,), generator=gen)
        for _ in range(G):
            samples.append(torch.cat([prompt, torch.randint(0, 32000, (C,), generator=gen)]))
            old.append(-torch.rand(P + C, generator=gen))
            adv.append(float(torch.randn((), generator=gen)))
    rows = [list(range(r * G, (r + 1) * G)) for r in range(R)]
    return dict(R=R, G=G, P=P, C=C, samples=samples, old=old, adv=adv, rows=rows)


def _ours(x: Dict) -> Callable[[], object]:
    def run():
        return pack_rows(x["samples"], x["rows"], completion_start=x["P"], old_log_probs=x["old"], advantages=x["adv"])

    return run


def _trl(x: Dict) -> Callable[[], object]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.async_grpo.packing import TreeRow
    mask = torch.cat([torch.zeros(x["P"], dtype=torch.int64), torch.ones(x["C"], dtype=torch.int64)])
    dicts = [
        dict(input_ids=s, completion_mask=mask, old_log_probs=o, advantage=a, group_id=i // x["G"])
        for i, (s, o, a) in enumerate(zip(x["samples"], x["old"], x["adv"]))
    ]

    def run():
        out = []
        for row in x["rows"]:
            tree = TreeRow()
            for i in row:
                tree.add(dicts[i])
            out.append(tree.pack())
        return out

    return run


def build_workload(device: str, quick: bool = False) -> Dict:
    x = build_inputs(quick)
    ours, trl = _ours(x), _trl(x)
    # The same tensors, checked once before timing.
    a, b = ours(), trl()
    agree = all(torch.equal(p.to_trl()[k], q[k]) for p, q in zip(a[:4] + a[-4:], b[:4] + b[-4:]) for k in q)
    del a, b
    t_ours = time_fn(ours, "cpu", repeats=5, warmup=1)["ms"]
    t0 = time.perf_counter()
    trl()
    t_trl = (time.perf_counter() - t0) * 1e3
    tokens = x["R"] * x["G"] * (x["P"] + x["C"])
    rows = [
        {"method": "rlvr_kernels pack_rows (C++ trie, rows in parallel)", "key": "fused", "ms": t_ours, "ratio": 1.0},
        {"method": "TRL 1.16 TreeRow add + pack (Python trie)", "key": "trl", "ms": t_trl, "ratio": t_trl / t_ours},
    ]
    targets = [
        {
            "target": f"TRL / ours time >= {BUILD_SPEEDUP_TARGET:.0f}",
            "measured": t_trl / t_ours,
            "met": t_trl / t_ours >= BUILD_SPEEDUP_TARGET,
        },
        {
            "target": f"ours (s) < {BUILD_SECONDS_TARGET:.0f}",
            "measured": t_ours / 1e3,
            "met": t_ours / 1e3 < BUILD_SECONDS_TARGET,
        },
    ]
    notes = [
        f"{x['R']} rows, each one group of {x['G']} samples × (prompt {x['P']} + completion {x['C']}): "
        f"{tokens / 1e6:.1f} M tokens in, {x['R'] * (x['P'] + x['G'] * x['C']) / 1e6:.1f} M unique tokens out; "
        "inputs: 1-D token tensors, per-token old log-probs, per-sample advantages",
        f"ours: median of 5 calls after a warm-up; TRL: one call. Output equal to TRL's tensor for tensor: {agree}",
    ]
    kind = "quick" if quick else "standard"
    return {
        "name": f"{kind} build: {x['R']} rows × {x['G']} samples × ({x['P']} + {x['C']}) tokens",
        "rows": rows,
        "targets": targets,
        "notes": notes,
    }


WORKLOADS: Dict[str, Callable] = {"build": build_workload}
