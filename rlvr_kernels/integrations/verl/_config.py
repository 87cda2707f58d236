"""What the verl drop-ins read from verl's actor config, parsed once per content.

The actor config (verl's ``ActorConfig`` dataclass, an OmegaConf ``DictConfig`` or a plain
dict) is read on every call, but only as the raw values of the dozen fields the losses
use; the parse (checks, defaults, the resolved :class:`PolicyLossOptions`) is cached by
those values (:func:`read_actor_config`). Keying by content rather than by object identity
means a mutated config, or a new config that reuses a dead one's ``id``, can never get a
stale parse: different values are a different key, equal values parse to the same
result. What a call pays is the raw read: attribute reads for dataclasses and dicts, and
for a ``DictConfig`` the stored node values (OmegaConf's ``get`` costs ~5 µs a field, a
fifth of a millisecond per call). A ``DictConfig`` field holding an interpolation
(``${...}``) or ``???`` is read through OmegaConf's public API instead, which resolves it.

``global_batch_info`` is not part of the key: verl's ``ppo_loss`` rewrites it on every
step, so it is read on every call (:func:`batch_info`).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Dict, Optional, Tuple

from ...options import PolicyLossOptions, resolve_policy_loss_options
from .._errors import caller_names


class _Absent:
    """A field the config does not have (distinct from a field set to None)."""

    def __repr__(self) -> str:
        return "<absent>"


ABSENT = _Absent()
_UNREAD = object()  # a DictConfig value the raw read cannot take (interpolation, missing)

# The ActorConfig fields the losses read, in snapshot order; policy_loss.loss_mode comes last.
FIELDS = (
    "clip_ratio",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "tau_pos",
    "tau_neg",
    "loss_agg_mode",
    "loss_scale_factor",
    "entropy_coeff",
    "use_kl_loss",
    "kl_loss_coef",
    "kl_loss_type",
)
BATCH_INFO_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")
_CACHE_SIZE = 64

# PolicyLossOptions field -> the config field (or argument) a verl caller sets it with.
_OPTION_SOURCES = {
    "clip_ratio_c": "config.clip_ratio_c",
    "tau_pos": "config.tau_pos",
    "tau_neg": "config.tau_neg",
    "kl_coef": "config.kl_loss_coef",
    "entropy_coef": "config.entropy_coeff",
    "rollout_threshold": "rollout_is_threshold",
    "agg": "loss_agg_mode",
    "dro_beta": "config.policy_loss.dro_beta",
    "kl_cov_coef": "config.policy_loss.ppo_kl_coef",
}


# ------------------------------------------------------------------ the parsed config
class ActorLossConfig:
    """The actor-loss fields of one verl config content (raw values, ``ABSENT`` when the
    config lacks the field), with checked accessors that name the config field, and a memo
    for what callers derive from them (options, plans)."""

    __slots__ = FIELDS + ("loss_mode", "_memo")

    def __init__(self, values: Tuple[Any, ...]):
        for name, value in zip(FIELDS + ("loss_mode",), values):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_memo", {})

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is read-only")

    def get(self, name: str, default: Any) -> Any:
        value = getattr(self, name)
        return default if value is ABSENT else value

    def memo(self, key, build: Callable[[], Any]) -> Any:
        """``build()``, once per ``key`` for this config content (a failure is not cached)."""
        try:
            return self._memo[key]
        except KeyError:
            value = self._memo[key] = build()
            return value

    def number(self, name: str, default: Any = ABSENT) -> float:
        value = self.get(name, default)
        if value is ABSENT:
            raise ValueError(f"config.{name}: the config has no {name}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ValueError(f"config.{name}: expected a number, got {value!r}")
        return float(value)

    def clip_eps(self) -> Tuple[Tuple[str, float], Tuple[str, float]]:
        """``((field, ε_low), (field, ε_high))``: clip_ratio_low / clip_ratio_high, each
        defaulting to clip_ratio (verl's rule), with the field each value came from."""
        out = []
        for side in ("clip_ratio_low", "clip_ratio_high"):
            name = side if self.get(side, None) is not None else "clip_ratio"
            if self.get(name, None) is None:
                raise ValueError(
                    "config.clip_ratio: expected clip_ratio (or clip_ratio_low and clip_ratio_high), "
                    "as verl's ActorConfig"
                )
            out.append((name, self.number(name)))
        return out[0], out[1]

    def options(self, loss_type: str, agg: str, **fields) -> PolicyLossOptions:
        """``resolve_policy_loss_options("verl", ...)`` (memoised); an invalid value raises
        naming the config field it came from."""
        key = ("options", loss_type, agg, tuple(sorted(fields.items())))
        return self.memo(key, lambda: self._options(loss_type, agg, fields))

    def _options(self, loss_type: str, agg: str, fields: Dict[str, Any]) -> PolicyLossOptions:
        fields = dict(fields, loss_type=loss_type, agg=agg)
        sources = dict(_OPTION_SOURCES)
        if loss_type in ("ppo", "gspo", "cispo", "dppo_tv", "dppo_kl", "geo_mean", "clip_cov"):
            (low_name, fields["clip_low"]), (high_name, fields["clip_high"]) = self.clip_eps()
            sources.update(clip_low=f"config.{low_name}", clip_high=f"config.{high_name}")
        if loss_type == "ppo":
            fields["clip_ratio_c"] = self.number("clip_ratio_c", 3.0)  # verl: config.get("clip_ratio_c", 3.0)
        if loss_type in ("dppo_tv", "dppo_kl"):
            fields["clip_ratio_c"] = self.number("clip_ratio_c", 20.0)  # verl: config.get("clip_ratio_c", 20.0)
        if loss_type == "sapo":
            fields["tau_pos"], fields["tau_neg"] = self.number("tau_pos"), self.number("tau_neg")
        with caller_names(sources):
            opts = resolve_policy_loss_options("verl", **fields)
        if loss_type in ("clip_cov", "kl_cov"):  # verl's clip_cov / kl_cov do not clamp δ
            opts = dataclasses.replace(opts, log_ratio_clamp=None)
        return opts


def read_actor_config(config: Any) -> ActorLossConfig:
    """The parsed actor-loss fields of ``config`` (cached by their values; see the module
    docstring)."""
    if config is None:
        raise ValueError("config: verl's policy losses read the clip ratios and global_batch_info from it; got None")
    values = _snapshot(config)
    try:
        key = (values, tuple(map(type, values)))  # 1 and 1.0 and True are different keys
        return _CACHE[key]
    except TypeError:  # an unhashable value (a list, ...): parse without caching
        return ActorLossConfig(values)
    except KeyError:
        pass
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))  # the oldest entry
    parsed = _CACHE[key] = ActorLossConfig(values)
    return parsed


