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
* sampling support (``apply(match_sampling=True)``, opt-in): the head class carries the
  setting (``kernels.configured``), ``GRPOTrainer._get_per_token_logps_and_entropies`` is
  wrapped to open a ``kernels.sampling_support`` block with the trainer's filters
  (:func:`trainer_sampling`) around the policy's forward, and ``grpo_trainer.use_adapter``
  to mark the PEFT reference (scored, like ``ref_model``, on the full vocabulary).
* mismatch metrics (``apply(mismatch_metrics=True)``, opt-in): the five statements of
  ``_generate_and_score_completions`` that form ``sampling/sampling_logp_difference/*``
  (:data:`SAMPLING_DIFF_SHA256`) become one :func:`sampling_logp_difference` call
  (``rollout_mismatch``), by the same source rewrite as the advantage block (both blocks,
  when both are asked, in one rewritten method: :func:`generate_and_score_targets`).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import inspect
import linecache
import math
import textwrap
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from ...ops.rollout_mismatch import rollout_mismatch
from .._backend import current_backend
from .._patch import Build, Needs, Patcher, PatchError, Target, record
from .grpo_trainer import compute_grpo_advantages, grpo_loss_trl, reduce_trl_metrics, trl_entropy_threshold
from .kernels import configured, sampling_support

TRL_GRPO = "trl.trainer.grpo_trainer"
TRL_UTILS = "trl.trainer.utils"
TRL_TRAINER = TRL_GRPO + ":GRPOTrainer"

# Stable names under which the patched entry points count their calls (``call_counts()``).
CALL_ADVANTAGES = "trl.GRPOTrainer.advantages"
CALL_LOSS = "trl.GRPOTrainer._compute_loss"
CALL_LOSS_FALLBACK = "trl.GRPOTrainer._compute_loss[trl fallback]"
CALL_SAMPLING_METRICS = "trl.GRPOTrainer.sampling_logp_difference"

# ---------------------------------------------------------------------------------------
# log-probs
# ---------------------------------------------------------------------------------------


def logprobs_targets(
    *, compact: bool = True, logits_precision: str = "fp32", match_sampling: bool = False
) -> List[Target]:
    head = configured(logits_precision=logits_precision, match_sampling=match_sampling)
    out = [Target(TRL_UTILS, "_ChunkedLogProbFunction", head)]
    if compact:
        out.append(Target(TRL_UTILS, "_use_triton", Build(_compact_on_cpu)))
    if match_sampling:
        out += [
            Target(TRL_TRAINER, "_get_per_token_logps_and_entropies", Build(_with_sampling_support)),
            # TRL's PEFT reference: the policy model with the adapter swapped, under use_adapter.
            Target(TRL_GRPO, "use_adapter", Build(_reference_adapter)),
        ]
    return out


def _compact_on_cpu(original: Callable[[torch.device], bool]) -> Callable[[torch.device], bool]:
    """TRL's ``_use_triton`` (read by the fused forward only, to choose the compact path),
    also True on the CPU: there, shapes that change per batch cost nothing."""

    @functools.wraps(original)
    def _use_triton(device: torch.device) -> bool:
        return device.type == "cpu" or original(device)

    return _use_triton


# ---------------------------------------------------------------------------------------
# log-probs on the sampling support (apply(match_sampling=True))
# ---------------------------------------------------------------------------------------

# Keys of GRPOConfig.generation_kwargs that change the distribution the completions are
# sampled from beyond temperature / top-k / top-p / min-p (and those four themselves, which
# would override the GRPOConfig fields): the head cannot reproduce them, so they are refused.
_DISTRIBUTION_KEYS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "no_repeat_ngram_size",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "top_h",
    "bad_words_ids",
    "suppress_tokens",
    "begin_suppress_tokens",
    "sequence_bias",
    "logit_bias",
    "allowed_token_ids",
    "min_new_tokens",
    "min_tokens",
    "structured_outputs",
    "guided_decoding",
    "logits_processors",
)


def trainer_sampling(trainer: Any) -> Optional[Dict[str, Any]]:
    """The ``linear_logprobs`` sampling-support arguments of ``trainer``'s generation (None:
    no filter on, the full vocabulary), read where TRL keeps them for generating:
    ``trainer.top_k / top_p / min_p`` (``GRPOConfig``'s), with vLLM (``use_vllm``) vLLM's
    convention, else transformers' ``generate`` (temperature, top-k, top-p over the top-k
    survivors, then min-p: vLLM's order except for min-p, see below). ValueError naming a bad
    value; NotImplementedError naming a setting the head cannot reproduce. Cached per
    trainer and settings."""
    key = (
        trainer.top_k,
        trainer.top_p,
        trainer.min_p,
        trainer.temperature,
        trainer.repetition_penalty,
        bool(trainer.use_vllm),
        repr(trainer.args.generation_kwargs),
        getattr(trainer.args, "vllm_structured_outputs_regex", None),
    )
    return _cached(trainer, "_rlvr_sampling", key, _read_sampling)


def _cached(trainer: Any, attr: str, key: Tuple, compute: Callable[[Any], Any]) -> Any:
    """``compute(trainer)``, kept on the trainer under ``attr`` while ``key`` (its settings)
    is unchanged."""
    cached = getattr(trainer, attr, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    value = compute(trainer)
    setattr(trainer, attr, (key, value))
    return value


def _unsupported_sampling(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"rlvr_kernels.integrations.trl.apply(match_sampling=True): {what}; the fused head reproduces "
        "temperature, top_k, top_p and min_p only. apply(match_sampling=False) scores the full vocabulary"
    )


def _read_sampling(trainer: Any) -> Optional[Dict[str, Any]]:
    top_k, top_p, min_p = trainer.top_k, trainer.top_p, trainer.min_p
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise TypeError(f"GRPOConfig.top_k: expected an int, got {top_k!r}")
    for name, value, open_low in (("top_p", top_p, True), ("min_p", min_p, False)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"GRPOConfig.{name}: expected a number, got {value!r}")
        if not ((value > 0.0 if open_low else value >= 0.0) and value <= 1.0):
            raise ValueError(f"GRPOConfig.{name}: expected a value in {'(0' if open_low else '[0'}, 1], got {value!r}")
    if trainer.repetition_penalty != 1.0:
        raise _unsupported_sampling(f"GRPOConfig.repetition_penalty={trainer.repetition_penalty!r} (not 1.0)")
    extra = trainer.args.generation_kwargs or {}
    if not isinstance(extra, dict):
        raise _unsupported_sampling(f"GRPOConfig.generation_kwargs={extra!r} could not be read")
    for k in _DISTRIBUTION_KEYS:
        if k in extra:
            raise _unsupported_sampling(f"GRPOConfig.generation_kwargs[{k!r}] is set")
    if trainer.use_vllm and getattr(trainer.args, "vllm_structured_outputs_regex", None) is not None:
        raise _unsupported_sampling("GRPOConfig.vllm_structured_outputs_regex is set (constrained decoding)")
    top_k_on = top_k is not None and top_k > 0
    top_p_on = top_p is not None and top_p < 1.0
    min_p_on = min_p is not None and min_p > 0.0
    if not trainer.use_vllm and top_p_on and min_p_on:
        # transformers' generate applies min-p after top-p (TopPLogitsWarper, then
        # MinPLogitsWarper), vLLM before it; only one of them matches either convention.
        raise _unsupported_sampling(
            "GRPOConfig.top_p < 1 together with GRPOConfig.min_p > 0 under transformers' generate "
            "(use_vllm=False), which applies min-p after top-p; neither sampling_convention does"
        )
    kwargs: Dict[str, Any] = {}
    if top_k_on:
        kwargs["top_k"] = int(top_k)
    if top_p_on:
        kwargs["top_p"] = float(top_p)
    if min_p_on:
        kwargs["min_p"] = float(min_p)
    if not kwargs:
        return None
    kwargs["sampling_convention"] = "vllm"  # vLLM's; transformers' equals it without min-p + top-p
    return kwargs


_IN_REFERENCE = [0]  # depth of TRL's use_adapter blocks (the PEFT reference model)


def _with_sampling_support(original: Callable) -> Callable:
    """``GRPOTrainer._get_per_token_logps_and_entropies`` with the trainer's sampling support
    in force for the policy's forward; the reference model (``self.ref_model``, or the PEFT
    policy under TRL's ``use_adapter``) is scored on the full vocabulary (its own kept set
    need not hold the sampled token: a −inf reference log-prob would make the KL infinite)."""

    @functools.wraps(original)
    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        ref = getattr(self, "ref_model", None)
        reference = _IN_REFERENCE[0] > 0 or (ref is not None and model is ref)
        with sampling_support(None if reference else trainer_sampling(self)):
            return original(self, model, *args, **kwargs)

    return _get_per_token_logps_and_entropies


def _reference_adapter(original: Callable) -> Callable:
    """TRL's ``use_adapter`` (the PEFT reference model), marking its block as the reference."""

    @functools.wraps(original)
    @contextlib.contextmanager
    def use_adapter(*args, **kwargs):
        with original(*args, **kwargs):
            _IN_REFERENCE[0] += 1
            try:
                yield
            finally:
                _IN_REFERENCE[0] -= 1

    return use_adapter


# ---------------------------------------------------------------------------------------
# advantages: rewriting _generate_and_score_completions' advantage block
# ---------------------------------------------------------------------------------------

# sha256 of ast.dump() of TRL 1.16.0's advantage block (positions not included, so comments
# and formatting do not matter; any change of the code does).
ADV_BLOCK_SHA256 = "ffa228f26c8d334454e40e8cd2ea1172a0a27b81eb3dd6fa527124a99409bdc1"
# sha256 of the five statements of TRL 1.16.0's sampling_logp_difference metric (``delta =
# ...`` to ``max_delta = ...``), the same way.
SAMPLING_DIFF_SHA256 = "8163ea390781cab1d83cc253df9ee78b34d7628ce475e1819381137e82194832"
_PATCHED_FILENAME = "<rlvr_kernels: trl GRPOTrainer._generate_and_score_completions, rewritten>"


class _Rewrite(NamedTuple):
    """One block of ``_generate_and_score_completions`` replaced by one line: ``find``
    returns its statements (consecutive, in one body), which must hash to ``sha``; ``call``
    may read only ``reads`` (assigned before the block) and the rest of the method may read
    only ``defines`` of the names the block assigns; ``helper`` is the closure name the call
    uses, bound to ``impl``."""

    what: str
    find: Callable[[ast.FunctionDef], List[ast.stmt]]
    sha: str
    reads: Tuple[str, ...]
    defines: Tuple[str, ...]
    call: str
    helper: str
    impl: Callable


def _find_advantage_block(func_def: ast.FunctionDef) -> List[ast.stmt]:
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
    return found[0:1]


def _find_sampling_diff(func_def: ast.FunctionDef) -> List[ast.stmt]:
    """The first five statements of the ``if self.use_vllm and
    self.vllm_importance_sampling_correction:`` block that logs the sampling metrics (the one
    whose body starts with ``delta = ...``)."""
    found = [
        stmt
        for stmt in func_def.body
        if isinstance(stmt, ast.If)
        and ast.unparse(stmt.test) == "self.use_vllm and self.vllm_importance_sampling_correction"
        and stmt.body
        and isinstance(stmt.body[0], ast.Assign)
        and ast.unparse(stmt.body[0].targets[0]) == "delta"
    ]
    if len(found) != 1 or len(found[0].body) < 5:
        raise PatchError(
            "GRPOTrainer._generate_and_score_completions: expected one sampling-metrics block "
            "(if self.use_vllm and self.vllm_importance_sampling_correction: delta = ...), "
            f"found {len(found)}; TRL changed the method (rlvr_kernels is tested with TRL 1.16)"
        )
    return found[0].body[:5]


def _stmts_sha(stmts: List[ast.stmt]) -> str:
    return hashlib.sha256("".join(ast.dump(s) for s in stmts).encode()).hexdigest()


def _block_sha(node: ast.AST) -> str:
    return _stmts_sha([node])


def sampling_logp_difference(
    old_per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    tool_mask: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What TRL's five statements leave for the rest of its metric block: ``mean_delta``,
    ``max_delta`` (0-d device tensors: TRL's ``sampling/sampling_logp_difference/mean`` and
    ``/max`` before its gather) and ``mask`` (TRL's bool mask, which the block reads on).
    One :func:`rlvr_kernels.rollout_mismatch` call: ``abs_diff_mean`` / ``abs_diff_max`` of
    ``old − sampling`` over the mask, less the tokens whose difference is NaN (vLLM could not
    score them), exactly the tokens TRL keeps; 0 when none is left, as TRL. No host sync
    (TRL's boolean indexing and its ``numel()`` branch are one)."""
    record(CALL_SAMPLING_METRICS)
    mask = completion_mask.bool() if tool_mask is None else (completion_mask * tool_mask).bool()
    valid = mask & ~torch.isnan(old_per_token_logps - sampling_per_token_logps)
    m = rollout_mismatch(old_per_token_logps, sampling_per_token_logps, valid, backend=current_backend())
    return m.abs_diff_mean, m.abs_diff_max, mask


ADVANTAGES = _Rewrite(
    what="advantage block",
    find=_find_advantage_block,
    sha=ADV_BLOCK_SHA256,
    reads=("self", "rewards_per_func", "num_generations", "device"),
    defines=("advantages", "is_std_zero"),
    call="advantages, is_std_zero = _rlvr_grpo_advantages(self, rewards_per_func, num_generations, device)",
    helper="_rlvr_grpo_advantages",
    impl=None,  # grpo_advantages, bound below where it is defined
)
SAMPLING_DIFF = _Rewrite(
    what="sampling_logp_difference metric",
    find=_find_sampling_diff,
    sha=SAMPLING_DIFF_SHA256,
    reads=("old_per_token_logps", "sampling_per_token_logps", "completion_mask", "tool_mask"),
    defines=("mean_delta", "max_delta", "mask"),
    call=(
        "mean_delta, max_delta, mask = _rlvr_sampling_logp_difference("
        "old_per_token_logps, sampling_per_token_logps, completion_mask, tool_mask)"
    ),
    helper="_rlvr_sampling_logp_difference",
    impl=sampling_logp_difference,
)
# The names the replacement of the advantage block reads / defines (kept for readers).
_ADV_READS, _ADV_DEFINES, _ADV_CALL = ADVANTAGES.reads, ADVANTAGES.defines, ADVANTAGES.call


def generate_and_score_targets(*, advantages: bool = True, sampling_metrics: bool = False) -> List[Target]:
    """The one target of ``_generate_and_score_completions``, with the blocks asked for
    rewritten (both rewrite the same method, so they are one replacement)."""
    rewrites = ([ADVANTAGES] if advantages else []) + ([SAMPLING_DIFF] if sampling_metrics else [])
    if not rewrites:
        return []

    def build(stored):
        return rewrite_generate_and_score(
            Patcher.resolve(TRL_TRAINER), stored, Patcher.resolve(TRL_GRPO), rewrites=rewrites
        )

    return [Target(TRL_TRAINER, "_generate_and_score_completions", Build(build))]


def advantages_targets() -> List[Target]:
    return generate_and_score_targets(advantages=True)


def _find_block(func_def: ast.FunctionDef) -> ast.If:
    return _find_advantage_block(func_def)[0]


def _check_names(func_def: ast.FunctionDef, stmts: List[ast.stmt], rewrite: _Rewrite = ADVANTAGES) -> None:
    """The replacement reads only names assigned before the block, and the block's other
    names are not read after it before being reassigned."""
    stmts = stmts if isinstance(stmts, list) else [stmts]
    lo, hi = stmts[0].lineno, stmts[-1].end_lineno
    every = sorted((n for n in ast.walk(func_def) if isinstance(n, ast.Name)), key=lambda n: (n.lineno, n.col_offset))
    stored_before = {n.id for n in every if n.lineno < lo and isinstance(n.ctx, ast.Store)}
    stored_before |= {a.arg for a in func_def.args.args}
    missing = [v for v in rewrite.reads if v not in stored_before]
    if missing:
        raise PatchError(
            f"GRPOTrainer._generate_and_score_completions: {missing} not defined before the {rewrite.what}"
        )
    inside = [n for s in stmts for n in ast.walk(s) if isinstance(n, ast.Name)]
    defined = {n.id for n in inside if isinstance(n.ctx, ast.Store)} - set(rewrite.defines)
    seen = set()
    for n in every:
        if n.lineno > hi and n.id in defined and n.id not in seen:
            seen.add(n.id)
            if not isinstance(n.ctx, ast.Store):
                raise PatchError(
                    f"GRPOTrainer._generate_and_score_completions reads {n.id!r} (line {n.lineno}) from the "
                    f"{rewrite.what}, which the fused replacement does not define"
                )


def rewrite_generate_and_score(
    cls: type, stored: Any, module: Any, *, rewrites: Optional[List[_Rewrite]] = None
) -> Callable:
    """TRL's ``_generate_and_score_completions`` with each block of ``rewrites`` (default: the
    advantage block) replaced by its one-line call; everything else is TRL's source text,
    compiled in TRL's module namespace, line numbers kept (the patched source is registered
    in ``linecache`` so tracebacks show it)."""
    rewrites = [ADVANTAGES] if rewrites is None else list(rewrites)
    func = inspect.unwrap(stored)
    try:
        lines, first = inspect.getsourcelines(func)
    except (OSError, TypeError) as e:
        raise PatchError(f"GRPOTrainer._generate_and_score_completions: source not readable ({e})") from e
    if stored is not func and not lines[0].lstrip().startswith("@"):
        # A decorator the source does not show could not be re-applied to the rebuilt method.
        raise PatchError("GRPOTrainer._generate_and_score_completions: decorated, and its source lacks the decorator")
    source = patched_source(lines, first, func.__name__, rewrites=rewrites)
    linecache.cache[_PATCHED_FILENAME] = (len(source), None, source.splitlines(True), _PATCHED_FILENAME)
    namespace: Dict[str, Any] = {}
    exec(compile(source, _PATCHED_FILENAME, "exec"), vars(module), namespace)
    new = namespace["_rlvr_factory"](cls, *(r.impl for r in rewrites))
    for f in {new, inspect.unwrap(new)}:
        f.__qualname__ = func.__qualname__
        f.__module__ = func.__module__
    return new


def _parse(lines: List[str], name: str) -> Tuple[int, ast.FunctionDef]:
    indent = len(lines[0]) - len(lines[0].lstrip())
    tree = ast.parse("".join(line[indent:] if line.strip() else "\n" for line in lines))
    func_def = tree.body[0]
    if not isinstance(func_def, ast.FunctionDef) or func_def.name != name:
        raise PatchError(f"GRPOTrainer.{name}: unexpected source")
    return indent, func_def


def original_block_source(lines: List[str], name: str, rewrite: _Rewrite) -> str:
    """TRL's own text of ``rewrite``'s block, dedented (the tests run it as TRL's code)."""
    indent, func_def = _parse(lines, name)
    stmts = rewrite.find(func_def)
    body = [ln[indent:] for ln in lines[stmts[0].lineno - 1 : stmts[-1].end_lineno]]
    return textwrap.dedent("".join(body))


def patched_source(lines: List[str], first: int, name: str, *, rewrites: Optional[List[_Rewrite]] = None) -> str:
    """The source of a factory ``_rlvr_factory(__class__, <helpers>)`` returning the method
    whose source ``lines`` (from line ``first`` of its file) are given, with each block of
    ``rewrites`` (default: the advantage block) replaced; PatchError when a block is missing,
    differs from TRL 1.16.0's, or the rest of the method reads one of its other names."""
    rewrites = [ADVANTAGES] if rewrites is None else list(rewrites)
    indent, func_def = _parse(lines, name)
    spans = []
    for rewrite in rewrites:
        stmts = rewrite.find(func_def)
        sha = _stmts_sha(stmts)
        if sha != rewrite.sha:
            raise PatchError(
                f"GRPOTrainer.{name}: the {rewrite.what} differs from TRL 1.16.0's "
                f"(sha256 {sha[:12]}…); the fused replacement is only exact for that code"
            )
        _check_names(func_def, stmts, rewrite)
        spans.append((stmts[0].lineno - 1, stmts[-1].end_lineno, indent + stmts[0].col_offset, rewrite.call))
    # Replace each block's lines (1-based within `lines`) by its call, then blank lines so
    # that the following lines keep TRL's line numbers; from the last block up.
    new_lines = list(lines)
    for lo, hi, col, call in sorted(spans, reverse=True):
        new_lines[lo:hi] = [" " * col + call + "\n"] + ["\n"] * (hi - lo - 1)
    # A factory gives the method its `__class__` cell (zero-argument super()) and the helpers
    # as closure variables: TRL's module namespace is read, never written.
    header = f"def _rlvr_factory(__class__, {', '.join(r.helper for r in rewrites)}):\n"
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


ADVANTAGES = ADVANTAGES._replace(impl=grpo_advantages)


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
    return _cached(trainer, "_rlvr_support", _settings(trainer), _dry_run)


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
