"""One training step of AReaL 1.0.4's own FSDP engine, stock vs ``integrations.areal.apply()``.

The step is the actor update of one minibatch that is one micro-batch: AReaL's
``FSDPEngine.train_batch`` (zero_grad; the micro-batch packed; ``forward_backward_batch``: the
model, ``_compute_logprobs_and_loss`` with ``gather_logprobs_entropy`` of the logits, AReaL's
``grpo_loss_fn`` bound with ``functools.partial`` as ``PPOActor._ppo_update`` binds it, the
loss scaled by ``loss_weight_fn``, backward; ``optimizer_step``: gradient clipping and AdamW, at
lr 0 so that every row and round sees the same weights). The engine runs as
:mod:`rlvr_kernels.testing.areal_engine` builds it (AReaL's CPU platform, a world-size-1 gloo
group, FSDP2 over a one-rank mesh). Model and sizes are those of the GRPOTrainer step
(:mod:`.trainer`): a config-built Qwen2, vocab 32k, hidden 512, 2 layers, 8 responses of up to
256 tokens after prompts of up to 64 (``quick``: a smoke-test size), fp32. The loss: decoupled
PPO (clip 0.2 / 0.28) against proximal log-probs from AReaL's ``forward_batch`` of the same
weights plus noise, behaviour log-probs off those, token-level rejection sampling (ratio in
[0.5, 2]), one advantage per response.

Rows: AReaL stock (its logits path; ``gather_logprobs_entropy`` is ``torch.compile``-d by AReaL,
compiled in the warm-up); applied (the logit-free step with only the loss-mask rows through the
head, its gradient formed in the forward, and the fused loss); applied with
``grad_in_forward=False`` (those rows through ``linear_logprobs`` and its backward); applied with
``loss_rows_only=False`` (every packed row through the
head, as AReaL); applied with ``logit_free=False`` (AReaL's logits, the fused
``gather_logprobs_entropy`` and loss). Peak memory: each row in a fresh
process, its second step (the first compiles AReaL's gather and creates AdamW's state).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any, Callable, Dict, Iterator, Tuple

import torch

from .timing import peak_extra_gb
from .trainer import (
    MEMORY_NOTE,
    floor_target,
    head_floor,
    model_note,
    qwen2_config,
    run_methods,
    shape,
    step_result,
    switch_to,
)

# key -> (label, apply() switches or None for stock)
METHODS: Dict[str, Tuple[str, Any]] = {
    "areal": ("AReaL 1.0.4 FSDPEngine.train_batch with grpo_loss_fn, stock", None),
    "fused": ("train_batch after rlvr_kernels.integrations.areal.apply() (logit-free, loss rows)", {}),
    "fused_backward": (
        "apply(grad_in_forward=False): the loss rows through linear_logprobs and its backward",
        {"grad_in_forward": False},
    ),
    "fused_all_rows": ("apply(loss_rows_only=False): every packed row through the head", {"loss_rows_only": False}),
    "fused_loss_only": (
        "apply(logit_free=False): AReaL's logits, the fused gathers and loss",
        {"logit_free": False},
    ),
}


@contextlib.contextmanager
def engine_session() -> Iterator[None]:
    """What the engine needs while it is built and runs: rank 0's environment and a
    world-size-1 process group; AReaL's actor module imported (its logging backends stubbed)."""
    from ..testing import areal_engine
    from ..testing.peers import import_areal_actor

    import_areal_actor()
    with areal_engine.single_process():
        yield


