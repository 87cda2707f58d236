"""AReaL 1.0.4's own FSDP engine (``areal.engine.fsdp_engine.FSDPEngine`` and its PPO actor
``FSDPPPOActor``) driven in one process on the CPU, for the integration tests and the AReaL
training-step benchmark.

AReaL has a CPU platform (``areal/infra/platforms/cpu.py``), so the engine runs its own code
end to end: ``create_process_group`` on a world-size-1 gloo group, ``initialize`` (the model
from a saved checkpoint, FSDP2 ``fully_shard`` over a one-rank mesh, AReaL's optimizer), then
``train_batch`` / ``forward_batch`` (micro-batch packing, the model, ``gather_logprobs_entropy``,
the loss, backward, the optimizer step). The model is a config-built Qwen2 saved with a
word-level tokenizer (no download), attention ``sdpa`` (flash-attn has no CPU build).

The batch helper builds what AReaL's rollout hands the actor: right-padded prompt + response
rows with ``attention_mask``, ``loss_mask`` (the response tokens), the behaviour ``logprobs``
and a reward per row (:func:`rollout_batch`).

Importing this module imports AReaL (not a dependency of rlvr_kernels): ``rlvr_kernels.testing``
does not import it; callers do, where AReaL is installed.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Dict, Iterator

import torch

from .dist import single_process_group

ENV = {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}


def save_model(config, seed: int = 0, head_scale: float = 1.0) -> str:
    """A directory holding a Qwen2 built from ``config`` (fp32, ``lm_head`` scaled by
    ``head_scale``) and a word-level tokenizer of its vocabulary (AReaL loads both)."""
    import transformers
    from tokenizers import Tokenizer, models

    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    path = tempfile.mkdtemp(prefix="rk-areal-")
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", pad_token="t0").save_pretrained(path)
    return path


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """The environment of rank 0 of a one-process job (AReaL reads ``LOCAL_RANK``) and a
    world-size-1 gloo group (:func:`rlvr_kernels.testing.dist.single_process_group`)."""
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    try:
        with single_process_group():
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def engine_config(path: str, *, actor: bool = False, **overrides):
    """AReaL's ``TrainEngineConfig`` (``PPOActorConfig`` with ``actor``) for the model at
    ``path``: fp32, sdpa attention, a fixed learning rate, and ``overrides``."""
    from areal.api.cli_args import OptimizerConfig, PPOActorConfig, TrainEngineConfig

    cls = PPOActorConfig if actor else TrainEngineConfig
    fields: Dict[str, Any] = dict(
        experiment_name="rlvr-kernels",
        trial_name="test",
        path=path,
        dtype="float32",
        attn_impl="sdpa",
        optimizer=OptimizerConfig(lr=1e-2, warmup_steps_proportion=0.0, lr_scheduler_type="constant"),
    )
    fields.update(overrides)
    return cls(**fields)


def build_engine(config, dataset_size: int = 8, batch_size: int = 4):
    """AReaL's ``FSDPEngine`` (``FSDPPPOActor`` for a ``PPOActorConfig``), process group
    created and initialised. Call it (and run the engine) inside :func:`single_process`."""
    from areal.api.alloc_mode import ParallelStrategy
    from areal.api.cli_args import PPOActorConfig
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPEngine, FSDPPPOActor

    engine = (FSDPPPOActor if isinstance(config, PPOActorConfig) else FSDPEngine)(config)
    engine.create_process_group(ParallelStrategy())
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=dataset_size, train_batch_size=batch_size))
    return engine


def rollout_batch(vocab: int, B: int, P: int, C: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """AReaL's rollout layout: B right-padded rows of a prompt of up to P tokens then a
    response of up to C (random lengths), ``loss_mask`` on the response tokens, behaviour
    ``logprobs`` (at each response token), a 0/1 ``rewards`` per row."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(max(P // 2, 1), P + 1, (B,), generator=g)
    resp = torch.randint(max(C // 4, 1), C + 1, (B,), generator=g)
    L = int((prompt + resp).max())
    pos = torch.arange(L)[None]
    attn = pos < (prompt + resp)[:, None]
    loss_mask = attn & (pos >= prompt[:, None])
    ids = torch.randint(2, vocab, (B, L), generator=g) * attn
    logprobs = torch.where(loss_mask, -2 * torch.rand(B, L, generator=g) - 0.5, 0.0)
    return dict(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=loss_mask.int(),
        logprobs=logprobs,
        rewards=(torch.rand(B, generator=g) > 0.5).float(),
    )
