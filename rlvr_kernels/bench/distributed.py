"""Communication of the ops under ``process_group``: how many collectives each call issues and
how many bytes they carry, on 2 and 4 gloo processes on this machine, against the tensors a
naive implementation would all-gather to compute the same thing in one place.

What is counted: every ``torch.distributed`` collective the call issues (the functions are
wrapped in each rank while the op runs), the bytes of each rank's local contribution, and the
bytes each rank receives under the usual algorithms (ring all-gather: (W−1)·n; ring
all-reduce: 2·(W−1)/W·n). The naive column is computed from the sizes of the tensors it
would all-gather (it is not run: the vocabulary-parallel one would move the whole
``[tokens, vocab]`` logits).

Workloads (global sizes, the same for every W, split evenly over the ranks):

- ``group_advantages`` (GRPO, 0/1 rewards): 512 groups of 16 samples, the samples of every
  group spread over all ranks. Naive: all-gather the scores (fp32) and group ids (int64).
- ``policy_loss`` (token-mean, clip-higher, k3 KL): 128 sequences of 2048 tokens. Naive:
  all-gather the ``[B, L]`` bool response mask to count the global tokens and sequences.
- ``global_counts``: the same mask (for trainers that aggregate themselves).
- ``linear_logprobs`` vocabulary-parallel, with entropy: 4096 tokens, hidden 256, vocabulary
  32000 split over the ranks, fp32, forward and backward. Naive: all-gather the fp32 logit
  shards ``[N, V/W]``. The backward's all-reduce of the hidden-state gradient is the same
  for both (each rank's LM-head shard contributes to every hidden state).
"""

from __future__ import annotations

import datetime
import json
import os
from contextlib import contextmanager
from typing import Dict, Iterator, List

import torch

GROUPS, GROUP_SIZE = 512, 16
SEQS, SEQ_LEN = 128, 2048
TOKENS, HIDDEN, VOCAB = 4096, 256, 32000
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor")


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x)


@contextmanager
def count_collectives(world: int) -> Iterator[List[Dict]]:
    """Record every collective issued inside the block: name, local bytes, received bytes."""
    import torch.distributed as dist

    calls: List[Dict] = []
    saved = {name: getattr(dist, name) for name in _COLLECTIVES}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            # all_gather(list, tensor): the local contribution is the second argument.
            local = args[1] if name in ("all_gather", "all_gather_into_tensor") else args[0]
            n = _nbytes(local)
            received = {"all_reduce": 2 * (world - 1) * n / world, "broadcast": n}.get(name, (world - 1) * n)
            calls.append(dict(name=name, local_bytes=n, received_bytes=received))
            return fn(*args, **kwargs)

        return counted

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _row(op: str, world: int, calls: List[Dict], naive_local: int, naive_what: str, needed: int) -> Dict:
    return dict(
        op=op,
        world=world,
        collectives=len(calls),
        needed=needed,
        names=[c["name"] for c in calls],
        local_bytes=sum(c["local_bytes"] for c in calls),
        received_bytes=sum(c["received_bytes"] for c in calls),
        naive=naive_what,
        naive_local_bytes=naive_local,
        naive_received_bytes=(world - 1) * naive_local,
    )


