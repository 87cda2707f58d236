"""Reference masked group advantages: docs/advantages.md as readable PyTorch.

Slow on purpose (a Python loop over groups) and computed in the dtype of ``scores``, so
float64 inputs give the ground truth every fast backend is diffed against. Inputs are
assumed validated by the public function; this file only states the math.

Notation: r_i score, g(i) group, valid_i (sample_mask, finite score, group id in range),
n = valid count of a group, μ its mean, σ its std, w_i the token count of sample i.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Optional

import torch

from ..contracts.advantages import NUM_PARTIAL_COLUMNS, Baseline, GroupAdvantagesParams, PartialColumn, Scale, Whiten
from ..options import AdvantageOptions, GroupAdvantages

__all__ = ["group_advantages", "token_counts", "broadcast_to_tokens", "group_partials", "group_apply"]


def group_advantages(
    scores: torch.Tensor,
    group_index: torch.Tensor,
    num_groups: int,
    opts: AdvantageOptions,
    *,
    sample_mask: Optional[torch.Tensor] = None,
    response_mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    lengths: Optional[torch.Tensor] = None,
    reward_weights: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> GroupAdvantages:
    dtype = scores.dtype
    out_dtype = out_dtype or dtype
    B = scores.shape[0]
    in_range = (group_index >= 0) & (group_index < num_groups)
    valid = in_range if sample_mask is None else in_range & sample_mask.bool()
    n_tok = token_counts(B, dtype, response_mask, cu_seqlens, lengths)

    if scores.dim() == 2:
        finite = torch.isfinite(scores)
        K = scores.shape[1]
        w = torch.ones(K, dtype=dtype) if reward_weights is None else reward_weights.to(dtype)
        valid = valid & finite.any(dim=1)  # a row is unscorable only when every term is NaN
    else:
        valid = valid & torch.isfinite(scores)

    if opts.estimator == "gdpo":
        # GDPO: normalise each reward term within its groups, sum with weights, whiten.
        cols = scores if scores.dim() == 2 else scores[:, None]
        if scores.dim() == 1:
            w = torch.ones(1, dtype=dtype)
        total = torch.zeros(B, dtype=dtype)
        means, stds, degs = [], [], []
        for k in range(cols.shape[1]):
            term_valid = valid & torch.isfinite(cols[:, k])
            a_k, mean_k, std_k, _, deg_k = _single_term(
                cols[:, k], group_index, num_groups, term_valid, n_tok, opts, baseline="mean", scale=opts.scale
            )
            total = total + w[k] * a_k
            means.append(mean_k)
            stds.append(std_k)
            degs.append(deg_k)
        adv = _whiten(total, valid, n_tok, opts)
        mean = torch.stack(means, dim=1)
        std = torch.stack(stds, dim=1)
        degenerate = torch.stack(degs, dim=1).all(dim=1)
        count = torch.zeros(num_groups, dtype=torch.int64)
        count.index_add_(0, group_index[valid], torch.ones(int(valid.sum()), dtype=torch.int64))
    else:
        if scores.dim() == 2:
            # Several reward terms, one estimator: r = Σ_k w_k r_k, NaN terms count as 0 (nansum).
            r = torch.where(finite, scores * w, torch.zeros((), dtype=dtype)).sum(dim=1)
        else:
            r = scores
        baseline, scale = {
            "grpo": ("mean", opts.scale),
            "dr_grpo": ("mean", "none"),
            "rloo": ("rloo", "none"),
            "opo": ("opo", "none"),
            "gpg": ("gpg", "none"),
            "passk": ("passk", "none"),
            "reinforce_pp_baseline": ("mean", "none"),
        }[opts.estimator]
        adv, mean, std, count, degenerate = _single_term(
            r, group_index, num_groups, valid, n_tok, opts, baseline=baseline, scale=scale
        )
        if opts.estimator == "reinforce_pp_baseline" or opts.batch_whiten:
            adv = _whiten(adv, valid, n_tok, opts)

    g_safe = group_index.clamp(0, max(num_groups - 1, 0))
    keep = valid & ~degenerate[g_safe] if num_groups > 0 else valid & False
    token_adv = broadcast_to_tokens(adv, response_mask, cu_seqlens, out_dtype)
    return GroupAdvantages(
        advantages=adv.to(out_dtype),
        token_advantages=token_adv,
        group_mean=mean.to(out_dtype),
        group_std=std.to(out_dtype),
        group_count=count,
        group_degenerate=degenerate,
        sample_keep=keep,
    )


def token_counts(B, dtype, response_mask, cu_seqlens, lengths) -> Optional[torch.Tensor]:
    """w_i: ``lengths`` if given, else Σ_t m_{i,t} of the token layout, else None."""
    if lengths is not None:
        return lengths.to(dtype)
    if response_mask is not None and cu_seqlens is None:
        return response_mask.to(dtype).sum(dim=1)
    if cu_seqlens is not None:
        cu = cu_seqlens.long()
        if response_mask is None:
            return (cu[1:] - cu[:-1]).to(dtype)
        m = response_mask.to(dtype)
        return torch.stack([m[cu[i] : cu[i + 1]].sum() for i in range(B)]) if B else torch.zeros(0, dtype=dtype)
    return None


def broadcast_to_tokens(adv, response_mask, cu_seqlens, out_dtype) -> Optional[torch.Tensor]:
    """Token advantages A_i · m_{i,t} for the padded or packed layout."""
    if cu_seqlens is not None:
        cu = cu_seqlens.long()
        seq_len = cu[1:] - cu[:-1]
        per_token = torch.repeat_interleave(adv, seq_len)
        if response_mask is not None:
            per_token = per_token * response_mask.to(adv.dtype)
        return per_token.to(out_dtype)
    if response_mask is not None:
        return (adv[:, None] * response_mask.to(adv.dtype)).to(out_dtype)
    return None


def _std(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Two-pass std; 0 where it is undefined (n = 0, or n = 1 with Bessel's correction)."""
    n = x.numel()
    if n == 0 or (kind == "unbiased" and n == 1):
        return torch.zeros((), dtype=x.dtype)
    centered = x - x.mean()
    return torch.sqrt((centered * centered).sum() / (n - 1 if kind == "unbiased" else n))


