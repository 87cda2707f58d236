"""What the verl policy-loss drop-ins share (``core_algos.compute_policy_loss_*``, the
actor loss ``losses.policy_loss_verl`` and the patched ``ppo_loss``): verl's names for
the op's arguments, verl's loss modes and KL estimators as the op's, the config and
``global_batch_info`` reading, the input checks, the fold of ``rollout_is_weights`` into
the advantages, and the one body of every ``compute_policy_loss_*``."""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Tuple

import torch

from ..._core.validation import FLOAT_DTYPES, MASK_DTYPES, check_tensor, checks_enabled
from ...ops.policy_loss import policy_loss
from .._backend import current_backend
from .._errors import caller_names
from .._torch_math import AGG_MODES, aggregate, times_mask
from ._config import ActorLossConfig, batch_info, read_actor_config
from ._rollout_corr import bypass_correction, bypass_metrics, masked_mean

# policy_loss' argument names -> verl's.
PG_NAMES = {
    "logprobs": "log_prob",
    "old_logprobs": "old_log_prob",
    "mask": "response_mask",
    "ref_logprobs": "ref_log_prob",
    "rollout_logprobs": "rollout_log_probs",
    "global_num_tokens": "batch_num_tokens",
    "global_num_seqs": "global_batch_size",
}


# verl kl_penalty names → our fused estimators (the same numbers and gradients).
KL_FUSED = {
    "kl": "k1",
    "k1": "k1",
    "mse": "k2",
    "k2": "k2",
    "mse+": "k2",
    "k2+": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
    "low_var_kl+": "k3+",
    "k3+": "k3+",
}
# what kl_penalty computes unfused (abs, and the straight-through "+" forms of k1 / abs)
KL_UNFUSED = ("abs", "kl+", "k1+", "abs+")


# =======================================================================================
# Policy losses: compute_policy_loss_*
# =======================================================================================
#
# How verl's pieces map onto one ``policy_loss`` call (preset="verl": δ clamped to ±20,
# dual clip c from the config, k3 clamps, log s_i clamped at 10 for GSPO):
#   vanilla → loss_type="ppo" (clip_ratio_c = config.get("clip_ratio_c", 3.0)),
#   gspo → "gspo", cispo → "cispo", sapo → "sapo" (always aggregated seq-mean-token-mean,
#   as verl does), gpg → "reinforce", dppo_tv → "dppo_tv" and dppo_kl → "dppo_kl" (the
#   divergence thresholds from clip_ratio / clip_ratio_low / clip_ratio_high, the truncation
#   cap config.get("clip_ratio_c", 20.0)), geo_mean → "geo_mean", dro → "dro" (dro_beta),
#   clip_cov → "clip_cov", kl_cov → "kl_cov" (kl_cov_coef = ppo_kl_coef), with verl's
#   covariance selection as cov_selection= (the note before _geo_seq_weights);
#   agg_loss(**config.global_batch_info) → agg, dp_size, global_num_tokens
#   (batch_num_tokens), global_num_seqs (global_batch_size), loss_scale_factor.
#
# ``rollout_is_weights`` (a tensor verl computes before the actor) is folded into the
# advantages (geo_mean: a sequence weight instead, pg_inputs): the loss types above are
# positively homogeneous in A per token —
# pg(w·A) = w·pg(A) for w >= 0 (the clip and dual-clip branches and SAPO's temperature
# depend only on the sign of A, CISPO and GPG are linear, DPPO's trust region depends only
# on the sign of A and its truncated ratio not on A at all) — so the loss and its gradient
# are exact for any non-negative weights (verl's are exp(...) or 0); dro's and kl_cov's
# terms that A does not scale are completed by pg_remainder. Negative weights
# would flip PPO's max/min and SAPO's temperature: they are rejected. The clip-fraction
# metrics see sign(w·A), which is 0 where w = 0 (IcePop); verl counts those tokens with
# their own A, so the float-metric drop-ins recompute the clip fractions with the raw
# advantages (a second, gradient-free call) when some valid weight is 0.

