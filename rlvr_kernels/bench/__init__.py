"""``rlvr-kernels bench``: every op's benchmark, as a table, a plot and result files.

Benchmarks live in the package (not only in ``benchmarks/``) so that the installed CLI
runs them; ``benchmarks/bench_*.py`` are the pytest-benchmark entry points.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
import textwrap
from typing import Dict, List, Optional

import torch

from . import (
    advantages,
    areal_step,
    logprobs,
    openrlhf_step,
    packing,
    policy_loss,
    rollout_mismatch,
    trainer,
    verl_step,
)

SUITES = {
    "group_advantages": advantages.WORKLOADS,
    "policy_loss": policy_loss.WORKLOADS,
    "linear_logprobs": logprobs.WORKLOADS,
    "packing": packing.WORKLOADS,
    "rollout_mismatch": rollout_mismatch.WORKLOADS,
    "trainer": {**trainer.WORKLOADS, **verl_step.WORKLOADS, **openrlhf_step.WORKLOADS, **areal_step.WORKLOADS},
}


def machine_info(device: str) -> Dict:
    from .. import __version__
    from .._core.platform import cpu_name

    info = {
        "date": datetime.date.today().isoformat(),
        "device": device,
        "cpu": cpu_name(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "rlvr_kernels": __version__,
        "python": platform.python_version(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    for peer in ("verl", "trl"):
        try:
            from importlib.metadata import version

            info[peer] = version(peer)
        except Exception:
            info[peer] = "not installed"
    return info


def device_tag(info: Dict) -> str:
    if info["device"] == "cuda":
        return info["gpu"].lower().replace("nvidia", "").strip().replace(" ", "-") or "cuda"
    return "cpu"


def run_all(out_dir: str, device: Optional[str] = None, quick: bool = False, ops: Optional[List[str]] = None) -> int:
    try:
        from tqdm import tqdm
    except ImportError:  # the `bench` extra brings it; without it, no bar
        tqdm = None
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    info = machine_info(device)
    unknown = sorted(set(ops or ()) - set(SUITES))
    if unknown:
        raise ValueError(f"ops: unknown op families {unknown}; expected some of {list(SUITES)}")
    jobs = [
        (op, name, fn) for op, workloads in SUITES.items() if not ops or op in ops for name, fn in workloads.items()
    ]
    results: List[Dict] = []
    bar = tqdm(jobs, desc="bench", unit="workload", file=sys.stderr) if tqdm else jobs
    for op, name, fn in bar:
        if tqdm:
            bar.set_postfix_str(f"{op}/{name}")
        res = fn(device, quick=quick)
        res["op"] = op
        results.append(res)
    report = {"machine": info, "quick": quick, "results": results}
    md = to_markdown(report)
    print(md)
    os.makedirs(out_dir, exist_ok=True)
    subset = "".join(f"-{op}" for op in SUITES if ops and op in ops)
    stem = os.path.join(out_dir, f"{info['date']}-{device_tag(info)}{subset}{'-quick' if quick else ''}")
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(md)
    plotted = plot(report, stem + ".png")
    print(f"results: {stem}.json, {stem}.md" + (f", {stem}.png" if plotted else " (no plot: matplotlib missing)"))
    return 0


def to_markdown(report: Dict) -> str:
    m = report["machine"]
    where = m.get("gpu") or f"{m['cpu']}, {m['torch_threads']} threads"
    lines = [
        f"### rlvr-kernels bench — {m['date']}, {where}",
        "",
        f"torch {m['torch']}, verl {m['verl']}, trl {m['trl']}; median of repeated runs; "
        "ratio = method time / fused op time.",
        "",
    ]
    for res in report["results"]:
        lines += [f"**{res['op']} — {res['name']}**", "", "| method | ms | ratio |", "|---|---:|---:|"]
        for r in res["rows"]:
            ms = f"{r['ms']:.2f}" if r.get("ms") is not None else "—"
            ratio = f"{r['ratio']:.2f}×" if r.get("ratio") is not None else "—"
            extra = ""
            if "gbps" in r:
                copy = f"{100 * r['copy_fraction']:.0f}% of measured copy {res['copy_gbps']:.1f} GB/s"
                extra = f" ({r['gbps']:.1f} GB/s, {copy})"
            if r.get("extra_gb") is not None:
                extra += f" (peak +{r['extra_gb']:.2f} GB)"
            if r.get("tflops") is not None:
                extra += f" ({r['tflops']:.0f} TFLOP/s, {100 * r['matmul_fraction']:.0f}% of measured matmul)"
            if r.get("note"):
                extra += f" (did not run: {r['note'][:60]})"
            lines.append(f"| {r['method']}{extra} | {ms} | {ratio} |")
        for t in res["targets"]:
            got = "—" if t["measured"] is None else f"{t['measured']:.2f}"
            verdict = {True: "met", False: "MISSED", None: "not measured", "info": "(no target)"}[t["met"]]
            kind = "ratio" if t["met"] == "info" else "target"
            lines.append(f"| {kind}: {t['target']} | measured {got} | {verdict} |")
        lines.append("")
        for note in res.get("notes", []):
            lines.append(f"- {note}")
        if res.get("notes"):
            lines.append("")
    return "\n".join(lines)


def plot(report: Dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    results = report["results"]
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.2 + 0.55 * sum(len(r["rows"]) for r in results)))
    axes = axes if hasattr(axes, "__len__") else [axes]
    for ax, res in zip(axes, results):
        rows = [r for r in res["rows"] if r.get("ms") is not None]
        labels = [r["method"][:70] for r in rows]
        values = [r["ms"] for r in rows]
        ours = ("fused", "fused_novalidate", "dropin", "fused_group_size")
        colors = ["tab:green" if r["key"] in ours else "tab:gray" for r in rows]
        ax.barh(labels, values, color=colors)
        if max(values) / min(values) > 10:  # log scale only where the range needs it, from a whole decade
            ax.set_xscale("log")
            ax.set_xlim(left=10 ** math.floor(math.log10(min(values))), right=max(values) * 3)
            ax.set_xlabel("ms (log scale, lower is better)")
        else:
            ax.set_xlim(left=0, right=max(values) * 1.3)
            ax.set_xlabel("ms (lower is better)")
        ax.invert_yaxis()
        ax.set_title(textwrap.fill(f"{res['op']}: {res['name']}", 80), fontsize=9)
        for i, r in enumerate(rows):
            ax.text(r["ms"], i, f" {r['ms']:.2f} ms ({r['ratio']:.1f}×)", va="center", fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
    m = report["machine"]
    fig.suptitle(f"rlvr-kernels bench {m['date']} on {m.get('gpu') or m['cpu']}", fontsize=10)
    # Room at the top for the title: tight_layout alone lets the first panel's title run into it.
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
