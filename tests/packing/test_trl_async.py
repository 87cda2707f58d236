"""TreeRowBuilder inside TRL 1.16's AsyncGRPO data path: its real planners and collator, with
``TreeRow`` swapped for the C++ builder, give the batches TRL gives on its own."""

from __future__ import annotations

import random
import warnings
from collections import defaultdict

import pytest
import torch

from rlvr_kernels.packing import TreeRowBuilder

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import trl.experimental.async_grpo.async_grpo_trainer as async_grpo

pytestmark = pytest.mark.cpu_kernel


def _stream(seed: int, n_groups: int = 12, group_size: int = 4):
    rng = random.Random(seed)
    system = [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
    out = []
    for g in range(n_groups):
        prompt = system + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        for _ in range(group_size):
            completion = [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            ids = prompt + completion
            mask = [0] * len(prompt) + [1] * len(completion)
            if rng.random() < 0.3:  # a tool turn inside the completion, untrained
                cut = rng.randrange(len(prompt), len(ids))
                mask[cut : cut + 2] = [0] * len(mask[cut : cut + 2])
            out.append(
                dict(
                    input_ids=torch.tensor(ids),
                    completion_mask=torch.tensor(mask),
                    old_log_probs=-torch.rand(len(ids)),
                    advantage=rng.uniform(-1, 1),
                    group_id=g,
                    metrics={"reward": rng.random()},
                )
            )
    rng.shuffle(out)  # groups arrive interleaved, as from an async rollout queue
    return out


def _batches(batcher_cls, samples, **kw):
    metrics = defaultdict(list)
    if batcher_cls is async_grpo.TokenBudgetBatcher:
        batcher = batcher_cls(samples, num_processes=2, token_budget=kw["budget"], metrics=metrics)
    else:
        batcher = batcher_cls(samples, num_processes=2, microbatch_size=kw["microbatch"])
    collator = async_grpo.DataCollatorForRollout(pad_token_id=0, num_processes=2, metrics=metrics)
    out = [collator.torch_call([rows]) for rows in batcher]
    return out, metrics


def _as_numpy(sample):
    """As TRL's rollout worker sends it (RolloutSample: numpy int64 / int64 / float32 arrays)."""
    out = dict(sample)
    for key, dtype in (("input_ids", "int64"), ("completion_mask", "int64"), ("old_log_probs", "float32")):
        out[key] = sample[key].numpy().astype(dtype)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("batcher", ["budget", "fixed"])
@pytest.mark.parametrize("arrays", ["torch", "numpy"])
def test_trl_planner_and_collator_with_our_builder(monkeypatch, seed, batcher, arrays):
    cls = async_grpo.TokenBudgetBatcher if batcher == "budget" else async_grpo.FixedCountBatcher
    kw = dict(budget=40 + 10 * seed, microbatch=8)
    samples = _stream(seed)
    if arrays == "numpy":
        samples = [_as_numpy(s) for s in samples]
    theirs, their_metrics = _batches(cls, samples, **kw)
    monkeypatch.setattr(async_grpo, "TreeRow", TreeRowBuilder)  # the README's one line
    ours, our_metrics = _batches(cls, samples, **kw)
    assert len(theirs) == len(ours) > 1
    for a, b in zip(theirs, ours):
        assert list(a) == list(b)
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert dict(their_metrics) == dict(our_metrics)
