"""Reference ``policy_loss`` and ``shape_token_advantages`` (docs/token-shaping.md, docs/policy-loss.md): plain PyTorch,
autograd through ordinary ops, fp64-capable, written for reading, not for speed.

Everything works on the padded ``[B, L]`` layout; the packed ``[T]`` layout is scattered
into it and the results gathered back, so both layouts share one definition.

Gradients flow to ``logprobs`` and ``entropy`` only: old, reference and rollout log-probs
and the advantages are constants of the loss (every trainer detaches them).

The stages, in order (the C++ ``csrc/policy_loss.cpp`` and Triton ``triton/policy_loss.py``
kernels have one helper per stage, named after these, so each can be read against this file
function by function):

- ``pg_term``: the ratio (``log_ratio``; ``gspo_ratio``) and one ``*_term`` per loss type
  (``ppo_term``, ``gspo_term``, ``cispo_term``, ``sapo_term``, ``reinforce_term``,
  ``dppo_term`` for dppo_tv and dppo_kl, ``geo_mean_term``, ``dro_term``, ``clip_cov_term``,
  ``kl_cov_term``); ppo and gspo take
  ``clipped_objective`` then ``dual_clip``, dppo ``dppo_ratio`` and ``dppo_keep``, geo_mean
  ``geo_mean_log_ratio``; ``clip_sides`` for the metrics;
- ``shaping_weights`` (``polarity_weights`` × ``probability_weights`` × ``a3po_scales`` ×
  ``entropy_keep``);
- ``is_weights``;
- ``kl_term``: ``kl_estimate`` (k1, k2, k3, k3+), times ``importance_ratio`` with
  ``kl_ratio_correction``;
- ``token_loss``: ℓ = pg·w·is_w + β·kl − c_H·H;
- ``aggregate``: the per-token loss (and the pg / kl metrics) over the valid tokens, by ``agg``.

Context parallelism (``cp_group``): ``seq_statistics`` (a rank's per-sequence sums over its
slice), ``seq_rejection`` (the rejection chain's sequence options on the reduced sums) and
``policy_loss(seq_stats=...)``, which reads every sequence-level quantity from them.

The entropy-quantile threshold and the packed layout's validity are the kernel contract's own
definitions (:mod:`rlvr_kernels.contracts.policy_loss`), shared with the op layer.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from .._core.layout import packed_mask
from .._core.layout import safe_div as _safe_div
from ..contracts.policy_loss import (
    NUM_SEQ_STATS,
    SEQ_STAT_MAXIMA,
    SeqStat,
    cov_selection_of,
    entropy_quantile_threshold,
)
from ..options import PolicyLossMetrics, PolicyLossOptions, TokenShaping


# ------------------------------------------------------------------ layout helpers
def to_padded(x: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], fill=0) -> Optional[torch.Tensor]:
    """Packed ``[T]`` → padded ``[B, Lmax]`` (differentiable); padded input unchanged."""
    if x is None or cu_seqlens is None:
        return x
    cu = [int(c) for c in cu_seqlens]
    B = len(cu) - 1
    Lmax = max([cu[i + 1] - cu[i] for i in range(B)] + [0])
    rows = []
    for i in range(B):
        row = x[cu[i] : cu[i + 1]]
        pad = x.new_full((Lmax - row.shape[0],), fill)
        rows.append(torch.cat([row, pad]))
    return torch.stack(rows) if rows else x[:0].reshape(0, 0)  # keeps the autograd edge


def from_padded(y: torch.Tensor, cu_seqlens: Optional[torch.Tensor], num_tokens: int) -> torch.Tensor:
    """Padded ``[B, Lmax]`` → packed ``[T]`` (tokens beyond ``cu_seqlens[-1]`` get 0)."""
    if cu_seqlens is None:
        return y
    cu = [int(c) for c in cu_seqlens]
    parts = [y[i, : cu[i + 1] - cu[i]] for i in range(len(cu) - 1)]
    tail = y.new_zeros((num_tokens - cu[-1],)) + y.reshape(-1)[:0].sum()  # (an empty sum keeps the edge)
    return torch.cat(parts + [tail])


# ------------------------------------------------------------------ shaping (docs/token-shaping.md)
# The shaping weight w multiplies the policy-gradient term; it is a constant (no gradient),
# formed in fp64: polarity_weights × probability_weights × a3po_scales × entropy_keep.
def polarity_weights(adv: torch.Tensor, shaping: TokenShaping) -> torch.Tensor:
    """w_pos for A > 0, w_neg for A < 0, 1 for A = 0 (``adv`` in fp64)."""
    one = adv.new_ones(())
    return torch.where(adv > 0, one * shaping.w_pos, torch.where(adv < 0, one * shaping.w_neg, one))


def probability_weights(adv: torch.Tensor, old_logprobs: torch.Tensor, shaping: TokenShaping) -> torch.Tensor:
    """(1 − λ) + λ·w with w = 1 − p for A > 0, p for A < 0 (0 for A = 0), p = exp(old)."""
    p = old_logprobs.detach().double().exp()
    wp = torch.where(adv > 0, 1 - p, torch.where(adv < 0, p, torch.zeros_like(p)))
    lam = shaping.probability
    return (1 - lam) + lam * wp


def a3po_scales(adv: torch.Tensor, metric: torch.Tensor, valid: torch.Tensor, shaping: TokenShaping) -> torch.Tensor:
    """Per-token product of the A3PO knob scales (padded layout), a Python loop per sequence:
    the sequence's polarity is the sign of Σ_t A·m; each knob (ratio, scale) of that polarity
    scales the k = max(1, ⌊n·ratio⌋) highest / lowest-metric candidates (valid, metric ≠ 0)."""
    scales = torch.ones_like(adv, dtype=torch.float64)
    B = adv.shape[0]
    for i in range(B):
        pol = float((adv[i].double() * valid[i]).sum())
        if pol == 0:
            continue
        cand = (valid[i] & (metric[i] != 0)).nonzero().flatten().tolist()
        n = len(cand)
        if n == 0:
            continue
        knobs = shaping.a3po_knobs[:2] if pol > 0 else shaping.a3po_knobs[2:]
        for (ratio, scale), high in zip(knobs, (True, False)):
            if not (ratio > 0 and scale != 1):
                continue
            k = max(1, int(n * ratio))
            m = [float(metric[i, t]) for t in cand]
            # Ties: the lower token index first, whichever end is selected.
            order = sorted(range(n), key=lambda j: ((-m[j]) if high else m[j], cand[j]))
            for j in order[:k]:
                scales[i, cand[j]] *= scale
    return scales


def entropy_keep(entropy: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """1 where the (fp32) entropy is ≥ the quantile threshold, else 0."""
    return (entropy.detach().float() >= threshold).double()


def shaping_weights(adv, old_logprobs, valid, shaping: TokenShaping, entropy=None, threshold=None) -> torch.Tensor:
    """Per-token constant weight (padded layout, fp64) multiplying the policy-gradient term:
    polarity × probability × A3PO scales × entropy-quantile keep."""
    a = adv.double()
    w = polarity_weights(a, shaping)
    if shaping.probability != 0:
        w = w * probability_weights(a, old_logprobs, shaping)
    if shaping.a3po_active:
        metric = old_logprobs.detach().double().exp() if shaping.a3po_metric == "prob" else entropy.detach().double()
        w = w * a3po_scales(a, metric, valid, shaping)
    if shaping.entropy_quantile is not None:
        w = w * entropy_keep(entropy, threshold)
    return w


def shape_token_advantages(
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: Optional[torch.Tensor],
    shaping: TokenShaping,
    *,
    entropy: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Ã = A · w per token (0 on invalid tokens and on tokens the entropy quantile drops),
    in ``old_logprobs``' layout, fp32 (fp64 for fp64 inputs)."""
    out_dtype = torch.float64 if old_logprobs.dtype == torch.float64 else torch.float32
    T = old_logprobs.shape[0]
    valid = _valid_padded(old_logprobs, mask, cu_seqlens)
    adv = _adv_padded(advantages, old_logprobs, cu_seqlens)
    old = to_padded(old_logprobs, cu_seqlens)
    ent = to_padded(entropy, cu_seqlens)
    thr = None
    if shaping.entropy_quantile is not None:
        thr = entropy_quantile_threshold(ent, valid, shaping.entropy_quantile)
    w = shaping_weights(adv, old, valid, shaping, ent, thr)
    out = torch.where(valid, adv.double() * w, 0.0).to(out_dtype)
    return from_padded(out, cu_seqlens, T) if cu_seqlens is not None else out


