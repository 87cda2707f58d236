"""One training step of verl 0.9's own FSDP engine, stock vs ``integrations.verl.apply()``.

The step is the actor update of one mini-batch that is one micro-batch: verl's
``FSDPEngineWithLMHead.train_batch`` (zero_grad; ``forward_backward_batch``: verl's
``prepare_model_inputs``, the model forward on the unpadded tokens, ``prepare_model_outputs``
with ``logprobs_from_logits``, ``ppo_loss`` bound with ``functools.partial`` as verl's
worker binds it, backward; ``optimizer_step``: clip_grad_norm_ and AdamW.step, at lr 0 so
that every row and round sees the same weights). The engine runs in one process as
:mod:`rlvr_kernels.testing.verl_engine` builds it (verl has no CPU platform: its device
lookups pointed at the device, no device mesh, the plain module and optimizer). Model and
sizes are those of the GRPOTrainer step (:mod:`.trainer`): a config-built Qwen2, vocab 32k,
hidden 512, 2 layers, 8 responses of up to 256 tokens after prompts of up to 64 (``quick``:
a smoke-test size), fp32; loss_mode vanilla with verl's defaults (token-mean, clip 0.2, no
entropy or KL term). Old log-probs: verl's ``infer_batch`` of the same weights (its
compute_log_prob) plus noise, so that some ratios clip.

Rows: verl stock; applied (the engine's forward logit-free: the response rows' log-probs from
the hidden states and the LM head, the head's gradient formed in the forward, and the fused
ppo_loss); applied with ``grad_in_forward=False`` (the same rows through ``linear_logprobs`` and
its backward); applied with ``logit_free=False`` (verl's logits,
the log-prob drop-ins on them); applied with ``logprobs=False`` (verl's log-probs, the fused
loss). Peak memory: each row once in a fresh
process (its second step: the first also makes AdamW's state, the same in every row).
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
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
    "verl": ("verl 0.9 FSDPEngineWithLMHead.train_batch, stock", None),
    "fused": ("train_batch after rlvr_kernels.integrations.verl.apply() (logit-free engine forward)", {}),
    "fused_backward": (
        "apply(grad_in_forward=False): the loss rows through linear_logprobs and its backward",
        {"grad_in_forward": False},
    ),
    "fused_logits": (
        "apply(logit_free=False): the engine's logits, the log-prob drop-ins, the fused ppo_loss",
        {"logit_free": False},
    ),
    "fused_loss_only": ("apply(logprobs=False): verl's log-probs, the fused ppo_loss", {"logprobs": False}),
}


@contextlib.contextmanager
def engine_session(device: str) -> Iterator[None]:
    """What the engine needs while it is built and runs: a world-size-1 process group and the
    engine module's device lookups on ``device``."""
    from ..testing import verl_engine
    from ..testing.dist import single_process_group

    with single_process_group(), verl_engine.engine_on(device):
        yield


def build(device: str, quick: bool, seed: int = 0):
    """(engine, worker batch, actor config): verl's engine on a config-built Qwen2 and one
    mini-batch as the worker receives it (one micro-batch). Call inside :func:`engine_session`."""
    from transformers import Qwen2ForCausalLM
    from verl.workers.utils.padding import no_padding_2_padding

    from ..testing import verl_engine

    s = shape(quick)
    torch.manual_seed(seed)
    cfg = qwen2_config(s)
    config_dir = tempfile.mkdtemp(prefix="rlvr-bench-verl-")
    cfg.architectures = ["Qwen2ForCausalLM"]  # what a saved model's config names (verl asserts one)
    cfg.save_pretrained(config_dir)  # the engine reads the config from a path; the weights stay in memory
    engine = verl_engine.build_engine(
        config_dir,
        Qwen2ForCausalLM(cfg).to(device),
        micro_batch_size=s["B"],
        optimizer=lambda params: torch.optim.AdamW(params, lr=0.0),
    )
    sizes = dict(vocab=s["V"], batch=s["B"], prompt=s["P"], response=s["C"], seed=seed)
    rollout = verl_engine.rollout_batch(**sizes)
    td = verl_engine.worker_batch(rollout, micro_batch_size=s["B"], entropy=False, train=False)
    out = engine.infer_batch(td.to(device))  # verl's compute_log_prob of these weights
    logp = no_padding_2_padding(out["model_output"]["log_probs"], td).detach().cpu()
    g = torch.Generator().manual_seed(seed + 1)
    old = logp + 0.2 * torch.randn(logp.shape, generator=g)
    rollout = verl_engine.rollout_batch(**sizes, old_log_probs=old)
    td = verl_engine.worker_batch(rollout, micro_batch_size=s["B"], entropy=False).to(device)
    config = verl_engine.actor_config("vanilla", batch_size=s["B"], micro_batch_size=s["B"])
    return engine, td, config


