"""The AsyncGRPOTrainer part of ``integrations.trl.apply()`` (TRL 1.16's experimental
``trl.experimental.async_grpo``).

:func:`async_targets` declares what it replaces, as
:class:`~rlvr_kernels.integrations._patch.Target` entries for the caller's ``Patcher`` (so
``unapply()`` puts every original back, the identical objects):

- ``TreeRow`` in ``async_grpo_trainer`` and ``packing`` (the names TRL's planners
  ``TokenBudgetBatcher`` / ``FixedCountBatcher`` and its collator ``DataCollatorForRollout``
  read) -> :class:`TreeRow`, the package's C++ prefix trie
  (:class:`~rlvr_kernels.packing.TreeRowBuilder`) under TRL's interface: the same packed
  micro-batches, built in C++.
- TRL's tree attention, FA3 from the Hub (``kernels-community/flash-attn3``) and so CUDA
  only, -> :func:`tree_attention`, the package's tree attention. The attention name the
  trainer loads the model with (``packing.TREE_ATTENTION``, ``"tree_fa3"``) stays; what it
  resolves to in ``transformers``' ``AttentionInterface`` and ``AttentionMaskInterface``
  registries becomes ours (restored exactly on unapply: TRL's entry, or no entry if there
  was none), and TRL's ``register_tree_attention`` (called by the trainer's ``__init__``,
  which would re-register FA3) and ``packing.tree_attention`` become ours too.
  The path is chosen per call from the tensors, since one registered name serves every
  device: on CUDA with ``flash_attn`` importable and fp16/bf16 attention, ``rk_tree_varlen``
  (TRL's own gathered-K/V algorithm on flash-attn's varlen kernel); on CUDA otherwise,
  ``rk_tree_flex`` (compiled FlexAttention, forward and backward); elsewhere (CPU),
  ``rk_tree_sdpa`` (SDPA under the tree mask, with a backward, so the trainer trains on
  CPU). Like TRL's FA3 call, attention dropout is not applied (TRL passes none to FA3).
- ``get_peak_flops_per_device`` as the trainer module holds it (the MFU probe its
  ``__init__`` calls, which asks ``torch.cuda.get_device_name`` and so cannot build the
  trainer on a CPU-only torch) -> the same probe on CUDA, None (MFU metrics off, as TRL
  does for an unknown device) elsewhere: with the rest, the trainer builds and trains on CPU.
- ``create_model_from_path`` and ``add_fused_lm_head`` as the trainer module holds them ->
  the same calls, with hybrid models admitted: the tree check of
  ``rlvr_kernels.packing.hf`` (raising, naming the layer, for what cannot run on a tree)
  and Qwen3.5 / Qwen3-Next's Gated DeltaNet layers routed through the tree recurrence
  (``rlvr_kernels.packing.linear``), which reads the tree from TRL's keywords, so the
  trainer trains these models packed where TRL 1.16's ``__init__`` refuses them (see
  :func:`_make_create_model` for how its refusal is passed).
- with ``loss=True``, ``AsyncGRPOTrainer.compute_loss`` -> the same forward (TRL's fused LM
  head, whatever ``apply()`` put there) with the clipped surrogate as one fused
  :func:`~rlvr_kernels.policy_loss` call (``loss_type="ppo"``, TRL's clamps, no δ clamp,
  ``token-mean`` over TRL's ``global_n_tokens / world_size``, then TRL's
  gradient-accumulation divisor) and TRL's metric set with TRL's reductions (ratio, kl,
  entropy, clip_ratio/low_mean, high_mean, region_mean, per-completion low_min / high_max,
  aux_loss), and the same per-step accounting. The async trainer's only loss options are
  ``epsilon`` / ``epsilon_high`` and the MoE router loss: an ε outside what the op takes
  (a negative one) is unsupported: ``strict=True`` raises naming it, ``strict=False`` warns
  once and runs TRL's own ``compute_loss``.

Every patched entry point counts its calls (``record``) under ``trl.async_grpo.*``.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..._core import dispatch as _dispatch
from ...ops.policy_loss import policy_loss
from ...options import resolve_policy_loss_options
from ...packing import TreeRowBuilder
from ...packing.attention import ATTENTION_FUNCTIONS, FLEX, SDPA, VARLEN, _flash_dtype
from ...packing.hf import check_tree_model, enable_tree_linear_layers
from .._backend import current_backend
from .._patch import Build, Patcher, PatchError, Target, record

__all__ = ["TreeRow", "async_targets", "register_tree_attention", "tree_attention", "tree_attention_path"]

TRAINER_MODULE = "trl.experimental.async_grpo.async_grpo_trainer"
PACKING_MODULE = "trl.experimental.async_grpo.packing"


# ----------------------------------------------------------------------------- TreeRow


class TreeRow(TreeRowBuilder):
    """TRL's ``TreeRow()`` (no arguments) on the C++ trie; counts rows and packs."""

    def __init__(self):
        record("trl.async_grpo.TreeRow")
        super().__init__()

    def pack(self) -> Dict[str, torch.Tensor]:
        record("trl.async_grpo.TreeRow.pack")
        return super().pack()