def _measure(rank: int, world: int, scale: float) -> List[Dict]:
    """Every workload on this rank (``scale`` < 1 shrinks them for the test)."""
    import torch.distributed as dist

    from .. import group_advantages, linear_logprobs, policy_loss
    from ..distributed import global_counts

    pg = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)  # every rank builds the same global batch
    rows: List[Dict] = []

    # group_advantages: sample i belongs to group i % GROUPS; rank r takes every world-th sample.
    groups = max(int(GROUPS * scale), 1)
    n = groups * GROUP_SIZE
    scores = (torch.rand(n, generator=gen) < 0.5).float()
    gid = torch.arange(n) % groups
    mine = torch.arange(rank, n, world)
    args = (scores[mine],)
    kwargs = dict(group_index=gid[mine], num_groups=groups, process_group=pg)
    group_advantages(*args, **kwargs)  # warm-up (first-call set-up is not communication)
    with count_collectives(world) as calls:
        group_advantages(*args, **kwargs)
    naive = _nbytes([scores[mine], gid[mine]])
    rows.append(_row("group_advantages", world, calls, naive, "scores fp32 + group ids int64", needed=1))

    # policy_loss and global_counts: this rank's sequences.
    seqs, length = max(int(SEQS * scale), world), max(int(SEQ_LEN * scale), 8)
    b = seqs // world
    lengths = torch.randint(1, length + 1, (seqs,), generator=gen)[rank * b : (rank + 1) * b]
    mask = torch.arange(length)[None, :] < lengths[:, None]
    logp = (-torch.rand(b, length, generator=gen)).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(b, length, generator=gen)
    ref = logp.detach() + 0.1 * torch.randn(b, length, generator=gen)
    adv = torch.randn(b, generator=gen)
    loss_kwargs = dict(ref_logprobs=ref, kl="k3", kl_coef=0.01, clip_high=0.28, process_group=pg)
    policy_loss(logp, old, adv, mask, **loss_kwargs)
    with count_collectives(world) as calls:
        loss, _ = policy_loss(logp, old, adv, mask, **loss_kwargs)
        loss.backward()
    rows.append(_row("policy_loss", world, calls, _nbytes(mask), "response mask [B, L] bool", needed=1))
    # policy_loss under context parallelism: every rank a contiguous slice of every sequence.
    lengths = torch.randint(1, length + 1, (seqs,), generator=gen)
    lo, hi = length * rank // world, length * (rank + 1) // world
    cp_mask = (torch.arange(length)[None, :] < lengths[:, None])[:, lo:hi]
    cp_logp = (-torch.rand(seqs, length, generator=gen))[:, lo:hi].requires_grad_()
    cp_old = cp_logp.detach() + 0.1 * torch.randn(seqs, hi - lo, generator=gen)
    cp_adv = torch.randn(seqs, generator=gen)
    cp_kwargs = dict(loss_type="gspo", agg="seq-mean-token-mean", cp_group=pg)
    policy_loss(cp_logp, cp_old, cp_adv, cp_mask, **cp_kwargs)
    with count_collectives(world) as calls:
        loss, _ = policy_loss(cp_logp, cp_old, cp_adv, cp_mask, **cp_kwargs)
        loss.backward()
    naive = _nbytes([cp_logp, cp_old, cp_mask])
    rows.append(
        _row("policy_loss(cp_group=...)", world, calls, naive, "log-probs + old fp32 + mask of the slice", needed=2)
    )
    with count_collectives(world) as calls:
        global_counts(mask, process_group=pg)
    rows.append(_row("global_counts", world, calls, _nbytes(mask), "response mask [B, L] bool", needed=1))

    # linear_logprobs over a vocabulary shard (uneven when V is not a multiple of W).
    tokens, vocab = max(int(TOKENS * scale), 4), max(int(VOCAB * scale), 4 * world)
    bounds = [vocab * r // world for r in range(world + 1)]
    hidden = torch.randn(tokens, HIDDEN, generator=gen, dtype=torch.float32).requires_grad_()
    weight = (0.05 * torch.randn(vocab, HIDDEN, generator=gen))[bounds[rank] : bounds[rank + 1]].requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    linear_logprobs(hidden, weight, targets, return_entropy=True, process_group=pg)
    with count_collectives(world) as calls:
        out = linear_logprobs(hidden, weight, targets, return_entropy=True, process_group=pg)
    shard_logits = tokens * (bounds[rank + 1] - bounds[rank]) * 4
    rows.append(_row("linear_logprobs forward", world, calls, shard_logits, "logit shards [N, V/W] fp32", needed=2))
    with count_collectives(world) as calls:
        (out.logp.sum() + out.entropy.sum()).backward()
    grad = tokens * HIDDEN * 4  # both designs all-reduce the hidden-state gradient
    rows.append(_row("linear_logprobs backward", world, calls, 0, "(the same all-reduce)", needed=1))
    rows[-1]["naive_local_bytes"] = grad
    rows[-1]["naive_received_bytes"] = 2 * (world - 1) * grad / world
    return rows


def _worker(rank: int, world: int, port: int, scale: float, path: str) -> None:
    from ..testing.dist import gloo_process

    with gloo_process(rank, world, port):
        rows = _measure(rank, world, scale)
        if rank == 0:
            with open(path, "w") as f:
                json.dump(rows, f)


def measure(worlds=(2, 4), scale: float = 1.0) -> List[Dict]:
    """Spawn each world size on gloo, run every workload, return rank 0's rows."""
    import tempfile

    import torch.multiprocessing as mp

    from ..testing.dist import free_port

    rows: List[Dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            path = os.path.join(tmp, f"{world}.json")
            mp.spawn(_worker, args=(world, free_port(), scale, path), nprocs=world, join=True)
            with open(path) as f:
                rows += json.load(f)
    return rows


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def to_markdown(rows: List[Dict], date: str) -> str:
    lines = [
        f"### rlvr-kernels distributed bench — {date}, gloo on CPU",
        "",
        "Collectives per call and bytes per rank (local contribution; received under ring "
        "algorithms) against the tensors a naive implementation would all-gather.",
        "",
        "| op | W | collectives (needed) | local | received | naive all-gather of | naive received | ratio |",
        "|---|---:|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        ratio = r["received_bytes"] / r["naive_received_bytes"] if r["naive_received_bytes"] else float("nan")
        lines.append(
            f"| {r['op']} | {r['world']} | {r['collectives']} ({r['needed']}): {', '.join(r['names'])} "
            f"| {_bytes(r['local_bytes'])} | {_bytes(r['received_bytes'])} | {r['naive']} "
            f"| {_bytes(r['naive_received_bytes'])} | {ratio:.3g}× |"
        )
    return "\n".join(lines) + "\n"


def main(out_dir: str = os.path.join("benchmarks", "results")) -> int:
    rows = measure()
    date = datetime.date.today().isoformat()
    md = to_markdown(rows, date)
    print(md)
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{date}-cpu-distributed")
    with open(stem + ".json", "w") as f:
        json.dump(dict(date=date, backend="gloo", rows=rows), f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(f"results: {stem}.json, {stem}.md")
    return 0