def _valid_padded(logprobs, mask, cu_seqlens):
    if cu_seqlens is None:
        return mask != 0
    T = logprobs.shape[0]
    v = to_padded(packed_mask(mask, cu_seqlens, T, logprobs.device).to(torch.int8), cu_seqlens)
    return v != 0


def _adv_padded(advantages, logprobs, cu_seqlens):
    """Advantages broadcast to the padded token layout: token-level when shaped like
    ``logprobs`` (also when T == B in the packed layout), else sequence-level ``[B]``."""
    if advantages.shape == logprobs.shape:
        return to_padded(advantages, cu_seqlens)
    if cu_seqlens is None:
        return advantages[:, None].expand(logprobs.shape)
    Lmax = to_padded(logprobs, cu_seqlens).shape[1]
    return advantages[:, None].expand(advantages.shape[0], Lmax)


# ------------------------------------------------------------------ the policy-gradient term (docs/policy-loss.md)
# Each loss type returns (pg, clipped, clip_lower, δ): the per-token policy-gradient loss
# (before shaping and IS weights), the clip flags and δ for the ppo_kl metric.
def log_ratio(opts: PolicyLossOptions, logp, old):
    """δ = logp − old, clamped to ±log_ratio_clamp when that is set."""
    delta_raw = logp - old
    if opts.log_ratio_clamp is not None:
        c = opts.log_ratio_clamp
        return torch.clamp(delta_raw, -c, c)
    return delta_raw


def _clip_range(opts: PolicyLossOptions):
    return 1 - opts.clip_low, 1 + opts.clip_high


def gspo_ratio(opts: PolicyLossOptions, logp, old, valid, seq_stats=None):
    """GSPO's token ratio s_{i,t} = exp(log s_{i,t}), log s_{i,t} = logp − sg(logp) + sg(log s_i):
    the value of the sequence ratio s_i = exp(mean δ) (verl: the sequence mean of the
    unclamped δ), the gradient of the token's own log-prob; log s_{i,t} clamped above.
    With ``seq_stats`` (``seq_statistics`` over the whole sequences) the mean is theirs."""
    if seq_stats is not None:
        log_s = (seq_stats[:, SeqStat.DELTA] / seq_stats[:, SeqStat.N].clamp(min=1)).to(logp.dtype)
    else:
        n = valid.sum(-1).clamp(min=1)
        log_s = ((logp - old) * valid).sum(-1) / n
    log_st = logp - logp.detach() + log_s.detach()[:, None]
    return torch.exp(torch.clamp(log_st, max=opts.gspo_log_clamp) if opts.gspo_log_clamp is not None else log_st)


def clipped_objective(opts: PolicyLossOptions, x, adv):
    """max(−A·x, −A·clip(x)) of the ratio x, and the clipped flag −A·clip(x) > −A·x."""
    lo, hi = _clip_range(opts)
    l1 = -adv * x
    l2 = -adv * torch.clamp(x, lo, hi)
    return torch.maximum(l1, l2), l2 > l1


def dual_clip(opts: PolicyLossOptions, pg, adv):
    """For A < 0 with the dual clip c: min(pg, −A·c); returns (pg, clip_lower), clip_lower the
    A < 0 tokens it bounds (all False without ``clip_ratio_c``)."""
    if opts.clip_ratio_c is None:
        return pg, torch.zeros_like(pg, dtype=torch.bool)
    l3 = -adv * opts.clip_ratio_c
    return torch.where(adv < 0, torch.minimum(pg, l3), pg), (pg > l3) & (adv < 0)


def ppo_term(opts: PolicyLossOptions, logp, old, adv):
    """clipped_objective of ρ = exp(δ), then dual_clip."""
    delta = log_ratio(opts, logp, old)
    pg, clipped = clipped_objective(opts, torch.exp(delta), adv)
    pg, clip_lower = dual_clip(opts, pg, adv)
    return pg, clipped, clip_lower, delta


def gspo_term(opts: PolicyLossOptions, logp, old, adv, valid, seq_stats=None):
    """clipped_objective of gspo_ratio; with ``gspo_dual_clip``, then dual_clip."""
    pg, clipped = clipped_objective(opts, gspo_ratio(opts, logp, old, valid, seq_stats), adv)
    if opts.gspo_dual_clip:
        pg, clip_lower = dual_clip(opts, pg, adv)
    else:
        clip_lower = torch.zeros_like(clipped)
    return pg, clipped, clip_lower, logp - old


def cispo_term(opts: PolicyLossOptions, logp, old, adv):
    """−sg(clip(ρ))·A·logp: the clipped ratio is a constant."""
    delta = log_ratio(opts, logp, old)
    lo, hi = _clip_range(opts)
    ratio = torch.exp(delta)
    clipped_ratio = torch.clamp(ratio, lo, hi)
    clipped = ratio != clipped_ratio
    return -clipped_ratio.detach() * adv * logp, clipped, torch.zeros_like(clipped), delta