# ----------------------------------------------------------------------------- attention


@functools.lru_cache(maxsize=None)
def _flash_attn_available() -> bool:
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except ImportError:
        return False
    return True


def tree_attention_path(query: torch.Tensor, module: Any = None) -> str:
    """The package's attention path for this call: ``rk_tree_varlen`` on CUDA with flash-attn
    and a half-precision attention dtype, ``rk_tree_flex`` on CUDA otherwise, ``rk_tree_sdpa``
    on any other device."""
    if query.device.type != "cuda":
        return SDPA
    if _flash_attn_available() and _flash_dtype(query, module) in (torch.float16, torch.bfloat16):
        return VARLEN
    return FLEX


def tree_attention(module, query, key, value, attention_mask, *, dropout: float = 0.0, **kwargs):
    """TRL's ``packing.tree_attention`` signature (``tree_kv_index``, ``tree_cu_seqlens_q``,
    ``tree_cu_seqlens_k``, ``tree_max_seqlen_q``, ``tree_max_seqlen_k``, ``scaling``,
    ``sliding_window``, ``softcap`` as keywords) on the package's tree attention. ``dropout``
    is dropped, as TRL's FA3 call does."""
    path = tree_attention_path(query, module)
    record("trl.async_grpo.tree_attention")
    record(f"trl.async_grpo.tree_attention[{path}]")
    return ATTENTION_FUNCTIONS[path](module, query, key, value, attention_mask, **kwargs)


def _no_mask(**kwargs):
    """The mask function of the attention name: the tree attention builds its own visibility."""
    return None