# verl loss_mode → our loss_type.
LOSS_MODES = {
    "vanilla": "ppo",
    "gspo": "gspo",
    "cispo": "cispo",
    "sapo": "sapo",
    "gpg": "reinforce",
    "dppo_tv": "dppo_tv",
    "dppo_kl": "dppo_kl",
    "geo_mean": "geo_mean",
    "dro": "dro",
    "clip_cov": "clip_cov",
    "kl_cov": "kl_cov",
}
# bypass_mode: the loss type and the correction come from config.policy_loss.rollout_correction
# (``_rollout_corr.bypass_correction``), given to pg_options as ``bypass``.
LOSS_MODES["bypass_mode"] = None
# The modes whose pg term verl aggregates its own way, whatever loss_agg_mode says.
OWN_AGG = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-sum"}
# The modes whose clip-fraction metrics read sign(A) (recounted with the raw advantages
# when a valid weight is 0; see the note above).
CLIP_BY_SIGN = ("vanilla", "gspo", "cispo", "dppo_tv", "dppo_kl")


class PgTerm(NamedTuple):
    """What one call's verl ``loss_mode`` reads from ``config.policy_loss`` besides the
    cached fields (checked; hashable, so a memo can key on it): ``options``, the extra
    ``PolicyLossOptions`` fields (dro_beta, kl_cov_coef); ``cov``, the covariance
    selection's (ratio, lb, ub) for clip_cov, (ratio,) for kl_cov."""

    loss_mode: str
    options: Tuple[Tuple[str, float], ...] = ()
    cov: Tuple[float, ...] = ()


def pg_term(config, loss_mode: str) -> PgTerm:
    """The :class:`PgTerm` of ``loss_mode`` (read on every call: these fields are not part of
    the cached config content). An unfused mode raises NotImplementedError naming it."""
    if loss_mode not in LOSS_MODES:
        raise NotImplementedError(
            f"config.policy_loss.loss_mode: rlvr_kernels fuses verl's {tuple(LOSS_MODES)}, got {loss_mode!r}"
        )
    if loss_mode == "dro":
        return PgTerm(loss_mode, (("dro_beta", _dro_beta(config)),))
    if loss_mode in ("clip_cov", "kl_cov"):
        name = f"{loss_mode}_ratio"
        ratio = _cov_field(config, name, 0.0002)
        if not ratio > 0:
            raise ValueError(f"config.policy_loss.{name}: expected a value > 0 (as verl), got {ratio!r}")
        if loss_mode == "kl_cov":
            return PgTerm(loss_mode, (("kl_cov_coef", _cov_field(config, "ppo_kl_coef", 1.0)),), (ratio,))
        return PgTerm(
            loss_mode, (), (ratio, _cov_field(config, "clip_cov_lb", 1.0), _cov_field(config, "clip_cov_ub", 5.0))
        )
    return PgTerm(loss_mode)


def pg_agg(loss_mode: str, loss_agg_mode) -> str:
    """The pg term's aggregation: ``loss_agg_mode`` (checked) or the mode's own (OWN_AGG)."""
    return OWN_AGG.get(loss_mode) or check_agg_mode(loss_agg_mode)


def pg_options(cfg: ActorLossConfig, term: PgTerm, agg: str, bypass=None, **extra):
    """The ``PolicyLossOptions`` of the term's ``loss_mode`` with the config's clip ratios /
    temperatures and the term's fields (memoised per config content); bypass_mode's loss
    type and correction from ``bypass`` (``_rollout_corr.bypass_correction``)."""
    if term.loss_mode == "bypass_mode":
        loss_type, _, rc_loss = bypass
        return cfg.options(loss_type, agg, **extra, **({"rollout_correction": rc_loss} if rc_loss else {}))
    return cfg.options(LOSS_MODES[term.loss_mode], agg, **dict(term.options), **extra)


