"""The GRPO success recursion (``rlvr_kernels.dynamics``) against real GRPO runs.

The recursion models binary rewards, mean+std advantages and a KL of strength β to a fixed
reference: each iteration is the KL-regularised optimum π_ref·exp(A/β), so p_n is the
reference's success probability tilted by 1/(β·σ(p_{n−1})). This script measures what
``examples/grpo_tiny.py`` actually does for several β and sets it beside the prediction:

1. the reference (the warm-up checkpoint): its success probability p_ref(x) on every
   validation prompt, estimated from ``--samples`` completions at the training temperature
   (the recursion's p is the sampling policy's success probability, not greedy accuracy);
2. two predictions per β: *pooled*, the whole task as one prompt, p*(mean_x p_ref(x), β);
   and *per prompt*, mean_x p*(p_ref(x), β), where a prompt the reference never solves
   stays at 0 (a tilt reweights success paths, it cannot create one);
3. a GRPO run per β (``kl_coef`` = β), then the trained policy's sampled success on the same
   prompts, overall and split by whether the reference solved the prompt. ``--kl seq`` (the
   default) subtracts β·Σ_t(log π_old − log π_ref) from each sequence's normalised advantage:
   the gradient of E[A] − β·KL(π‖π_ref) over whole sequences, whose optimum is the
   recursion's π_ref·exp(A/β). The per-token estimators in the loss regularise differently:
   ``k2`` follows the gradient of each token's KL(π‖π_ref) given its prefix, which leaves out
   how a token changes the KL of the tokens after it; ``k3`` follows that of KL(π_ref‖π).

    python examples/dynamics_vs_grpo.py                      # ~11 min on a 2-core CPU
    python examples/dynamics_vs_grpo.py --betas 0.3,1 --steps 300

Writes ``dynamics_vs_grpo.png`` (success curves with the predicted fixed points, and
measured against predicted per β) and ``dynamics_vs_grpo.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import grpo_tiny as gt  # noqa: E402  (the example next to this one)

from rlvr_kernels import dynamics as dyn  # noqa: E402


def sampled_success(model, prompts: torch.Tensor, cfg: gt.Config, samples: int, seed: int) -> torch.Tensor:
    """[len(prompts)] success rate of ``samples`` completions per prompt at the training
    temperature (float64)."""
    rep = prompts.repeat_interleave(samples, dim=0)
    completions, _ = gt.sample(model, rep, cfg, torch.Generator().manual_seed(seed))
    rewards = torch.tensor([gt.reward(d, c) for d, c in zip(rep, completions)], dtype=torch.float64)
    return rewards.view(-1, samples).mean(dim=1)


def predictions(p_ref: torch.Tensor, beta: float) -> Dict[str, float]:
    """The recursion's fixed points for per-prompt reference success rates ``p_ref``."""
    return dict(
        pooled=float(dyn.grpo_fixed_point(p_ref.mean(), beta)),
        per_prompt=float(dyn.grpo_fixed_point(p_ref, beta).mean()),
    )


def experiment(
    cfg: gt.Config,
    betas: Sequence[float],
    *,
    steps: int,
    samples: int,
    kl: str = "seq",
    tail: int = 100,
    log=print,
    cache_dir: Optional[str] = None,
) -> Dict:
    """Reference success rates, the predictions, and one GRPO run per β (module docstring)."""
    val = gt.make_prompts(cfg.val_size, cfg, torch.Generator().manual_seed(10_000 + cfg.seed))
    reference, _ = gt.warmup(cfg, val, log=log, cache_dir=cache_dir)
    p_ref = sampled_success(reference, val, cfg, samples, seed=cfg.seed + 20)
    solved = p_ref > 0
    log(
        f"reference: sampled success {float(p_ref.mean()):.4f} (T = {cfg.temperature}), "
        f"{int(solved.sum())}/{len(val)} prompts solved at least once in {samples} samples"
    )
    runs: List[Dict] = []
    for beta in betas:
        t0 = time.time()
        run_cfg = dataclasses.replace(cfg, kl=kl, kl_coef=float(beta), steps=steps)
        res = gt.run(run_cfg, log=lambda *a: None, progress=False, cache_dir=cache_dir, keep_model=True)
        rewards = [h["reward"] for h in res["history"] if "reward" in h]
        kls = [h["kl"] for h in res["history"] if "kl" in h and h["kept_groups"] > 0]
        p_final = sampled_success(res["model"], val, cfg, samples, seed=cfg.seed + 21)
        row = dict(
            beta=float(beta),
            predicted=predictions(p_ref, float(beta)),
            measured=dict(
                final=float(p_final.mean()),
                final_solved=float(p_final[solved].mean()) if bool(solved.any()) else float("nan"),
                final_unsolved=float(p_final[~solved].mean()) if bool((~solved).any()) else float("nan"),
                reward_tail=sum(rewards[-tail:]) / max(len(rewards[-tail:]), 1),
                kl_tail=sum(kls[-tail:]) / max(len(kls[-tail:]), 1),
            ),
            reward_curve=rewards,
            seconds=time.time() - t0,
        )
        runs.append(row)
        m, p = row["measured"], row["predicted"]
        log(
            f"β = {beta:<5g} predicted: pooled {p['pooled']:.3f}, per prompt {p['per_prompt']:.3f} | "
            f"measured after {steps} steps: {m['final']:.3f} (solved by the reference {m['final_solved']:.3f}, "
            f"unsolved {m['final_unsolved']:.3f}), reward over the last {tail} steps {m['reward_tail']:.3f}, "
            f"KL {m['kl_tail']:.3f}  ({row['seconds']:.0f} s)"
        )
    return dict(
        config=dataclasses.asdict(cfg),
        steps=steps,
        samples=samples,
        kl=kl,
        p_ref_mean=float(p_ref.mean()),
        solved_fraction=float(solved.double().mean()),
        p_ref=p_ref.tolist(),
        runs=runs,
    )


