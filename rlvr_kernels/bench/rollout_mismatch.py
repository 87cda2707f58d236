"""Benchmark of ``rollout_mismatch`` against verl's metric code.

Workload (the actor-side metrics of a verl step): B = 64 sequences, L = 8192, float32
train and rollout log-probs, response lengths uniform in [1, L], a float32
``response_mask``. Compared: the fused op (every metric of docs/rollout-mismatch.md as
device tensors), verl 0.9.1's ``compute_rollout_corr_metrics_from_logprobs`` (its
``rollout_corr/*`` subset, read back to floats as verl does), and the cost of one
elementwise pass over the inputs (the floor of any version). Medians of interleaved rounds.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

from .. import rollout_mismatch
from .advantages import _time_methods
from .timing import copy_bandwidth


def _verl():
    try:
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_corr_metrics_from_logprobs

        return compute_rollout_corr_metrics_from_logprobs
    except Exception as e:  # reported as a row, not hidden
        return e


def workload(device: str, quick: bool = False) -> Dict:
    B, L = (8, 512) if quick else (64, 8192)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, L + 1, (B,), generator=gen)
    mask = (torch.arange(L)[None, :] < lengths[:, None]).to(torch.float32).to(device)
    train = (-4 * torch.rand(B, L, generator=gen)).to(device)
    rollout = train + (0.05 * torch.randn(B, L, generator=gen)).to(device)

    def fused():
        return rollout_mismatch(train, rollout, mask)

    def fused_read():  # the fused op plus the one read-back a logger makes
        return rollout_mismatch(train, rollout, mask).k3.item()

    methods = [
        ("rlvr_kernels.rollout_mismatch (fused, device tensors)", fused, "fused"),
        ("rlvr_kernels.rollout_mismatch + one .item()", fused_read, "fused_read"),
        ("torch.sub(train, rollout) alone (one elementwise pass)", lambda: torch.sub(train, rollout), "floor"),
    ]
    verl = _verl()
    if isinstance(verl, Exception):
        methods.append((f"verl (not importable: {verl!r})"[:90], None, "verl"))
    else:
        methods.append(("verl compute_rollout_corr_metrics_from_logprobs", lambda: verl(train, rollout, mask), "verl"))
        ours, theirs = fused(), verl(train, rollout, mask)
        for key, field in (("kl", "k1"), ("k3_kl", "k3"), ("chi2_token", "chi2_token")):
            diff = abs(float(getattr(ours, field)) - theirs[f"rollout_corr/{key}"])
            if not diff <= 1e-4 * max(1.0, abs(theirs[f"rollout_corr/{key}"])):
                raise RuntimeError(f"rollout_mismatch bench: {field} disagrees with verl's {key} ({diff:.3g})")
    rows = _time_methods(methods, device, repeats=7 if quick else 21)
    base = rows["fused"]["ms"]
    for r in rows.values():
        r["ratio"] = r["ms"] / base if r.get("ms") else None
    gbps = copy_bandwidth(device, 1 << 24 if quick else 1 << 28)
    nbytes = 3 * B * L * 4  # train, rollout, mask read once
    rows["fused"]["gbps"] = nbytes / (base * 1e-3) / 1e9
    rows["fused"]["copy_fraction"] = rows["fused"]["gbps"] / gbps
    verl_ms = rows["verl"].get("ms")
    return {
        "name": f"B = {B} sequences, L = {L}, float32 log-probs and mask",
        "rows": list(rows.values()),
        "targets": [
            {
                "target": "verl / fused",
                "measured": verl_ms / base if verl_ms else None,
                "met": "info",
            }
        ],
        "copy_gbps": gbps,
        "notes": ["verl reads each metric back to a float (a host sync per metric); the fused op reads none"],
    }


WORKLOADS: Dict[str, Callable] = {"metrics": workload}
