"""Workers of tests/common/test_ddp_fsdp.py: a tiny transformer (transformers' Qwen2 from a
config: hidden 32, 2 layers, vocabulary 64, fp32, no download) trained for 3 SGD steps with
the fused ops on gloo CPU processes, wrapped in DDP or FSDP2 (``fully_shard``), against one
process on the full batch. (Here, not in the test file: a spawned process unpickles the
worker by module name.)

Each step: B = 12 sequences in 3 groups of 4, the group ids interleaved so every group is
split over the ranks; rewards -> ``group_advantages(process_group=pg)`` (global group ids);
log-probs of the response tokens from the model (hidden states + ``linear_logprobs`` with
the LM head weight, inside the wrapped module's forward so FSDP2 has unsharded it);
``policy_loss(process_group=pg)``; backward (DDP / FSDP2 average the gradients over ranks);
SGD. The reference is the same model, data and ops without a process group on the whole
batch, in every rank's own process."""

from __future__ import annotations

import itertools
from typing import Callable, Dict

import torch

from rlvr_kernels.testing.dist import gloo_process

B, G, L, P, V = 12, 4, 11, 3, 64  # sequences, group size, tokens (prompt P + response), vocabulary
STEPS = 3
LR = 0.5  # large enough that a wrong gradient scale moves the parameters visibly
# (loss_type, agg): PPO with clipping under the common aggregations, and GSPO's sequence ratios.
MODES = [
    ("ppo", "token-mean"),
    ("ppo", "seq-mean-token-mean"),
    ("ppo", "seq-mean-token-sum-norm"),
    ("gspo", "seq-mean-token-mean"),
]
RTOL = 1e-6


class _Policy(torch.nn.Module):
    """The causal LM's log-probs of the response tokens: hidden states of the backbone, then
    ``linear_logprobs`` with the LM head weight (never materialising the logits)."""

    def __init__(self, seed: int):
        super().__init__()
        from transformers import Qwen2ForCausalLM

        from rlvr_kernels.bench.trainer import qwen2_config  # the benchmark's config builder: hidden 32, 2 layers

        config = qwen2_config(dict(V=V, H=32, layers=2, P=P, C=L - P))
        torch.manual_seed(seed)
        lm = Qwen2ForCausalLM(config).float()
        with torch.no_grad():  # biases random too (HF zeroes them): a relative error of the
            for name, p in lm.named_parameters():  # parameter, not of its first few updates
                if name.endswith("bias"):
                    p.normal_(0.0, config.initializer_range)
        self.model, self.lm_head = lm.model, lm.lm_head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from rlvr_kernels import linear_logprobs

        hidden = self.model(input_ids=tokens).last_hidden_state[:, P - 1 : -1]  # predicts tokens[:, P:]
        targets = tokens[:, P:]
        logp = linear_logprobs(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight, targets.reshape(-1)).logp
        return logp.view(targets.shape)


def _batch(step: int) -> Dict[str, torch.Tensor]:
    """The step's global batch, the same on every rank: tokens, a response mask with uneven
    lengths (one response empty), group ids interleaved (rows 0, 3, 6, 9 form group 0, ...),
    binary rewards, and old log-prob offsets (so that PPO's clip is active)."""
    gen = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(1, L - P + 1, (B,), generator=gen)
    lengths[5] = 0
    return dict(
        tokens=torch.randint(0, V, (B, L), generator=gen),
        mask=torch.arange(L - P)[None, :] < lengths[:, None],
        group_index=torch.arange(B) % (B // G),
        rewards=(torch.rand(B, generator=gen) < 0.5).float(),
        old_shift=0.3 * torch.randn(B, L - P, generator=gen),
    )


def _step(policy, opt, batch: Dict, loss_type: str, agg: str, pg) -> float:
    """One SGD step; returns the fraction of tokens where the clipped branch was active."""
    from rlvr_kernels import group_advantages, policy_loss

    adv = group_advantages(batch["rewards"], batch["group_index"], num_groups=B // G, process_group=pg).advantages
    logp = policy(batch["tokens"])
    old = logp.detach() + batch["old_shift"]
    loss, metrics = policy_loss(
        logp, old, adv, batch["mask"], preset="verl", loss_type=loss_type, agg=agg, process_group=pg
    )
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(metrics.pg_clipfrac)


def _full(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (an FSDP2 DTensor shard is gathered)."""
    p = p.detach()
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _wrap_ddp(policy):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(policy)


def _wrap_fsdp2(policy):
    from torch.distributed.fsdp import fully_shard

    for layer in policy.model.layers:
        fully_shard(layer)
    policy = fully_shard(policy)  # the root: embeddings, final norm, LM head
    from torch.distributed.tensor import DTensor

    assert all(isinstance(p, DTensor) for p in policy.parameters()), "fully_shard left a parameter unsharded"
    return policy


WRAPPERS: Dict[str, Callable] = {"ddp": _wrap_ddp, "fsdp2": _wrap_fsdp2}


def train_worker(rank: int, world: int, port: int, wrapper: str) -> None:
    """For each mode of MODES: 3 steps wrapped (this rank's rows of the step's batch) and 3
    steps single-process (the whole batch), the clip active; after every step each parameter must agree,
    max |p − p_ref| ≤ RTOL · max |p_ref| per tensor; and the 3 steps must have moved every
    parameter by at least 100 · RTOL (relative), so a lost or mis-scaled gradient cannot
    hide under the tolerance."""
    with gloo_process(rank, world, port) as pg:
        rows = torch.arange(rank, B, world)  # rank r gets every world-th row: each group is split
        worst = 0.0
        for (loss_type, agg), seed in zip(MODES, itertools.count()):
            ref = _Policy(seed)
            init = {name: p.detach().clone() for name, p in ref.named_parameters()}
            dp = WRAPPERS[wrapper](_Policy(seed))
            ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
            dp_opt = torch.optim.SGD(dp.parameters(), lr=LR)
            clipped = 0.0
            for step in range(STEPS):
                batch = _batch(step)
                clipped += _step(ref, ref_opt, batch, loss_type, agg, None)
                _step(dp, dp_opt, {k: v[rows] for k, v in batch.items()}, loss_type, agg, pg)
                ref_params = dict(ref.named_parameters())
                for name, p in dp.named_parameters():
                    name = name.removeprefix("module.")
                    want, got = ref_params[name].detach(), _full(p)
                    err = float((got - want).abs().max() / want.abs().max())
                    worst = max(worst, err)
                    what = f"{wrapper} rank {rank} {loss_type} {agg} step {step} {name}"
                    assert err <= RTOL, f"{what}: relative error {err:.3g} > {RTOL}"
            assert clipped > 0, f"{loss_type} {agg}: the clip was never active"
            for name, p in ref.named_parameters():
                moved = float((p.detach() - init[name]).abs().max() / p.detach().abs().max())
                assert moved >= 100 * RTOL, f"{wrapper} {loss_type} {agg}: {name} moved only {moved:.3g} (relative)"
        print(f"{wrapper} rank {rank}: max relative parameter error {worst:.3g}")
        # The wrapped module must die before the process group is destroyed: DDP's reducer
        # (and FSDP2's state) hold the last reference to the gloo group once it is out of
        # the registry, and its destructor then joins gloo's run-loop thread while holding
        # the GIL that thread waits for (a deadlock).
        del dp, dp_opt