_CACHE: Dict[Tuple, ActorLossConfig] = {}


def batch_info(config: Any) -> Dict[str, Any]:
    """``config.global_batch_info`` as a dict (read on every call: verl rewrites it per step)."""
    info = _raw_mapping(config, "global_batch_info")
    if info is None or info is ABSENT:
        return {}
    unknown = sorted(set(info) - set(BATCH_INFO_KEYS))
    if unknown:
        raise TypeError(f"config.global_batch_info: unexpected keys {unknown}; verl's agg_loss takes {BATCH_INFO_KEYS}")
    return info


# ------------------------------------------------------------------ raw reads
def _snapshot(config: Any) -> Tuple[Any, ...]:
    """The raw values of :data:`FIELDS` and of ``policy_loss.loss_mode``."""
    if _is_dictconfig(config):
        values = _dictconfig_values(config)
        if values is not None:
            return values
    get = _getter(config)
    values = [get(config, name) for name in FIELDS]
    policy = get(config, "policy_loss")
    values.append(ABSENT if policy is ABSENT or policy is None else _getter(policy)(policy, "loss_mode"))
    return tuple(values)


def _getter(obj: Any) -> Callable[[Any, str], Any]:
    """``obj.get(name, ABSENT)`` for mappings and verl's BaseConfig, else ``getattr``."""
    if callable(getattr(obj, "get", None)):
        return lambda o, name: o.get(name, ABSENT)
    return lambda o, name: getattr(o, name, ABSENT)


def _is_dictconfig(obj: Any) -> bool:
    omegaconf = sys.modules.get("omegaconf")  # not imported: obj cannot be a DictConfig
    return omegaconf is not None and isinstance(obj, omegaconf.DictConfig)


def _node_value(node: Any) -> Any:
    """A DictConfig node's stored value, or ``_UNREAD`` where OmegaConf must resolve it."""
    value_of = getattr(node, "_value", None)
    if value_of is None or _is_dictconfig(node):
        return _UNREAD
    value = value_of()
    if isinstance(value, str) and ("${" in value or value == "???"):
        return _UNREAD
    return value


def _dictconfig_values(cfg: Any) -> Optional[Tuple[Any, ...]]:
    """The fields' stored values, read from the config's nodes (OmegaConf internals, so any
    surprise returns None and the caller reads through the public API)."""
    try:
        content = cfg.__dict__["_content"]
        if not isinstance(content, dict):
            return None
        values = []
        for name in FIELDS:
            node = content.get(name)
            value = ABSENT if node is None else _node_value(node)
            if value is _UNREAD:
                return None
            values.append(value)
        policy = content.get("policy_loss")
        if policy is None:
            values.append(ABSENT)
        elif _is_dictconfig(policy):
            inner = policy.__dict__["_content"]
            if not isinstance(inner, dict):
                return None
            node = inner.get("loss_mode")
            value = ABSENT if node is None else _node_value(node)
            if value is _UNREAD:
                return None
            values.append(value)
        else:
            return None
        return tuple(values)
    except (AttributeError, KeyError, TypeError):
        return None


def _raw_mapping(config: Any, name: str) -> Any:
    """``dict(config.<name>)`` (plain values), ``ABSENT`` or None."""
    if _is_dictconfig(config):
        try:
            node = config.__dict__["_content"].get(name)
            if node is None:
                return ABSENT
            if _is_dictconfig(node):
                content = node.__dict__["_content"]
                if isinstance(content, dict):
                    out = {k: _node_value(v) for k, v in content.items()}
                    if all(v is not _UNREAD for v in out.values()):
                        return out
        except (AttributeError, KeyError, TypeError):
            pass
        from omegaconf import OmegaConf

        value = config.get(name, None)
        return OmegaConf.to_container(value, resolve=True) if _is_dictconfig(value) else value
    value = _getter(config)(config, name)
    return value if value is ABSENT or value is None else dict(value)
