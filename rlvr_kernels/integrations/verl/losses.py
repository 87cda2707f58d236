"""verl's actor loss, ``verl.workers.utils.losses.ppo_loss`` (pg + kl_loss_coef·kl −
entropy_coeff·entropy), as one fused ``policy_loss`` call: :func:`policy_loss_verl`.

It is not a drop-in (ppo_loss takes verl's model output and TensorDict); it takes the
padded tensors ppo_loss works on, and verl's ``ActorConfig`` (or a DictConfig / dict of
the same fields), parsed once per config content (``_config.read_actor_config``): the
per-call work outside the op is reading the dozen raw config values and the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from ...ops.policy_loss import policy_loss
from ...options import PolicyLossOptions
from .._backend import current_backend
from .._errors import caller_names
from .._torch_math import aggregate
from ._config import ActorLossConfig, batch_info, read_actor_config
from ._losses import (
    KL_FUSED,
    KL_UNFUSED,
    PG_NAMES,
    PgTerm,
    agg_kwargs,
    check_agg_mode,
    check_pg_inputs,
    float_metrics,
    pg_agg,
    pg_agg_kwargs,
    pg_inputs,
    pg_metric_pairs,
    pg_options,
    pg_remainder,
    pg_term,
    recounts_clip,
)
from ._rollout_corr import bypass_correction, bypass_metrics
from .core_algos import kl_penalty

__all__ = ["policy_loss_verl"]


@dataclass(frozen=True)
class _Plan:
    """Everything ``policy_loss_verl`` derives from one config content and the call's
    kind (entropy given or not, fused rollout correction): built once, memoised."""

    term: PgTerm  # the loss_mode and what it reads from config.policy_loss
    agg: str  # config.loss_agg_mode: the KL and entropy terms
    pg_agg: str  # the pg term's (SAPO, geo_mean: their own)
    fused: PolicyLossOptions  # the one fused call (pg, and KL / entropy when they share its agg)
    rest: Optional[PolicyLossOptions]  # SAPO with another agg, geo_mean: KL / entropy in a second call
    clip: PolicyLossOptions  # pg alone: the clip fractions with raw advantages (IcePop weights)
    use_kl: bool
    kl_type: Optional[str]
    kl_fused: Optional[str]
    kl_coef: float
    kl_coef_metric: Any  # config.kl_loss_coef as given (verl's "kl_coef" metric)
    ent_coef: float
    loss_scale_factor: Any


def _plan(cfg: ActorLossConfig, term: PgTerm, has_entropy: bool, rc: Tuple) -> _Plan:
    agg = check_agg_mode(cfg.get("loss_agg_mode", "token-mean"), "config.loss_agg_mode")
    term_agg = pg_agg(term.loss_mode, agg)
    use_kl = cfg.get("use_kl_loss", False)
    if not isinstance(use_kl, (bool, int)):
        raise ValueError(f"config.use_kl_loss: expected a bool, got {use_kl!r}")
    use_kl = bool(use_kl)
    kl_type = cfg.get("kl_loss_type", "low_var_kl") if use_kl else None
    if use_kl and kl_type not in KL_FUSED and kl_type not in KL_UNFUSED:
        raise NotImplementedError(
            f"config.kl_loss_type: expected one of {tuple(KL_FUSED) + KL_UNFUSED}, got {kl_type!r}"
        )
    kl_fused = KL_FUSED.get(kl_type) if use_kl else None
    kl_coef = cfg.number("kl_loss_coef", 0.0) if use_kl else 0.0
    ent_coef = cfg.number("entropy_coeff", 0.0) if has_entropy else 0.0
    lsf = cfg.get("loss_scale_factor", None)
    if lsf is not None and (isinstance(lsf, bool) or not isinstance(lsf, (int, float)) or not 0 < lsf < float("inf")):
        raise ValueError(f"config.loss_scale_factor: expected None or a number > 0, got {lsf!r}")

    extra = dict(rc)  # (bypass_mode: with "bypass", see _rollout_corr.bypass_correction)
    bypass = extra.get("bypass")
    # verl's bypass rejection masks the pg term only: ppo_loss aggregates KL and entropy
    # over the unmodified response_mask, so they take the second call; geo_mean's pg term
    # is a mean over the micro-batch's rows, never the KL / entropy terms'.
    rejects = bypass is not None and bypass[2] is not None and bypass[2].rs_mask != 0
    fuse_rest = term_agg == agg and term.loss_mode != "geo_mean" and not rejects
    if fuse_rest and kl_fused is not None:
        extra.update(kl=kl_fused, kl_coef=kl_coef)
    if fuse_rest and ent_coef != 0:
        extra.update(entropy_coef=ent_coef)
    rest = None
    if not fuse_rest and (kl_fused is not None or ent_coef != 0):
        kl = {"kl": kl_fused, "kl_coef": kl_coef} if kl_fused else {}
        rest = cfg.options("reinforce", agg, entropy_coef=ent_coef or None, **kl)
    return _Plan(
        term=term,
        agg=agg,
        pg_agg=term_agg,
        fused=pg_options(cfg, term, term_agg, **extra),
        rest=rest,
        clip=pg_options(cfg, term, term_agg, bypass=bypass),
        use_kl=use_kl,
        kl_type=kl_type,
        kl_fused=kl_fused,
        kl_coef=kl_coef,
        kl_coef_metric=cfg.get("kl_loss_coef", 0.0),
        ent_coef=ent_coef,
        loss_scale_factor=lsf,
    )


def _parse_is_threshold(spec) -> float:
    """verl's rollout_is_threshold: a float (TIS cap) or "lower_upper" (IcePop)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_is_threshold: expected a float or a string, got {type(spec).__name__}")
    if isinstance(spec, str):
        if "_" in spec.strip():
            raise NotImplementedError(
                f"rollout_is_threshold={spec!r} is verl's IcePop, which keeps the raw weight inside the bounds "
                "(rlvr_kernels' token_mis/seq_mis use weight 1 there): compute verl's rollout_is_weights and pass them "
                "as rollout_is_weights instead"
            )
        try:
            spec = float(spec)
        except ValueError:
            raise ValueError(
                f"rollout_is_threshold: expected a float (or verl's 'lower_upper'), got {spec!r}"
            ) from None
    if not spec > 0 or spec == float("inf"):
        raise ValueError(f"rollout_is_threshold: expected a finite upper bound > 0, got {spec!r}")
    return float(spec)


