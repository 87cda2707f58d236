"""Pack a GRPO batch into prefix trees and see what it saves.

G samples per prompt share the prompt; packing forwards it once per row. The script packs a
synthetic batch (random token ids standing in for tokenised prompts and completions), prints
the tokens before and after and the compression against the theory G(P+R)/(P+GR), then runs
a small Llama's forward + log-probs + backward on one group, packed and unpacked, and prints
the time saved.

    .venv/bin/python examples/pack_grpo_batch.py [--groups 8] [--group-size 8] [--prompt 512] [--completion 128]
"""

import argparse
import time

import torch

from rlvr_kernels.bench.packing import _forward_step, forward_inputs
from rlvr_kernels.packing import pack_rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--completion", type=int, default=128)
    ap.add_argument("--skip-model", action="store_true", help="only pack, do not run the model")
    args = ap.parse_args()
    G, P, R = args.group_size, args.prompt, args.completion
    torch.manual_seed(0)

    samples, start = [], []
    for _ in range(args.groups):
        prompt = torch.randint(0, 32000, (P,))
        for _ in range(G):
            length = int(torch.randint(R // 2, R + 1, ()))  # completions of varied length
            samples.append(torch.cat([prompt, torch.randint(0, 32000, (length,))]))
            start.append(P)
    rows = [list(range(g * G, (g + 1) * G)) for g in range(args.groups)]  # one group per row
    t0 = time.perf_counter()
    packs = pack_rows(samples, rows, completion_start=start)
    build_ms = (time.perf_counter() - t0) * 1e3
    before = sum(p.num_tokens_unpacked for p in packs)
    after = sum(p.num_tokens for p in packs)
    print(f"{len(samples)} samples in {len(packs)} rows (prompt {P}, completions {R // 2}-{R} tokens)")
    print(f"tokens before packing: {before}, after: {after}, compression {before / after:.2f}x")
    print(f"  (full-length completions would give G(P+R)/(P+GR) = {G * (P + R) / (P + G * R):.2f}x)")
    print(f"built in {build_ms:.1f} ms; targets (trained tokens): {sum(p.num_targets for p in packs)}")

    if args.skip_model:
        return
    x = forward_inputs("cpu")
    steps = {"packed": _forward_step(x, True), "unpacked": _forward_step(x, False)}
    ms = {}
    for name, step in steps.items():
        step()  # warm-up
        t0 = time.perf_counter()
        step()
        ms[name] = (time.perf_counter() - t0) * 1e3
        print(f"{name:>8}: {step.tokens} tokens, forward + log-probs + backward {ms[name]:.0f} ms")
    print(
        f"small Llama (hidden {x['H']}, {x['layers']} layers), one group G={x['G']}, prompt {x['P']}, completion "
        f"{x['R']}: {ms['unpacked'] / ms['packed']:.2f}x faster packed, {ms['unpacked'] - ms['packed']:.0f} ms saved"
    )


if __name__ == "__main__":
    main()