def sapo_term(opts: PolicyLossOptions, logp, old, adv):
    """−σ(τ·(ρ − 1))·(4/τ)·A, τ = τ_pos for A > 0, else τ_neg."""
    delta = log_ratio(opts, logp, old)
    ratio = torch.exp(delta)
    one = logp.new_ones(())
    tau = torch.where(adv > 0, one * opts.tau_pos, one * opts.tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1)) * (4.0 / tau)
    no = torch.zeros_like(logp).bool()
    return -gate * adv, no, no, delta


def reinforce_term(opts: PolicyLossOptions, logp, old, adv):
    """−A·logp (reinforce, gpg)."""
    no = torch.zeros_like(logp).bool()
    return -adv * logp, no, no, logp - old


def dppo_ratio(opts: PolicyLossOptions, logp, old):
    """DPPO's truncated ratio sg(min(ρ, c)) (ρ = exp(δ); no cap without ``clip_ratio_c``),
    ρ, and δ."""
    delta = log_ratio(opts, logp, old)
    ratio = torch.exp(delta)
    trunc = ratio if opts.clip_ratio_c is None else torch.clamp(ratio, max=opts.clip_ratio_c)
    return trunc.detach(), ratio, delta


def dppo_keep(opts: PolicyLossOptions, logp, old, adv):
    """DPPO's trust-region mask (a constant), p = exp(logp), p_old = exp(old), δ_low =
    ``clip_low``, δ_high = ``clip_high``. dppo_tv: p − p_old <= δ_high for A > 0, >= −δ_low
    otherwise. dppo_kl: with kl = p_old·(old − logp) + (1 − p_old)·log((1 − p_old + 1e-8) /
    (1 − p + 1e-8)), kl <= δ_high or p <= p_old for A > 0, kl <= δ_low or p >= p_old otherwise."""
    lp = logp.detach()
    p, p_old = torch.exp(lp), torch.exp(old)
    if opts.loss_type == "dppo_tv":
        d = p - p_old
        return torch.where(adv > 0, d <= opts.clip_high, d >= -opts.clip_low)
    kl = p_old * (old - lp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    return torch.where(adv > 0, (kl <= opts.clip_high) | (p <= p_old), (kl <= opts.clip_low) | (p >= p_old))


def dppo_term(opts: PolicyLossOptions, logp, old, adv):
    """−A·sg(min(ρ, c))·logp·keep (dppo_tv, dppo_kl), keep = dppo_keep; clipped = outside
    the region, clip_lower = kept with ρ > c."""
    trunc, ratio, delta = dppo_ratio(opts, logp, old)
    keep = dppo_keep(opts, logp, old, adv)
    pg = -adv * trunc * logp * keep.to(logp.dtype)
    if opts.clip_ratio_c is None:
        clip_lower = torch.zeros_like(keep)
    else:
        clip_lower = keep & (ratio > opts.clip_ratio_c)
    return pg, ~keep, clip_lower, delta


def geo_mean_log_ratio(opts: PolicyLossOptions, delta, adv):
    """GMPO's sign-aware clip of δ = logp − old: δ_min = sgn(A)·min(sgn(A)·δ, sgn(A)·clip(δ,
    −ε_low, ε_high)), i.e. δ clipped above at ε_high for A > 0, below at −ε_low for A < 0, 0
    for A = 0. Its derivative (torch.minimum splits a tie in halves, clamp passes the closed
    interval): 1, except 0 where the clip binds (A > 0 and δ > ε_high, A < 0 and δ < −ε_low)
    and for A = 0. Also returns the flag δ ≠ clip(δ, −ε_low, ε_high)."""
    sgn = torch.sign(adv)
    clamped = torch.clamp(delta, -opts.clip_low, opts.clip_high)
    return sgn * torch.minimum(sgn * delta, sgn * clamped), delta != clamped


def geo_mean_term(opts: PolicyLossOptions, logp, old, adv, valid, seq_stats=None):
    """GMPO (geo_mean), a sequence-level term spread over the sequence's valid tokens: with
    δ_min = geo_mean_log_ratio, n_i the valid count, r_i = exp(Σ_t m·δ_min / n_i) and
    Ā_i = Σ_t m·A / n_i, the sequence loss is L_i = −Ā_i·r_i; each valid token carries the
    share L_i / n_i (so a token sum gives L_i) in token form,
    pg_t = sg(L_i / n_i)·(1 + δ_min,t − sg(δ_min,t)): the value L_i / n_i and the gradient
    ∂L_i/∂logp_t = (L_i / n_i)·∂δ_min,t/∂δ_t of the token's own log-prob (the shaping and IS
    weights multiply a token's share and its gradient, as for GSPO). No ``log_ratio_clamp``
    (verl). clipped = δ outside [−ε_low, ε_high] with A > 0, clip_lower the same with A < 0
    (verl's pg_clipfrac / pg_clipfrac_lower). With ``seq_stats`` n_i, Σ m·δ_min and Σ m·A are
    those of the whole sequences (``seq_statistics``)."""
    delta = logp - old
    d_min, outside = geo_mean_log_ratio(opts, delta, adv)
    if seq_stats is not None:
        n = seq_stats[:, SeqStat.N].clamp(min=1)
        r = torch.exp((seq_stats[:, SeqStat.DMIN] / n).to(logp.dtype))
        adv_mean = (seq_stats[:, SeqStat.ADV] / n).to(logp.dtype)
        n = n.to(logp.dtype)
    else:
        m = valid.to(logp.dtype)
        n = m.sum(-1).clamp(min=1)
        r = torch.exp((d_min * m).sum(-1) / n)
        adv_mean = (adv * m).sum(-1) / n
    share = (-adv_mean * r / n).detach()[:, None]
    pg = share * (1 + (d_min - d_min.detach()))
    return pg, outside & (adv > 0), outside & (adv < 0), delta


def dro_term(opts: PolicyLossOptions, logp, old, adv):
    """DRO: −(A·logp − ½·β·δ²), δ = logp − old unclamped (verl), β = ``dro_beta``."""
    delta = logp - old
    no = torch.zeros_like(logp).bool()
    return -(logp * adv - 0.5 * opts.dro_beta * delta.square()), no, no, delta


def clip_cov_term(opts: PolicyLossOptions, logp, old, adv, sel):
    """Clip-Cov: ppo's clipped_objective of ρ = exp(δ) (δ from ``log_ratio``, no dual clip),
    0 (value and gradient) on the covariance-selected tokens ``sel``; clipped = ``sel`` (the
    CLIP count is the selected valid tokens, verl's pg_clipfrac of clip_cov)."""
    delta = log_ratio(opts, logp, old)
    pg, _ = clipped_objective(opts, torch.exp(delta), adv)
    return torch.where(sel, torch.zeros_like(pg), pg), sel, torch.zeros_like(sel), delta


def kl_cov_term(opts: PolicyLossOptions, logp, old, adv, sel):
    """KL-Cov: −A·ρ + kl_cov_coef·|δ| on the covariance-selected tokens ``sel`` (∂|δ|/∂δ =
    sign(δ), 0 at δ = 0); clipped = ``sel``. The δ slot holds −|δ|, so the ppo_kl metric is
    mean |δ| (verl's ppo_kl of kl_cov)."""
    delta = log_ratio(opts, logp, old)
    abs_delta = delta.abs()
    pg = -adv * torch.exp(delta) + torch.where(sel, opts.kl_cov_coef * abs_delta, torch.zeros_like(abs_delta))
    return pg, sel, torch.zeros_like(sel), -abs_delta


def pg_term(opts: PolicyLossOptions, logp, old, adv, valid, sel=None, seq_stats=None):
    """The policy-gradient term of ``opts.loss_type``: (pg, clipped, clip_lower, δ); ``sel``
    is the covariance selection (padded, bool) of clip_cov / kl_cov; ``seq_stats`` the
    statistics of the whole sequences (``seq_statistics``; cp_group)."""
    if opts.loss_type == "clip_cov":
        return clip_cov_term(opts, logp, old, adv, sel)
    if opts.loss_type == "kl_cov":
        return kl_cov_term(opts, logp, old, adv, sel)
    if opts.loss_type == "ppo":
        return ppo_term(opts, logp, old, adv)
    if opts.loss_type == "gspo":
        return gspo_term(opts, logp, old, adv, valid, seq_stats)
    if opts.loss_type == "cispo":
        return cispo_term(opts, logp, old, adv)
    if opts.loss_type == "sapo":
        return sapo_term(opts, logp, old, adv)
    if opts.loss_type in ("dppo_tv", "dppo_kl"):
        return dppo_term(opts, logp, old, adv)
    if opts.loss_type == "geo_mean":
        return geo_mean_term(opts, logp, old, adv, valid, seq_stats)
    if opts.loss_type == "dro":
        return dro_term(opts, logp, old, adv)
    return reinforce_term(opts, logp, old, adv)


def importance_ratio(opts: PolicyLossOptions, logp, old, valid, seq_stats=None):
    """The ratio r the loss type is built on, with its token-form gradient: exp(δ) (δ from
    ``log_ratio``), GSPO's s_{i,t} (value s_i, gradient through the token's own log-prob).
    Used by the clip-side metrics and by ``kl_ratio_correction``."""
    if opts.loss_type == "gspo":
        return gspo_ratio(opts, logp, old, valid, seq_stats)
    return torch.exp(log_ratio(opts, logp, old))


def clip_sides(opts: PolicyLossOptions, logp, old, adv, valid, seq_stats=None):
    """(low, high) per token: ρ < 1 − ε_low with A < 0, ρ > 1 + ε_high with A > 0, for the
    loss types that clip (ppo, gspo, cispo, clip_cov); all False for the others."""
    if opts.loss_type not in ("ppo", "gspo", "cispo", "clip_cov"):
        no = torch.zeros_like(valid)
        return no, no
    lo, hi = _clip_range(opts)
    r = importance_ratio(opts, logp, old, valid, seq_stats).detach()
    return valid & (r < lo) & (adv < 0), valid & (r > hi) & (adv > 0)


def seq_fractions(x, valid):
    """Per-sequence mean of the flags ``x`` over the valid tokens, for the sequences with one."""
    n = valid.sum(-1)
    f = (x & valid).sum(-1).double() / n.clamp(min=1).double()
    return f[n > 0]


# ------------------------------------------------------------------ IS weight, KL, token loss
def rc_log_ratio(rc, lp, old, rollout):
    """x = base − rollout (detached), base = old (``log_ratio="old"``) or the current logprobs."""
    base = lp if rc.log_ratio == "current" else old
    return (base - rollout).detach()


def corrected_weight(rc, w):
    """The IS weight from the raw weight w, and the flags of the weights a bound zeroed:
    truncate min(w, C); icepop w inside [low, C], else 0; mask 1 inside, else 0;
    decoupled w <= C, else 0; clamp clamp(w, low, C), flagging the weights outside."""
    C = rc.is_threshold
    if rc.mode == "clamp":  # OpenRLHF's clip mode
        return torch.clamp(torch.clamp(w, min=rc.low), max=C), (w < rc.low) | (w > C)
    if rc.mode == "truncate":
        return torch.clamp(w, max=C), torch.zeros_like(w, dtype=torch.bool)
    if rc.mode == "decoupled":  # AReaL: tokens whose behaviour weight exceeds the cap are dropped
        rejected = w > C
        return torch.where(rejected, 0.0, w), rejected
    rejected = (w < rc.low) | (w > C)
    if rc.mode == "icepop":
        return torch.where(rejected, 0.0, w), rejected
    return torch.where(rejected, 0.0, 1.0).to(w.dtype), rejected  # mask: rejection sampling


def gate_token_statistic(rc, x, base, rollout):
    """The token term of is_mode="gate": x for ratio, else the binary_kl / tv of
    p = exp(rollout), q = exp(base), both clamped to [1e-6, 1 − 1e-6]."""
    if rc.is_gate == "ratio":
        return x
    p = torch.exp(rollout.detach()).clamp(1e-6, 1 - 1e-6)
    q = torch.exp(base.detach()).clamp(1e-6, 1 - 1e-6)
    if rc.is_gate == "binary_kl":
        return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))
    return (p - q).abs()