def check_agg_mode(loss_agg_mode, name: str = "loss_agg_mode") -> str:
    if loss_agg_mode not in AGG_MODES:
        # verl's own message (its callers match on it), naming the argument.
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode} ({name}: expected one of {AGG_MODES})")
    return loss_agg_mode


def _count(name: str, value):
    """A global count of verl's ``global_batch_info``: None, a number >= 0 or a 1-element tensor."""
    if value is None or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < float("inf")):
        raise ValueError(f"{name}: expected a finite count >= 0 (or a 1-element tensor), got {value!r}")
    return value


def agg_kwargs(
    loss_agg_mode,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
    *,
    prefix: str = "",
) -> Dict[str, Any]:
    """verl ``agg_loss`` arguments → ``policy_loss`` keyword arguments (verl's errors
    included); ``prefix`` is where the caller put them (e.g. "config.global_batch_info.")."""
    check_agg_mode(loss_agg_mode)
    dp = 1 if dp_size is None else dp_size
    if isinstance(dp, torch.Tensor) and dp.numel() == 1:
        dp = int(dp)
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"{prefix}dp_size: expected an int >= 1, got {dp_size!r}")
    seq = loss_agg_mode.startswith("seq-mean")
    if loss_agg_mode == "token-mean" and batch_num_tokens is None and dp > 1:
        raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
    if seq and global_batch_size is None and dp > 1:
        raise ValueError("global_batch_size is required when dp_size > 1")
    norm = loss_agg_mode == "seq-mean-token-sum-norm"
    lsf = loss_scale_factor if norm else None  # verl divides by it only in this mode
    if lsf is not None and (isinstance(lsf, bool) or not isinstance(lsf, (int, float)) or not 0 < lsf < float("inf")):
        raise ValueError(f"{prefix}loss_scale_factor: expected a finite number > 0, got {lsf!r}")
    token_mean = loss_agg_mode == "token-mean"
    return dict(
        dp_size=dp,
        global_num_tokens=_count(f"{prefix}batch_num_tokens", batch_num_tokens) if token_mean else None,
        global_num_seqs=_count(f"{prefix}global_batch_size", global_batch_size) if seq else None,
        loss_scale_factor=lsf,
    )


def out_dtype(*tensors) -> torch.dtype:
    """The floating dtype verl's arithmetic on these tensors would produce."""
    dt = None
    for t in tensors:
        if t is not None and t.dtype.is_floating_point:
            dt = t.dtype if dt is None else torch.promote_types(dt, t.dtype)
    return dt or torch.float32


def check_pg_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights=None) -> None:
    """The tensors a policy loss touches before the op does, checked under the caller's names."""
    check_tensor("log_prob", log_prob, dtypes=FLOAT_DTYPES, ndim=(2,))
    check_tensor("old_log_prob", old_log_prob, dtypes=FLOAT_DTYPES)
    check_tensor("advantages", advantages, dtypes=FLOAT_DTYPES)
    check_tensor("response_mask", response_mask, dtypes=MASK_DTYPES)
    if rollout_is_weights is not None:
        check_tensor("rollout_is_weights", rollout_is_weights, dtypes=FLOAT_DTYPES, like=log_prob, like_name="log_prob")


def fold_is_weights(advantages, weights, mask, shape, validate=True):
    """A·w: the loss and gradient of every verl loss type times w (see the section note)."""
    if weights is None:
        return advantages
    try:
        full = torch.broadcast_shapes(weights.shape, shape)
    except RuntimeError:
        full = None
    if full != tuple(shape):
        raise ValueError(
            f"rollout_is_weights: expected a shape broadcastable to {tuple(shape)}, got {tuple(weights.shape)}"
        )
    if checks_enabled(validate, weights):
        bad = ~(weights.detach() >= 0) & (mask != 0)  # negative or NaN on a valid token
        if bool(bad.any()):
            idx = tuple(int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"rollout_is_weights: expected weights >= 0 on valid tokens, got "
                f"{float(weights.detach().expand(shape)[idx])} at {idx}"
            )
    return advantages * weights.detach()