def build(device: str, quick: bool, seed: int = 0):
    """(engine, micro-batch): AReaL's engine on a config-built Qwen2 and one rollout with what
    ``grpo_loss_fn`` reads, as ``compute_advantages`` leaves it. Call inside :func:`engine_session`."""
    from areal.api.cli_args import OptimizerConfig

    from ..testing import areal_engine

    if device != "cpu":
        raise ValueError(f"device: the AReaL engine step runs on the CPU here, got {device!r}")
    s = shape(quick)
    path = areal_engine.save_model(qwen2_config(s), seed=seed)
    optimizer = OptimizerConfig(lr=0.0, warmup_steps_proportion=0.0, lr_scheduler_type="constant")
    engine = areal_engine.build_engine(areal_engine.engine_config(path, optimizer=optimizer))
    data = areal_engine.rollout_batch(s["V"], B=s["B"], P=s["P"], C=s["C"], seed=seed)
    mask = torch.roll(data["loss_mask"], shifts=-1, dims=-1)  # compute_advantages' shift
    prox = engine.forward_batch(copy.deepcopy(data))  # AReaL's compute_logp of these weights
    g = torch.Generator().manual_seed(seed + 1)
    prox = torch.where(mask.bool(), prox + 0.1 * torch.randn(prox.shape, generator=g), 0.0)
    behave = torch.where(mask.bool(), prox + 0.2 * torch.randn(prox.shape, generator=g), 0.0)
    adv = torch.randn(s["B"], 1, generator=g).expand_as(prox) * mask
    data.update(loss_mask=mask, prox_logp=prox, logprobs=behave, advantages=adv.contiguous())
    return engine, data


def step_fn(engine, data) -> Callable[[], float]:
    """One ``train_batch`` with AReaL's ``grpo_loss_fn`` bound as ``PPOActor._ppo_update`` binds
    it (a ``functools.partial``; its module's losses are the fused ones when applied); returns
    the mean per-token actor loss AReaL logs."""
    from areal.api.cli_args import RejectionSamplingConfig
    from areal.trainer.ppo import actor
    from areal.utils import stats_tracker

    loss_fn = functools.partial(
        actor.grpo_loss_fn,
        eps_clip=0.2,
        eps_clip_higher=0.28,
        c_clip=None,
        rejection_sampling=RejectionSamplingConfig(upper=2.0, lower=0.5),
        use_decoupled_loss=True,
    )

    def step():
        engine.train_batch(copy.copy(data), loss_fn=loss_fn, loss_weight_fn=lambda x: x["loss_mask"].count_nonzero())
        return stats_tracker.export_all()["actor_loss/avg"]  # and reset, as AReaL's trainer does each step

    return step


def _switch(key: str) -> None:
    from ..integrations import areal as rk_areal

    switch_to(METHODS[key][1], rk_areal.apply, rk_areal.unapply)


def measure_memory(key: str, device: str, quick: bool) -> Dict:
    """Peak extra memory of the second step of ``key`` (a fresh process, see ``memory_rows``)."""
    with engine_session():
        _switch(key)
        step = step_fn(*build(device, quick))
        step()
        return {"extra_gb": peak_extra_gb(step, device)}


def workload(device: str, quick: bool = False) -> Dict:
    from ..integrations import areal as rk_areal

    s = shape(quick)
    was_applied = rk_areal.applied_options()

    def restore():
        rk_areal.unapply()
        if was_applied:
            rk_areal.apply(**was_applied)

    with engine_session():
        engine, data = build(device, quick)
        make_step = functools.partial(step_fn, engine, data)
        rows, losses, rounds = run_methods(METHODS, _switch, make_step, restore, device, quick, __name__)
        try:  # the applied step with the head's gradient formed in the forward (auto: at these sizes)
            switch_to({"grad_in_forward": True}, rk_areal.apply, rk_areal.unapply)
            floor = head_floor(make_step(), device, quick)
        finally:
            restore()
    step = (
        f"{s['B']} responses of up to {s['C']} tokens after prompts of up to {s['P']} (one packed micro-batch); "
        "decoupled PPO with token rejection sampling, fp32; one step = AReaL's train_batch: forward, log-probs, "
        f"grpo_loss_fn, backward, gradient clipping + AdamW step (lr 0: same weights every round); median of "
        f"{rounds} interleaved rounds"
    )
    notes = [model_note(s) + step, MEMORY_NOTE + " (the second step: after the compile and AdamW's state)"]
    title = f"one AReaL FSDP engine training step (train_batch), V={s['V']}, H={s['H']}, B={s['B']}, responses"
    result = step_result(title, quick, rows, losses, notes, stock="areal")
    bound, note = floor_target(floor, next(r["ms"] for r in rows if r["key"] == "areal"))
    result["targets"].append(bound)
    result["notes"].insert(-1, note)
    return result


WORKLOADS: Dict[str, Callable] = {"areal_engine_step": workload}