def gate_statistic(rc, x, base, rollout, valid, seq_stats=None):
    """The statistic is_mode="gate" bounds, per token or (sequence level) per sequence over the
    valid tokens, broadcast to the tokens: ratio w = exp(clamp(x, ±20)) (per sequence
    exp(clamp(mean x, ±20))); binary_kl / tv (gate_token_statistic; per sequence their mean).
    With ``seq_stats`` the sequence's sum and count are the whole sequence's (GATE, N_RAW)."""
    stat = gate_token_statistic(rc, x, base, rollout)
    if rc.is_level == "sequence":
        if seq_stats is None:
            n = valid.sum(-1, keepdim=True)
            total = (stat * valid).sum(-1, keepdim=True)
        else:
            n = seq_stats[:, SeqStat.N_RAW, None].to(x.dtype)
            total = seq_stats[:, SeqStat.GATE, None].to(x.dtype)
        stat = torch.where(n > 0, total / n.clamp(min=1), 0.0).expand_as(x)
    return torch.exp(torch.clamp(stat, -20, 20)) if rc.is_gate == "ratio" else stat


def is_weights(rc, x, valid, seq_stats=None, base=None, rollout=None):
    """Detached rollout-correction weights (padded layout, before batch normalisation) and the
    flags a bound zeroed, from x = rc_log_ratio: per token exp(clamp(x, ±20)), per sequence
    exp(clamp(Σ_t x·m, ±20)) (verl clamps the masked sum; with ``seq_stats``, the sum over the
    whole sequence). is_mode="gate" keeps the token
    weight where ``gate_statistic`` (of ``base`` and ``rollout``) lies in [low, C], else 0."""
    if rc.mode == "gate":
        stat = gate_statistic(rc, x, base, rollout, valid, seq_stats)
        rejected = (stat < rc.low) | (stat > rc.is_threshold)
        return torch.where(rejected, 0.0, torch.exp(torch.clamp(x, -20, 20))), rejected
    if rc.is_level == "token":
        w = torch.exp(torch.clamp(x, -20, 20))
    else:
        total = (x * valid).sum(-1, keepdim=True) if seq_stats is None else seq_stats[:, SeqStat.LOGW, None].to(x.dtype)
        s = torch.clamp(total, -20, 20)
        w = torch.exp(s).expand_as(x)
    return corrected_weight(rc, w)


