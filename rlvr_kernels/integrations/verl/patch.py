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
                       cispo, sapo, gpg
``ppo_loss``           ``verl.workers.utils.losses.ppo_loss`` (the engine workers' actor loss:
                       pg + kl + entropy as one fused ``policy_loss`` call) where verl
                       imported it by name (the engine workers, distillation)
``logprobs``           ``verl.utils.torch_functional.logprobs_from_logits`` /
                       ``entropy_from_logits`` (and the engines that imported them by name),
                       ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``
=====================  ====================================================================

Names: the fused functions are registered under verl's own names, so an existing verl
config (``algorithm.adv_estimator=grpo``, ``actor.policy_loss.loss_mode=vanilla``) runs
them with no change; names verl has that are not fused (gae, remax, clip_cov, ...) keep
verl's functions. ``unapply()`` puts back the identical objects, registry entries included.

An option the fused path does not support (``NotImplementedError`` from a drop-in, or a
``loss_mode`` / ``kl_loss_type`` that ``ppo_loss`` does not fuse): with ``strict=True``
(the default) the call raises, naming the option; with ``strict=False`` it warns once and
runs verl's own function for that call. Never silently different.

Besides the named modules, every loaded ``verl.*`` module is swept for attributes that are
the replaced objects (``is``), so a module that imported one by name is patched too; at
``unapply()`` the sweep also restores modules imported while the patch was applied.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import rlvr_kernels.integrations.verl.core_algos as _ours_core
import rlvr_kernels.integrations.verl.kernel as _ours_kernel
import rlvr_kernels.integrations.verl.torch_functional as _ours_tf

from .._patch import Patcher, PatchError, check_version, record, set_counting
from .losses import KL_FUSED, KL_UNFUSED, policy_loss_verl

__all__ = ["apply", "unapply", "is_applied", "POLICY_LOSSES", "ADV_ESTIMATORS", "TESTED_VERSIONS"]

TESTED_VERSIONS = ("0.9.0", "0.10.0")  # low <= verl.__version__ < high