def _divide(x, sigma, eps, eps_in_sqrt):
    """x / (σ + eps) or x / sqrt(σ² + eps); a zero divisor (σ = eps = 0: all scores equal,
    so x = 0 too) gives 0, never NaN."""
    d = torch.sqrt(sigma * sigma + eps) if eps_in_sqrt else sigma + eps
    d = torch.as_tensor(d, dtype=x.dtype)
    return torch.where(d > 0, x / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(x))


def _single_term(r, group_index, num_groups, valid, n_tok, opts, *, baseline, scale):
    """Per-sample advantages of one score column, and the group statistics."""
    dtype = r.dtype
    B = r.shape[0]
    adv = torch.zeros(B, dtype=dtype)
    mean = torch.zeros(num_groups, dtype=dtype)
    std = torch.zeros(num_groups, dtype=dtype)
    count = torch.zeros(num_groups, dtype=torch.int64)
    degenerate = torch.ones(num_groups, dtype=torch.bool)

    batch_sigma = _std(r[valid], opts.std)
    n_valid = int(valid.sum())
    # GPG: α = B_valid / max(#{valid r_j ≠ 0}, 1).
    gpg_alpha = n_valid / max(int((r[valid] != 0).sum()), 1)

    for g in range(num_groups):
        members = torch.nonzero((group_index == g) & valid).flatten()
        n = members.numel()
        count[g] = n
        if n == 0:
            continue
        rg = r[members]
        mu = rg.mean()
        mean[g] = mu
        std[g] = _std(rg, opts.std)
        degenerate[g] = bool((rg == rg[0]).all())

        if baseline == "passk":
            adv[members] = _passk(rg, opts.k, opts.eps, opts.eps_in_sqrt)
            continue
        if n == 1 and opts.singleton == "zero":
            continue  # A = 0
        if n == 1:
            # verl's loop rule: a lone sample is compared with mean 0 and std 1.
            mu_g, sigma_g = torch.zeros((), dtype=dtype), torch.ones((), dtype=dtype)
        else:
            mu_g, sigma_g = mu, std[g]

        if baseline == "mean" and opts.leave_one_out and n > 1:
            adv[members] = _leave_one_out(rg, scale, opts)
        elif baseline == "mean":
            if scale == "group":
                adv[members] = _divide(rg - mu_g, sigma_g, opts.eps, opts.eps_in_sqrt)
            elif scale == "batch":
                sigma = sigma_g if n == 1 else batch_sigma  # raw singletons keep σ := 1
                adv[members] = _divide(rg - mu_g, sigma, opts.eps, opts.eps_in_sqrt)
            else:
                adv[members] = rg - mu_g
        elif baseline == "rloo":
            adv[members] = rg if n == 1 else n / (n - 1) * (rg - mu)
        elif baseline == "gpg":
            adv[members] = gpg_alpha * (rg - mu_g)
        elif baseline == "opo":
            if n == 1:
                adv[members] = rg
            else:
                lg = n_tok[members]
                # Length-weighted baseline; with no tokens at all the weights are equal.
                b = (lg * rg).sum() / lg.sum() if lg.sum() > 0 else mu
                adv[members] = rg - b
        else:
            raise AssertionError(baseline)
    return adv, mean, std, count, degenerate