def is_batch_norm(rc, is_w, valid, seq_stats=None):
    """The batch-normalisation mean μ of the IS weights over the valid tokens (token level) or
    over the sequences with a valid token (sequence level); 1 when it is <= 1e-8 (verl then
    leaves the weights as they are). With ``seq_stats``, over the whole sequences."""
    m = valid.to(is_w.dtype)
    if seq_stats is not None:
        n_raw = seq_stats[:, SeqStat.N_RAW]
        if rc.is_level == "token":
            mu = _safe_div(seq_stats[:, SeqStat.IS_W].sum(), n_raw.sum())
        else:
            seq_w = is_weights(rc, is_w.new_zeros((is_w.shape[0], 1)), None, seq_stats)[0][:, 0].double()
            has = (n_raw > 0).double()
            mu = _safe_div((seq_w * has).sum(), has.sum())
        mu = mu.to(is_w.dtype)
    elif rc.is_level == "token":
        mu = _safe_div((is_w * m).sum(), m.sum())
    else:
        has = valid.any(-1)
        seq_w = is_w[:, 0] if is_w.shape[-1] else is_w.new_zeros(is_w.shape[0])
        mu = _safe_div((seq_w * has).sum(), has.to(is_w.dtype).sum())
    return torch.where(mu > 1e-8, mu, torch.ones_like(mu))


def rs_statistics(x, valid):
    """The token divergences of verl's rejection (x clamped to ±20): k1 = −x, k2 = x²/2,
    k3 = eˣ − 1 − x, and per sequence their sums, means (over the valid tokens) and maxima
    (k2, k3; 0 without a valid token)."""
    xs = torch.clamp(x, -20, 20)
    k = {"k1": -xs, "k2": 0.5 * xs.square(), "k3": torch.exp(xs) - 1.0 - xs}
    m = valid.to(x.dtype)
    n = m.sum(-1)
    stats = {}
    for j, v in k.items():
        stats[f"token_{j}"] = v
        ssum = (torch.where(valid, v, 0.0)).sum(-1)
        stats[f"seq_sum_{j}"] = ssum
        stats[f"seq_mean_{j}"] = torch.where(n > 0, ssum / n.clamp(min=1), 0.0)
        if j != "k1":
            mx = torch.where(valid, v, float("-inf")).amax(-1) if v.shape[-1] else v.new_zeros(v.shape[0])
            stats[f"seq_max_{j}"] = torch.where(n > 0, mx, 0.0)
    return stats


def rs_pass(rc, stats, level: str):
    """The options of ``rc``'s rejection chain of one ``level`` ("token" or "seq") on the
    statistics ``stats`` (rs_statistics' names): True where all pass, None without such an
    option. k1 options keep low <= stat <= high (log space), the others stat <= bound."""
    from ..options import RS_BOUND_FIELDS, RS_OPTIONS

    bounds = dict(zip(RS_BOUND_FIELDS, rc.rs_bounds))
    keep = None
    for j, opt in enumerate(RS_OPTIONS):
        if not (rc.rs_mask >> j) & 1 or not opt.startswith(level):
            continue
        v = stats[opt]
        if opt.endswith("k1"):
            ok = (v >= bounds[f"rs_{opt}_low"]) & (v <= bounds[f"rs_{opt}_high"])
        else:
            ok = v <= bounds[f"rs_{opt}"]
        keep = ok if keep is None else keep & ok
    return keep


def rejection_keep(rc, x, valid, seq_stats=None):
    """verl's rejection chain: True where every option of ``rc`` (rs and geo_mean, as the
    bounds ``rc.rs_bounds``) passes (rs_pass); token options per token, sequence options for
    every token of the sequence. Statistics over the valid tokens before rejection. With
    ``seq_stats`` (the whole sequences' statistics, ``seq_rejection`` applied: N = 0 for a
    rejected sequence) the sequence options are read from it."""
    keep = torch.ones_like(valid)
    if not rc.rs_mask:
        return keep
    stats = rs_statistics(x, valid)
    tok = rs_pass(rc, stats, "token")
    if tok is not None:
        keep = keep & tok
    if seq_stats is not None:
        return keep & (seq_stats[:, SeqStat.N] > 0)[:, None]
    seq = rs_pass(rc, stats, "seq")
    return keep if seq is None else keep & seq[:, None]


def _kl_clamps(opts: PolicyLossOptions, estimator: str):
    """(input clamp, output clamp) that apply to ``estimator`` (None = off): ``kl_clamp_input``
    / ``kl_clamp_output`` for k3 and k3+ under ``kl_clamp`` "k3" (True), for every estimator
    under "all"."""
    scope = opts.kl_clamp_scope
    if scope == "all" or (scope == "k3" and estimator in ("k3", "k3+")):
        return opts.kl_clamp_input, opts.kl_clamp_output
    return None, None


def kl_estimate(opts: PolicyLossOptions, logp, ref):
    """The per-token KL estimate to the reference policy, ``opts.kl`` of k1 = x, k2 = x²/2,
    k3 = e^{−x} + x − 1 (x = logp − ref) and k3+ (the value of k3 with the gradient of k2, each
    clamped as it would be on its own); where ``_kl_clamps`` applies, x is clamped to
    ±``kl_clamp_input`` first and the estimate to ±``kl_clamp_output`` last (verl: k3's
    −x to ±20, the value to ±10)."""
    x = logp - ref
    if opts.kl in ("k1", "k2"):
        c_in, c_out = _kl_clamps(opts, opts.kl)
        if c_in is not None:
            x = torch.clamp(x, -c_in, c_in)
        v = x if opts.kl == "k1" else 0.5 * x.square()
        return torch.clamp(v, -c_out, c_out) if c_out is not None else v
    c_in, c_out = _kl_clamps(opts, "k3")
    y = ref - logp
    if c_in is not None:
        y = torch.clamp(y, -c_in, c_in)
    k3 = torch.exp(y) - y - 1
    if c_out is not None:
        k3 = torch.clamp(k3, -c_out, c_out)
    if opts.kl == "k3":
        return k3
    k2 = kl_estimate(_with_kl(opts, "k2"), logp, ref)
    return k2 - k2.detach() + k3.detach()


