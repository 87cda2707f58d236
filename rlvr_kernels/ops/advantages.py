"""``group_advantages``: validation, the ``rlvr_kernels::group_advantages`` custom op and
its dispatch to the C++ (CPU) and Triton (CUDA) kernels.

The kernels compute one score column per call, described by a small plan:
  baseline  none | mean | rloo | opo | gpg | passk   (what is subtracted / how A is formed)
  scale     none | group | batch                     (the σ that divides, mean baseline)
  whiten    off | tokens | samples                   (batch whitening after the baseline)
Every estimator of SPEC §1 is one plan, except ``gdpo``, which runs one ``mean`` plan per
reward term and a final ``none`` + whitening plan over their weighted sum.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import reference
from ..options import AdvantageOptions, GroupAdvantages, Whitening, resolve_advantage_options
from . import _dispatch
from ._validation import (
    FLOAT_DTYPES,
    INT_DTYPES,
    MASK_DTYPES,
    check_int,
    check_out_dtype,
    check_shape,
    check_tensor,
    checks_enabled,
    fail_if,
)

BASELINE = {"none": 0, "mean": 1, "rloo": 2, "opo": 3, "gpg": 4, "passk": 5}
SCALE = {"none": 0, "group": 1, "batch": 2}
WHITEN = {"off": 0, "tokens": 1, "samples": 2}

# estimator -> (baseline, uses opts.scale, whitening)
_PLANS = {
    "grpo": ("mean", True, "off"),
    "dr_grpo": ("mean", False, "off"),
    "rloo": ("rloo", False, "off"),
    "opo": ("opo", False, "off"),
    "gpg": ("gpg", False, "off"),
    "passk": ("passk", False, "off"),
    "reinforce_pp_baseline": ("mean", False, "whiten"),
}

_Out = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@torch.library.custom_op("rlvr_kernels::group_advantages", mutates_args=())
def _group_advantages_op(
    scores: torch.Tensor,
    group_index: torch.Tensor,
    num_groups: int,
    group_size: int,
    valid: Optional[torch.Tensor],
    lengths: Optional[torch.Tensor],
    response_mask: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    num_tokens: int,
    baseline: int,
    scale: int,
    std_unbiased: bool,
    eps: float,
    eps_in_sqrt: bool,
    singleton_raw: bool,
    passk_k: int,
    whiten: int,
    whiten_eps: float,
    whiten_eps_in_sqrt: bool,
    out_dtype: torch.dtype,
    backend: str,
) -> _Out:
    """One score column → (advantages [B], token_advantages ([B, L], [T] or [0]),
    group_mean [Gn], group_std [Gn], group_count [Gn] int64, group_degenerate [Gn] bool,
    sample_keep [B] bool). With ``group_size > 0`` groups are contiguous rows and
    ``group_index`` is empty (not read)."""
    args = (
        scores,
        group_index,
        num_groups,
        group_size,
        valid,
        lengths,
        response_mask,
        cu_seqlens,
        num_tokens,
        baseline,
        scale,
        std_unbiased,
        eps,
        eps_in_sqrt,
        singleton_raw,
        passk_k,
        whiten,
        whiten_eps,
        whiten_eps_in_sqrt,
        out_dtype,
    )
    if _dispatch.resolve_backend(backend, scores.device) == "cpu":
        return torch.ops.rlvr_kernels_C.group_advantages(*args)
    from ..triton.advantages import group_advantages_triton

    return group_advantages_triton(*args)


@_group_advantages_op.register_fake
def _(scores, group_index, num_groups, group_size, valid, lengths, response_mask, cu_seqlens, num_tokens, *rest):
    out_dtype = rest[-2]
    B = scores.shape[0]
    if cu_seqlens is not None:
        token_shape = (response_mask.shape[0] if response_mask is not None else num_tokens,)
    elif response_mask is not None:
        token_shape = tuple(response_mask.shape)
    else:
        token_shape = (0,)
    new = scores.new_empty
    return (
        new((B,), dtype=out_dtype),
        new(token_shape, dtype=out_dtype),
        new((num_groups,), dtype=out_dtype),
        new((num_groups,), dtype=out_dtype),
        new((num_groups,), dtype=torch.int64),
        new((num_groups,), dtype=torch.bool),
        new((B,), dtype=torch.bool),
    )


def group_advantages(
    scores: torch.Tensor,
    group_index: Optional[torch.Tensor] = None,
    *,
    group_size: Optional[int] = None,
    num_groups: Optional[int] = None,
    estimator: Optional[str] = None,
    preset: Optional[str] = None,
    sample_mask: Optional[torch.Tensor] = None,
    response_mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    lengths: Optional[torch.Tensor] = None,
    reward_weights: Optional[torch.Tensor] = None,
    std: Optional[str] = None,
    eps: Optional[float] = None,
    eps_in_sqrt: Optional[bool] = None,
    scale: Optional[str] = None,
    singleton: Optional[str] = None,
    nan_policy: Optional[str] = None,
    k: Optional[int] = None,
    whitening: Optional[Whitening] = None,
    out_dtype: torch.dtype = torch.float32,
    validate: bool = True,
    backend: str = "auto",
) -> GroupAdvantages:
    """Masked group-relative advantages, group statistics and dynamic-sampling flags (SPEC §1).

    Args:
        scores: ``[B]`` rewards, or ``[B, K]`` reward terms (combined with ``reward_weights``;
            ``gdpo`` normalises each term first). fp16/bf16/fp32/fp64; accumulated in fp32+.
        group_index: ``[B]`` integer group id in ``[0, num_groups)``, any order and group sizes
            (see :func:`uids_to_group_index` for verl's uid strings). Or give ``group_size``.
        group_size: G, meaning rows ``[k·G, (k+1)·G)`` form group k (TRL's layout).
        num_groups: Gn. Inferred as ``max(group_index) + 1`` when omitted (a host sync).
        estimator: ``grpo`` (default), ``dr_grpo``, ``rloo``, ``opo``, ``gpg``, ``passk``,
            ``reinforce_pp_baseline``, ``gdpo``.
        preset: ``"verl"``, ``"trl"`` or ``"trl_async"``: the peer's exact conventions;
            explicit keyword arguments override the preset.
        sample_mask: ``[B]``, False excludes a sample from the statistics and gives it A = 0.
        response_mask: padded ``[B, L]`` token mask, or packed ``[T]`` with ``cu_seqlens``:
            token advantages A_i · m_{i,t} are written in the same pass.
        cu_seqlens: ``[B + 1]`` int32/int64 offsets of the packed layout.
        lengths: ``[B]`` token counts (OPO weights and token whitening); defaults to the row
            sums of the token layout.
        reward_weights: ``[K]`` weights of the reward terms.
        std: ``"unbiased"`` (Bessel) or ``"population"``.
        eps, eps_in_sqrt: (r − μ)/(σ + eps), or (r − μ)/sqrt(σ² + eps) when ``eps_in_sqrt``.
        scale: ``"group"`` (σ per group), ``"batch"`` (one σ over all valid scores) or
            ``"none"``; used by ``grpo`` and ``gdpo``.
        singleton: groups with one valid sample get A = 0 (``"zero"``) or are compared with
            mean 0 and std 1 (``"raw"``, verl's loop rule).
        nan_policy: ``"error"`` rejects non-finite scores (of unmasked samples);
            ``"unscorable"`` excludes them (A = 0), as TRL does.
        k: the pass@k size for ``estimator="passk"``.
        whitening: :class:`Whitening` for ``reinforce_pp_baseline`` and ``gdpo``.
        out_dtype: dtype of the advantages, token advantages and group mean/std.
        validate: check values (group ids in range, finite scores, monotone ``cu_seqlens``);
            reads the data (a host sync on CUDA), skipped under ``torch.compile``.
        backend: ``"auto"``, or ``"reference"``, ``"cpu"``, ``"triton"`` for tests.

    Returns:
        :class:`GroupAdvantages`.
    """
    _dispatch.check_backend(backend)
    opts = resolve_advantage_options(
        preset,
        estimator=estimator,
        std=std,
        eps=eps,
        eps_in_sqrt=eps_in_sqrt,
        scale=scale,
        singleton=singleton,
        nan_policy=nan_policy,
        k=k,
        whitening=whitening,
    )
    out_dtype = check_out_dtype(out_dtype)
    inputs = _validate(
        scores,
        group_index,
        group_size,
        num_groups,
        sample_mask,
        response_mask,
        cu_seqlens,
        lengths,
        reward_weights,
        opts,
        validate,
    )
    scores, group_index, num_groups, group_size, sample_mask, num_tokens = inputs
    scores = scores.detach()  # advantages are constants of the loss: no gradient to rewards

    if backend == "reference":
        if group_size:
            group_index = torch.arange(scores.shape[0], device=scores.device) // group_size
        return reference.group_advantages(
            scores,
            group_index,
            num_groups,
            opts,
            sample_mask=sample_mask,
            response_mask=response_mask,
            cu_seqlens=cu_seqlens,
            lengths=lengths,
            reward_weights=reward_weights,
            out_dtype=out_dtype,
        )

    layout = dict(lengths=lengths, response_mask=response_mask, cu_seqlens=cu_seqlens, num_tokens=num_tokens)
    groups = (group_index, num_groups, group_size)
    if scores.dim() == 1 and opts.estimator != "gdpo":
        r, valid = scores, sample_mask  # the kernels exclude non-finite scores themselves
    else:
        # Reward terms: a row counts when some term is finite (TRL: all-NaN rows are unscorable).
        terms = scores if scores.dim() == 2 else scores[:, None]
        finite = torch.isfinite(terms)
        valid = finite.any(dim=1) if sample_mask is None else sample_mask & finite.any(dim=1)
        dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
        w = reward_weights.to(dtype) if reward_weights is not None else terms.new_ones(terms.shape[1], dtype=dtype)
        if opts.estimator == "gdpo":
            return _gdpo(terms, finite, valid, w, groups, layout, opts, out_dtype, backend)
        # One estimator over r = Σ_k w_k r_k, NaN terms counted as 0 (TRL's nansum).
        r = torch.where(finite, terms.to(dtype) * w, torch.zeros((), dtype=dtype, device=scores.device)).sum(1)
    baseline, uses_scale, whiten = _PLANS[opts.estimator]
    out = _call(
        r,
        groups,
        valid,
        layout,
        opts,
        baseline,
        opts.scale if uses_scale else "none",
        opts.whitening.over if whiten == "whiten" else "off",
        out_dtype,
        backend,
    )
    adv, tok, mean, sd, count, degenerate, keep = out
    return GroupAdvantages(adv, _token_or_none(tok, layout), mean, sd, count, degenerate, keep)


def _gdpo(terms, finite, valid, weights, groups, layout, opts, out_dtype, backend) -> GroupAdvantages:
    """GDPO: each reward term normalised within its groups (GRPO), a weighted sum in
    float64, then one whitening pass that also writes the token advantages."""
    group_index, num_groups, group_size = groups
    total = torch.zeros(terms.shape[0], dtype=torch.float64, device=terms.device)
    means, stds, degs = [], [], []
    for j in range(terms.shape[1]):
        a, _, mean, sd, _, deg, _ = _call(
            terms[:, j],
            groups,
            valid & finite[:, j],
            dict(lengths=layout["lengths"]),
            opts,
            "mean",
            opts.scale,
            "off",
            torch.float64,
            backend,
        )
        total = total + weights[j].double() * a
        means.append(mean)
        stds.append(sd)
        degs.append(deg)
    adv, tok, _, _, count, _, _ = _call(
        total, groups, valid, layout, opts, "none", "none", opts.whitening.over, out_dtype, backend
    )
    # Degenerate: every reward term constant in the group; keep: valid and not degenerate.
    degenerate = torch.stack(degs, dim=1).all(dim=1)
    if group_size:
        keep = valid & ~degenerate.repeat_interleave(group_size)
    elif num_groups:
        in_range = (group_index >= 0) & (group_index < num_groups)
        keep = valid & in_range & ~degenerate[group_index.clamp(0, num_groups - 1)]
    else:
        keep = torch.zeros_like(valid)
    return GroupAdvantages(
        adv,
        _token_or_none(tok, layout),
        torch.stack(means, 1).to(out_dtype),
        torch.stack(stds, 1).to(out_dtype),
        count,
        degenerate,
        keep,
    )


def _call(r, groups, valid, layout, opts: AdvantageOptions, baseline, scale, whiten, out_dtype, backend):
    group_index, num_groups, group_size = groups
    return _group_advantages_op(
        r,
        group_index,
        num_groups,
        group_size,
        valid,
        layout.get("lengths"),
        layout.get("response_mask"),
        layout.get("cu_seqlens"),
        layout.get("num_tokens", -1),
        BASELINE[baseline],
        SCALE[scale],
        opts.std == "unbiased",
        float(opts.eps),
        bool(opts.eps_in_sqrt),
        opts.singleton == "raw",
        int(opts.k or 0),
        WHITEN[whiten],
        float(opts.whitening.eps),
        bool(opts.whitening.eps_in_sqrt),
        out_dtype,
        backend,
    )


def _token_or_none(tok, layout):
    return tok if layout["response_mask"] is not None or layout["cu_seqlens"] is not None else None


def _validate(
    scores,
    group_index,
    group_size,
    num_groups,
    sample_mask,
    response_mask,
    cu_seqlens,
    lengths,
    reward_weights,
    opts,
    validate,
):
    """Static checks (always) and value checks (``validate``); returns normalised inputs."""
    check_tensor("scores", scores, dtypes=FLOAT_DTYPES, ndim=(1, 2))
    dev = scores.device
    B = scores.shape[0]
    if (group_index is None) == (group_size is None):
        raise ValueError("group_index / group_size: give exactly one of them")
    if group_size is not None:
        check_int("group_size", group_size, minimum=1)
        if B % group_size:
            raise ValueError(f"group_size: B = {B} samples do not split into groups of {group_size}")
        if num_groups is not None and num_groups != B // group_size:
            raise ValueError(f"num_groups: expected B / group_size = {B // group_size}, got {num_groups}")
        num_groups = B // group_size
        group_index = torch.empty(0, dtype=torch.long, device=dev)  # contiguous groups: no ids needed
    else:
        check_tensor("group_index", group_index, dtypes=INT_DTYPES, ndim=(1,), device=dev)
        check_shape("group_index", group_index, (B,), "one group id per row of scores")
        group_index = group_index.long()
        if num_groups is None:
            num_groups = int(group_index.max()) + 1 if B else 0
        check_int("num_groups", num_groups, minimum=0)
    if sample_mask is not None:
        check_tensor("sample_mask", sample_mask, dtypes=MASK_DTYPES, ndim=(1,), device=dev)
        check_shape("sample_mask", sample_mask, (B,), "one flag per sample")
        sample_mask = sample_mask != 0
    if scores.dim() == 2:
        K = scores.shape[1]
        if reward_weights is not None:
            check_tensor("reward_weights", reward_weights, dtypes=FLOAT_DTYPES, ndim=(1,), device=dev)
            check_shape("reward_weights", reward_weights, (K,), "one weight per reward term")
    elif reward_weights is not None:
        raise ValueError("reward_weights: only used with [B, K] scores (K reward terms)")
    num_tokens = -1
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32, torch.int64), ndim=(1,), device=dev)
        check_shape("cu_seqlens", cu_seqlens, (B + 1,), "B + 1 offsets of the packed layout")
        if response_mask is not None:
            check_tensor("response_mask", response_mask, dtypes=MASK_DTYPES, ndim=(1,), device=dev)
            num_tokens = response_mask.shape[0]
        else:
            num_tokens = int(cu_seqlens[-1])  # a host sync; pass a [T] mask to avoid it
    elif response_mask is not None:
        check_tensor("response_mask", response_mask, dtypes=MASK_DTYPES, ndim=(2,), device=dev)
        if response_mask.shape[0] != B:
            raise ValueError(
                f"response_mask: expected [B={B}, L] rows matching scores, got {tuple(response_mask.shape)}"
            )
    if lengths is not None:
        check_tensor("lengths", lengths, dtypes=FLOAT_DTYPES + INT_DTYPES, ndim=(1,), device=dev)
        check_shape("lengths", lengths, (B,), "one token count per sample")
    if opts.estimator == "opo" and lengths is None and response_mask is None and cu_seqlens is None:
        raise ValueError("lengths: estimator='opo' needs lengths, response_mask or cu_seqlens for its length weights")

    if checks_enabled(validate) and B:
        # One reduction each on the common (valid) path; the exact, slower search for the
        # offending row only runs when that reduction says something is wrong.
        if group_size is None:
            lo, hi = torch.aminmax(group_index)
            if int(lo) < 0 or int(hi) >= num_groups:
                bad = (group_index < 0) | (group_index >= num_groups)
                i = int(bad.nonzero()[0])
                raise ValueError(
                    f"group_index: expected ids in [0, num_groups={num_groups}), got {int(group_index[i])} at row {i}"
                )
        # A float64 sum is finite iff every score is (no overflow below 1e308 · B).
        if opts.nan_policy == "error" and not bool(torch.isfinite(scores.sum(dtype=torch.float64))):
            finite = torch.isfinite(scores) if scores.dim() == 1 else torch.isfinite(scores).all(dim=1)
            counted = ~finite if sample_mask is None else ~finite & sample_mask
            if bool(counted.any()):
                i = int(counted.nonzero()[0])
                raise ValueError(
                    f"scores: non-finite score at row {i} (pass nan_policy='unscorable' to exclude such "
                    f"samples, or mask them with sample_mask)"
                )
        if reward_weights is not None:
            fail_if(~torch.isfinite(reward_weights).all(), "reward_weights: expected finite weights")
        if lengths is not None:
            fail_if(~(torch.isfinite(lengths.double()) & (lengths >= 0)).all(), "lengths: expected finite counts >= 0")
    if checks_enabled(validate) and cu_seqlens is not None:
        cu = cu_seqlens.long()
        if int(cu[0]) != 0:
            raise ValueError(f"cu_seqlens: expected cu_seqlens[0] == 0, got {int(cu[0])}")
        fail_if((cu[1:] < cu[:-1]).any(), "cu_seqlens: expected non-decreasing offsets")
        if response_mask is not None and int(cu[-1]) != num_tokens:
            raise ValueError(
                f"cu_seqlens: expected cu_seqlens[-1] == T = {num_tokens} (response_mask length), got {int(cu[-1])}"
            )
    return scores, group_index, num_groups, group_size or 0, sample_mask, num_tokens