def _rollout_correction(rollout_is_weights, rollout_log_probs, rollout_is, rollout_is_threshold) -> Tuple:
    """The fused TIS options, as a hashable tuple of (name, value) pairs (empty: none)."""
    if rollout_log_probs is None and rollout_is is None:
        return ()
    if rollout_is_weights is not None:
        raise ValueError("rollout_is_weights: give either the weights or rollout_log_probs with rollout_is, not both")
    if rollout_is not in ("token", "sequence") or rollout_log_probs is None:
        raise ValueError(
            f"rollout_is: expected 'token' or 'sequence' together with rollout_log_probs, got rollout_is={rollout_is!r}"
        )
    return (
        ("rollout_correction", "token_tis" if rollout_is == "token" else "seq_tis"),
        ("rollout_threshold", _parse_is_threshold(rollout_is_threshold)),
    )


def policy_loss_verl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any,
    *,
    entropy: Optional[torch.Tensor] = None,
    ref_log_prob: Optional[torch.Tensor] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    rollout_log_probs: Optional[torch.Tensor] = None,
    rollout_is: Optional[str] = None,
    rollout_is_threshold=2.0,
    dp_size=None,
    batch_num_tokens=None,
    global_batch_size=None,
    return_tensors: bool = False,
    validate: bool = True,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """verl's actor loss (``verl.workers.utils.losses.ppo_loss``) in one fused call:
    ``pg_loss − entropy_coeff·agg(entropy) + kl_loss_coef·agg(kl_penalty)``, every term
    aggregated with ``config.loss_agg_mode`` and ``config.global_batch_info`` (SAPO's pg
    term always seq-mean-token-mean and geo_mean's a mean over the rows, as verl; then the
    KL/entropy terms take a second call when the aggregations differ). clip_cov draws
    verl's torch.randperm from the global RNG, as verl's does.

    ``config`` is read as verl's ActorConfig: ``policy_loss.loss_mode`` (vanilla, gspo,
    cispo, sapo, gpg, dppo_tv, dppo_kl, geo_mean, dro, clip_cov, kl_cov; with their
    ``policy_loss`` fields dro_beta, clip_cov_ratio / clip_cov_lb / clip_cov_ub,
    kl_cov_ratio, ppo_kl_coef, read on every call; bypass_mode with
    ``policy_loss.rollout_correction``), clip ratios, ``clip_ratio_c``, ``tau_pos``/``tau_neg``,
    ``loss_agg_mode``, ``loss_scale_factor``, ``entropy_coeff``, ``use_kl_loss``,
    ``kl_loss_coef``, ``kl_loss_type``, ``global_batch_info`` (parsed once per content;
    ``global_batch_info`` on every call). ``dp_size``, ``batch_num_tokens``,
    ``global_batch_size`` override ``global_batch_info`` (what ppo_loss copies there from
    its data). The entropy term is present iff ``entropy`` is given (it gets the gradient
    −entropy_coeff·∂agg); ``ref_log_prob`` is needed with ``use_kl_loss``.

    Rollout correction, either
      * ``rollout_is_weights``: verl's precomputed weights (any non-negative tensor), folded
        into the advantages (exact; see the note in ``_losses``), or
      * ``rollout_log_probs`` with ``rollout_is`` = "token" / "sequence" and a float
        ``rollout_is_threshold``: verl's TIS weights, computed inside the kernel from
        ``old_log_prob − rollout_log_probs`` (the numbers of verl's
        compute_rollout_correction_weights). verl's IcePop ("lower_upper" threshold) and
        ``rollout_is_batch_normalize`` are not fused: pass their weights as a tensor.

    Returns ``(loss, metrics)`` with ppo_loss's keys: "actor/pg_clipfrac",
    "actor/ppo_kl", "actor/pg_clipfrac_lower" (the pg ones of the verl function: none for
    gpg, ppo_kl for dro / kl_cov, no pg_clipfrac_lower for clip_cov), "actor/pg_loss",
    "actor/entropy_loss" (with ``entropy``), "kl_loss" and "kl_coef" (with use_kl_loss).
    Floats by default (one host sync); ``return_tensors=True`` gives detached 0-d tensors
    and no sync — then, with zero entries in ``rollout_is_weights``, the clip fractions
    leave those tokens out (verl counts them).
    """
    backend = current_backend(backend)
    cfg = read_actor_config(config)
    bypass = None
    if cfg.get("loss_mode", "vanilla") == "bypass_mode":
        # verl's bypass loss: old_log_prob is the rollout's, the correction is computed
        # inside the loss against log_prob, and precomputed rollout_is_weights are ignored.
        bypass = bypass_correction(config)
        rollout_is_weights = None
    rc = _rollout_correction(rollout_is_weights, rollout_log_probs, rollout_is, rollout_is_threshold)
    if bypass is not None:
        rc = rc + (("bypass", bypass),)
    term = pg_term(config, cfg.get("loss_mode", "vanilla"))
    plan = cfg.memo(
        ("policy_loss_verl", term, entropy is not None, rc), lambda: _plan(cfg, term, entropy is not None, rc)
    )

    info = batch_info(config)
    given = dict(dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    prefix = "" if any(v is not None for v in given.values()) else "config.global_batch_info."
    info.update({k: v for k, v in given.items() if v is not None})
    info["loss_scale_factor"] = plan.loss_scale_factor  # as ppo_loss does
    pg_kw = pg_agg_kwargs(term.loss_mode, plan.pg_agg, info, log_prob, prefix)

    if plan.use_kl and ref_log_prob is None:
        raise ValueError("ref_log_prob: config.use_kl_loss needs the reference log-probs")
    check_pg_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    with caller_names(PG_NAMES):
        adv, sel = pg_inputs(
            term, plan.fused, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, validate
        )
        fused = plan.fused
        loss, m = policy_loss(
            log_prob,
            old_log_prob,
            adv,
            response_mask,
            options=fused,
            ref_logprobs=ref_log_prob if fused.kl is not None else None,
            rollout_logprobs=old_log_prob if bypass is not None and fused.rc is not None else rollout_log_probs,
            entropy=entropy if fused.entropy_coef != 0 else None,
            cov_selection=sel,
            validate=validate,
            backend=backend,
            **pg_kw,
        )
        pg_loss, kl_loss = m.pg_loss, m.kl_loss
        pg_rest = pg_remainder(term, old_log_prob, log_prob, response_mask, rollout_is_weights, sel, plan.pg_agg, pg_kw)
        if pg_rest is not None:
            loss = loss + pg_rest
            pg_loss = pg_loss + pg_rest.detach()
        if plan.rest is not None or (plan.use_kl and plan.kl_fused is None) or entropy is not None:
            kw = agg_kwargs(plan.agg, **info, prefix=prefix)
        if plan.rest is not None:
            # SAPO with another loss_agg_mode, geo_mean, or bypass_mode with rejection: KL and
            # entropy in a second call (A = 0, no pg term) over the unmodified mask.
            zeros = torch.zeros(log_prob.shape[0], dtype=torch.float32, device=log_prob.device)
            loss2, m2 = policy_loss(
                log_prob,
                old_log_prob,
                zeros,
                response_mask,
                options=plan.rest,
                ref_logprobs=ref_log_prob if plan.rest.kl is not None else None,
                entropy=entropy if plan.rest.entropy_coef != 0 else None,
                validate=validate,
                backend=backend,
                **kw,
            )
            loss = loss + loss2
            kl_loss = m2.kl_loss
        if plan.use_kl and plan.kl_fused is None:
            kl_val = _agg_verl(kl_penalty(log_prob, ref_log_prob, plan.kl_type), response_mask, plan.agg, kw)
            loss = loss + kl_val * plan.kl_coef
            kl_loss = kl_val.detach()

        clip = m
        if not return_tensors and recounts_clip(term.loss_mode, rollout_is_weights, response_mask):
            with torch.no_grad():  # verl's clip fractions count zero-weight tokens with their own A
                _, clip = policy_loss(
                    log_prob.detach(),
                    old_log_prob,
                    advantages,
                    response_mask,
                    options=plan.clip,
                    validate=False,
                    backend=backend,
                    **pg_kw,
                )
    if bypass is not None and bypass[0] == "reinforce":  # verl's compute_policy_loss_reinforce
        pairs = [("actor/ppo_kl", m.ppo_kl)]
    else:
        pairs = pg_metric_pairs(term.loss_mode, m, clip)
    if bypass is not None:
        with torch.no_grad():
            rc_m = bypass_metrics(bypass[1], log_prob, old_log_prob, response_mask, backend)
        pairs += [(f"rollout_corr/{k}", v) for k, v in rc_m.items()]
    pairs.append(("actor/pg_loss", pg_loss))
    if entropy is not None:
        with torch.no_grad():
            pairs.append(("actor/entropy_loss", _agg_verl(entropy.detach(), response_mask, plan.agg, kw)))
    if plan.use_kl:
        pairs.append(("kl_loss", kl_loss))
    metrics = {k: v.detach() for k, v in pairs} if return_tensors else float_metrics(pairs)
    if plan.use_kl:
        metrics["kl_coef"] = plan.kl_coef_metric
    return loss, metrics


def _agg_verl(x: torch.Tensor, mask: torch.Tensor, agg: str, kw: Dict[str, Any]) -> torch.Tensor:
    """verl's agg_loss of ``x`` (already-checked ``agg_kwargs``)."""
    return aggregate(
        x, mask, agg, kw["dp_size"], kw["global_num_tokens"], kw["global_num_seqs"], kw["loss_scale_factor"]
    )
