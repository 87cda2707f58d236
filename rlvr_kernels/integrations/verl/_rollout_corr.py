"""What the verl rollout-correction drop-ins (``rollout_corr_helper``) and the bypass-mode
loss share: verl's ``rollout_corr_helper`` metrics (their names and values) as 0-d device
tensors, with no host sync, from the weights and keep mask the fused op computed
(:func:`rlvr_kernels.rollout_correction`).

The metrics are verl's formulas on the same tensors verl builds them from (the raw
weights, the per-option divergence statistics), so some of them are elementwise work
here besides the kernel; where verl indexes by a boolean mask (a host sync) or branches
on a count, a masked reduction and ``torch.where`` give the same value.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Optional

import torch

from ...ops.policy_loss import rollout_correction
from ...ops.rollout_mismatch import rollout_mismatch
from ...options import RS_BOUND_FIELDS, RolloutCorrection
from .._backend import current_backend
from .._torch_math import _counts, _masked_sum

SAFETY_BOUND = 20.0
Metrics = Dict[str, torch.Tensor]
# apply(mismatch_metrics=True) sets this (through its patcher): verl's off-policy metrics
# from one rollout_mismatch call instead of verl's formulas (:func:`offpolicy_metrics`).
MISMATCH_OP = False
# verl's compute_offpolicy_metrics names -> the RolloutMismatch field of the same definition
# (docs/rollout-mismatch.md): the same mask and reductions; rollout_mismatch divides by the
# count where verl divides by count + 1e-8.
OFFPOLICY_FIELDS = {
    "training_ppl": "training_ppl",
    "training_log_ppl": "training_log_ppl",
    "kl": "k1",
    "k3_kl": "k3",
    "rollout_ppl": "rollout_ppl",
    "rollout_log_ppl": "rollout_log_ppl",
    "log_ppl_diff": "log_ppl_diff",
    "log_ppl_abs_diff": "log_ppl_abs_diff",
    "log_ppl_diff_max": "log_ppl_diff_max",
    "log_ppl_diff_min": "log_ppl_diff_min",
    "ppl_ratio": "ppl_ratio",
    "chi2_token": "chi2_token",
    "chi2_seq": "chi2_seq",
}


def masked_sum(values, mask, axis=None):
    """verl's masked_sum: values off the mask (NaN included) zeroed, times the mask (the
    shared arithmetic of ``_torch_math``: the same bits in fewer passes)."""
    return _masked_sum(values, mask, axis)


def masked_mean(values, mask, axis=None):
    """verl's masked_mean: masked_sum / (Σ mask + 1e-8)."""
    return masked_sum(values, mask, axis) / (_counts(mask, axis) + 1e-8)


def _where(cond, a, b):
    return torch.where(cond, a, torch.as_tensor(b, dtype=a.dtype, device=a.device))


def _seq_stats(v, valid):
    """mean, unbiased std (0 for one sequence), max, min, |max| of the per-sequence ``v`` over
    the ``valid`` sequences (verl's ``v[valid]`` reductions), each 0 without one."""
    n = valid.sum()
    has = n > 0
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    vz = torch.where(valid, v, zero)
    mean = vz.sum() / n.clamp(min=1)
    var = (torch.where(valid, v - mean, zero).square()).sum() / (n - 1).clamp(min=1)
    std = _where(n > 1, var.sqrt(), 0.0)
    mx = torch.where(valid, v, torch.full_like(v, float("-inf"))).amax() if v.numel() else zero
    mn = torch.where(valid, v, torch.full_like(v, float("inf"))).amin() if v.numel() else zero
    dev = torch.where(valid, v.abs(), zero).amax() if v.numel() else zero
    return tuple(_where(has, x, 0.0) for x in (mean, std, mx, mn, dev))


def _frac(flags, valid):
    """Mean of ``flags`` over the ``valid`` sequences (verl's ``flags[valid].float().mean()``)."""
    return (flags & valid).float().sum() / valid.sum().clamp(min=1)