def _leave_one_out(rg, scale, opts):
    """A_i = D(r_i − μ₋ᵢ, σ₋ᵢ) over the other n − 1 >= 1 samples of the group (σ₋ᵢ of
    ``opts.std``; exactly 0 when the others are all equal); ``skip_zero_std``: r_i − μ₋ᵢ
    where σ₋ᵢ = 0; ``scale="none"``: r_i − μ₋ᵢ."""
    out = torch.zeros_like(rg)
    for j in range(rg.numel()):
        others = torch.cat([rg[:j], rg[j + 1 :]])
        centred = rg[j] - others.mean()
        sigma = torch.zeros((), dtype=rg.dtype) if bool((others == others[0]).all()) else _std(others, opts.std)
        if scale == "none" or (opts.skip_zero_std and sigma == 0):
            out[j] = centred
        else:
            out[j] = _divide(centred, sigma, opts.eps, opts.eps_in_sqrt)
    return out


def _passk(rg, k, eps, eps_in_sqrt):
    """Analytic pass@k advantages (Chen et al. 2025) for one group; correct ⇔ r > 0."""
    n = rg.numel()
    if n < k:
        return torch.zeros_like(rg)  # no k-subset exists: no signal
    n_neg = int((rg <= 0).sum())
    # Exact rationals: R̄ = 1 − C(n_neg, k)/C(n, k), drop = C(n_neg − 1, k − 1)/C(n − 1, k − 1).
    r_bar = 1 - Fraction(math.comb(n_neg, k), math.comb(n, k))
    drop = Fraction(math.comb(n_neg - 1, k - 1), math.comb(n - 1, k - 1)) if n_neg >= 1 else Fraction(0)
    sig = torch.tensor(math.sqrt(r_bar * (1 - r_bar)), dtype=rg.dtype)
    pos = _divide(torch.tensor(float(1 - r_bar), dtype=rg.dtype), sig, eps, eps_in_sqrt)
    neg = _divide(torch.tensor(float(1 - r_bar - drop), dtype=rg.dtype), sig, eps, eps_in_sqrt)
    return torch.where(rg > 0, pos, neg)


def _whiten(s, valid, n_tok, opts):
    """Batch whitening with weights w_i (tokens or 1), the variance ÷(W − 1) or ÷W, eps added
    or a floor (``clamp``) (docs/advantages.md)."""
    wh = opts.whitening
    if wh.over == "tokens" and n_tok is not None:
        weight = torch.where(valid, n_tok, torch.zeros((), dtype=s.dtype))
    else:
        weight = valid.to(s.dtype)
    use = weight > 0
    W = weight.sum()
    if W <= 0:
        return torch.zeros_like(s)
    mean = (weight * s).sum() / W
    centered = s - mean
    m2 = (weight * centered * centered).sum()
    if wh.std == "unbiased":
        var = m2 / (W - 1) if W > 1 else torch.zeros((), dtype=s.dtype)
    else:
        var = m2 / W
    if wh.clamp:
        floor = torch.as_tensor(wh.eps, dtype=s.dtype)
        d = torch.sqrt(torch.maximum(var, floor)) if wh.eps_in_sqrt else torch.maximum(torch.sqrt(var), floor)
        out = _divide(centered, d, 0.0, False)
    else:
        out = _divide(centered, torch.sqrt(var), wh.eps, wh.eps_in_sqrt)
    return torch.where(use, out, torch.zeros((), dtype=s.dtype))


# ------------------------------------------------------------------ data parallel: partials and apply
# The kernel rows ``group_partials`` and ``group_apply`` (schema arguments, GroupAdvantagesParams):
# a batch spread over W ranks is reduced to per-group partials on each rank, gathered, and
# merged in rank order. Elementwise float64 over the groups.
_C = PartialColumn


def _samples(scores, group_index, valid, p: GroupAdvantagesParams):
    """float64 scores, every sample's group id and its validity (mask, finite, id in range)."""
    x = scores.to(torch.float64)
    B = x.shape[0]
    gi = torch.arange(B, device=x.device) // p.group_size if p.group_size > 0 else group_index.long()
    ok = torch.isfinite(x) & (gi >= 0) & (gi < p.num_groups)
    if valid is not None:
        ok &= valid.bool()
    return x, gi, ok