# verl registry name -> (the core_algos function verl registers under it, our drop-in)
POLICY_LOSSES: Dict[str, Tuple[str, Callable]] = {
    "vanilla": ("compute_policy_loss_vanilla", _ours_core.compute_policy_loss_vanilla),
    "gspo": ("compute_policy_loss_gspo", _ours_core.compute_policy_loss_gspo),
    "cispo": ("compute_policy_loss_cispo", _ours_core.compute_policy_loss_cispo),
    "sapo": ("compute_policy_loss_sapo", _ours_core.compute_policy_loss_sapo),
    "gpg": ("compute_policy_loss_gpg", _ours_core.compute_policy_loss_gpg),
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
# Modules that import a patched function by name: (module, required). A required module
# (where verl defines the function) must import; the others are patched when they import
# (one that cannot, for want of another engine's or the rollout server's packages, cannot
# run either; imported later, it takes the patched function by name, and the sweep at
# unapply() restores it).
_PPO_LOSS_USERS = (
    (_LOSSES, True),
    ("verl.workers.engine_workers", False),
    ("verl.trainer.distillation.losses", False),
)
_LOGPROB_USERS = (
    (_TF, True),
    ("verl.workers.engine.fsdp.transformer_impl", False),
    ("verl.trainer.ppo.prefix_grouper_utils", False),
    ("verl.workers.rollout.naive.naive_rollout", False),
    ("verl.workers.engine.automodel.transformer_impl", False),
    ("verl.workers.engine.torchtitan.transformer_impl", False),
)


class _State:
    def __init__(self):
        self.lock = threading.RLock()
        self.patcher: Optional[Patcher] = None
        self.registry_saved: List[Tuple[Dict[str, Any], str, Any]] = []  # (registry, name, original or _ABSENT)
        self.entries: Dict[int, Tuple[Any, Any]] = {}  # id(entry) -> (entry, original)
        self.strict = True
        self.warned: set = set()


_ABSENT = object()
_state = _State()


# ------------------------------------------------------------------ unsupported options
def _unsupported(name: str, reason: str, original: Callable, args, kwargs):
    """strict: raise naming the option; else warn once and run verl's own ``original``."""
    if _state.strict:
        raise NotImplementedError(
            f"rlvr_kernels' {name}: {reason}. apply(strict=False) runs verl's own {name} for such calls "
            "(with a warning)"
        )
    key = (name, reason)
    if key not in _state.warned:
        _state.warned.add(key)
        warnings.warn(
            f"rlvr_kernels' {name}: {reason}; running verl's own {name} for such calls (apply(strict=False))",
            RuntimeWarning,
            stacklevel=3,
        )
    record(f"{name}[verl]")
    return original(*args, **kwargs)


def _entry(name: str, ours: Callable, original: Callable) -> Callable:
    """``ours`` with the signature of verl's ``original``, counting its calls as ``name``;
    a ``NotImplementedError`` from ours (an option it does not fuse, raised before any
    work) goes to :func:`_unsupported`."""

    @functools.wraps(ours)
    def entry(*args, **kwargs):
        record(name)
        try:
            return ours(*args, **kwargs)
        except NotImplementedError as e:
            return _unsupported(name, str(e), original, args, kwargs)

    entry.__wrapped_verl__ = original
    return entry


# ------------------------------------------------------------------ ppo_loss
def _make_ppo_loss(original: Callable) -> Callable:
    """verl's engine ``ppo_loss`` (same signature, data handling, side effects on
    ``config.global_batch_info`` and metric objects), its arithmetic as one
    :func:`policy_loss_verl` call."""
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.padding import no_padding_2_padding

    def ppo_loss(config, model_output, data, dp_group=None):
        record("verl.ppo_loss")
        loss_mode = config.policy_loss.get("loss_mode", "vanilla")
        reason = None
        if loss_mode not in _ours_core.LOSS_MODES:
            reason = f"config.policy_loss.loss_mode={loss_mode!r} is not fused (fused: {tuple(_ours_core.LOSS_MODES)})"
        elif config.use_kl_loss and config.kl_loss_type not in KL_FUSED and config.kl_loss_type not in KL_UNFUSED:
            reason = f"config.kl_loss_type={config.kl_loss_type!r} is not supported"
        if reason is not None:
            return _unsupported("verl.ppo_loss", reason, original, (config, model_output, data, dp_group), {})

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
    return _state.patcher is not None


def apply(
    *,
    advantages: bool = True,
    policy_loss: bool = True,
    ppo_loss: bool = True,
    logprobs: bool = True,
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
    the previous call.
    """
    import verl

    with _state.lock:
        check_version("verl", getattr(verl, "__version__", "0"), *TESTED_VERSIONS, strict=strict)
        if count_calls is not None:
            set_counting(count_calls)
        if is_applied():
            unapply()
        patcher = Patcher("verl")
        plan = _plan(advantages, policy_loss, ppo_loss, logprobs)  # every lookup first: PatchError changes nothing
        _state.strict = bool(strict)
        _state.warned = set()
        _state.patcher = patcher
        try:
            for kind, owner, attr, new in plan:
                if kind == "attr":
                    original = patcher.replace(owner, attr, new)
                else:  # a registry dict
                    original = owner.get(attr, _ABSENT)
                    _state.registry_saved.append((owner, attr, original))
                    owner[attr] = new
                if callable(original) and original is not new:
                    _state.entries.setdefault(id(new), (new, original))
            _sweep(to_ours=True)
        except BaseException:
            unapply()
            raise


def unapply() -> None:
    """Put back every object apply() replaced (the identical objects) and verl's
    registries as they were; a no-op when not applied."""
    with _state.lock:
        if _state.patcher is None:
            return
        _sweep(to_ours=False)
        _state.patcher.restore()
        while _state.registry_saved:
            registry, name, original = _state.registry_saved.pop()
            if original is _ABSENT:
                registry.pop(name, None)
            else:
                registry[name] = original
        _state.entries.clear()
        _state.patcher = None


def _plan(advantages: bool, policy_loss: bool, ppo_loss: bool, logprobs: bool) -> List[Tuple[str, Any, str, Any]]:
    """Every replacement, as ("attr", owner, name, new) or ("registry", dict, key, new),
    after looking up each original (a moved name raises PatchError here)."""
    plan: List[Tuple[str, Any, str, Any]] = []
    core = Patcher.resolve(_CORE)

    def registry(name: str) -> Dict[str, Any]:
        reg = Patcher.lookup(core, name)
        if not isinstance(reg, dict):
            raise PatchError(f"{_CORE}.{name} is not a dict: verl changed its registry")
        return reg

    for switch, reg_name, table, prefix in (
        (advantages, "ADV_ESTIMATOR_REGISTRY", ADV_ESTIMATORS, "verl.adv."),
        (policy_loss, "POLICY_LOSS_REGISTRY", POLICY_LOSSES, "verl.policy_loss."),
    ):
        if not switch:
            continue
        reg = registry(reg_name)
        for key, (fn_name, ours) in table.items():
            original = Patcher.lookup(core, fn_name)
            if reg.get(key) is not original:
                raise PatchError(f"{_CORE}.{reg_name}[{key!r}] is not {fn_name}: verl changed its registry")
            entry = _entry(prefix + key, ours, original)
            plan.append(("registry", reg, key, entry))
            plan.append(("attr", core, fn_name, entry))
    if ppo_loss:
        new = _make_ppo_loss(Patcher.lookup(_LOSSES, "ppo_loss"))
        plan += _by_name(_PPO_LOSS_USERS, "ppo_loss", Patcher.lookup(_LOSSES, "ppo_loss"), new)
    if logprobs:
        for attr, ours in (("logprobs_from_logits", _ours_tf.logprobs_from_logits), ("entropy_from_logits", None)):
            original = Patcher.lookup(_TF, attr)
            entry = _entry(f"verl.{attr}", ours or _ours_tf.entropy_from_logits, original)
            users = _LOGPROB_USERS if attr == "logprobs_from_logits" else ((_TF, True),)
            plan += _by_name(users, attr, original, entry)
        original = Patcher.lookup(_LCE, "linear_cross_entropy")
        plan += _by_name(
            ((_LCE, True),),
            "linear_cross_entropy",
            original,
            _entry("verl.linear_cross_entropy", _ours_kernel.linear_cross_entropy, original),
        )
    return plan


def _by_name(users, attr: str, original: Any, new: Any) -> List[Tuple[str, Any, str, Any]]:
    out = []
    for module, required in users:
        if not required:
            try:
                mod = Patcher.resolve(module)
            except PatchError:
                continue  # another engine's module, whose extra packages are not installed
        else:
            mod = Patcher.resolve(module)
        if Patcher.lookup(mod, attr) is not original:
            raise PatchError(f"{module}.{attr} is not verl's {attr}: verl changed how it imports it")
        out.append(("attr", mod, attr, new))
    return out


def _sweep(to_ours: bool) -> None:
    """Every loaded verl module's attribute that is a replaced original (``to_ours``) or
    one of our entries (restoring) is set to the other; the replacements go through the
    patcher (restored with the rest), the restorations are direct."""
    pairs = {id(orig if to_ours else new): (orig, new) for new, orig in _state.entries.values()}
    if not pairs:
        return
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "verl" or name.startswith("verl.")):
            continue
        for attr, value in list(vars(module).items()):
            pair = pairs.get(id(value))
            if pair is None or isinstance(value, (int, str, type(None), torch.Tensor)):
                continue
            orig, new = pair
            if to_ours and value is orig:
                _state.patcher.replace(module, attr, new)
            elif not to_ours and value is new:
                setattr(module, attr, orig)
