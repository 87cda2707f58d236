"""The worker of tests/policy_loss/test_peers_trl.py::test_entropy_threshold_across_processes,
in a module of its own: spawned processes import the worker by module name, and test modules
(pytest's importlib mode) are not importable by name. Everything it needs comes as arguments."""

import torch
import torch.distributed as dist

from rlvr_kernels.integrations.trl import grpo_loss_trl
from rlvr_kernels.integrations.trl.grpo_trainer import trl_entropy_threshold


def worker(rank, init_file, out_dir, how, batches, kw):
    """Rank ``rank`` of a 2-process gloo group: grpo_loss_trl on ``batches[rank]`` with the
    entropy threshold over both ranks (``process_group=`` or a precomputed
    ``entropy_threshold=``); saves the loss and gradients to ``out_dir/rank{rank}.pt``."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        batch = batches[rank]
        lp = batch["per_token_logps"].clone().requires_grad_(True)
        ent = batch["entropies"].clone().requires_grad_(True)
        extra = dict(process_group=dist.group.WORLD)
        if how == "threshold":  # the caller computes the threshold (one collective), the loss takes it
            thr = trl_entropy_threshold(ent, batch["completion_mask"], kw["top_entropy_quantile"], dist.group.WORLD)
            extra = dict(entropy_threshold=thr)
        loss, _ = grpo_loss_trl(
            lp,
            batch["old_per_token_logps"],
            batch["advantages"],
            batch["completion_mask"],
            ref_per_token_logps=batch["ref_per_token_logps"],
            entropies=ent,
            num_items_in_batch=batch["num_items"],
            num_processes=2,
            backend="cpu",
            **kw,
            **extra,
        )
        loss.backward()
        torch.save(dict(loss=loss.detach(), grad=lp.grad, grad_ent=ent.grad), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