def any_zero_weight(weights, mask) -> bool:
    return weights is not None and bool(((weights.detach() == 0) & (mask != 0)).any())


def float_metrics(pairs) -> Dict[str, float]:
    """One host sync for all the metrics (verl calls .item() per metric)."""
    if not pairs:
        return {}
    values = torch.stack([v.float() for _, v in pairs]).tolist()
    return {k: v for (k, _), v in zip(pairs, values)}


def pg_agg_kwargs(loss_mode: str, agg: str, info: Dict[str, Any], log_prob, prefix: str = "") -> Dict[str, Any]:
    """The ``policy_loss`` aggregation arguments of the pg term: verl's geo_mean is
    torch.mean over the micro-batch's B rows (empty ones included) whatever
    ``global_batch_info`` says, i.e. seq-mean-token-sum of the L_i / n_i shares with
    global_num_seqs = B and dp_size = 1; every other mode ``agg_loss(**global_batch_info)``."""
    if loss_mode == "geo_mean":
        return dict(dp_size=1, global_num_tokens=None, global_num_seqs=log_prob.shape[0], loss_scale_factor=None)
    return agg_kwargs(agg, **info, prefix=prefix)


def pg_inputs(term: PgTerm, opts, old_log_prob, log_prob, advantages, response_mask, weights, validate=True):
    """The op's advantages and ``cov_selection`` for the term: A·w folded (see the note),
    geo_mean's A·s_i with its sequence weight s_i, and clip_cov's / kl_cov's selection built
    with verl's arithmetic (clip_cov draws torch.randperm from the global RNG exactly when
    verl does)."""
    if term.loss_mode == "geo_mean":
        adv = advantages
        if weights is not None:
            fold_is_weights(advantages, weights, response_mask, log_prob.shape, validate)  # (the checks)
            adv = advantages * _geo_seq_weights(weights.expand(log_prob.shape), response_mask)[:, None]
    else:
        adv = fold_is_weights(advantages, weights, response_mask, log_prob.shape, validate)
    sel = None
    if term.loss_mode == "clip_cov":
        ratio, lb, ub = term.cov
        sel = clip_cov_selection(
            old_log_prob, log_prob, advantages, response_mask, opts.clip_low, opts.clip_high, ratio, lb, ub
        )
    elif term.loss_mode == "kl_cov":
        sel = kl_cov_selection(log_prob, advantages, response_mask, term.cov[0])
    return adv, sel


def pg_remainder(term: PgTerm, old_log_prob, log_prob, response_mask, weights, sel, agg, agg_kw):
    """What the fold leaves out, aggregated as the op's call (None when nothing): with
    ``rollout_is_weights`` w, dro's ½·β·δ² and kl_cov's coef·|δ| on the selected tokens
    are scaled by w but not by A, so (w − 1) times them is added in lean torch."""
    if weights is None or term.loss_mode not in ("dro", "kl_cov"):
        return None
    w1 = weights.detach() - 1
    if term.loss_mode == "dro":
        values = 0.5 * dict(term.options)["dro_beta"] * w1 * (log_prob - old_log_prob).square()
    else:
        values = dict(term.options)["kl_cov_coef"] * w1 * (log_prob - old_log_prob).abs() * sel
    return aggregate_like(values, response_mask, agg, agg_kw)


def recounts_clip(loss_mode: str, weights, mask) -> bool:
    """Whether verl's clip fractions need the gradient-free call with the raw advantages."""
    return loss_mode in CLIP_BY_SIGN and any_zero_weight(weights, mask)


