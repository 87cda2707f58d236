"""Benchmark of ``group_advantages`` against verl and eager PyTorch.

Workloads (the driver-side call of a verl GRPO step):
- tokens: 512 prompts × 16 samples, L = 4096, response lengths uniform in [1, L], binary
  rewards, float32 ``response_mask``; token advantages are written.
- groups: B = 2^20 samples in groups of 16, group statistics and per-sample advantages only,
  with contiguous and with shuffled group ids; measured against the leanest eager version
  (``bincount`` + two ``index_add_`` + gathers).
Methods are timed interleaved (one call of each per round), so a change in the machine's
load hits every row alike; the table reports medians and the load average.
"""

from __future__ import annotations

import os
import random
import statistics
import time
import uuid
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from .. import group_advantages, uids_to_group_index
from ..integrations import verl as verl_dropin
from .timing import copy_bandwidth


def _eager_grpo(scores, group_index, num_groups, response_mask=None, eps=1e-6):
    """The best plain-PyTorch version we know: two-pass index_add statistics, one mul."""
    ones = torch.ones_like(scores)
    count = scores.new_zeros(num_groups).index_add_(0, group_index, ones)
    mean = scores.new_zeros(num_groups).index_add_(0, group_index, scores) / count.clamp_min(1)
    centered = scores - mean[group_index]
    var = scores.new_zeros(num_groups).index_add_(0, group_index, centered * centered) / (count - 1).clamp_min(1)
    adv = centered / (var.sqrt()[group_index] + eps)
    return adv if response_mask is None else adv[:, None] * response_mask


def _lean_eager_grpo(scores, group_index, num_groups, eps=1e-6):
    """The leanest eager GRPO we know: ``bincount`` counts, two ``index_add_`` sums (Σr, then
    Σ(r − μ)²), gathers and in-place arithmetic; the numbers of ``preset="verl"`` on groups
    of two or more samples (no NaN, no masks)."""
    count = torch.bincount(group_index, minlength=num_groups).to(scores.dtype)
    mean = scores.new_zeros(num_groups).index_add_(0, group_index, scores).div_(count.clamp_min(1))
    centered = scores - mean[group_index]
    m2 = scores.new_zeros(num_groups).index_add_(0, group_index, centered * centered)
    sd = m2.div_((count - 1).clamp_min(1)).sqrt_().add_(eps)
    return centered.div_(sd[group_index])


def _peer(name: str) -> Optional[object]:
    try:
        if name == "verl":
            from verl.trainer.ppo import core_algos

            return core_algos
        if name == "verl_groupwise":
            from verl.utils import groupwise

            return groupwise
    except Exception as e:  # reported as a row, not hidden
        return e
    raise KeyError(name)


def token_methods(device: str, quick: bool = False):
    """The token workload's inputs and the (label, fn, key) of every method compared."""
    P, G, L = (64, 16, 512) if quick else (512, 16, 4096)
    B = P * G
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, L + 1, (B,), generator=gen)
    response_mask = (torch.arange(L)[None, :] < lengths[:, None]).to(torch.float32).to(device)
    rewards = torch.randint(0, 2, (B,), generator=gen).to(torch.float32).to(device)
    token_level_rewards = torch.zeros(B, L, device=device)
    token_level_rewards[torch.arange(B), (lengths - 1).to(device)] = rewards
    uids = np.array([str(uuid.UUID(int=int(x))) for x in torch.randint(0, 2**62, (P,), generator=gen)], dtype=object)
    index = uids.repeat(G)
    group_index, num_groups = uids_to_group_index(index, device=device, return_num_groups=True)
    adv = torch.randn(B, device=device)
    out_buf = torch.empty(B, L, device=device)

    methods: List[tuple] = [
        (
            "rlvr_kernels.group_advantages (fused op: scores -> token advantages)",
            lambda: group_advantages(
                rewards, group_index, num_groups=num_groups, response_mask=response_mask, preset="verl"
            ),
            "fused",
        ),
        (
            "rlvr_kernels verl drop-in (token_level_rewards + uids, as verl)",
            lambda: verl_dropin.compute_grpo_outcome_advantage(token_level_rewards, response_mask, index),
            "dropin",
        ),
        (
            "eager torch, vectorised (index_add stats + mul)",
            lambda: _eager_grpo(rewards, group_index, num_groups, response_mask),
            "eager",
        ),
        ("torch.mul(response_mask, adv[:, None]) alone", lambda: torch.mul(response_mask, adv[:, None]), "floor"),
        (
            "torch.mul(..., out=preallocated) alone",
            lambda: torch.mul(response_mask, adv[:, None], out=out_buf),
            "floor_out",
        ),
    ]
    verl = _peer("verl")
    if isinstance(verl, Exception):
        methods.append((f"verl (not importable: {verl!r})"[:90], None, "verl_loop"))
    else:
        methods += [
            (
                "verl compute_grpo_outcome_advantage (default loop)",
                lambda: verl.compute_grpo_outcome_advantage(token_level_rewards, response_mask, index),
                "verl_loop",
            ),
            (
                "verl compute_grpo_vectorized_outcome_advantage",
                lambda: verl.compute_grpo_vectorized_outcome_advantage(token_level_rewards, response_mask, index),
                "verl_vec",
            ),
        ]
    return dict(P=P, G=G, L=L, B=B), methods


