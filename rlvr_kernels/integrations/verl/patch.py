"""``apply()`` / ``unapply()``: the fused ops inside verl 0.9's own trainer and workers.

One call, ``rlvr_kernels.integrations.verl.apply()``, made in every process that runs
verl's code (the driver computes the advantages, the actor workers the log-probs and the
loss) before the workers build their models (verl binds the loss function and the entropy
function when it builds them):

=====================  ====================================================================
``advantages``         verl's advantage-estimator registry (``ADV_ESTIMATOR_REGISTRY``) and
                       the ``core_algos.compute_*_outcome_advantage`` functions (verl's
                       ``compute_advantage`` calls GRPO by module attribute) for grpo,
                       grpo_vectorized, rloo, rloo_vectorized, opo, gpg,
                       reinforce_plus_plus_baseline, gdpo
``policy_loss``        verl's policy-loss registry (``POLICY_LOSS_REGISTRY``) and the
                       ``core_algos.compute_policy_loss_*`` functions for vanilla, gspo,
                       cispo, sapo, gpg, dppo_tv, dppo_kl, geo_mean, dro, clip_cov, kl_cov,
                       bypass_mode
``ppo_loss``           ``verl.workers.utils.losses.ppo_loss`` (the engine workers' actor loss:
                       pg + kl + entropy as one fused ``policy_loss`` call) where verl
                       imported it by name (the engine workers, distillation)
``logprobs``           ``verl.utils.torch_functional.logprobs_from_logits`` /
                       ``entropy_from_logits`` (and the engines that imported them by name),
                       ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``
``logit_free``         ``FSDPEngineWithLMHead.forward_step``: the FSDP actor engine's
                       log-probs and entropy from the hidden states and the LM head, never
                       the ``[tokens, vocab]`` logits (:mod:`.transformer_impl`); part of
                       ``logprobs`` (off with it)
=====================  ====================================================================

``rollout_correction``: ``verl.trainer.ppo.rollout_corr_helper``'s
``compute_rollout_correction_weights``, ``compute_rollout_rejection_mask``,
``compute_rollout_correction_and_rejection_mask``, ``compute_offpolicy_metrics`` and
``compute_rollout_corr_metrics_from_logprobs`` on that module (the trainer's
``compute_rollout_correction_and_add_to_batch`` and the bypass loss look them up there).

Names: the fused functions are registered under verl's own names, so an existing verl
config (``algorithm.adv_estimator=grpo``, ``actor.policy_loss.loss_mode=vanilla``) runs
them with no change; names verl has that are not fused (gae, remax, ...) keep
verl's functions. ``unapply()`` puts back the identical objects, registry entries included.

An option the fused path does not support (``NotImplementedError`` from a drop-in, or a
``loss_mode`` / ``kl_loss_type`` that ``ppo_loss`` does not fuse): with ``strict=True``
(the default) the call raises, naming the option; with ``strict=False`` it warns once and
runs verl's own function for that call. Never silently different.

Besides the named modules, every loaded ``verl.*`` module is swept for attributes that are
the replaced objects (``is``), so a module that imported one by name is patched too; at
``unapply()`` the sweep also restores modules imported while the patch was applied.

Opt-in, off by default (docs/integrations-verl.md): ``logits_precision`` ("fp32" | "bf16")
and ``match_sampling`` (with ``rollout_config``, verl's ``actor_rollout_ref.rollout``: the
log-prob drop-ins score the rollout's kept set, top-k / top-p in the engine's convention)
set ``_head``'s attributes; ``mismatch_metrics`` sets ``_rollout_corr.MISMATCH_OP`` (verl's
off-policy ``rollout_corr/*`` metrics from one ``rollout_mismatch`` call). All three are
patcher targets on our own modules, so ``unapply()`` restores the defaults.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import rlvr_kernels.integrations.verl._head as _ours_head
import rlvr_kernels.integrations.verl._rollout_corr as _ours_rc
import rlvr_kernels.integrations.verl.core_algos as _ours_core
import rlvr_kernels.integrations.verl.kernel as _ours_kernel
import rlvr_kernels.integrations.verl.rollout_corr_helper as _ours_rch
import rlvr_kernels.integrations.verl.torch_functional as _ours_tf
import rlvr_kernels.integrations.verl.transformer_impl as _ours_engine

from ..._core.validation import check_bools
from .._head_grad import check_setting as check_grad_in_forward
from .._patch import Build, Integration, Needs, Target, record
from ._losses import KL_FUSED, KL_UNFUSED, LOSS_MODES
from .losses import policy_loss_verl

__all__ = ["apply", "unapply", "is_applied", "POLICY_LOSSES", "ADV_ESTIMATORS", "TESTED_VERSIONS"]

TESTED_VERSIONS = ("0.9.0", "0.10.0")  # low <= verl.__version__ < high

# verl registry name -> (the core_algos function verl registers under it, our drop-in)
POLICY_LOSSES: Dict[str, Tuple[str, Callable]] = {
    "vanilla": ("compute_policy_loss_vanilla", _ours_core.compute_policy_loss_vanilla),
    "gspo": ("compute_policy_loss_gspo", _ours_core.compute_policy_loss_gspo),
    "cispo": ("compute_policy_loss_cispo", _ours_core.compute_policy_loss_cispo),
    "sapo": ("compute_policy_loss_sapo", _ours_core.compute_policy_loss_sapo),
    "gpg": ("compute_policy_loss_gpg", _ours_core.compute_policy_loss_gpg),
    "dppo_tv": ("compute_policy_loss_dppo_tv", _ours_core.compute_policy_loss_dppo_tv),
    "dppo_kl": ("compute_policy_loss_dppo_kl", _ours_core.compute_policy_loss_dppo_kl),
    "geo_mean": ("compute_policy_loss_geo_mean", _ours_core.compute_policy_loss_geo_mean),
    "dro": ("compute_policy_loss_dro", _ours_core.compute_policy_loss_dro),
    "clip_cov": ("compute_policy_loss_clip_cov", _ours_core.compute_policy_loss_clip_cov),
    "kl_cov": ("compute_policy_loss_kl_cov", _ours_core.compute_policy_loss_kl_cov),
    "bypass_mode": ("compute_policy_loss_bypass_mode", _ours_core.compute_policy_loss_bypass_mode),
}
# verl.trainer.ppo.rollout_corr_helper functions (verl's callers look them up on the module
# or import them by name inside functions) -> our drop-in.
ROLLOUT_CORR = {
    name: getattr(_ours_rch, name)
    for name in (
        "compute_rollout_correction_weights",
        "compute_rollout_rejection_mask",
        "compute_rollout_correction_and_rejection_mask",
        "compute_offpolicy_metrics",
        "compute_rollout_corr_metrics_from_logprobs",
    )
}
ADV_ESTIMATORS: Dict[str, Tuple[str, Callable]] = {
    "grpo": ("compute_grpo_outcome_advantage", _ours_core.compute_grpo_outcome_advantage),
    "grpo_vectorized": (
        "compute_grpo_vectorized_outcome_advantage",
        _ours_core.compute_grpo_vectorized_outcome_advantage,
    ),
    "rloo": ("compute_rloo_outcome_advantage", _ours_core.compute_rloo_outcome_advantage),
    "rloo_vectorized": (
        "compute_rloo_vectorized_outcome_advantage",
        _ours_core.compute_rloo_vectorized_outcome_advantage,
    ),
    "opo": ("compute_opo_outcome_advantage", _ours_core.compute_opo_outcome_advantage),
    "gpg": ("compute_gpg_outcome_advantage", _ours_core.compute_gpg_outcome_advantage),
    "reinforce_plus_plus_baseline": (
        "compute_reinforce_plus_plus_baseline_outcome_advantage",
        _ours_core.compute_reinforce_plus_plus_baseline_outcome_advantage,
    ),
    "gdpo": ("compute_gdpo_outcome_advantage", _ours_core.compute_gdpo_outcome_advantage),
}

_CORE = "verl.trainer.ppo.core_algos"
_TF = "verl.utils.torch_functional"
_LCE = "verl.utils.kernel.linear_cross_entropy"
_LOSSES = "verl.workers.utils.losses"
_RCH = "verl.trainer.ppo.rollout_corr_helper"
_ENGINE = "verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead"
# Modules that import a patched function by name, besides the one where verl defines it
# (which must import). These are patched when they import (one that cannot, for want of
# another engine's or the rollout server's packages, cannot run either; imported later,
# it takes the patched function by name, and the sweep at unapply() restores it).
_PPO_LOSS_USERS = ("verl.workers.engine_workers", "verl.trainer.distillation.losses")
_LOGPROB_USERS = (
    "verl.workers.engine.fsdp.transformer_impl",
    "verl.trainer.ppo.prefix_grouper_utils",
    "verl.workers.rollout.naive.naive_rollout",
    "verl.workers.engine.automodel.transformer_impl",
    "verl.workers.engine.torchtitan.transformer_impl",
)

# Every loaded verl.* module is swept for by-name imports of the replaced objects.
_VERL = Integration("verl", TESTED_VERSIONS, sweep=("verl",))


# ------------------------------------------------------------------ unsupported options
class _Fallback:
    """What an option the fused path does not support does, for one apply(): strict
    raises naming the option; else a warning (once per option) and verl's own function."""

    def __init__(self, strict: bool):
        self.strict = bool(strict)
        self.warned: set = set()

    def __call__(self, name: str, reason: str, original: Callable, args, kwargs):
        if self.strict:
            raise NotImplementedError(
                f"rlvr_kernels' {name}: {reason}. apply(strict=False) runs verl's own {name} for such calls "
                "(with a warning)"
            )
        key = (name, reason)
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(
                f"rlvr_kernels' {name}: {reason}; running verl's own {name} for such calls (apply(strict=False))",
                RuntimeWarning,
                stacklevel=3,
            )
        record(f"{name}[verl]")
        return original(*args, **kwargs)


