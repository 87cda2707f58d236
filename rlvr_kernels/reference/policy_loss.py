"""Reference ``policy_loss`` and ``shape_token_advantages`` (SPEC §2, §4): plain PyTorch,
autograd through ordinary ops, fp64-capable, written for reading, not for speed.

Everything works on the padded ``[B, L]`` layout; the packed ``[T]`` layout is scattered
into it and the results gathered back, so both layouts share one definition.

Gradients flow to ``logprobs`` and ``entropy`` only: old, reference and rollout log-probs
and the advantages are constants of the loss (every trainer detaches them).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

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


def packed_mask(mask: Optional[torch.Tensor], cu_seqlens: torch.Tensor, num_tokens: int, device) -> torch.Tensor:
    """The ``[T]`` validity of the packed layout: tokens inside a sequence (before
    ``cu_seqlens[-1]``), and where the mask, if given, is set."""
    inside = torch.arange(num_tokens, device=device) < cu_seqlens[-1]
    return inside if mask is None else inside & (mask != 0)


# ------------------------------------------------------------------ shaping
def entropy_quantile_threshold(entropy: torch.Tensor, valid: torch.Tensor, rho: float) -> torch.Tensor:
    """The (1 − ρ) quantile of ``entropy`` over ``valid`` tokens, linear interpolation
    (``torch.quantile``'s rule), as a 0-d fp32 tensor; +inf when no token is valid.

    Sort-based with invalid tokens pushed to +inf, so the shapes stay static (no
    ``masked_select``): works under torch.compile and for more than 2^24 tokens, where
    ``torch.quantile`` refuses.
    """
    x = torch.where(valid, entropy.detach().float(), torch.full((), float("inf"), device=entropy.device))
    x = x.reshape(-1).sort().values
    n = valid.sum()
    pos = (1.0 - rho) * (n - 1).clamp(min=0).to(torch.float64)
    lo = pos.floor()
    w = (pos - lo).float()
    lo_i = lo.long().clamp(max=max(x.numel() - 1, 0))
    hi_i = (lo_i + 1).clamp(max=(n - 1).clamp(min=0))
    if x.numel() == 0:
        return torch.full((), float("inf"), device=entropy.device)
    a, b = x[lo_i], x[hi_i]
    t = torch.lerp(a, b, w)
    return torch.where(n > 0, t, torch.full((), float("inf"), device=entropy.device))


def _a3po_scales(adv: torch.Tensor, metric: torch.Tensor, valid: torch.Tensor, shaping: TokenShaping) -> torch.Tensor:
    """Per-token product of the A3PO knob scales (padded layout), a Python loop per sequence."""
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


def shaping_weights(adv, old_logprobs, valid, shaping: TokenShaping, entropy=None, threshold=None) -> torch.Tensor:
    """Per-token constant weight (padded layout) multiplying the policy-gradient term:
    polarity × probability × A3PO scales × entropy-quantile keep."""
    a = adv.double()
    one = a.new_ones(())
    w = torch.where(a > 0, one * shaping.w_pos, torch.where(a < 0, one * shaping.w_neg, one))
    if shaping.probability != 0:
        p = old_logprobs.detach().double().exp()
        wp = torch.where(a > 0, 1 - p, torch.where(a < 0, p, torch.zeros_like(p)))
        lam = shaping.probability
        w = w * ((1 - lam) + lam * wp)
    if shaping.a3po_active:
        metric = old_logprobs.detach().double().exp() if shaping.a3po_metric == "prob" else entropy.detach().double()
        w = w * _a3po_scales(a, metric, valid, shaping)
    if shaping.entropy_quantile is not None:
        w = w * (entropy.detach().float() >= threshold).double()
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


# ------------------------------------------------------------------ the loss
def _pg_term(opts: PolicyLossOptions, logp, old, adv, valid):
    """Per-token policy-gradient loss (before shaping and IS weights), the clip flags and δ
    for the ppo_kl metric."""
    zero = torch.zeros_like(logp)
    delta_raw = logp - old
    if opts.log_ratio_clamp is not None:
        c = opts.log_ratio_clamp
        delta = torch.clamp(delta_raw, -c, c)
    else:
        delta = delta_raw
    lo, hi = 1 - opts.clip_low, 1 + opts.clip_high
    clip_lower = torch.zeros_like(valid)
    if opts.loss_type == "ppo":
        ratio = torch.exp(delta)
        l1 = -adv * ratio
        l2 = -adv * torch.clamp(ratio, lo, hi)
        pg1 = torch.maximum(l1, l2)
        clipped = l2 > l1
        if opts.clip_ratio_c is not None:
            l3 = -adv * opts.clip_ratio_c
            pg = torch.where(adv < 0, torch.minimum(pg1, l3), pg1)
            clip_lower = (pg1 > l3) & (adv < 0)
        else:
            pg = pg1
        return pg, clipped, clip_lower, delta
    if opts.loss_type == "gspo":
        n = valid.sum(-1).clamp(min=1)
        log_s = (delta_raw * valid).sum(-1) / n  # verl: the sequence mean of the unclamped δ
        log_st = logp - logp.detach() + log_s.detach()[:, None]
        s = torch.exp(torch.clamp(log_st, max=opts.gspo_log_clamp) if opts.gspo_log_clamp is not None else log_st)
        l1 = -adv * s
        l2 = -adv * torch.clamp(s, lo, hi)
        return torch.maximum(l1, l2), l2 > l1, clip_lower, delta_raw
    if opts.loss_type == "cispo":
        ratio = torch.exp(delta)
        clipped_ratio = torch.clamp(ratio, lo, hi)
        return -clipped_ratio.detach() * adv * logp, ratio != clipped_ratio, clip_lower, delta
    if opts.loss_type == "sapo":
        ratio = torch.exp(delta)
        one = logp.new_ones(())
        tau = torch.where(adv > 0, one * opts.tau_pos, one * opts.tau_neg)
        gate = torch.sigmoid(tau * (ratio - 1)) * (4.0 / tau)
        return -gate * adv, zero.bool(), clip_lower, delta
    # reinforce / gpg
    return -adv * logp, zero.bool(), clip_lower, delta_raw


def _kl_term(opts: PolicyLossOptions, logp, ref):
    x = logp - ref
    if opts.kl == "k1":
        return x
    if opts.kl == "k2":
        return 0.5 * x.square()
    y = ref - logp
    if opts.kl_clamp:
        y = torch.clamp(y, -20, 20)
    k3 = torch.exp(y) - y - 1
    if opts.kl_clamp:
        k3 = torch.clamp(k3, -10, 10)
    if opts.kl == "k3":
        return k3
    k2 = 0.5 * x.square()  # k3+: the value of k3 with the gradient of k2
    return k2 - k2.detach() + k3.detach()


def _is_weights(opts: PolicyLossOptions, old, rollout, valid):
    """Detached rollout-correction weights and the "rejected" flags (padded layout)."""
    C = opts.rollout_threshold
    kind = opts.rollout_correction
    logw = (old - rollout).detach()
    if kind in ("token_tis", "token_mis", "decoupled"):
        w = torch.exp(torch.clamp(logw, -20, 20))
    else:  # sequence level: verl clamps the masked sum of log-ratios
        s = torch.clamp((logw * valid).sum(-1, keepdim=True), -20, 20)
        w = torch.exp(s).expand_as(logw)
    if kind in ("token_tis", "seq_tis"):
        return torch.clamp(w, max=C), torch.zeros_like(valid)
    if kind == "decoupled":  # AReaL: tokens whose behaviour weight exceeds the cap are dropped
        rejected = w > C
        return torch.where(rejected, 0.0, w), rejected
    rejected = (w < opts.mis_low) | (w > C)  # IcePop / Seq-MIS: 1 inside the bounds, masked outside
    return torch.where(rejected, 0.0, 1.0).to(w.dtype), rejected


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
) -> Tuple[torch.Tensor, PolicyLossMetrics]:
    """The GRPO-family policy loss, per SPEC §4, and its metrics.

    Computes in the dtype of ``logprobs`` promoted to at least fp32 (fp64 stays fp64).
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
    m = valid.to(dtype)

    pg, clipped, clip_lower, delta = _pg_term(opts, lp, old, adv, valid)
    thr = None
    if opts.shaping.entropy_quantile is not None:
        thr = entropy_quantile_threshold(ent, valid, opts.shaping.entropy_quantile)
    shape_w = shaping_weights(adv, old, valid, opts.shaping, ent, thr).to(dtype)
    loss_tok = pg * shape_w
    is_w = torch.ones_like(lp)
    rejected = torch.zeros_like(valid)
    if opts.rollout_correction is not None:
        is_w, rejected = _is_weights(opts, old, roll.to(dtype), m)
        loss_tok = loss_tok * is_w
    pg_tok = loss_tok
    kl_tok = torch.zeros_like(lp)
    if opts.kl is not None:
        kl_tok = _kl_term(opts, lp, ref.to(dtype))
        loss_tok = loss_tok + opts.kl_coef * kl_tok
    if ent is not None and opts.entropy_coef != 0:
        loss_tok = loss_tok - opts.entropy_coef * ent

    n_i = m.sum(-1)
    N_tok = m.sum()
    N_seq = (n_i > 0).to(dtype).sum()

    def aggregate(x):
        if opts.agg == "none":
            return x * m
        if opts.agg == "token-sum":
            return (x * m).sum() * dp_size
        if opts.agg == "token-mean":
            den = N_tok if global_num_tokens is None else torch.as_tensor(global_num_tokens, dtype=dtype)
            return _safe_div((x * m).sum(), den) * dp_size
        if opts.agg == "seq-mean-token-mean":
            per_seq = torch.where(n_i > 0, (x * m).sum(-1) / n_i.clamp(min=1), 0.0)
        else:
            per_seq = (x * m).sum(-1)
        den = N_seq if global_num_seqs is None else torch.as_tensor(global_num_seqs, dtype=dtype)
        out = _safe_div(per_seq.sum(), den) * dp_size
        if opts.agg == "seq-mean-token-sum-norm":
            out = out / (loss_scale_factor if loss_scale_factor is not None else lp.shape[-1])
        return out

    loss = aggregate(loss_tok)
    if opts.agg == "none":
        loss = from_padded(loss, cu_seqlens, T)

    def mean(x):
        return _safe_div((x.to(dtype) * m).sum(), N_tok).float()

    with torch.no_grad():
        is_max = torch.where(valid, is_w, torch.zeros_like(is_w)).max() if valid.numel() else lp.new_zeros(())
        metrics = PolicyLossMetrics(
            pg_loss=aggregate(pg_tok.detach()).sum().float()
            if opts.agg == "none"
            else aggregate(pg_tok.detach()).float(),
            kl_loss=aggregate(kl_tok.detach()).sum().float()
            if opts.agg == "none"
            else aggregate(kl_tok.detach()).float(),
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
            num_seqs=N_seq.float(),
        )
    return loss.to(dtype), metrics


def _safe_div(num, den):
    den = torch.as_tensor(den, dtype=num.dtype, device=num.device)
    return torch.where(den != 0, num / torch.where(den != 0, den, 1.0), torch.zeros_like(num))