def token_workload(device: str, quick: bool = False) -> Dict:
    shape, methods = token_methods(device, quick)
    P, G, L, B = shape["P"], shape["G"], shape["L"], shape["B"]
    rows = _time_methods(methods, device, slow={"verl_loop"})
    fused = rows["fused"]["ms"]
    tokens_bytes = 2 * B * L * 4  # read the fp32 mask once, write fp32 token advantages once
    bw = copy_bandwidth(device)
    for r in rows.values():
        r["ratio"] = r["ms"] / fused if r.get("ms") else None
    rows["fused"]["gbps"] = tokens_bytes / (fused * 1e-3) / 1e9
    rows["fused"]["copy_fraction"] = rows["fused"]["gbps"] / bw
    targets = [
        _target("verl loop / fused", rows, "verl_loop", "fused", ">=", 15.0),
        _target("verl vectorised / fused", rows, "verl_vec", "fused", ">=", 6.0),
        _target("fused / torch.mul alone", rows, "fused", "floor", "<=", 1.3),
        _target("verl loop / verl drop-in", rows, "verl_loop", "dropin", "info", None),
        _target("verl vectorised / verl drop-in", rows, "verl_vec", "dropin", "info", None),
    ]
    return {
        "name": f"tokens: {P} prompts x {G} samples, L={L}, fp32 response_mask, binary rewards",
        "rows": list(rows.values()),
        "targets": targets,
        "copy_gbps": bw,
    }