def step_fn(engine, td, config) -> Callable[[], float]:
    """One ``train_batch`` with ``ppo_loss`` bound now (as verl's worker binds it: the patched
    one when applied); returns the loss."""
    from verl.workers.utils import losses as verl_losses

    loss_fn = functools.partial(verl_losses.ppo_loss, config=config)

    def step():
        out = engine.train_batch(td, loss_function=loss_fn)
        loss = out["loss"]
        return float(sum(loss) if isinstance(loss, (list, tuple)) else loss)

    return step


def _switch(key: str) -> None:
    from ..integrations import verl as rk_verl

    switch_to(METHODS[key][1], rk_verl.apply, rk_verl.unapply)


def measure_memory(key: str, device: str, quick: bool) -> Dict:
    """Peak extra memory of the second step of ``key`` (a fresh process, see ``memory_rows``): a
    training step as every step after the first runs it (the first also creates AdamW's state,
    the same in every row)."""
    _switch(key)
    with engine_session(device):
        step = step_fn(*build(device, quick))
        step()
        return {"extra_gb": peak_extra_gb(step, device)}


def workload(device: str, quick: bool = False) -> Dict:
    from ..integrations import verl as rk_verl

    s = shape(quick)
    was_applied = rk_verl.is_applied()

    def restore():
        rk_verl.unapply()
        if was_applied:  # verl's apply() records no switches: applied again with its defaults
            rk_verl.apply()

    with engine_session(device):
        engine, td, config = build(device, quick)
        make_step = functools.partial(step_fn, engine, td, config)
        rows, losses, rounds = run_methods(METHODS, _switch, make_step, restore, device, quick, __name__)
        try:  # the applied step with the head's gradient formed in the forward (auto: at these sizes)
            switch_to({"grad_in_forward": True}, rk_verl.apply, rk_verl.unapply)
            floor = head_floor(make_step(), device, quick)
        finally:
            restore()
    step = (
        f"{s['B']} responses of up to {s['C']} tokens after prompts of up to {s['P']} (one micro-batch, unpadded); "
        "loss_mode vanilla, verl's defaults (token-mean), fp32; one step = verl's train_batch: forward, log-probs, "
        f"ppo_loss, backward, clip_grad_norm_ + AdamW step (lr 0: same weights every round); median of {rounds} "
        "interleaved rounds"
    )
    notes = [model_note(s) + step, MEMORY_NOTE + " (the second step: after AdamW's state is made)"]
    title = f"one verl FSDP engine training step (train_batch), V={s['V']}, H={s['H']}, B={s['B']}, responses"
    result = step_result(title, quick, rows, losses, notes, stock="verl")
    bound, note = floor_target(floor, next(r["ms"] for r in rows if r["key"] == "verl"))
    result["targets"].append(bound)
    result["notes"].insert(-1, note)
    return result


WORKLOADS: Dict[str, Callable] = {"verl_engine_step": workload}
