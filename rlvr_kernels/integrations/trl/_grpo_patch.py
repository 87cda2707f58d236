"""The ``GRPOTrainer`` parts of :func:`rlvr_kernels.integrations.trl.apply` (TRL 1.16).

Each part has a ``*_targets`` function returning the part's declared
:class:`~rlvr_kernels.integrations._patch.Target` entries ``(owner, attr, replacement)``
(a :class:`~rlvr_kernels.integrations._patch.Build` when the replacement is made from the
original); apply() hands them to its ``Integration``, which looks up every name and builds
every replacement before anything is changed.

* log-probs: ``trl.trainer.utils._ChunkedLogProbFunction`` (the module global TRL's fused
  LM-head forward reads at call time) becomes :class:`..kernels.ChunkedLogProbFunction`
  (``linear_logprobs``); ``trl.trainer.utils._use_triton`` is wrapped so the fused forward
  scores only the valid (completion) positions on the CPU too (TRL's "compact" path, which
  it uses on Triton devices only because other devices would recompile on every shape):
  the per-row results are the same, the prompt and padding rows are not computed.
* advantages: TRL computes them inline in ``_generate_and_score_completions``. The method's
  source is read at apply() time and its advantage block (the ``if
  self.multi_objective_aggregation == "sum_then_normalize": ... else: raise`` statement) is
  replaced by one line calling :func:`compute_grpo_advantages`; the rest of the method is
  TRL's own text, compiled in TRL's module namespace (so it reads TRL's globals). The block
  is identified by its AST, which must hash to the one of TRL 1.16.0 (:data:`ADV_BLOCK_SHA256`),
  and the names the block defines that the rest of the method reads must be only
  ``advantages`` and ``is_std_zero``: otherwise PatchError.
* loss: ``GRPOTrainer._compute_loss`` becomes :func:`_fused_compute_loss` (TRL's
  ``_get_per_token_logps_and_entropies``, then one :func:`grpo_loss_trl` call with the
  trainer's settings, then TRL's metric set with TRL's reductions). A setting the fused
  loss does not support raises with ``strict=True`` (at trainer init, naming the option);
  with ``strict=False`` it warns once and runs TRL's own ``_compute_loss`` for that trainer.
  ``GRPOTrainer.__init__`` is wrapped to run that check when the trainer is built.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import linecache
import math
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .._patch import Build, Needs, Patcher, PatchError, Target, record
from .grpo_trainer import compute_grpo_advantages, grpo_loss_trl, reduce_trl_metrics, trl_entropy_threshold
from .kernels import ChunkedLogProbFunction

TRL_GRPO = "trl.trainer.grpo_trainer"
TRL_UTILS = "trl.trainer.utils"
TRL_TRAINER = TRL_GRPO + ":GRPOTrainer"

# Stable names under which the patched entry points count their calls (``call_counts()``).
CALL_ADVANTAGES = "trl.GRPOTrainer.advantages"
CALL_LOSS = "trl.GRPOTrainer._compute_loss"
CALL_LOSS_FALLBACK = "trl.GRPOTrainer._compute_loss[trl fallback]"

# ---------------------------------------------------------------------------------------
# log-probs
# ---------------------------------------------------------------------------------------


def logprobs_targets(*, compact: bool = True) -> List[Target]:
    out = [Target(TRL_UTILS, "_ChunkedLogProbFunction", ChunkedLogProbFunction)]
    if compact:
        out.append(Target(TRL_UTILS, "_use_triton", Build(_compact_on_cpu)))
    return out


def _compact_on_cpu(original: Callable[[torch.device], bool]) -> Callable[[torch.device], bool]:
    """TRL's ``_use_triton`` (read by the fused forward only, to choose the compact path),
    also True on the CPU: there, shapes that change per batch cost nothing."""

    @functools.wraps(original)
    def _use_triton(device: torch.device) -> bool:
        return device.type == "cpu" or original(device)

    return _use_triton


# ---------------------------------------------------------------------------------------
# advantages: rewriting _generate_and_score_completions' advantage block
# ---------------------------------------------------------------------------------------

# sha256 of ast.dump() of TRL 1.16.0's advantage block (positions not included, so comments
# and formatting do not matter; any change of the code does).
ADV_BLOCK_SHA256 = "ffa228f26c8d334454e40e8cd2ea1172a0a27b81eb3dd6fa527124a99409bdc1"
# What the replacement line reads (each must be assigned before the block) and defines
# (the only names of the block the rest of the method may read).
_ADV_READS = ("self", "rewards_per_func", "num_generations", "device")
_ADV_DEFINES = ("advantages", "is_std_zero")
_ADV_CALL = "advantages, is_std_zero = _rlvr_grpo_advantages(self, rewards_per_func, num_generations, device)"
_PATCHED_FILENAME = "<rlvr_kernels: trl GRPOTrainer._generate_and_score_completions, advantage block replaced>"


def advantages_targets() -> List[Target]:
    def build(stored):
        return rewrite_generate_and_score(Patcher.resolve(TRL_TRAINER), stored, Patcher.resolve(TRL_GRPO))

    return [Target(TRL_TRAINER, "_generate_and_score_completions", Build(build))]


def _block_sha(node: ast.AST) -> str:
    return hashlib.sha256(ast.dump(node).encode()).hexdigest()


def _find_block(func_def: ast.FunctionDef) -> ast.If:
    found = [
        stmt
        for stmt in func_def.body
        if isinstance(stmt, ast.If)
        and isinstance(stmt.test, ast.Compare)
        and ast.unparse(stmt.test) == "self.multi_objective_aggregation == 'sum_then_normalize'"
    ]
    if len(found) != 1:
        raise PatchError(
            f"GRPOTrainer._generate_and_score_completions: expected one advantage block "
            f"(if self.multi_objective_aggregation == 'sum_then_normalize': ...), found {len(found)}; "
            "TRL changed the method (rlvr_kernels is tested with TRL 1.16)"
        )
    return found[0]


def _check_names(func_def: ast.FunctionDef, block: ast.If) -> None:
    """The replacement reads only names assigned before the block, and the block's other
    names are not read after it before being reassigned."""

    def names(nodes):
        return sorted(
            (n for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name)),
            key=lambda n: (n.lineno, n.col_offset),
        )

    before = [s for s in func_def.body if s.end_lineno < block.lineno]
    after = [s for s in func_def.body if s.lineno > block.end_lineno]
    stored_before = {n.id for n in names(before) if isinstance(n.ctx, ast.Store)}
    stored_before |= {a.arg for a in func_def.args.args}
    missing = [v for v in _ADV_READS if v not in stored_before]
    if missing:
        raise PatchError(
            f"GRPOTrainer._generate_and_score_completions: {missing} not defined before the advantage block"
        )
    defined = {n.id for n in names([block]) if isinstance(n.ctx, ast.Store)} - set(_ADV_DEFINES)
    seen = set()
    for n in names(after):
        if n.id in defined and n.id not in seen:
            seen.add(n.id)
            if not isinstance(n.ctx, ast.Store):
                raise PatchError(
                    f"GRPOTrainer._generate_and_score_completions reads {n.id!r} (line {n.lineno}) from the "
                    "advantage block, which the fused replacement does not define"
                )


def rewrite_generate_and_score(cls: type, stored: Any, module: Any) -> Callable:
    """TRL's ``_generate_and_score_completions`` with the advantage block replaced by
    ``advantages, is_std_zero = _rlvr_grpo_advantages(...)``; everything else is TRL's
    source text, compiled in TRL's module namespace, line numbers kept (the patched source
    is registered in ``linecache`` so tracebacks show it)."""
    func = inspect.unwrap(stored)
    try:
        lines, first = inspect.getsourcelines(func)
    except (OSError, TypeError) as e:
        raise PatchError(f"GRPOTrainer._generate_and_score_completions: source not readable ({e})") from e
    if stored is not func and not lines[0].lstrip().startswith("@"):
        # A decorator the source does not show could not be re-applied to the rebuilt method.
        raise PatchError("GRPOTrainer._generate_and_score_completions: decorated, and its source lacks the decorator")
    source = patched_source(lines, first, func.__name__)
    linecache.cache[_PATCHED_FILENAME] = (len(source), None, source.splitlines(True), _PATCHED_FILENAME)
    namespace: Dict[str, Any] = {}
    exec(compile(source, _PATCHED_FILENAME, "exec"), vars(module), namespace)
    new = namespace["_rlvr_factory"](cls, grpo_advantages)
    for f in {new, inspect.unwrap(new)}:
        f.__qualname__ = func.__qualname__
        f.__module__ = func.__module__
    return new


def patched_source(lines: List[str], first: int, name: str) -> str:
    """The source of a factory ``_rlvr_factory(__class__, _rlvr_grpo_advantages)`` returning
    the method whose source ``lines`` (from line ``first`` of its file) are given, with the
    advantage block replaced; PatchError when the block is missing, differs from TRL
    1.16.0's, or the rest of the method reads one of its other names."""
    indent = len(lines[0]) - len(lines[0].lstrip())
    tree = ast.parse("".join(line[indent:] if line.strip() else "\n" for line in lines))
    func_def = tree.body[0]
    if not isinstance(func_def, ast.FunctionDef) or func_def.name != name:
        raise PatchError(f"GRPOTrainer.{name}: unexpected source")
    block = _find_block(func_def)
    sha = _block_sha(block)
    if sha != ADV_BLOCK_SHA256:
        raise PatchError(
            f"GRPOTrainer.{name}: the advantage block differs from TRL 1.16.0's "
            f"(sha256 {sha[:12]}…); the fused replacement is only exact for that code"
        )
    _check_names(func_def, block)
    # Replace the block's lines (1-based within `lines`) by the call, then blank lines so
    # that the following lines keep TRL's line numbers.
    lo, hi = block.lineno - 1, block.end_lineno
    pad = " " * (indent + block.col_offset)
    new_lines = lines[:lo] + [pad + _ADV_CALL + "\n"] + ["\n"] * (hi - lo - 1) + lines[hi:]
    # A factory gives the method its `__class__` cell (zero-argument super()) and the helper
    # as a closure variable: TRL's module namespace is read, never written.
    header = "def _rlvr_factory(__class__, _rlvr_grpo_advantages):\n"
    body = "".join(" " * max(0, 4 - indent) + line if line.strip() else "\n" for line in new_lines)
    return "\n" * max(0, first - 2) + header + body + f"    return {name}\n"