def group_methods(device: str, quick: bool = False, shuffled: bool = True):
    """The group-only workload's inputs and methods: group ids contiguous (a group's
    samples side by side, as verl and TRL lay out a batch) or shuffled."""
    B, G = (1 << 14, 16) if quick else (1 << 20, 16)
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 2, (B,), generator=gen).to(torch.float32).to(device)
    order = torch.randperm(B, generator=gen) if shuffled else torch.arange(B)
    group_index = (order // G).to(device)
    num_groups = B // G
    methods = [
        (
            "rlvr_kernels.group_advantages (group-only)",
            lambda: group_advantages(scores, group_index, num_groups=num_groups, preset="verl"),
            "fused",
        ),
        (
            "eager torch, leanest (bincount + two index_add_ + gathers)",
            lambda: _lean_eager_grpo(scores, group_index, num_groups),
            "eager_lean",
        ),
        ("eager torch, vectorised (index_add stats)", lambda: _eager_grpo(scores, group_index, num_groups), "eager"),
    ]
    if not shuffled:  # TRL's layout: groups are contiguous rows, no ids to read
        methods.insert(
            1,
            (
                "rlvr_kernels.group_advantages(group_size=16) (no ids)",
                lambda: group_advantages(scores, group_size=G, preset="verl"),
                "fused_group_size",
            ),
        )
    gw = _peer("verl_groupwise")
    if not isinstance(gw, Exception):

        def verl_groups():
            mean, std, _ = gw.group_mean_std(scores, group_index, eps=0.0, device=scores.device)
            return (scores - mean[group_index]) / (std[group_index] + 1e-6)

        methods.append(("verl group_mean_std + GRPO formula (verl's vectorised core)", verl_groups, "verl_vec"))
    return dict(B=B, G=G), methods


def group_workload(device: str, quick: bool = False, shuffled: bool = True) -> Dict:
    shape, methods = group_methods(device, quick, shuffled)
    B, G = shape["B"], shape["G"]
    load_before = os.getloadavg()
    agreement = _check_agreement(methods)
    rows = _time_methods(methods, device, repeats=7 if quick else 21)
    load_after = os.getloadavg()
    fused = rows["fused"]["ms"]
    for r in rows.values():
        r["ratio"] = r["ms"] / fused if r.get("ms") else None
    ids = "shuffled" if shuffled else "contiguous"
    targets = [_target("leanest eager / fused", rows, "eager_lean", "fused", ">=", 1.5)]
    if "fused_group_size" in rows:
        targets.append(_target("leanest eager / fused(group_size)", rows, "eager_lean", "fused_group_size", ">=", 1.5))
    return {
        "name": f"groups only: B = {B} samples, groups of {G}, {ids} ids",
        "rows": list(rows.values()),
        "targets": targets,
        "copy_gbps": None,
        "agreement": agreement,
        "load": {"before": load_before, "after": load_after},
        "notes": [
            "max |advantage − fused| per method: " + ", ".join(f"{k} {v:.1e}" for k, v in agreement.items()),
            f"interleaved rounds, medians; load average (1/5/15 min) {_load(load_before)} before, "
            f"{_load(load_after)} after",
        ],
    }


def _load(avg) -> str:
    return "/".join(f"{x:.2f}" for x in avg)


def _advantages_of(out) -> torch.Tensor:
    return out.advantages if hasattr(out, "advantages") else out


def _check_agreement(methods, tol: float = 1e-4) -> Dict[str, float]:
    """Every method computes the fused op's advantages (a benchmark of a method that computes
    something else measures nothing): the largest difference from the fused op's, or an error."""
    outs = {key: _advantages_of(fn()) for _, fn, key in methods if fn is not None}
    fused = outs.pop("fused").double()
    agreement = {}
    for key, out in outs.items():
        diff = float((out.double() - fused).abs().max()) if out.numel() else 0.0
        if not diff <= tol:
            raise RuntimeError(f"group_advantages bench: {key} disagrees with the fused op (max abs diff {diff:.3g})")
        agreement[key] = diff
    return agreement


def _time_methods(methods, device, slow=frozenset(), repeats: int = 9) -> Dict[str, Dict]:
    """Median (and min) wall time of each method, timed interleaved: one call of every method per
    round, in a shuffled order, after one warm-up call each; ``slow`` methods run in the
    first three rounds only."""
    rows = {key: {"method": label, "key": key} for label, _, key in methods}
    runnable = [(fn, key) for _, fn, key in methods if fn is not None]
    for fn, _ in runnable:
        fn()
    times: Dict[str, list] = {key: [] for _, key in runnable}
    order = random.Random(0)
    for r in range(repeats):
        # A fresh order each round (seeded), so no method always has the same neighbour: one
        # that follows a heavy method runs on cold caches and a trimmed heap.
        for fn, key in order.sample(runnable, len(runnable)):
            if key in slow and r >= 3:
                continue
            times[key].append(_time_once(fn, device))
    for key, ts in times.items():
        rows[key].update(ms=statistics.median(ts), min_ms=min(ts), runs=len(ts))
    return rows


def _time_once(fn, device) -> float:
    """One call in milliseconds (CUDA: events around it). The output is dropped before the
    next call, as a training loop would."""
    if device == "cuda":
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _target(label, rows, num, den, op, value):
    a, b = rows.get(num, {}).get("ms"), rows.get(den, {}).get("ms")
    ratio = a / b if a and b else None
    if op == "info":  # a ratio worth showing, with no target attached
        return {"target": label, "measured": ratio, "met": "info"}
    met = None if ratio is None else (ratio >= value if op == ">=" else ratio <= value)
    return {"target": f"{label} {op} {value}", "measured": ratio, "met": met}


WORKLOADS: Dict[str, Callable] = {
    "tokens": token_workload,
    "groups_contiguous": lambda device, quick=False: group_workload(device, quick, shuffled=False),
    "groups_shuffled": lambda device, quick=False: group_workload(device, quick, shuffled=True),
}