def register_tree_attention() -> None:
    """TRL's ``packing.register_tree_attention()``, registering ours under TRL's name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    record("trl.async_grpo.register_tree_attention")
    name = Patcher.resolve(PACKING_MODULE).TREE_ATTENTION
    AttentionInterface.register(name, tree_attention)
    AttentionMaskInterface.register(name, _no_mask)


# ----------------------------------------------------------------------------- MFU probe


def _make_peak_flops(original):
    def get_peak_flops_per_device(accelerator, dtype):
        record("trl.async_grpo.get_peak_flops_per_device")
        if accelerator.device.type != "cuda":
            return None  # TRL's own answer for a device it has no peak for; its probe is CUDA-only
        return original(accelerator, dtype)

    get_peak_flops_per_device.__wrapped__ = original
    return get_peak_flops_per_device


# ----------------------------------------------------------------------------- hybrid models


def _make_create_model(original):
    """TRL's ``create_model_from_path`` (the trainer's only way to its model), then the tree
    check of ``rlvr_kernels.packing.hf`` (which raises, naming the layer, for any kind that
    cannot run on a tree) and the Gated DeltaNet layers routed through the tree recurrence,
    guarded under TRL's attention name. TRL's own check, next in its ``__init__``, refuses
    every layer kind beyond full and sliding attention: for a model with routed layers it is
    shown the attention kinds only (``linear_attention`` read as ``full_attention``), and the
    true list is put back by the next call of ``__init__`` (``add_fused_lm_head``), before
    anything else reads it."""

    def create_model_from_path(model_id, *args, **kwargs):
        model = original(model_id, *args, **kwargs)
        record("trl.async_grpo.create_model_from_path")
        linear = check_tree_model(model)
        if linear:
            name = Patcher.resolve(PACKING_MODULE).TREE_ATTENTION
            enable_tree_linear_layers(model, linear, attention_names=(name,))
            text = model.config.get_text_config()
            setattr(model, _TRUE_LAYER_TYPES, list(text.layer_types))
            text.layer_types = [t if t != "linear_attention" else "full_attention" for t in text.layer_types]
        return model

    create_model_from_path.__wrapped__ = original
    return create_model_from_path


_TRUE_LAYER_TYPES = "_rk_tree_layer_types"


def _make_add_fused_lm_head(original):
    def add_fused_lm_head(model, *args, **kwargs):
        true = model.__dict__.pop(_TRUE_LAYER_TYPES, None)
        if true is not None:
            model.config.get_text_config().layer_types = true
        return original(model, *args, **kwargs)

    add_fused_lm_head.__wrapped__ = original
    return add_fused_lm_head


# ----------------------------------------------------------------------------- compute_loss


def unsupported_option(trainer) -> Optional[Tuple[str, str]]:
    """(TRL option name, why) of the first of the trainer's loss options the fused path does
    not take, or None."""
    for option, eps in (("epsilon", trainer.epsilon_low), ("epsilon_high", trainer.epsilon_high)):
        if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            return option, f"{option}={eps!r}: the fused loss takes a finite clip range >= 0"
    return None


@functools.lru_cache(maxsize=64)
def _loss_options(epsilon_low: float, epsilon_high: float):
    # TRL clamps the ratio to [1 - ε_low, 1 + ε_high] with no δ clamp and no dual clip. A
    # lower bound <= 0 never binds (the ratio is >= 0), so ε_low > 1 is ε_low = 1, the op's
    # largest.
    return resolve_policy_loss_options(
        "trl", loss_type="ppo", clip_low=min(float(epsilon_low), 1.0), clip_high=float(epsilon_high), agg="token-mean"
    )


def _make_compute_loss(original, strict: bool):
    warned = set()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        bad = unsupported_option(self)
        if bad is not None:
            option, why = bad
            message = f"rlvr_kernels.integrations.trl.apply(): AsyncGRPOTrainer.compute_loss: {why}"
            if strict:
                raise NotImplementedError(message + "; pass strict=False to run TRL's own compute_loss for it")
            if option not in warned:
                warned.add(option)
                warnings.warn(message + "; running TRL's own compute_loss (strict=False)", RuntimeWarning, stacklevel=2)
            record("trl.async_grpo.compute_loss[trl]")
            return original(self, model, inputs, return_outputs, num_items_in_batch)
        record("trl.async_grpo.compute_loss")
        return _fused_compute_loss(self, model, inputs)

    compute_loss.__doc__ = "AsyncGRPOTrainer.compute_loss on rlvr_kernels.policy_loss (integrations.trl.apply())."
    compute_loss.__wrapped__ = original
    return compute_loss


def _fused_compute_loss(self, model, inputs):
    """TRL 1.16's ``AsyncGRPOTrainer.compute_loss`` with the loss as one ``policy_loss`` call.
    The unpacking, forward, metrics and accounting are TRL's, statement for statement."""
    mask_bool = inputs["attention_mask"].bool()
    selected = inputs["token_index"] >= 0
    input_ids = inputs["input_ids"][mask_bool].unsqueeze(0)
    position_ids = inputs["position_ids"][mask_bool].unsqueeze(0)
    shift_labels = inputs["shift_labels"][mask_bool].unsqueeze(0)
    token_index = inputs["token_index"][selected]
    old_log_probs = inputs["old_log_probs"][selected]
    advantages = inputs["advantages"][selected]
    segment_id = inputs["segment_id"][selected]
    tree_kwargs = {
        key: inputs[key][inputs[key] >= 0] for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")
    }
    tree_kwargs["tree_max_seqlen_q"], tree_kwargs["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()

    forward_start = time.time()
    router_kwargs = {"output_router_logits": True} if self.aux_loss_enabled else {}
    outputs = model(
        input_ids=input_ids,
        position_ids=position_ids,
        shift_labels=shift_labels,
        fused_lm_head=True,
        **router_kwargs,
        **tree_kwargs,
    )
    log_probs = outputs.log_probs.flatten()[token_index]
    entropy = outputs.entropy.flatten()[token_index]
    self._last_forward_time_s = time.time() - forward_start

    # TRL: Σ −min(r·A, clip(r)·A) / clamp(global_n_tokens / world_size, 1) / GA steps (the
    # all-reduce of DDP/FSDP then averages over ranks). One packed span: the loss is a token
    # sum, so the completions' boundaries do not enter it.
    global_n_tokens = inputs["global_n_tokens"][0]
    world_size = self.accelerator.num_processes
    tokens_per_rank = (global_n_tokens / world_size).clamp(min=1.0).to(torch.float32)
    cu_seqlens = torch.tensor([0, log_probs.shape[0]], dtype=torch.int64, device=log_probs.device)
    loss, _ = policy_loss(
        log_probs,
        old_log_probs,
        advantages,
        options=_loss_options(self.epsilon_low, self.epsilon_high),
        cu_seqlens=cu_seqlens,
        global_num_tokens=tokens_per_rank,
        validate=False,  # TRL checks nothing here; a NaN propagates as in its loss
        backend=current_backend(),
    )
    loss = loss / self.current_gradient_accumulation_steps
    if self.aux_loss_enabled:
        aux_loss = outputs.aux_loss
        loss = loss + self.router_aux_loss_coef * aux_loss / self.current_gradient_accumulation_steps

    with torch.no_grad():
        _log_trl_metrics(self, log_probs.detach(), old_log_probs, advantages, entropy.detach(), segment_id)
        if self.aux_loss_enabled:
            gathered_aux = self.accelerator.reduce(aux_loss.detach().to(torch.float32), reduction="sum")
            self._metrics["train"]["aux_loss"].append((gathered_aux / world_size).item())

    n_forward_tokens = float(inputs["global_n_forward_tokens"][0])
    mean_seq_len = float(inputs["mean_seq_len"][0])
    self._step_forward_tokens += n_forward_tokens
    self._step_trained_tokens += float(global_n_tokens)
    self._step_seq_len_weighted += mean_seq_len * n_forward_tokens
    self._step_samples += n_forward_tokens / mean_seq_len
    self._step_forward_s += self._last_forward_time_s
    return loss


def _log_trl_metrics(self, log_probs, old_log_probs, advantages, entropy, segment_id) -> None:
    """TRL's metrics of the micro-batch, reduced across ranks as TRL does: one all-reduce of
    the token sums, one gather of the per-completion extrema. (Detached elementwise work on
    the trained tokens; the op's sums do not carry TRL's per-side clip counts.)"""
    from trl.trainer.utils import nanmax, nanmin

    log_ratio = log_probs - old_log_probs
    coef_1 = torch.exp(log_ratio)
    is_low_clipped = (coef_1 < 1 - self.epsilon_low) & (advantages < 0)
    is_high_clipped = (coef_1 > 1 + self.epsilon_high) & (advantages > 0)
    is_region_clipped = is_low_clipped | is_high_clipped
    ratio_sum = coef_1.sum()
    stats = torch.stack(
        [
            ratio_sum,
            ((coef_1 - 1) - log_ratio).sum(),  # approx KL, http://joschu.net/blog/kl-approx.html
            entropy.sum(),
            is_low_clipped.float().sum(),
            is_high_clipped.float().sum(),
            is_region_clipped.float().sum(),
            torch.full_like(ratio_sum, float(log_probs.numel())),
        ]
    )
    stats = self.accelerator.reduce(stats, reduction="sum")
    ratio, kl, ent, low, high, region, count = stats.unbind(0)
    metrics = self._metrics["train"]
    metrics["ratio"].append((ratio / count).item())
    metrics["kl"].append((kl / count).item())
    metrics["entropy"].append((ent / count).item())
    metrics["clip_ratio/low_mean"].append((low / count).item())
    metrics["clip_ratio/high_mean"].append((high / count).item())
    metrics["clip_ratio/region_mean"].append((region / count).item())

    # Per completion (segment_id) of this rank's row: its clipped fractions; NaN for one with
    # no trained token, which the nan-aware extrema skip. An empty row has none (TRL's
    # segment_id.max() would raise there).
    num_seq = int(segment_id.max()) + 1 if segment_id.numel() else 0
    seq_tokens = torch.zeros(num_seq, device=coef_1.device).index_add_(0, segment_id, torch.ones_like(coef_1))
    per_seq_low = torch.zeros(num_seq, device=coef_1.device).index_add_(0, segment_id, is_low_clipped.float())
    per_seq_high = torch.zeros(num_seq, device=coef_1.device).index_add_(0, segment_id, is_high_clipped.float())
    gathered_low_min = self.accelerator.gather(nanmin(per_seq_low / seq_tokens))
    gathered_high_max = self.accelerator.gather(nanmax(per_seq_high / seq_tokens))
    metrics["clip_ratio/low_min"].append(nanmin(gathered_low_min).item())
    metrics["clip_ratio/high_max"].append(nanmax(gathered_high_max).item())


# ----------------------------------------------------------------------------- install


def async_targets(*, strict: bool, loss: bool) -> List[Target]:
    """What apply() replaces in TRL's AsyncGRPOTrainer (see the module docstring). The
    attention registries are entries of ``transformers``' dicts (absent until TRL's FA3
    was registered: then added, and removed again on restore)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not _dispatch.load_extension():
        raise RuntimeError(
            "integrations.trl.apply(async_grpo=True): the tree builder needs the "
            "C++ kernels, which are not built (see `rlvr-kernels info`)"
        )
    name = Patcher.lookup(PACKING_MODULE, "TREE_ATTENTION")
    trainer_name = Patcher.lookup(TRAINER_MODULE, "TREE_ATTENTION")
    if trainer_name != name or not isinstance(name, str):
        raise PatchError(
            f"{TRAINER_MODULE}.TREE_ATTENTION ({trainer_name!r}) is not "
            f"{PACKING_MODULE}.TREE_ATTENTION ({name!r}): the peer changed how it names its tree attention"
        )
    targets = [
        Target(TRAINER_MODULE, "TreeRow", TreeRow),
        Target(PACKING_MODULE, "TreeRow", TreeRow),
        Target(PACKING_MODULE, "tree_attention", tree_attention),
        Target(PACKING_MODULE, "register_tree_attention", register_tree_attention),
        Target(TRAINER_MODULE, "register_tree_attention", register_tree_attention),
        Target(TRAINER_MODULE, "get_peak_flops_per_device", Build(_make_peak_flops)),
        Target(TRAINER_MODULE, "create_model_from_path", Build(_make_create_model)),
        Target(TRAINER_MODULE, "add_fused_lm_head", Build(_make_add_fused_lm_head)),
        Target(AttentionInterface._global_mapping, name, tree_attention, missing_ok=True),
        Target(AttentionMaskInterface._global_mapping, name, _no_mask, missing_ok=True),
    ]
    if loss:
        targets.append(
            Target(TRAINER_MODULE + ":AsyncGRPOTrainer", "compute_loss", Build(lambda o: _make_compute_loss(o, strict)))
        )
    return targets