def grpo_advantages(
    trainer: Any, rewards_per_func: torch.Tensor, num_generations: int, device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """What TRL's advantage block leaves for the rest of the method: ``advantages`` [B] (the
    fused op, once) and ``is_std_zero`` [B] (TRL's logging flag, defined as TRL does)."""
    record(CALL_ADVANTAGES)
    weights = trainer.reward_weights.to(device)
    advantages = compute_grpo_advantages(
        rewards_per_func,
        num_generations,
        reward_weights=weights,
        scale_rewards=trainer.scale_rewards,
        multi_objective_aggregation=trainer.multi_objective_aggregation,
    )
    is_std_zero = _reward_std_is_zero(
        rewards_per_func, weights, num_generations, trainer.scale_rewards, trainer.multi_objective_aggregation
    )
    return advantages, is_std_zero


def _reward_std_is_zero(rpf: torch.Tensor, weights: torch.Tensor, G: int, scale: str, aggregation: str) -> torch.Tensor:
    """TRL's ``frac_reward_zero_std`` flag: ``isclose(σ, 0)`` of the std TRL divides by (per
    group for "group"/"none", over the batch for "batch" and for normalize_then_sum), with
    TRL's ``nanstd`` and the unscorable rows (every function None) left out. ``B`` values of
    logging arithmetic: the op does not return TRL's batch σ of the combined rewards."""
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(rpf).all(dim=1)
    if aggregation == "normalize_then_sum":
        grouped = rpf.view(-1, G, rpf.shape[1])
        std_k = nanstd(grouped, dim=1, keepdim=True) if G > 1 else torch.zeros_like(grouped[:, :1])
        z = ((grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (std_k + 1e-4)).view(-1, rpf.shape[1])
        r = (z * weights.unsqueeze(0)).nansum(dim=1).masked_fill(unscorable, math.nan)
        std = nanstd(r).expand_as(r) if r.numel() > 1 else torch.zeros_like(r)
    else:
        r = (rpf * weights.unsqueeze(0)).nansum(dim=1).masked_fill(unscorable, math.nan)
        if scale == "batch":
            std = nanstd(r).expand_as(r) if r.numel() > 1 else torch.zeros_like(r)
        elif G > 1:
            std = nanstd(r.view(-1, G), dim=1).repeat_interleave(G, dim=0)
        else:
            std = torch.zeros_like(r)
    return torch.isclose(std, torch.zeros_like(std))


# ---------------------------------------------------------------------------------------
# loss
# ---------------------------------------------------------------------------------------

_MM_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def _settings(trainer: Any) -> Tuple:
    """The trainer settings that decide whether the fused loss supports it (the cache key)."""
    args = trainer.args
    return (
        trainer.loss_type,
        trainer.importance_sampling_level,
        float(trainer.beta),
        bool(args.use_bias_correction_kl),
        trainer.epsilon_low,
        trainer.epsilon_high,
        args.delta,
        trainer.top_entropy_quantile,
        trainer.off_policy_mask_threshold,
        trainer.accelerator.num_processes,
        bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction),
        bool(trainer._entropy_bonus_enabled),
        args.sapo_temperature_pos,
        args.sapo_temperature_neg,
        args.vespo_k_pos,
        args.vespo_lambda_pos,
        args.vespo_k_neg,
        args.vespo_lambda_neg,
        trainer.max_completion_length,
    )


def _dry_run(trainer: Any) -> Optional[str]:
    """None when grpo_loss_trl takes the trainer's settings; else its message (naming the
    option). A call on a 2×3 CPU batch, so the answer follows grpo_loss_trl as it grows."""
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(2, 3, generator=g)
    kw: Dict[str, Any] = {}
    if trainer.beta != 0.0:
        kw["ref_per_token_logps"] = logps - 0.1
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        kw["importance_sampling_ratio"] = torch.ones(2, 3)
    if trainer.accelerator.num_processes > 1 and trainer.top_entropy_quantile < 1.0:
        kw["entropy_threshold"] = torch.tensor(0.5)  # the real call passes the process group
    try:
        grpo_loss_trl(
            logps,
            logps - 0.05,
            torch.tensor([1.0, -1.0]),
            torch.ones(2, 3),
            entropies=torch.rand(2, 3, generator=g),
            entropy_coef=0.01 if trainer._entropy_bonus_enabled else 0.0,
            num_items_in_batch=6,
            **kw,
            **_loss_settings(trainer, training=True),
        )
    except NotImplementedError as e:
        return str(e)
    return None


def _loss_settings(trainer: Any, *, training: bool) -> Dict[str, Any]:
    args = trainer.args
    return dict(
        loss_type=trainer.loss_type,
        epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,
        delta=args.delta,
        importance_sampling_level=trainer.importance_sampling_level,
        beta=trainer.beta,
        use_bias_correction_kl=args.use_bias_correction_kl,
        sapo_temperature_pos=args.sapo_temperature_pos,
        sapo_temperature_neg=args.sapo_temperature_neg,
        vespo_k_pos=args.vespo_k_pos,
        vespo_lambda_pos=args.vespo_lambda_pos,
        vespo_k_neg=args.vespo_k_neg,
        vespo_lambda_neg=args.vespo_lambda_neg,
        top_entropy_quantile=trainer.top_entropy_quantile,
        off_policy_mask_threshold=trainer.off_policy_mask_threshold,
        max_completion_length=trainer.max_completion_length,
        # HF sets current_gradient_accumulation_steps when training starts (absent at init).
        gradient_accumulation_steps=getattr(trainer, "current_gradient_accumulation_steps", 1) if training else 1,
        num_processes=trainer.accelerator.num_processes,
        steps_per_generation=args.steps_per_generation,
        training=training,
    )


def unsupported(trainer: Any) -> Optional[str]:
    """Why the fused loss cannot serve ``trainer`` (a message naming the option), or None.
    Cached on the trainer per settings."""
    key = _settings(trainer)
    cached = getattr(trainer, "_rlvr_support", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    reason = _dry_run(trainer)
    trainer._rlvr_support = (key, reason)
    return reason


def _refuse_or_warn(trainer: Any, reason: str, strict: bool) -> None:
    if strict:
        raise NotImplementedError(
            f"rlvr_kernels.integrations.trl.apply(strict=True): this GRPOTrainer's settings are not fused: "
            f"{reason}. Change the setting, or apply(strict=False) to run TRL's own _compute_loss for it"
        )
    if not getattr(trainer, "_rlvr_warned", False):
        trainer._rlvr_warned = True
        warnings.warn(
            f"rlvr_kernels.integrations.trl.apply(strict=False): {reason}; this trainer runs TRL's own "
            "_compute_loss (log-probs and advantages stay fused where applied)",
            RuntimeWarning,
            stacklevel=3,
        )


def loss_targets(*, strict: bool) -> List[Target]:
    def build_loss(original_loss):
        @functools.wraps(original_loss)
        def _compute_loss(self, model, inputs):
            reason = unsupported(self)
            if reason is not None:
                _refuse_or_warn(self, reason, strict)
                record(CALL_LOSS_FALLBACK)
                return original_loss(self, model, inputs)
            record(CALL_LOSS)
            return _fused_compute_loss(self, model, inputs)

        return _compute_loss

    def build_init(original_init):
        @functools.wraps(original_init)
        def __init__(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            reason = unsupported(self)
            if reason is not None:
                _refuse_or_warn(self, reason, strict)

        return __init__

    return [
        Needs(TRL_TRAINER, ("_get_per_token_logps_and_entropies", "get_high_entropy_mask")),
        Needs(TRL_UTILS, ("nanmin", "nanmax", "nanstd")),
        Target(TRL_TRAINER, "__init__", Build(build_init)),
        Target(TRL_TRAINER, "_compute_loss", Build(build_loss)),
    ]


def _fused_compute_loss(self, model, inputs):
    """``GRPOTrainer._compute_loss`` on the fused ops: TRL's forward (which runs the
    log-prob adapter when that part is applied), one :func:`grpo_loss_trl` call, TRL's
    entropy-bonus controller, aux loss and metric set."""
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
        model,
        input_ids,
        attention_mask,
        completion_ids.size(1),
        compute_entropy=True,
        compute_aux_loss=self.aux_loss_enabled,
        **{k: inputs.get(k) for k in _MM_KEYS},
    )
    mode = "train" if self.model.training else "eval"
    training = mode == "train"
    accumulation = self.current_gradient_accumulation_steps if training else 1.0
    apply_coef = 0.0
    if self._entropy_bonus_enabled:
        # The coefficient (and, adaptive, its gate) of the end of the previous optimizer step.
        gate = (not self.use_adaptive_entropy) or self._last_world_entropy <= self.args.entropy_target
        apply_coef = self.entropy_coef if gate else 0.0
    use_is = bool(self.use_vllm and self.vllm_importance_sampling_correction)
    threshold = None
    if self.top_entropy_quantile < 1.0:
        # TRL's threshold is over every process's valid-token entropies (a collective, as
        # TRL's gather); computed once for the loss and the entropy bonus.
        group = torch.distributed.group.WORLD if self.accelerator.num_processes > 1 else None
        threshold = trl_entropy_threshold(entropies.detach(), mask, self.top_entropy_quantile, group)
    loss, _, trl_metrics = grpo_loss_trl(
        per_token_logps,
        inputs.get("old_per_token_logps"),
        inputs["advantages"],
        mask,
        ref_per_token_logps=inputs.get("ref_per_token_logps"),
        entropies=entropies,
        entropy_coef=apply_coef,
        importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
        vllm_importance_sampling_correction=use_is,
        sampling_per_token_logps=inputs.get("sampling_per_token_logps"),
        entropy_threshold=threshold,
        num_items_in_batch=inputs.get("num_items_in_batch"),
        return_trl_metrics=True,
        **_loss_settings(self, training=training),
    )
    policy_loss = trl_metrics.pop("policy_loss")
    if self._entropy_bonus_enabled:
        # TRL logs its "policy_loss" (before the bonus and the accumulation divisor) only here.
        value = reduce_trl_metrics({"policy_loss": policy_loss}, self.accelerator)["policy_loss"]
        self._metrics[mode]["policy_loss"].append(value)
        if self.use_adaptive_entropy and training:
            _adaptive_entropy_update(self, entropies, _bonus_mask(entropies, mask, threshold))
        if training and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

    if self.aux_loss_enabled:
        loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
        self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

    # TRL's names, in TRL's order, reduced across processes as TRL does.
    for name, value in reduce_trl_metrics(trl_metrics, self.accelerator).items():
        self._metrics[mode][name].append(value)
    return loss


def _bonus_mask(entropies: torch.Tensor, mask: torch.Tensor, threshold: Optional[torch.Tensor]) -> torch.Tensor:
    """The tokens TRL's entropy bonus acts on: the completion tokens, entropy-masked at
    TRL's threshold when ``top_entropy_quantile`` < 1."""
    if threshold is None:
        return mask
    keep = (mask != 0) & (entropies.detach().float() >= threshold.to(entropies.device))
    return mask * keep.to(mask.dtype)


def _adaptive_entropy_update(self, entropies: torch.Tensor, effective_mask: torch.Tensor) -> None:
    """TRL's adaptive entropy controller: window totals of Σ H·m and Σ m over the
    micro-batches of an optimizer step, reduced over processes at the step boundary, move
    ``entropy_coef`` by ``entropy_coef_delta`` toward the target (bounded)."""
    args = self.args
    stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
    window = self._entropy_window_stats
    self._entropy_window_stats = stats if window is None else window + stats
    if not self.accelerator.sync_gradients:
        return
    totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
    world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
    if world_entropy <= args.entropy_target:
        self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
    else:
        self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
    self._last_world_entropy = world_entropy
    self._entropy_window_stats = None