def _entry(name: str, ours: Callable, fallback: _Fallback, original: Callable) -> Callable:
    """``ours`` with the signature of verl's ``original``, counting its calls as ``name``;
    a ``NotImplementedError`` from ours (an option it does not fuse, raised before any
    work) goes to the ``fallback``."""

    @functools.wraps(ours)
    def entry(*args, **kwargs):
        record(name)
        try:
            return ours(*args, **kwargs)
        except NotImplementedError as e:
            return fallback(name, str(e), original, args, kwargs)

    entry.__wrapped_verl__ = original
    return entry


# ------------------------------------------------------------------ ppo_loss
def _make_ppo_loss(fallback: _Fallback, original: Callable) -> Callable:
    """verl's engine ``ppo_loss`` (same signature, data handling, side effects on
    ``config.global_batch_info`` and metric objects), its arithmetic as one
    :func:`policy_loss_verl` call."""
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.padding import no_padding_2_padding

    def ppo_loss(config, model_output, data, dp_group=None):
        record("verl.ppo_loss")
        loss_mode = config.policy_loss.get("loss_mode", "vanilla")
        reason = None
        if loss_mode not in LOSS_MODES:
            reason = f"config.policy_loss.loss_mode={loss_mode!r} is not fused (fused: {tuple(LOSS_MODES)})"
        elif config.use_kl_loss and config.kl_loss_type not in KL_FUSED and config.kl_loss_type not in KL_UNFUSED:
            reason = f"config.kl_loss_type={config.kl_loss_type!r} is not supported"
        if reason is not None:
            return fallback("verl.ppo_loss", reason, original, (config, model_output, data, dp_group), {})
        if config.use_kl_loss and _ours_head.SAMPLING is not None:
            # The reference policy's log-probs come from the same patched logprobs_from_logits,
            # so they are restricted to the reference's own kept set, which need not hold the
            # sampled token (−inf): the KL term would not be verl's.
            raise NotImplementedError(
                "apply(match_sampling=True) with actor.use_kl_loss: the reference log-probs would be restricted "
                "to the reference's own kept set too; turn one of them off"
            )

        # ---- verl's ppo_loss, line for line, up to the arithmetic
        log_prob = no_padding_2_padding(model_output["log_probs"], data)
        entropy = model_output.get("entropy", None)
        if entropy is not None:
            entropy = no_padding_2_padding(entropy, data)
        config.global_batch_info["dp_size"] = data["dp_size"]
        config.global_batch_info["batch_num_tokens"] = data["batch_num_tokens"]
        config.global_batch_info["global_batch_size"] = data["global_batch_size"]
        config.global_batch_info["loss_scale_factor"] = config.loss_scale_factor
        if (
            data["dp_size"] > 1
            or data["batch_num_tokens"] is not None
            or data["global_batch_size"] is not None
            or config.loss_scale_factor is not None
        ):
            metric_aggregation = AggregationType.SUM
        else:
            metric_aggregation = AggregationType.MEAN
        fields = ["response_mask", "old_log_probs", "advantages"]
        if "rollout_is_weights" in data:
            fields.append("rollout_is_weights")
        if "ref_log_prob" in data:
            fields.append("ref_log_prob")
        data = data.select(*fields).to_padded_tensor()
        response_mask = data["response_mask"].to(bool)

        # ---- the arithmetic: one fused call
        loss, values = policy_loss_verl(
            data["old_log_probs"],
            log_prob,
            data["advantages"],
            response_mask,
            config,
            entropy=entropy,
            ref_log_prob=data["ref_log_prob"] if config.use_kl_loss else None,
            rollout_is_weights=data.get("rollout_is_weights", None),
        )

        # ---- verl's metrics, in verl's order and aggregation
        pg_keys = [k for k in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower") if k in values]
        pg_keys += [k for k in values if k.startswith("rollout_corr/")]  # bypass_mode
        metrics = dict(Metric.from_dict({k: values[k] for k in pg_keys}, aggregation=AggregationType.MEAN))
        for key in ("actor/pg_loss", "actor/entropy_loss", "kl_loss"):
            if key in values:
                metrics[key] = Metric(value=values[key], aggregation=metric_aggregation)
        if "kl_coef" in values:
            metrics["kl_coef"] = values["kl_coef"]
        return loss, metrics

    ppo_loss.__doc__ = original.__doc__
    ppo_loss.__wrapped_verl__ = original
    return ppo_loss


# ------------------------------------------------------------------ apply / unapply
def is_applied() -> bool:
    return _VERL.is_applied()


def apply(
    *,
    advantages: bool = True,
    policy_loss: bool = True,
    ppo_loss: bool = True,
    logprobs: bool = True,
    rollout_correction: bool = True,
    logit_free: bool = True,
    loss_rows_only: bool = True,
    grad_in_forward: Optional[bool] = None,
    logits_precision: str = "fp32",
    match_sampling: bool = False,
    rollout_config: Any = None,
    mismatch_metrics: bool = False,
    strict: bool = True,
    count_calls: Optional[bool] = None,
) -> None:
    """Put the fused ops into verl (see the module docstring for what each switch replaces).

    ``strict``: a verl version outside :data:`TESTED_VERSIONS` raises (else warns), and an
    option the fused path does not support raises naming it (else: a warning, once, and
    verl's own function for that call). ``count_calls``: turn the debug call counting on
    or off (None: leave it); the entry points are counted as "verl.<name>" (e.g.
    "verl.ppo_loss", "verl.policy_loss.vanilla", "verl.adv.grpo", "verl.logprobs_from_logits"),
    fallbacks to verl's own code as "verl.<name>[verl]". Calling apply() again first undoes
    the previous call. Every name is looked up, and every replacement built, before the
    first one is set: a failure leaves verl untouched.

    ``logit_free`` (with ``logprobs``): ``FSDPEngineWithLMHead.forward_step`` computes the
    log-probs and entropy from the hidden states and the LM head, never the ``[tokens, vocab]``
    logits (:mod:`.transformer_impl`; what it cannot serve runs verl's step, with a warning);
    False keeps verl's logits and the log-prob drop-ins on them. Under it, for a training step
    whose loss is verl's engine actor loss (``ppo_loss``, ours or verl's, bound as verl's worker
    binds it): ``loss_rows_only`` sends only the response rows (those ``ppo_loss`` reads) through
    the head, 0 elsewhere; ``grad_in_forward``, for a loss mode separable over tokens
    (:data:`.transformer_impl.SEPARABLE_LOSS_MODES`), forms the head's gradient in the forward
    (three GEMMs instead of four; exact for any loss, see ``integrations/_head_grad.py``): True
    always, False never, None (the default) where that was measured faster (rows on the CPU, at
    least ``_head_grad.MIN_MACS`` multiply-adds per GEMM).

    Opt-in (the defaults are verl's numbers): ``logits_precision`` ("fp32" | "bf16") of the
    log-prob drop-ins; ``match_sampling=True`` with ``rollout_config`` (verl's
    ``actor_rollout_ref.rollout``: ``name`` "vllm" / "sglang", ``top_k``, ``top_p``): the
    log-prob and entropy drop-ins score the rollout's kept set (a token outside: −inf);
    without ``rollout_config`` ValueError (verl's log-prob call has no config in reach), an
    engine or setting the head cannot reproduce NotImplementedError naming it, and the
    fused ``ppo_loss`` refuses ``use_kl_loss`` with it. ``mismatch_metrics=True``: verl's
    off-policy ``rollout_corr/*`` metrics from one ``rollout_mismatch`` call (the same
    tokens and reductions; rollout_mismatch divides by the count where verl divides by
    count + 1e-8, so not bit for bit).
    """
    precision = _ours_head.check_logits_precision(logits_precision)
    check_bools(
        match_sampling=match_sampling,
        mismatch_metrics=mismatch_metrics,
        logit_free=logit_free,
        loss_rows_only=loss_rows_only,
    )
    check_grad_in_forward(grad_in_forward)
    if not logprobs and (match_sampling or precision != "fp32"):
        name = "match_sampling" if match_sampling else "logits_precision"
        raise ValueError(f"{name}: acts on the log-prob drop-ins, which apply(logprobs=False) does not install")
    # their non-defaults act on the logit-free engine only
    for name, value in (
        ("loss_rows_only", loss_rows_only is not True),
        ("grad_in_forward", grad_in_forward is not None),
    ):
        if not (logit_free and logprobs) and value:
            raise ValueError(
                f"{name}: acts on the logit-free engine, which apply(logit_free=False) or apply(logprobs=False) "
                "does not install"
            )
    if rollout_config is not None and not match_sampling:
        raise ValueError("rollout_config: only read with match_sampling=True")
    sampling = _ours_head.rollout_sampling(rollout_config) if match_sampling else None
    head = [Target(_ours_head, "LOGITS_PRECISION", precision), Target(_ours_head, "SAMPLING", sampling)]
    head += [
        Target(_ours_head, "LOSS_ROWS_ONLY", loss_rows_only),
        Target(_ours_head, "GRAD_IN_FORWARD", grad_in_forward),
    ]
    metrics = [Target(_ours_rc, "MISMATCH_OP", True)] if mismatch_metrics else []
    options = dict(
        advantages=advantages,
        policy_loss=policy_loss,
        ppo_loss=ppo_loss,
        logprobs=logprobs,
        rollout_correction=rollout_correction,
        logit_free=logit_free and logprobs,
        loss_rows_only=loss_rows_only,
        grad_in_forward=grad_in_forward,
        logits_precision=precision,
        match_sampling=match_sampling,
        mismatch_metrics=mismatch_metrics,
        strict=strict,
    )
    _VERL.apply(
        lambda: (
            _targets(advantages, policy_loss, ppo_loss, logprobs, _Fallback(strict), rollout_correction, logit_free)
            + head
            + metrics
        ),
        strict=strict,
        count_calls=count_calls,
        options=options,
    )


def unapply() -> None:
    """Put back every object apply() replaced (the identical objects) and verl's
    registries as they were; a no-op when not applied."""
    _VERL.unapply()


def _targets(
    advantages: bool,
    policy_loss: bool,
    ppo_loss: bool,
    logprobs: bool,
    fallback: _Fallback,
    rollout_correction=True,
    logit_free=True,
) -> List[Target]:
    """Every replacement. A Build shared by several targets gives them one object, and
    they must hold the identical original (verl's registry entry is its core_algos
    function; a module importing a function by name holds verl's)."""
    out: List[Target] = []
    for switch, registry, table, prefix in (
        (advantages, f"{_CORE}:ADV_ESTIMATOR_REGISTRY", ADV_ESTIMATORS, "verl.adv."),
        (policy_loss, f"{_CORE}:POLICY_LOSS_REGISTRY", POLICY_LOSSES, "verl.policy_loss."),
    ):
        if switch:
            for key, (fn_name, ours) in table.items():
                entry = Build(functools.partial(_entry, prefix + key, ours, fallback))
                out += [Target(_CORE, fn_name, entry), Target(registry, key, entry)]
    if ppo_loss:
        entry = Build(functools.partial(_make_ppo_loss, fallback))
        out += [Target(_LOSSES, "ppo_loss", entry)]
        out += [Target(m, "ppo_loss", entry, optional=True) for m in _PPO_LOSS_USERS]
    if logprobs:
        entry = Build(functools.partial(_entry, "verl.logprobs_from_logits", _ours_tf.logprobs_from_logits, fallback))
        out += [Target(_TF, "logprobs_from_logits", entry)]
        out += [Target(m, "logprobs_from_logits", entry, optional=True) for m in _LOGPROB_USERS]
        entry = Build(functools.partial(_entry, "verl.entropy_from_logits", _ours_tf.entropy_from_logits, fallback))
        out += [Target(_TF, "entropy_from_logits", entry)]
        entry = Build(
            functools.partial(_entry, "verl.linear_cross_entropy", _ours_kernel.linear_cross_entropy, fallback)
        )
        out += [Target(_LCE, "linear_cross_entropy", entry)]
        if logit_free:
            out += [
                Needs(_ENGINE, ("prepare_model_inputs", "prepare_model_outputs", "_gather_and_unpad_packed")),
                Target(_ENGINE, "forward_step", Build(_ours_engine.make_forward_step)),
            ]
    if rollout_correction:
        for name, ours in ROLLOUT_CORR.items():
            entry = Build(functools.partial(_entry, f"verl.rollout_corr.{name}", ours, fallback))
            out += [Target(_RCH, name, entry)]
    return out
