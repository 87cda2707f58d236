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

from ..options import AdvantageOptions, GroupAdvantages

__all__ = ["group_advantages", "token_counts", "broadcast_to_tokens"]


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
        if opts.estimator == "reinforce_pp_baseline":
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

        if baseline == "mean":
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
    """Batch whitening with weights w_i (tokens or 1), unbiased variance (docs/advantages.md)."""
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
    var = (weight * centered * centered).sum() / (W - 1) if W > 1 else torch.zeros((), dtype=s.dtype)
    sigma = torch.sqrt(var)
    return torch.where(use, _divide(centered, sigma, wh.eps, wh.eps_in_sqrt), torch.zeros((), dtype=s.dtype))
