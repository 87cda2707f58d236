"""Plot the GRPO success recursion p_n for several p_ref and β, with each fixed point dashed.

Binary rewards, mean+std normalisation, KL of strength β to a fixed reference with success
probability p_ref (docs/dynamics.md, :mod:`rlvr_kernels.dynamics`). A fixed point at 1.0 means the
map never crosses the diagonal below 1: the policy is driven to (numerically) certain success.

    .venv/bin/python examples/dynamics_plot.py [--out examples/figures/dynamics.png] [--steps 25]
"""

import argparse
import pathlib

import torch

from rlvr_kernels.dynamics import grpo_fixed_point, grpo_success_recursion

P_REFS = (0.05, 0.2, 0.5)
BETAS = (0.5, 1.0, 2.0)
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "figures" / "dynamics.png"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="PNG path (its folder is created)")
    ap.add_argument("--steps", type=int, default=25, help="number of updates to iterate")
    ap.add_argument("--eps", type=float, default=1e-6, help="ε inside the std")
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    p_ref = torch.tensor(P_REFS, dtype=torch.float64)[:, None]
    beta = torch.tensor(BETAS, dtype=torch.float64)
    seq = grpo_success_recursion(p_ref, beta, args.steps, eps=args.eps)  # [p_ref, β, steps + 1]
    fixed = grpo_fixed_point(p_ref, beta, eps=args.eps)  # [p_ref, β]

    print(f"{'p_ref':>6} {'beta':>5} {'p* (smallest fixed point)':>26} {'p_' + str(args.steps):>8}")
    for i, pr in enumerate(P_REFS):
        for j, b in enumerate(BETAS):
            print(f"{pr:>6g} {b:>5g} {fixed[i, j]:>26.4f} {seq[i, j, -1]:>8.4f}")

    fig, axes = plt.subplots(1, len(P_REFS), figsize=(12, 3.4), sharey=True)
    steps = range(args.steps + 1)
    for i, (ax, pr) in enumerate(zip(axes, P_REFS)):
        for j, (b, color) in enumerate(zip(BETAS, ("tab:red", "tab:blue", "tab:green"))):
            ax.plot(steps, seq[i, j], marker=".", ms=3, lw=1, color=color, label=f"β = {b:g}")
            ax.axhline(float(fixed[i, j]), ls="--", lw=1, color=color, alpha=0.7)
        ax.axhline(pr, ls=":", lw=1, color="gray")
        ax.set_title(f"p_ref = {pr:g}")
        ax.set_xlabel("update n")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("success probability p_n")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="center right", fontsize=8, title="solid p_n\ndashed p*\ndotted p_ref", title_fontsize=8
    )
    fig.suptitle(f"GRPO success recursion (mean+std normalisation, KL to p_ref, ε = {args.eps:g})", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.9, 1))  # room for the legend on the right
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    plt.close(fig)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