def group_partials(scores, group_index, valid, lengths, response_mask, cu_seqlens, fparams, iparams):
    """This rank's ``[num_groups, 9]`` float64 partials (columns: ``PartialColumn``): per group,
    over its valid samples x in sample order, with x₁ the first of them: n, x₁, Σ(x − x₁),
    Σ(x − x₁)², [some x ≠ x₁], Σw·x and Σw (OPO: w the token counts, else 0), #{x <= 0},
    #{x != 0}."""
    p = GroupAdvantagesParams.unpack(fparams, iparams)
    x, gi, ok = _samples(scores, group_index, valid, p)
    out = torch.zeros(p.num_groups, NUM_PARTIAL_COLUMNS, dtype=torch.float64, device=x.device)
    w = None
    if p.baseline == Baseline.OPO:
        w = token_counts(x.shape[0], torch.float64, response_mask, cu_seqlens, lengths)
        w = torch.ones_like(x) if w is None else w
    for g in range(p.num_groups):
        members = torch.nonzero(ok & (gi == g)).flatten()
        if members.numel() == 0:
            continue
        xg = x[members]
        d = xg - xg[0]
        row = out[g]
        row[_C.N] = members.numel()
        row[_C.FIRST] = xg[0]
        row[_C.S] = d.sum()
        row[_C.S2] = (d * d).sum()
        row[_C.DIFFERS] = float(bool((d != 0).any()))
        if w is not None:
            row[_C.WX] = (w[members] * xg).sum()
            row[_C.W] = w[members].sum()
        row[_C.INCORRECT] = (xg <= 0).sum()
        row[_C.NONZERO] = (xg != 0).sum()
    return out