def is_metrics(weights, raw, log_ratio_for_metrics, mask, level, upper, lower) -> Metrics:
    """verl's compute_is_metrics (``weights`` before batch normalisation), and IcePop's
    ``rollout_is_oob_ratio``."""
    m: Metrics = {}
    dev = weights.device
    low = 1.0 / upper if lower is None else lower
    log_up = torch.log(torch.tensor(upper, device=dev))
    log_lo = torch.log(torch.tensor(low, device=dev))
    mb = mask.bool()
    if level == "sequence":
        lr = log_ratio_for_metrics
        m["rollout_is_max"] = torch.exp(torch.clamp(lr.max(), max=SAFETY_BOUND))
        m["rollout_is_min"] = torch.exp(lr.min())
        m["rollout_is_mean"] = masked_mean(weights, mask)
        m["rollout_is_ratio_fraction_high"] = (lr > log_up).float().mean()
        m["rollout_is_ratio_fraction_low"] = (lr < log_lo).float().mean()
    else:
        m["rollout_is_mean"] = masked_mean(weights, mask)
        m["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).float(), mask)
        m["rollout_is_ratio_fraction_low"] = masked_mean((raw < low).float(), mask)
        m["rollout_is_max"] = weights.masked_fill(~mb, float("-inf")).max()
        m["rollout_is_min"] = weights.masked_fill(~mb, float("inf")).min()
    w = weights.clamp(min=0.0, max=upper)
    mean_w = masked_mean(w, mask)
    var = masked_mean(w.square(), mask) - mean_w.square()
    m["rollout_is_std"] = _where(mask.sum() > 1, torch.sqrt(torch.clamp(var, min=0.0)), 0.0)
    normed = w / (mean_w + 1e-8)
    m["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normed.square(), mask)
    if weights.dim() > 1:
        seq_w = masked_mean(weights, mask, axis=-1)
        m["rollout_is_seq_mean"] = seq_w.mean()
        m["rollout_is_seq_std"] = seq_w.std() if seq_w.numel() > 1 else torch.zeros((), device=dev)
        m["rollout_is_seq_max"] = seq_w.max()
        m["rollout_is_seq_min"] = seq_w.min()
        m["rollout_is_seq_max_deviation"] = (seq_w - 1.0).abs().max()
        raw_seq = masked_mean(raw, mask, axis=-1)
        m["rollout_is_seq_fraction_high"] = (raw_seq > upper).float().mean()
        m["rollout_is_seq_fraction_low"] = (raw_seq < low).float().mean()
    if lower is not None:
        m["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).float(), mask)
    return m


def raw_is_weights(log_ratio, mask, level):
    """verl's raw (pre-truncation) masked weights and the log ratio its metrics read."""
    if level == "token":
        return torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)) * mask, log_ratio
    s = masked_sum(log_ratio, mask, axis=-1).unsqueeze(-1)
    return torch.exp(torch.clamp(s, -SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio) * mask, s


def _rs_option_metrics(name, stat, seq_stat, keep_tok, keep_seq, mask, seq_valid, upper, lower, k1) -> Metrics:
    """verl's compute_rs_metrics for one option plus its masked fractions. ``stat`` per token
    (a sequence option's statistic broadcast), ``seq_stat`` per sequence or None, and
    ``keep_seq`` the option's test on ``seq_stat`` (None for a token option)."""
    m: Metrics = {}
    p = f"rollout_rs_{name}"
    mb = mask.bool()
    seq_level = seq_stat is not None
    seq_v = seq_stat if seq_level else masked_mean(stat, mask, axis=-1)
    has_seq = seq_valid.any()
    if seq_level:
        # A sequence statistic broadcast over its row: its token means are Σ_i v_i·w_i / Σ w
        # with w_i the row's mask sum (verl sums the broadcast [B, L]: the same up to rounding,
        # and exactly for the 0/1 flags of the masked fraction under a bool mask).
        row_w, denom = mask.sum(dim=-1).to(seq_v.dtype), _counts(mask) + 1e-8

        def tok_mean(v):
            return (v * row_w).sum() / denom
    else:
        tok_mean = functools.partial(masked_mean, mask=mask)
    m[f"{p}_mean"] = tok_mean(seq_v if seq_level else stat)
    s_mean, s_std, s_max, s_min, s_dev = _seq_stats(seq_v, seq_valid)
    lo = lower if k1 else 0.0
    if seq_level:
        # A sequence statistic broadcast over its row: its token maximum is the maximum over
        # the rows with a valid token (s_max), and without one verl's token reductions run
        # over no token (max −inf, min +inf, fractions 0): no [B, L] pass needed for them.
        m[f"{p}_max"] = torch.where(has_seq, s_max, float("-inf"))
        m[f"{p}_min"] = torch.where(has_seq, s_min, float("inf"))
        hi_seq, lo_seq = _frac(seq_v > upper, seq_valid), _frac(seq_v < lo, seq_valid)
        m[f"{p}_fraction_high"] = _where(has_seq, hi_seq, 0.0)
        m[f"{p}_fraction_low"] = _where(has_seq, lo_seq, 0.0) if k1 else torch.zeros_like(hi_seq)
    else:
        m[f"{p}_max"] = stat.masked_fill(~mb, float("-inf")).max()
        m[f"{p}_min"] = stat.masked_fill(~mb, float("inf")).min()
        m[f"{p}_fraction_high"] = masked_mean((stat > upper).float(), mask)
        m[f"{p}_fraction_low"] = (
            masked_mean((stat < lo).float(), mask) if k1 else torch.zeros_like(m[f"{p}_fraction_high"])
        )
    # (the std in verl's order of summation, over the [B, L] broadcast: E[c²] − E[c]² cancels,
    # and a sum in another order would move it by far more than its rounding)
    c = stat.clamp(min=lo, max=upper)
    mc = masked_mean(c, mask)
    var = masked_mean(c.square(), mask) - mc.square()
    m[f"{p}_std"] = _where(mask.sum() > 1, torch.sqrt(torch.clamp(var, min=0.0)), 0.0)
    m[f"{p}_seq_mean"], m[f"{p}_seq_std"], m[f"{p}_seq_max"], m[f"{p}_seq_min"] = s_mean, s_std, s_max, s_min
    m[f"{p}_seq_max_deviation"] = s_dev
    m[f"{p}_seq_fraction_high"] = _where(has_seq, _frac(seq_v > upper, seq_valid), 0.0)
    if k1:
        m[f"{p}_seq_fraction_low"] = _where(has_seq, _frac(seq_v < lo, seq_valid), 0.0)
    m[f"{p}_masked_fraction"] = tok_mean(1 - (keep_seq if seq_level else keep_tok).to(stat.dtype))
    # (a sequence option keeps or rejects a whole row: its row flag is the option's test)
    seq_keep = keep_seq | ~seq_valid if seq_level else (~((~keep_tok) & mb)).all(dim=-1)
    m[f"{p}_seq_masked_fraction"] = _where(has_seq, _frac(~seq_keep, seq_valid), 0.0)
    return m


def rs_metrics(rc: RolloutCorrection, log_ratio, mask, keep) -> Metrics:
    """verl's compute_rollout_rejection_mask metrics: per option of ``rc.rs_options`` (its
    statistics as verl forms them) and of the whole chain from the kernel's ``keep``."""
    bounds = dict(zip(RS_BOUND_FIELDS, rc.rs_bounds))
    x = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    forms = {"k1": lambda: -x, "k2": lambda: 0.5 * x**2, "k3": lambda: torch.exp(x) - 1.0 - x}
    tok: Metrics = {}  # each divergence formed once, only where an option reads it
    seq_valid = mask.sum(dim=-1) > 0
    mb = mask.bool()
    m: Metrics = {}
    for opt in rc.rs_options:
        kind = opt[-2:]
        k1 = kind == "k1"
        lo = bounds[f"rs_{opt}_low"] if k1 else None
        hi = bounds[f"rs_{opt}_high"] if k1 else bounds[f"rs_{opt}"]
        if kind not in tok:
            tok[kind] = forms[kind]()
        if opt.startswith("token"):
            stat, seq = tok[kind], None
        else:
            if opt.startswith("seq_sum"):
                seq = masked_sum(tok[kind], mask, axis=-1)
            elif opt.startswith("seq_mean"):
                seq = masked_mean(tok[kind], mask, axis=-1)
            else:
                mx = tok[kind].masked_fill(~mb, float("-inf")).max(dim=-1).values
                seq = torch.where(mx == float("-inf"), torch.zeros_like(mx), mx)
            stat = seq.unsqueeze(-1).expand_as(mask)

        def test(v):
            return (v >= lo) & (v <= hi) if k1 else v <= hi

        keep_seq = None if seq is None else test(seq)
        keep_v = test(stat) if seq is None else keep_seq.unsqueeze(-1).expand_as(mask)
        m.update(_rs_option_metrics(opt, stat, seq, keep_v, keep_seq, mask, seq_valid, hi, lo, k1))
    rejected = mb & (keep == 0)
    m["rollout_rs_masked_fraction"] = masked_mean(rejected.to(log_ratio.dtype), mask)
    m["rollout_rs_seq_masked_fraction"] = rejected.any(dim=-1).float().mean()
    return m


def offpolicy_metrics(old_log_prob, rollout_log_prob: Optional[torch.Tensor], mask) -> Metrics:
    """verl's compute_offpolicy_metrics (with ``MISMATCH_OP`` and rollout log-probs: from
    :func:`offpolicy_from_mismatch`)."""
    if MISMATCH_OP and rollout_log_prob is not None:
        return offpolicy_from_mismatch(old_log_prob, rollout_log_prob, mask)
    m: Metrics = {}
    mean_train = masked_mean(old_log_prob, mask, axis=-1)
    m["training_ppl"] = torch.exp(-mean_train).mean()
    m["training_log_ppl"] = (-mean_train).mean()
    if rollout_log_prob is None:
        return m
    m["kl"] = masked_mean(rollout_log_prob - old_log_prob, mask)
    lr = old_log_prob - rollout_log_prob
    m["k3_kl"] = masked_mean(torch.exp(lr) - lr - 1, mask)
    mean_roll = masked_mean(rollout_log_prob, mask, axis=-1)
    m["rollout_ppl"] = torch.exp(-mean_roll).mean()
    m["rollout_log_ppl"] = (-mean_roll).mean()
    diff = mean_roll - mean_train
    m["log_ppl_diff"] = diff.mean()
    m["log_ppl_abs_diff"] = diff.abs().mean()
    m["log_ppl_diff_max"] = diff.max()
    m["log_ppl_diff_min"] = diff.min()
    m["ppl_ratio"] = torch.exp(diff).mean()
    rho = torch.exp(torch.clamp(lr, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    m["chi2_token"] = masked_mean(rho.square(), mask) - 1.0
    s = torch.clamp(masked_sum(lr, mask, axis=-1), min=-SAFETY_BOUND, max=SAFETY_BOUND)
    m["chi2_seq"] = torch.exp(2.0 * s).mean() - 1.0
    return m


def offpolicy_from_mismatch(old_log_prob, rollout_log_prob, mask) -> Metrics:
    """verl's compute_offpolicy_metrics (rollout log-probs given) as the fields of one
    :func:`rlvr_kernels.rollout_mismatch` call on the padded [B, L] tensors (verl's
    ``response_mask`` is 0/1: its non-zero entries are the valid tokens), in verl's order,
    in the dtype verl's formulas give (the inputs')."""
    m = rollout_mismatch(old_log_prob, rollout_log_prob, mask, backend=current_backend())
    dtype = torch.promote_types(old_log_prob.dtype, rollout_log_prob.dtype)
    return {name: getattr(m, field).to(dtype) for name, field in OFFPOLICY_FIELDS.items()}


def correction_metrics(rc: RolloutCorrection, log_ratio, mask, keep) -> Metrics:
    """Every metric of verl's compute_rollout_correction_weights / _rejection_mask for ``rc``
    (without prefix; no off-policy metrics); ``keep`` the kernel's keep mask. The IS
    statistics are verl's formulas on its truncated weights, formed here from the raw ones
    in verl's order of operations: the kernel's sequence sums run in another order, a few
    ulps apart, which a ratio such as the effective sample size would magnify."""
    m: Metrics = {}
    if rc.is_level is not None:
        raw, lr_metrics = raw_is_weights(log_ratio, mask, rc.is_level)
        upper, lower = rc.is_threshold, rc.is_threshold_low
        if lower is None:
            w = raw.clamp(max=upper)
        else:
            w = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
        m.update(is_metrics(w, raw, lr_metrics, mask, rc.is_level, upper, lower))
        if rc.is_batch_normalize:
            if rc.is_level == "token":
                mean = masked_mean(w, mask)
            else:
                seq_mask = (mask.sum(dim=-1) > 0).to(w.dtype)
                mean = (masked_mean(w, mask, axis=-1) * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
            m["rollout_is_batch_norm_factor"] = torch.where(mean > 1e-8, mean, torch.ones_like(mean))
    if rc.rs_options:
        m.update(rs_metrics(rc, log_ratio, mask, keep))
    return m


def check_world_for_batch_norm(rc: RolloutCorrection) -> None:
    """verl normalises the IS weights over every data-parallel rank (an all-reduce); the
    fused op normalises over its call."""
    if rc.is_level is None or not rc.is_batch_normalize:
        return
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise NotImplementedError(
            "rollout_is_batch_normalize with more than one torch.distributed rank (verl normalises over all "
            "ranks; the fused op over its call)"
        )


def prefixed(metrics: Dict[str, float]) -> Dict[str, float]:
    return {f"rollout_corr/{k}": v for k, v in metrics.items()}


# ------------------------------------------------------------------ bypass mode
# verl's compute_policy_loss_bypass_mode: old_log_prob is the rollout policy's, the
# correction is computed inside the loss against the current log-probs (log_ratio="current").
# loss_type "ppo_clip": verl's vanilla PPO on the kept tokens, no IS weight (its ratio is
# already current / rollout); "reinforce": −A·logπ·w on the kept tokens.
BYPASS_LOSS_TYPES = {"ppo_clip": "ppo", "reinforce": "reinforce"}


def _field(obj, name, default):
    if obj is None:
        return default
    if hasattr(obj, "get"):
        return obj.get(name, default)
    return getattr(obj, name, default)


def bypass_correction(config):
    """``(loss_type, rc, rc_loss)`` of ``config.policy_loss.rollout_correction``: our loss
    type, the full correction (for the metrics) and the one the loss applies (IS weights
    only for reinforce; None when nothing applies)."""
    policy = _field(config, "policy_loss", None)
    rcc = _field(policy, "rollout_correction", None)
    if rcc is None:
        raise ValueError(
            "rollout_correction config not found in policy_loss. "
            "When using loss_mode='bypass_mode', ensure rollout_correction config is passed."
        )
    loss_type = _field(rcc, "loss_type", "ppo_clip")
    if loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"Invalid loss_type: {loss_type}. Must be 'reinforce' or 'ppo_clip'.")
    level, thr = _field(rcc, "rollout_is", None), _field(rcc, "rollout_is_threshold", 2.0)
    if thr is None:
        level = None
    rs, rs_thr = _field(rcc, "rollout_rs", None), _field(rcc, "rollout_rs_threshold", None)
    if rs is not None and rs_thr is None:
        raise ValueError(
            "rollout_rs_threshold must be explicitly provided when rollout_rs is enabled. "
            "Set rollout_rs_threshold to the desired threshold value."
        )
    rc = RolloutCorrection.from_verl(
        level,
        thr if level is not None else 2.0,
        bool(_field(rcc, "rollout_is_batch_normalize", False)),
        rs,
        rs_thr,
        log_ratio="current",
    )
    check_world_for_batch_norm(rc)
    rc_loss = rc if loss_type == "reinforce" else dataclasses.replace(rc, is_level=None, is_batch_normalize=False)
    return BYPASS_LOSS_TYPES[loss_type], rc, (rc_loss if rc_loss.active else None)


def bypass_metrics(rc: RolloutCorrection, log_prob, rollout_log_prob, mask, backend) -> Metrics:
    """verl's bypass-mode rollout_corr metrics (unprefixed tensors): the correction's of the
    current policy against the rollout's, and the off-policy diagnostics."""
    lp, roll = log_prob.detach(), rollout_log_prob.detach()
    m: Metrics = {}
    if rc.active:
        _, keep, _ = rollout_correction(rc, roll, roll, mask, logprobs=lp, validate=False, backend=backend)
        m.update(correction_metrics(rc, lp - roll, mask, keep))
    m.update(offpolicy_metrics(lp, roll, mask))
    return m