def table(res: Dict) -> str:
    """The comparison as a Markdown table."""
    lines = [
        "| β | predicted p*, pooled | predicted, per prompt | measured | on prompts the reference solved | "
        "on prompts it never solved |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        p, m = r["predicted"], r["measured"]
        lines.append(
            f"| {r['beta']:g} | {p['pooled']:.3f} | {p['per_prompt']:.3f} | {m['final']:.3f} | "
            f"{m['final_solved']:.3f} | {m['final_unsolved']:.3f} |"
        )
    return "\n".join(lines)


def plot(res: Dict, path: str, window: int = 25) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(res["runs"]):
        c = colors[i % len(colors)]
        curve = torch.tensor(r["reward_curve"], dtype=torch.float64)
        w = min(window, len(curve))
        smooth = curve.unfold(0, w, 1).mean(dim=1) if w > 0 else curve
        ax.plot(range(w, len(curve) + 1), smooth.tolist(), color=c, label=f"β = {r['beta']:g}")
        ax.axhline(r["predicted"]["pooled"], color=c, ls="--", lw=1)
        ax.axhline(r["predicted"]["per_prompt"], color=c, ls=":", lw=1)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(f"batch success rate (mean of {window} steps)")
    ax.set_title("measured (solid); p* pooled (dashed), per prompt (dotted)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)

    betas = [r["beta"] for r in res["runs"]]
    x = torch.arange(len(betas)).tolist()
    bars = [
        ("predicted, pooled", [r["predicted"]["pooled"] for r in res["runs"]]),
        ("predicted, per prompt", [r["predicted"]["per_prompt"] for r in res["runs"]]),
        ("measured", [r["measured"]["final"] for r in res["runs"]]),
        ("measured, prompts the reference never solved", [r["measured"]["final_unsolved"] for r in res["runs"]]),
    ]
    width = 0.8 / len(bars)
    for j, (label, values) in enumerate(bars):
        bx.bar([v + (j - (len(bars) - 1) / 2) * width for v in x], values, width, label=label)
    bx.axhline(res["p_ref_mean"], color="k", lw=1, ls="--", label="reference")
    bx.set_xticks(x, [f"β = {b:g}" for b in betas])
    bx.set_ylabel("sampled success on the validation prompts")
    bx.set_title(f"after {res['steps']} steps ({res['kl']} KL, T = {res['config']['temperature']})")
    bx.set_ylim(0, 1.3)
    bx.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    bx.legend(fontsize=8, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--betas", default="0.03,0.1,0.3,0.5,1", help="comma-separated KL coefficients")
    p.add_argument("--steps", type=int, default=1000, help="GRPO steps per β")
    p.add_argument("--samples", type=int, default=64, help="completions per validation prompt")
    p.add_argument("--kl", default="seq", choices=gt.KL_CHOICES)
    p.add_argument("--seed", type=int, default=gt.Config.seed)
    p.add_argument("--out", default=os.path.join(HERE, "figures"))
    args = p.parse_args(argv)
    try:
        betas = [float(b) for b in args.betas.split(",")]
    except ValueError:
        p.error(f"--betas: expected comma-separated numbers, got {args.betas!r}")
    if any(not b > 0 for b in betas):
        p.error("--betas: every β must be > 0")
    if args.steps < 1 or args.samples < 1:
        p.error("--steps and --samples must be ≥ 1")
    torch.set_num_threads(max(1, min(os.cpu_count() or 1, 4)))
    cfg = dataclasses.replace(gt.Config(), seed=args.seed)
    res = experiment(cfg, betas, steps=args.steps, samples=args.samples, kl=args.kl)
    print(table(res))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dynamics_vs_grpo.json"), "w") as f:
        json.dump(res, f)
    png = os.path.join(args.out, "dynamics_vs_grpo.png")
    plot(res, png)
    print(f"figure: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