def pg_metric_pairs(loss_mode: str, m, clip) -> List[Tuple[str, torch.Tensor]]:
    """The pg metrics verl's ``compute_policy_loss_<loss_mode>`` returns, in its order
    (``clip``: the metrics to take the clip fractions from)."""
    if loss_mode == "gpg":
        return []
    if loss_mode in ("dro", "kl_cov"):
        return [("actor/ppo_kl", m.ppo_kl)]
    if loss_mode == "clip_cov":
        return [("actor/pg_clipfrac", clip.pg_clipfrac), ("actor/ppo_kl", m.ppo_kl)]
    return [
        ("actor/pg_clipfrac", clip.pg_clipfrac),
        ("actor/ppo_kl", m.ppo_kl),
        ("actor/pg_clipfrac_lower", clip.pg_clipfrac_lower),
    ]


def policy_loss_body(
    loss_mode: str, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
):
    """The one body of every ``compute_policy_loss_*`` drop-in."""
    cfg = read_actor_config(config)
    term = pg_term(config, loss_mode)
    agg = pg_agg(loss_mode, loss_agg_mode)
    opts = pg_options(cfg, term, agg)
    info = {} if loss_mode == "geo_mean" else batch_info(config)  # verl's geo_mean does not read it
    agg_kw = pg_agg_kwargs(loss_mode, agg, info, log_prob, prefix="config.global_batch_info.")
    check_pg_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    if loss_mode == "gpg":
        return _gpg_loss(log_prob, advantages, response_mask, agg, rollout_is_weights, agg_kw), {}
    backend = current_backend()
    with caller_names(PG_NAMES):
        adv, sel = pg_inputs(term, opts, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
        loss, m = policy_loss(
            log_prob, old_log_prob, adv, response_mask, options=opts, cov_selection=sel, backend=backend, **agg_kw
        )
        rest = pg_remainder(term, old_log_prob, log_prob, response_mask, rollout_is_weights, sel, agg, agg_kw)
        if rest is not None:
            loss = loss + rest
        loss = loss.to(out_dtype(log_prob, old_log_prob, advantages, rollout_is_weights))
        clip = m
        if recounts_clip(loss_mode, rollout_is_weights, response_mask):
            with torch.no_grad():  # verl's clip fractions count zero-weight tokens with their own A
                _, clip = policy_loss(
                    log_prob.detach(), old_log_prob, advantages, response_mask, options=opts, backend=backend, **agg_kw
                )
    return loss, float_metrics(pg_metric_pairs(loss_mode, m, clip))


class _NegLogpTimesAdv(torch.autograd.Function):
    """verl's ``-log_prob * advantages`` (the same number: negation is exact) for constant
    advantages, with a backward of one multiply (autograd's: a multiply and a negation)."""

    @staticmethod
    def forward(ctx, log_prob: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(advantages)
        ctx.shape = log_prob.shape
        return torch.mul(log_prob, advantages).neg_()

    @staticmethod
    def backward(ctx, grad):
        (advantages,) = ctx.saved_tensors
        g = torch.mul(grad, advantages).neg_()
        return (g if tuple(g.shape) == tuple(ctx.shape) else g.sum_to_size(ctx.shape)), None


def _broadcasts_to(t: torch.Tensor, shape) -> bool:
    try:
        return torch.broadcast_shapes(t.shape, shape) == tuple(shape)
    except RuntimeError:
        return False


def _gpg_loss(log_prob, advantages, response_mask, agg, rollout_is_weights, agg_kw) -> torch.Tensor:
    """GPG, −logπ·A (·w), aggregated: no ratio, no clip and no metrics, so elementwise
    work and one masked reduction, run as verl writes it (the same bits) with the lean
    aggregation below; like verl it reads neither old_log_prob nor the sign of w."""
    for name, t in (
        ("advantages", advantages),
        ("response_mask", response_mask),
        ("rollout_is_weights", rollout_is_weights),
    ):
        if t is not None and not _broadcasts_to(t, log_prob.shape):
            raise ValueError(
                f"{name}: expected a shape broadcastable to log_prob's {tuple(log_prob.shape)}, got {tuple(t.shape)}"
            )
    agg_args = (agg_kw["dp_size"], agg_kw["global_num_tokens"], agg_kw["global_num_seqs"], agg_kw["loss_scale_factor"])
    if (
        log_prob.device.type == "cpu"
        and response_mask.dtype == torch.bool
        and response_mask.shape == log_prob.shape == advantages.shape
        and rollout_is_weights is None
        and not advantages.requires_grad
    ):
        # The mask folded into the advantages first, c = A·m (A or 0: the same numbers as
        # verl's masked products), so the per-token losses −logπ·c are already masked and
        # are summed as they are: three fresh [B, L] buffers in all, forward and backward.
        # A non-finite result (maybe a NaN on padding, which verl's where zeroes) is redone
        # verl's way below.
        c = times_mask(advantages.detach(), response_mask.view(torch.uint8))
        loss = aggregate(_NegLogpTimesAdv.apply(log_prob, c), response_mask, agg, *agg_args, masked=True)
        if bool(torch.isfinite(loss)):
            return loss
    if advantages.requires_grad:
        pg_losses = -log_prob * advantages
    else:
        pg_losses = _NegLogpTimesAdv.apply(log_prob, advantages)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return aggregate(pg_losses, response_mask, agg, *agg_args)


# geo_mean, dro, clip_cov and kl_cov: what pg_inputs / pg_remainder build for them.
# verl's geo_mean is a sequence-level term (see pg_agg_kwargs) with a sequence IS weight,
# the geometric mean of the token weights s_i > 0, which multiplies Ā_i, hence the
# advantages (exact: Ā_i is linear in A and sign(s·A) = sign(A)). dro's ½·β·δ² and
# kl_cov's coef·|δ| are not scaled by A (pg_remainder). clip_cov's and kl_cov's covariance
# selection is built with verl's own arithmetic (clip_cov's torch.randperm from the global
# RNG, kl_cov's torch.topk on the CPU), so that under the same torch seed the same tokens
# are treated apart, and given to the kernel as cov_selection=. Their defaults are verl's
# (ratio 2e-4, bounds 1 / 5, coefficient 1).


def _geo_seq_weights(weights, mask):
    """verl's sequence weight of geo_mean, exp(Σ_t m·log(w + 1e-10) / (n + 1e-8)), per row."""
    m = mask.to(weights.dtype)
    n = m.sum(-1)
    return torch.exp((torch.log(weights.detach() + 1e-10) * m).sum(-1) / (n + 1e-8))


def _policy_loss_field(config, name, default=None):
    """``config.policy_loss.<name>`` (a dataclass, DictConfig or dict), ``default`` when unset."""
    policy = getattr(config, "policy_loss", None) if not isinstance(config, dict) else config.get("policy_loss")
    value = None if policy is None else (policy.get(name, None) if hasattr(policy, "get") else None)
    if value is None and policy is not None:
        value = getattr(policy, name, None)
    return default if value is None else value


def aggregate_like(values, response_mask, agg, agg_kw):
    """``values`` aggregated in lean torch as the ``policy_loss`` call with ``agg_kw`` aggregates."""
    return aggregate(
        values,
        response_mask,
        agg,
        agg_kw["dp_size"],
        agg_kw["global_num_tokens"],
        agg_kw["global_num_seqs"],
        agg_kw["loss_scale_factor"],
    )


def _dro_beta(config):
    beta = _policy_loss_field(config, "dro_beta")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
        raise ValueError(f"config.policy_loss.dro_beta: DRO needs a positive value, got {beta!r}")
    return float(beta)


def _cov_field(config, name, default):
    value = _policy_loss_field(config, name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"config.policy_loss.{name}: expected a number, got {value!r}")
    return float(value)


@torch.no_grad()
def clip_cov_selection(old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high, ratio, lb, ub):
    """verl's Clip-Cov choice: the valid tokens the PPO clip leaves alone with
    lb < cov_t < ub, cov_t = (A − mean A)·(logπ − mean logπ) (masked means); of them
    max(⌊ratio·N⌋, 1) (at most all) in the order of torch.randperm (the global RNG)."""
    lp = log_prob.detach()
    r = torch.exp(lp - old_log_prob)
    clipped = (-advantages * torch.clamp(r, 1 - clip_low, 1 + clip_high) > -advantages * r) & (response_mask > 0)
    cov = (advantages - masked_mean(advantages, response_mask)) * (lp - masked_mean(lp, response_mask))
    cand = (cov < ub) & (cov > lb) & (response_mask > 0) & ~clipped
    idx = torch.nonzero(cand)
    sel = torch.zeros(cand.shape, dtype=torch.bool, device=cand.device)
    if len(idx) > 0:
        k = max(int(ratio * response_mask.sum().item()), 1)
        idx = idx[torch.randperm(len(idx))[: min(k, len(idx))]]
        sel[idx[:, 0], idx[:, 1]] = True
    return sel


@torch.no_grad()
def kl_cov_selection(log_prob, advantages, response_mask, ratio):
    """verl's KL-Cov choice: of the N valid tokens, the max(1, ⌊N·ratio⌋) with the largest
    cov_t = (A − mean A)·(logπ − mean logπ) (plain means over the valid tokens, on the CPU),
    in torch.topk's order; none when N = 0."""
    valid = response_mask > 0
    flat_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    # (verl's advantages[valid] / log_prob[valid]: the same values in the same order, taken
    # with the one nonzero above instead of a boolean index's own each)
    adv = advantages.detach().expand(valid.shape).reshape(-1)[flat_idx].cpu()
    lp = log_prob.detach().reshape(-1)[flat_idx].cpu()
    sel = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    if len(adv) > 0:
        cov = (adv - adv.mean()) * (lp - lp.mean())
        top = torch.topk(cov, max(1, int(len(cov) * ratio)), largest=True).indices
        sel[flat_idx[top.to(flat_idx.device)]] = True
    return sel.reshape(valid.shape)


def bypass_body(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights):
    """verl's compute_policy_loss_bypass_mode as one ``policy_loss`` call (the rejection and,
    for reinforce, the IS weights inside the kernel, against the current log-probs) and the
    rollout_corr metrics (:func:`_rollout_corr.bypass_metrics`); ``rollout_is_weights`` is
    ignored, as verl does."""
    bypass = bypass_correction(config)
    cfg = read_actor_config(config)
    agg = check_agg_mode(loss_agg_mode)
    opts = pg_options(cfg, PgTerm("bypass_mode"), agg, bypass=bypass)
    agg_kw = agg_kwargs(agg, **batch_info(config), prefix="config.global_batch_info.")
    check_pg_inputs(old_log_prob, log_prob, advantages, response_mask)
    backend = current_backend()
    with caller_names(PG_NAMES):
        loss, m = policy_loss(
            log_prob,
            old_log_prob,
            advantages,
            response_mask,
            options=opts,
            rollout_logprobs=old_log_prob if opts.rc is not None else None,
            backend=backend,
            **agg_kw,
        )
        loss = loss.to(out_dtype(log_prob, old_log_prob, advantages))
        rc_m = bypass_metrics(bypass[1], log_prob, old_log_prob, response_mask, backend)
    pairs = [("actor/ppo_kl", m.ppo_kl)]
    if bypass[0] == "ppo":
        pairs = [("actor/pg_clipfrac", m.pg_clipfrac), pairs[0], ("actor/pg_clipfrac_lower", m.pg_clipfrac_lower)]
    metrics = float_metrics(pairs + [(f"rollout_corr/{k}", v) for k, v in rc_m.items()])
    return loss, metrics
