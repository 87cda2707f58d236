"""verl 0.9's own FSDP engine (``FSDPEngineWithLMHead``) driven in one process, for the
integration tests and the verl training-step benchmark.

verl 0.9.1 has no CPU platform (its device lookups fall back to CUDA) and its worker
classes import the rollout server's packages, so the engine is built by its own
``__init__`` (which binds the entropy function, as on a GPU) with the engine module's two
device lookups pointed at ``device`` (:func:`device_patches`), no device mesh (world size
1), and the plain module and a plain optimizer instead of the FSDP-wrapped ones. Between
those, ``train_batch`` / ``infer_batch`` run verl's code: ``prepare_model_inputs``, the
model, ``prepare_model_outputs`` with ``logprobs_from_logits`` / ``entropy_from_logits``,
the loss, backward, ``optimizer_step``.

The batch helpers build what verl's trainer hands its worker: a left/right-padded rollout
batch (:func:`rollout_batch`), converted as ``ray_trainer`` does it (:func:`worker_batch`),
and the actor config the worker binds ``ppo_loss`` with (:func:`actor_config`).

Importing this module imports verl (not a dependency of rlvr_kernels): ``rlvr_kernels.testing``
does not import it; callers do, where verl is installed.
"""

from __future__ import annotations

import contextlib
import tempfile
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
from verl import DataProto
from verl.trainer.config import CheckpointConfig
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, PolicyLossConfig
from verl.workers.engine.fsdp import transformer_impl as ti
from verl.workers.utils.padding import left_right_2_no_padding


def _no_device_mesh(self) -> None:
    """What ``FSDPEngine._init_device_mesh`` sets at world size 1, without a mesh."""
    self.device_mesh = None
    self.ulysses_device_mesh = None
    self.ulysses_parallel_group = None
    self.ulysses_sequence_parallel_size = 1
    self.use_ulysses_sp = False


def device_patches(device: str = "cpu") -> List[Tuple[Any, str, Any]]:
    """The (object, attribute, value) settings that run the engine module on ``device``: its
    two device lookups and no device mesh. Set them with pytest's ``monkeypatch.setattr`` or
    :func:`engine_on`; they must hold while the engine runs (the steps look the device up)."""
    return [
        (ti.FSDPEngine, "_init_device_mesh", _no_device_mesh),
        (ti, "get_device_id", lambda: device),
        (ti, "get_device_name", lambda: device),
    ]


@contextlib.contextmanager
def engine_on(device: str = "cpu") -> Iterator[None]:
    """:func:`device_patches` set for the ``with`` block, the previous values restored after."""
    patches = device_patches(device)
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def build_engine(
    config_dir: str,
    module: torch.nn.Module,
    *,
    micro_batch_size: int,
    optimizer: Callable[[Any], torch.optim.Optimizer],
    torch_compile: bool = False,
    clip_grad: float = 1.0,
) -> "ti.FSDPEngineWithLMHead":
    """verl's ``FSDPEngineWithLMHead`` for the model whose config is saved in ``config_dir``,
    running ``module`` (fp32, train mode) with ``optimizer(module.parameters())``. Call it
    (and run the engine) while :func:`device_patches` are set."""
    mc = HFModelConfig(path=config_dir, load_tokenizer=False, use_remove_padding=True)
    ec = FSDPEngineConfig(
        strategy="fsdp2",
        use_torch_compile=torch_compile,
        micro_batch_size_per_gpu=micro_batch_size,
        use_dynamic_bsz=False,
    )
    engine = ti.FSDPEngineWithLMHead(mc, ec, FSDPOptimizerConfig(clip_grad=clip_grad), CheckpointConfig())
    engine.module = module
    engine.module.train()
    engine._autocast_dtype = torch.float32
    engine.optimizer = optimizer(engine.module.parameters())
    return engine