def _with_kl(opts: PolicyLossOptions, kl: str) -> PolicyLossOptions:
    """``opts`` with another estimator; k2 inside k3+ keeps k3+'s clamp scope ("k3" leaves k2
    unclamped)."""
    return dataclasses.replace(opts, kl=kl)


def kl_clamped(opts: PolicyLossOptions, logp, ref):
    """Where a KL clamp is active (the estimate is a constant there): x outside
    ±``kl_clamp_input`` or the estimate outside ±``kl_clamp_output``, for the estimators
    ``_kl_clamps`` covers (k3+: those of k2, its gradient)."""
    name = "k2" if opts.kl == "k3+" else opts.kl
    c_in, c_out = _kl_clamps(opts, name)
    x = (logp - ref).detach()
    out = torch.zeros_like(x, dtype=torch.bool)
    if c_in is not None:
        out = out | (x.abs() > c_in)
    if c_out is not None:
        v = kl_estimate(dataclasses.replace(opts, kl=name, kl_clamp_output=None), logp.detach(), ref)
        out = out | (v.abs() > c_out)
    return out


def kl_term(opts: PolicyLossOptions, logp, old, ref, valid, seq_stats=None):
    """The KL term: kl_estimate, times the loss type's importance_ratio (with its token-form
    gradient) when ``kl_ratio_correction``; with ``kl_score_grad`` times w = exp(logp −
    sg(logp)) (value 1) where no clamp is active (``kl_clamped``): ∂/∂logp gains kl there."""
    kl = kl_estimate(opts, logp, ref)
    if opts.kl_ratio_correction:
        kl = kl * importance_ratio(opts, logp, old, valid, seq_stats)
    if opts.kl_score_grad:
        live = torch.where(kl_clamped(opts, logp, ref), 0.0, kl.detach())
        kl = kl + live * (logp - logp.detach())
    return kl


def token_loss(opts: PolicyLossOptions, pg, shape_w, is_w, kl, entropy):
    """ℓ = pg·w·is_w + β·kl − c_H·H per token; returns (ℓ, pg·w·is_w)."""
    pg_w = pg * shape_w
    if is_w is not None:
        pg_w = pg_w * is_w
    loss = pg_w
    if kl is not None:
        loss = loss + opts.kl_coef * kl
    if entropy is not None and opts.entropy_coef != 0:
        loss = loss - opts.entropy_coef * entropy
    return loss, pg_w