def merge_partials(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Partials of a's samples followed by b's, for every group: b's sums re-shifted to a's x₁
    (Δ = x₁' − x₁: Σ(x − x₁) = s' + n'Δ, Σ(x − x₁)² = s2' + 2Δs' + n'Δ²); a side with n = 0
    contributes nothing."""
    na, nb = a[:, _C.N], b[:, _C.N]
    delta = b[:, _C.FIRST] - a[:, _C.FIRST]
    m = a.clone()
    m[:, _C.S2] = a[:, _C.S2] + (b[:, _C.S2] + 2.0 * delta * b[:, _C.S] + nb * delta * delta)
    m[:, _C.S] = a[:, _C.S] + (b[:, _C.S] + nb * delta)
    m[:, _C.N] = na + nb
    m[:, _C.DIFFERS] = ((a[:, _C.DIFFERS] != 0) | (b[:, _C.DIFFERS] != 0) | (delta != 0)).to(torch.float64)
    for c in (_C.WX, _C.W, _C.INCORRECT, _C.NONZERO):
        m[:, c] = a[:, c] + b[:, c]
    m = torch.where((nb == 0)[:, None], a, m)
    return torch.where(((na == 0) & (nb > 0))[:, None], b, m)


def group_apply(scores, group_index, valid, lengths, response_mask, cu_seqlens, partials, fparams, iparams, out_dtype):
    """The outputs of ``group_advantages`` (one plan, no whitening) from W ranks' partials
    ``[W, num_groups, 9]``, merged in rank order: per group n, μ = x₁ + Σd/n,
    σ² = (Σd² − Σd·Σd/n)/(n − 1 or n), degenerate = no valid score differs; per sample
    A = (r − b)·f of the plan (pass@k: b for r > 0, else f), 0 for an invalid sample."""
    p = GroupAdvantagesParams.unpack(fparams, iparams)
    assert p.whiten == Whiten.OFF, "group_apply: whitening needs every rank's advantages"
    x, gi, ok = _samples(scores, group_index, valid, p)
    acc = torch.zeros(p.num_groups, NUM_PARTIAL_COLUMNS, dtype=torch.float64, device=x.device)
    for part in partials.to(torch.float64):  # rank order: the batch concatenated rank after rank
        acc = merge_partials(acc, part)
    stats = _merged_statistics(acc, p)
    g = gi.clamp(0, max(p.num_groups - 1, 0))
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    if p.num_groups == 0:
        adv, keep = torch.zeros_like(x), torch.zeros_like(ok)
    else:
        b, f = stats["b"][g], stats["f"][g]
        adv = torch.where(x > 0, b, f) if p.baseline == Baseline.PASSK else (x - b) * f
        adv = torch.where(ok, adv, zero)
        keep = ok & ~stats["degenerate"][g]
    token_adv = broadcast_to_tokens(adv, response_mask, cu_seqlens, out_dtype)
    if token_adv is None:
        token_adv = torch.zeros(0, dtype=out_dtype, device=x.device)
    return (
        adv.to(out_dtype),
        token_adv,
        stats["mean"].to(out_dtype),
        stats["std"].to(out_dtype),
        stats["count"],
        stats["degenerate"],
        keep,
    )


def _merged_statistics(acc: torch.Tensor, p: GroupAdvantagesParams) -> dict:
    """Group statistics and the affine map (b, f) of every group from its merged partials."""
    n = acc[:, _C.N]
    s, s2, first = acc[:, _C.S], acc[:, _C.S2], acc[:, _C.FIRST]
    one, zero = torch.ones_like(n), torch.zeros_like(n)
    has = n > 0
    d = s / torch.where(has, n, one)
    mu = torch.where(has, first + d, zero)
    m2 = torch.clamp_min(s2 - s * d, 0.0)
    denom = n - 1 if p.std_unbiased else n
    sigma = torch.where(denom > 0, torch.sqrt(m2 / torch.where(denom > 0, denom, one)), zero)
    degenerate = ~has | (acc[:, _C.DIFFERS] == 0)
    n_valid = n.sum()
    alpha = n_valid / torch.clamp_min(acc[:, _C.NONZERO].sum(), 1.0)
    eps, in_sqrt = p.eps, bool(p.eps_in_sqrt)
    if p.baseline == Baseline.PASSK:
        b, f = _passk_values(n, acc[:, _C.INCORRECT], p.passk_k, eps, in_sqrt)
    else:
        b, f = mu, one
        if p.baseline == Baseline.MEAN and p.scale == Scale.GROUP:
            f = _divide(one, sigma, eps, in_sqrt)
        elif p.baseline == Baseline.MEAN and p.scale == Scale.BATCH:
            f = _divide(one, _merged_batch_sigma(n, mu, m2, n_valid, p), eps, in_sqrt) * one
        elif p.baseline == Baseline.RLOO:
            f = n / torch.where(n > 1, n - 1, one)
        elif p.baseline == Baseline.OPO:  # no tokens at all: equal weights
            w = acc[:, _C.W]
            b = torch.where(w > 0, acc[:, _C.WX] / torch.where(w > 0, w, one), mu)
        elif p.baseline == Baseline.GPG:
            f = alpha * one
        elif p.baseline == Baseline.NONE:
            b = zero
        # A lone valid sample: A = 0, or verl's loop rule (mean 0, std 1).
        if p.baseline == Baseline.MEAN and p.scale != Scale.NONE:
            f1 = _divide(one, one, eps, in_sqrt)
        else:
            f1 = alpha * one if p.baseline == Baseline.GPG else one
        if p.baseline != Baseline.NONE:
            single = n == 1
            b = torch.where(single, zero, b)
            f = torch.where(single, f1 if p.singleton_raw else zero, f)
    return dict(mean=mu, std=sigma, count=n.to(torch.int64), degenerate=degenerate, b=b, f=f)


def _merged_batch_sigma(n, mu, m2, n_valid, p: GroupAdvantagesParams) -> torch.Tensor:
    """σ over all valid scores from the groups' moments (Chan et al.)."""
    zero = torch.zeros((), dtype=torch.float64, device=n.device)
    if float(n_valid) <= 0:
        return zero
    mean = (n * mu).sum() / n_valid
    total = (m2 + n * (mu - mean) * (mu - mean)).sum()
    denom = n_valid - 1 if p.std_unbiased else n_valid
    return torch.sqrt(total / denom) if float(denom) > 0 else zero


def _passk_values(n, n_neg, k: int, eps: float, eps_in_sqrt: bool):
    """Analytic pass@k values of every group: (correct, incorrect), 0 when n < k."""
    all_neg = torch.ones_like(n)  # C(n_neg, k)/C(n, k)
    for j in range(k):
        all_neg = all_neg * (torch.clamp_min(n_neg - j, 0.0) / (n - j))
    drop = (n_neg >= 1).to(n.dtype)  # C(n_neg − 1, k − 1)/C(n − 1, k − 1)
    for j in range(k - 1):
        drop = torch.where(n_neg >= 1, drop * (torch.clamp_min(n_neg - 1 - j, 0.0) / (n - 1 - j)), drop)
    s = torch.sqrt(all_neg * (1.0 - all_neg))
    pos = _divide(all_neg, s, eps, eps_in_sqrt)
    neg = _divide(all_neg - drop, s, eps, eps_in_sqrt)
    enough = n >= k
    return torch.where(enough, pos, torch.zeros_like(pos)), torch.where(enough, neg, torch.zeros_like(neg))