def saved_qwen2(
    *,
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    max_positions: int,
    head_scale: float,
    prefix: str = "rk-verl-qwen2-",
) -> str:
    """A config-built fp32 ``Qwen2ForCausalLM`` (seed 0, untied head scaled by ``head_scale``
    for peaked distributions) saved to a new temporary directory; its path."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen2ForCausalLM(cfg).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    d = tempfile.mkdtemp(prefix=prefix)
    model.save_pretrained(d)
    return d


def cpu_engine(
    monkeypatch, model_dir: str, *, micro_batch_size: int, model_cls=None, torch_compile: bool = False
) -> "ti.FSDPEngineWithLMHead":
    """:func:`build_engine` on the CPU for the model saved in ``model_dir`` (loaded as
    ``model_cls``, default ``Qwen2ForCausalLM``, fp32), :func:`device_patches` held by pytest's
    ``monkeypatch`` for the test. Plain SGD (lr 1): Adam's first steps are lr·g/(|g| + eps),
    which turns rounding-level differences of near-zero gradient elements into lr-sized
    parameter differences."""
    import transformers

    for obj, name, value in device_patches("cpu"):
        monkeypatch.setattr(obj, name, value)
    model_cls = model_cls or transformers.Qwen2ForCausalLM
    module = model_cls.from_pretrained(model_dir, torch_dtype=torch.float32)
    return build_engine(
        model_dir,
        module,
        micro_batch_size=micro_batch_size,
        optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
        torch_compile=torch_compile,
    )


def rollout_batch(
    *,
    vocab: int,
    batch: int,
    prompt: int,
    response: int,
    seed: int = 0,
    old_log_probs: Optional[torch.Tensor] = None,
) -> DataProto:
    """A left/right-padded rollout batch as verl's trainer holds it (prompts left-padded,
    responses right-padded, random lengths of at least one token, the first response full).
    Old log-probs: ``old_log_probs`` ([batch, response]) or random in [-3.05, -0.05]."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab, (batch, prompt), generator=g)
    resp = torch.randint(1, vocab, (batch, response), generator=g)
    plen = torch.randint(1, prompt + 1, (batch,), generator=g)
    rlen = torch.randint(1, response + 1, (batch,), generator=g)
    rlen[0] = response
    pm = (torch.arange(prompt)[None] >= prompt - plen[:, None]).long()
    rm = (torch.arange(response)[None] < rlen[:, None]).long()
    attn = torch.cat([pm, rm], 1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    old = -torch.rand(batch, response, generator=g) * 3 - 0.05
    if old_log_probs is not None:
        old = old_log_probs
    adv = (torch.randn(batch, 1, generator=g) * rm).float()
    tensors = dict(
        prompts=prompts,
        responses=resp,
        input_ids=torch.cat([prompts, resp], 1),
        attention_mask=attn,
        position_ids=pos,
        response_mask=rm,
        old_log_probs=old,
        advantages=adv,
        ref_log_prob=old + 0.3 * torch.randn(batch, response, generator=g),
        rollout_is_weights=torch.rand(batch, response, generator=g) * 2,
    )
    return DataProto.from_dict(tensors=tensors)


def worker_batch(
    batch: DataProto,
    *,
    micro_batch_size: int,
    entropy: bool,
    fused_kernels: bool = False,
    train: bool = True,
    is_weights: bool = False,
):
    """verl's trainer → worker conversion (ray_trainer._update_actor / _compute_old_log_prob):
    to_tensordict, left_right_2_no_padding, the non-tensor settings the worker injects."""
    batch = DataProto.from_dict(tensors={k: v.clone() for k, v in batch.batch.items()})
    if not is_weights:
        batch.batch.pop("rollout_is_weights")
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(
        td,
        calculate_entropy=entropy,
        use_remove_padding=True,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro_batch_size,
        use_fused_kernels=fused_kernels,
        temperature=1.0,
        global_batch_size=len(batch),
        compute_loss=train,
    )
    return td


def actor_config(
    loss_mode: str = "vanilla", *, batch_size: int, micro_batch_size: int, **overrides: Any
) -> FSDPActorConfig:
    """The actor config (``loss_mode``, verl's defaults otherwise: token-mean, clip 0.2, no
    entropy or KL term) for one mini-batch of ``batch_size`` responses; ``overrides`` set
    other fields."""
    fields = dict(
        strategy="fsdp2",
        rollout_n=1,
        ppo_mini_batch_size=batch_size,
        ppo_micro_batch_size_per_gpu=micro_batch_size,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
    )
    fields.update(overrides)
    return FSDPActorConfig(**fields)