# ------------------------------------------------------------------ aggregation
def aggregate(
    opts: PolicyLossOptions,
    x: torch.Tensor,
    m: torch.Tensor,
    *,
    global_num_tokens=None,
    global_num_seqs=None,
    dp_size: int = 1,
    loss_scale_factor: Optional[float] = None,
    n_i: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``agg`` of the per-token ``x`` over the valid tokens ``m`` (padded layout, compute dtype);
    a count of 0 gives 0. ``seq-mean-token-sum-norm`` divides by ``loss_scale_factor``,
    default L (1 when L = 0: no token, a loss of 0). ``n_i``: the sequences' valid counts
    (default: ``m``'s; the whole sequences' with cp_group)."""
    dtype = m.dtype
    n_i = m.sum(-1) if n_i is None else n_i.to(dtype)
    if opts.agg == "none":
        return x * m
    if opts.agg == "token-sum":
        return (x * m).sum() * dp_size
    if opts.agg == "token-mean":
        den = m.sum() if global_num_tokens is None else torch.as_tensor(global_num_tokens, dtype=dtype, device=m.device)
        return _safe_div((x * m).sum(), den) * dp_size
    if opts.agg == "seq-mean-token-mean":
        per_seq = torch.where(n_i > 0, (x * m).sum(-1) / n_i.clamp(min=1), 0.0)
    else:
        per_seq = (x * m).sum(-1)
    den = (
        (n_i > 0).to(dtype).sum()
        if global_num_seqs is None
        else torch.as_tensor(global_num_seqs, dtype=dtype, device=m.device)
    )
    out = _safe_div(per_seq.sum(), den) * dp_size
    if opts.agg == "seq-mean-token-sum-norm":
        out = out / (loss_scale_factor if loss_scale_factor is not None else max(m.shape[-1], 1))
    return out


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor],
    opts: PolicyLossOptions,
    *,
    ref_logprobs: Optional[torch.Tensor] = None,
    rollout_logprobs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    global_num_tokens=None,
    global_num_seqs=None,
    dp_size: int = 1,
    loss_scale_factor: Optional[float] = None,
    entropy_threshold: Optional[torch.Tensor] = None,
    cov_selection: Optional[torch.Tensor] = None,
    seq_stats: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, PolicyLossMetrics]:
    """The GRPO-family policy loss, per docs/policy-loss.md, and its metrics: pg_term → shaping_weights →
    is_weights → kl_term → token_loss → aggregate.

    Computes in the dtype of ``logprobs`` promoted to at least fp32 (fp64 stays fp64).
    ``entropy_threshold`` replaces the batch's entropy quantile (shaping.entropy_quantile).
    ``cov_selection`` (bool, shaped like ``logprobs``) replaces the covariance selection of
    clip_cov / kl_cov (``cov_tokens``).
    ``seq_stats`` ([B, NUM_SEQ_STATS] fp64, ``seq_statistics`` reduced over a context-parallel
    group, then ``seq_rejection``) replaces every sequence-level quantity of this call's tokens
    with the whole sequences' (n_i, GSPO's s_i, geo_mean's share, the sequence IS weights, the
    rejection chain's sequence options, the IS batch normalisation); the metrics stay this call's.
    Returns the aggregated loss (0-d; ``[B, L]``/``[T]`` for ``agg="none"``) and metrics.
    """
    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    T = logprobs.shape[0]
    valid = _valid_padded(logprobs, mask, cu_seqlens)

    # Every log-prob-like input is first rounded to the dtype of ``logprobs`` (the kernels'
    # single input dtype); advantages are read in the compute dtype.
    def same_dtype(x):
        return None if x is None else x.to(logprobs.dtype)

    lp = to_padded(logprobs, cu_seqlens).to(dtype)
    old = to_padded(same_dtype(old_logprobs), cu_seqlens).to(dtype)
    adv = _adv_padded(advantages, logprobs, cu_seqlens).to(dtype)
    ref = to_padded(same_dtype(ref_logprobs), cu_seqlens)
    roll = to_padded(same_dtype(rollout_logprobs), cu_seqlens)
    ent = to_padded(same_dtype(entropy), cu_seqlens)
    ent = ent.to(dtype) if ent is not None else None
    rc = opts.rc
    valid0 = valid
    if rc is not None:  # verl: rejection modifies response_mask, the IS weights use the unmodified one
        x = rc_log_ratio(rc, lp, old, roll.to(dtype))
        valid = valid0 & rejection_keep(rc, x, valid0, seq_stats)
    m = valid.to(dtype)

    sel = None
    if opts.loss_type in ("clip_cov", "kl_cov"):
        if cov_selection is None:
            cov_selection = cov_tokens(opts, logprobs, old_logprobs, adv, mask, cu_seqlens)
        sel = to_padded(cov_selection.to(torch.int8), cu_seqlens) != 0
    pg, clipped, clip_lower, delta = pg_term(opts, lp, old, adv, valid, sel, seq_stats)
    thr = None
    if entropy_threshold is not None:
        thr = entropy_threshold.detach().reshape(()).float()
    elif opts.shaping.entropy_quantile is not None:
        thr = entropy_quantile_threshold(ent, valid, opts.shaping.entropy_quantile)
    shape_w = shaping_weights(adv, old, valid, opts.shaping, ent, thr).to(dtype)
    is_w, rejected = torch.ones_like(lp), torch.zeros_like(valid)
    is_norm = lp.new_ones(())
    if rc is not None and rc.is_level is not None:
        base = lp.detach() if rc.log_ratio == "current" else old
        is_w, rejected = is_weights(rc, x, valid0.to(dtype), seq_stats, base, roll.to(dtype))
        if rc.is_batch_normalize:
            is_norm = is_batch_norm(rc, is_w, valid0, seq_stats)
            is_w = is_w / is_norm
    kl_tok = kl_term(opts, lp, old, ref.to(dtype), valid, seq_stats) if opts.kl is not None else None
    low, high = clip_sides(opts, lp, old, adv, valid, seq_stats)
    f_low, f_high = seq_fractions(low, valid), seq_fractions(high, valid)
    use_is = rc is not None and rc.is_level is not None
    loss_tok, pg_tok = token_loss(opts, pg, shape_w, is_w if use_is else None, kl_tok, ent)
    kl_tok = torch.zeros_like(lp) if kl_tok is None else kl_tok

    agg_kw = dict(
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        dp_size=dp_size,
        loss_scale_factor=loss_scale_factor,
        n_i=None if seq_stats is None else seq_stats[:, SeqStat.N],
    )
    loss = aggregate(opts, loss_tok, m, **agg_kw)
    if opts.agg == "none":
        loss = from_padded(loss, cu_seqlens, T)

    N_tok = m.sum()

    def mean(x):
        return _safe_div((x.to(dtype) * m).sum(), N_tok).float()

    def aggregate_metric(x):
        out = aggregate(opts, x.detach(), m, **agg_kw)
        return (out.sum() if opts.agg == "none" else out).float()

    with torch.no_grad():
        is_max = torch.where(valid, is_w, torch.zeros_like(is_w)).max() if valid.numel() else lp.new_zeros(())
        metrics = PolicyLossMetrics(
            pg_loss=aggregate_metric(pg_tok),
            kl_loss=aggregate_metric(kl_tok),
            pg_clipfrac=mean(clipped),
            pg_clipfrac_lower=mean(clip_lower),
            ppo_kl=mean(-delta.detach()),
            kl=mean(kl_tok.detach()),
            is_weight_mean=mean(is_w),
            is_weight_max=(is_max if N_tok > 0 else lp.new_zeros(())).float(),
            is_masked_frac=mean(rejected),
            shaped_frac=mean(shape_w != 1),
            entropy_mean=mean(ent.detach()) if ent is not None else lp.new_zeros((), dtype=torch.float32),
            num_tokens=N_tok.float(),
            num_seqs=(m.sum(-1) > 0).to(dtype).sum().float(),
            pg_clipfrac_low=mean(low),
            pg_clipfrac_high=mean(high),
            seq_clipfrac_low_mean=seq_stat(f_low, "mean"),
            seq_clipfrac_high_mean=seq_stat(f_high, "mean"),
            seq_clipfrac_low_min=seq_stat(f_low, "min"),
            seq_clipfrac_high_max=seq_stat(f_high, "max"),
            rs_masked_frac=_safe_div((valid0 & ~valid).sum().to(dtype), valid0.sum().to(dtype)).float(),
            rs_seq_masked_frac=_safe_div(
                (valid0 & ~valid).any(-1).sum().to(dtype) if valid.numel() else lp.new_zeros(()),
                lp.new_tensor(float(valid.shape[0])),
            ).float(),
            is_batch_norm_factor=(is_norm * (N_tok > 0)).float(),
        )
    return loss.to(dtype), metrics


def rollout_correction(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: Optional[torch.Tensor],
    rc,
    *,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token outputs ``TokenOut.IS_WEIGHTS`` and ``KEEP`` of a :class:`RolloutCorrection`
    ``rc``: ``(weights, keep, norm)`` in ``logprobs``' layout and compute dtype, norm the 0-d
    ``PolicyLossSum.IS_NORM`` (the batch-normalisation mean; 0 when off). weights: the
    rollout-correction weight (is_weights, after is_batch_norm; 1 without ``is_level``) on
    the valid tokens before rejection, else 0; keep: 1 on the valid tokens rejection_keep
    keeps, else 0 (verl's modified ``response_mask``). The same stages as :func:`policy_loss`."""
    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    T = logprobs.shape[0]
    valid0 = _valid_padded(logprobs, mask, cu_seqlens)

    def padded(x):
        return to_padded(x.detach().to(logprobs.dtype), cu_seqlens).to(dtype)

    lp, old, roll = padded(logprobs), padded(old_logprobs), padded(rollout_logprobs)
    x = rc_log_ratio(rc, lp, old, roll)
    keep = valid0 & rejection_keep(rc, x, valid0)
    is_w, norm = torch.ones_like(lp), lp.new_zeros(())
    if rc.is_level is not None:
        base = lp if rc.log_ratio == "current" else old
        is_w, _ = is_weights(rc, x, valid0.to(dtype), None, base, roll)
        if rc.is_batch_normalize:
            norm = is_batch_norm(rc, is_w, valid0)
            is_w = is_w / norm
    weights = torch.where(valid0, is_w, 0.0)
    keep = keep.to(dtype)
    if cu_seqlens is not None:
        return from_padded(weights, cu_seqlens, T), from_padded(keep, cu_seqlens, T), norm
    return weights, keep, norm


def cov_tokens(opts: PolicyLossOptions, logprobs, old_logprobs, adv_padded, mask, cu_seqlens):
    """The covariance selection of clip_cov / kl_cov on this call's inputs, in their layout
    (flat token indices pick ties and the random choice): the contract's ``cov_selection`` of
    ``logprobs``, ``old_logprobs`` rounded to its dtype, the token advantages in the compute
    dtype and the valid tokens."""
    T = logprobs.shape[0]
    valid = packed_mask(mask, cu_seqlens, T, logprobs.device) if cu_seqlens is not None else mask != 0
    adv = from_padded(adv_padded, cu_seqlens, T) if cu_seqlens is not None else adv_padded
    return cov_selection_of(opts, logprobs, old_logprobs.to(logprobs.dtype), adv, valid)


def seq_stat(f, how):
    """mean / min / max of the per-sequence values ``f`` as fp32, 0 when there is none."""
    if f.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=f.device)
    return getattr(f, how)().float()


# ------------------------------------------------------------------ context parallelism (cp_group)
# A rank of a context-parallel group holds a slice of every sequence. The sequence-level
# quantities are all detached sums (and two maxima) over a sequence's tokens: each rank computes
# them over its slice (seq_statistics), the op layer reduces them over the group, seq_rejection
# applies the rejection chain's sequence options, and policy_loss(seq_stats=...) uses them.
def seq_statistics(
    opts: PolicyLossOptions,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor],
    *,
    rollout_logprobs: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """This call's per-sequence statistics ([B, NUM_SEQ_STATS] fp64, the columns of
    contracts ``SeqStat``) over the tokens it holds: token terms in the compute dtype (as
    ``policy_loss`` forms them), summed in fp64. Columns the options do not read are 0 (the
    maxima −inf)."""
    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    valid0 = _valid_padded(logprobs, mask, cu_seqlens)
    lp = to_padded(logprobs.detach(), cu_seqlens).to(dtype)
    old = to_padded(old_logprobs.detach().to(logprobs.dtype), cu_seqlens).to(dtype)
    adv = _adv_padded(advantages.detach(), logprobs, cu_seqlens).to(dtype)
    out = torch.zeros((valid0.shape[0], NUM_SEQ_STATS), dtype=torch.float64, device=logprobs.device)
    out[:, SEQ_STAT_MAXIMA] = float("-inf")

    def total(v, m):
        return torch.where(m, v.double(), 0.0).sum(-1)

    valid, rc = valid0, opts.rc
    if rc is not None:
        roll = to_padded(rollout_logprobs.detach().to(logprobs.dtype), cu_seqlens).to(dtype)
        x = rc_log_ratio(rc, lp, old, roll)
        if rc.rs_mask:
            k = rs_statistics(x, valid0)
            tok = rs_pass(rc, k, "token")
            valid = valid0 if tok is None else valid0 & tok
            for col, j in ((SeqStat.K1, "k1"), (SeqStat.K2, "k2"), (SeqStat.K3, "k3")):
                out[:, col] = total(k[f"token_{j}"], valid0)
            if valid0.shape[-1]:
                out[:, SeqStat.K2_MAX] = torch.where(valid0, k["token_k2"].double(), float("-inf")).amax(-1)
                out[:, SeqStat.K3_MAX] = torch.where(valid0, k["token_k3"].double(), float("-inf")).amax(-1)
        if rc.mode == "gate" and rc.is_level == "sequence":
            base = lp if rc.log_ratio == "current" else old
            out[:, SeqStat.GATE] = total(gate_token_statistic(rc, x, base, roll), valid0)
        elif rc.is_level == "sequence":
            out[:, SeqStat.LOGW] = total(x, valid0)
        elif rc.is_level == "token" and rc.is_batch_normalize:
            out[:, SeqStat.IS_W] = total(is_weights(rc, x, valid0)[0], valid0)
    out[:, SeqStat.N] = valid.sum(-1).double()
    out[:, SeqStat.N_RAW] = valid0.sum(-1).double()
    delta = lp - old
    if opts.loss_type == "gspo":
        out[:, SeqStat.DELTA] = total(delta, valid)
        # the clip sides of a GSPO sequence are all or none of its A < 0 / A > 0 tokens
        out[:, SeqStat.CLIP_LOW] = total(adv < 0, valid)
        out[:, SeqStat.CLIP_HIGH] = total(adv > 0, valid)
    else:
        low, high = clip_sides(opts, lp, old, adv, valid)
        out[:, SeqStat.CLIP_LOW] = total(low, valid)
        out[:, SeqStat.CLIP_HIGH] = total(high, valid)
    if opts.loss_type == "geo_mean":
        out[:, SeqStat.DMIN] = total(geo_mean_log_ratio(opts, delta, adv)[0], valid)
        out[:, SeqStat.ADV] = total(adv, valid)
    return out


def seq_rejection(opts: PolicyLossOptions, seq_stats: torch.Tensor) -> torch.Tensor:
    """``seq_stats`` (whole sequences) with the rejection chain's sequence options applied:
    N = 0 for a sequence they reject (rejection_keep's sequence part, on the sums, the means
    over the valid tokens and the maxima; 0 for a sequence without a valid token)."""
    rc = opts.rc
    if rc is None or not rc.rs_mask:
        return seq_stats
    n_raw = seq_stats[:, SeqStat.N_RAW]
    has = n_raw > 0
    stats = {}
    for col, j in ((SeqStat.K1, "k1"), (SeqStat.K2, "k2"), (SeqStat.K3, "k3")):
        stats[f"seq_sum_{j}"] = seq_stats[:, col]
        stats[f"seq_mean_{j}"] = torch.where(has, seq_stats[:, col] / n_raw.clamp(min=1), 0.0)
    stats["seq_max_k2"] = torch.where(has, seq_stats[:, SeqStat.K2_MAX], 0.0)
    stats["seq_max_k3"] = torch.where(has, seq_stats[:, SeqStat.K3_MAX], 0.0)
    ok = rs_pass(rc, stats, "seq")
    if ok is None:
        return seq_stats
    out = seq_stats.clone()
    out[:, SeqStat.N] = torch.where(ok, out[:, SeqStat.N], 0.0)
    return out


def seq_clip_fractions(opts: PolicyLossOptions, seq_stats: torch.Tensor):
    """(f_low, f_high): the per-sequence clip fractions (seq_fractions) of the sequences with
    n_i > 0, from the whole sequences' statistics; GSPO's sides are decided by its sequence
    ratio s_i (gspo_ratio's value)."""
    n = seq_stats[:, SeqStat.N]
    low, high = seq_stats[:, SeqStat.CLIP_LOW], seq_stats[:, SeqStat.CLIP_HIGH]
    if opts.loss_type == "gspo":
        lo, hi = _clip_range(opts)
        log_s = seq_stats[:, SeqStat.DELTA] / n.clamp(min=1)
        if opts.gspo_log_clamp is not None:
            log_s = torch.clamp(log_s, max=opts.gspo_log_clamp)
        r = torch.exp(log_s)
        low, high = torch.where(r < lo, low, 0.0), torch.where(r > hi, high, 0.0)
    has = n > 0
    return (low / n.clamp(min=1))[has], (high / n.clamp(min=1))[has]
