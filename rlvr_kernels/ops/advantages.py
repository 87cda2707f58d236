"""``group_advantages`` (docs/advantages.md): masked group-relative advantages, group statistics and
dynamic-sampling flags, as the ``rlvr_kernels::group_advantages`` custom op over the C++
(CPU) and Triton (CUDA) kernels.

Every estimator is one or more *plans* over one score column:
  baseline  NONE | MEAN | RLOO | OPO | GPG | PASSK   (what is subtracted / how A is formed)
  scale     NONE | GROUP | BATCH                     (the σ that divides a MEAN baseline)
  whiten    OFF | TOKENS | SAMPLES                   (batch whitening after the baseline)
(:mod:`rlvr_kernels.contracts.advantages`). Every estimator of docs/advantages.md is one plan, except
``gdpo``, which runs one MEAN plan per reward term and a final NONE + whitening plan over
their weighted sum. ``[B, K]`` reward terms of the other estimators are summed first.

Kernel contract (C++ ``csrc/advantages.cpp``, Triton ``triton/advantages.py``; both named
``group_advantages`` in the dispatch table):

  group_advantages(scores [B] float, group_index [B] int32/int64 or None, valid [B] bool or None,
                   lengths [B] real or None, response_mask [B, L] / [T] or None,
                   cu_seqlens [B + 1] int32/int64 or None,
                   fparams, iparams (GroupAdvantagesParams.pack()), out_dtype)
      -> (advantages [B], token_advantages ([B, L] padded, [T] packed, [0] without a layout),
          group_mean [Gn], group_std [Gn], group_count [Gn] int64, group_degenerate [Gn] bool,
          sample_keep [B] bool)
  - Groups: ``group_size`` G > 0 means group k is rows [k·G, (k+1)·G), ``group_index`` is
    None and Gn·G == B; otherwise ``group_index`` holds the ids.
  - Sample i is valid when ``valid[i]`` (if given), ``scores[i]`` is finite and its group id
    is in [0, Gn). Invalid samples get A = 0, keep = False and count nowhere.
  - Statistics over each group's valid samples: n, μ, σ (``std_unbiased``: Bessel), in
    float64 on the CPU; in the scores' precision (fp32, fp64 for fp64 scores) in Triton.
    Empty groups: n = 0, μ = σ = 0, degenerate. Degenerate: all valid scores equal.
  - A per plan (docs/advantages.md), then whitening, in the kernel's compute precision; the outputs are
    rounded once to ``out_dtype`` (token values as ``A.to(float32) · mask`` for sub-fp64 outputs).
  - Token weights w_i (OPO, TOKENS whitening): ``lengths``, else the row sums of the token
    layout (span lengths for a packed layout without a mask, T = ``num_tokens``).
  - Packed spans follow the one cu_seqlens rule (``csrc/spans.h``): in bounds and disjoint
    whatever the offsets; tokens outside every span get 0.
  - Results are deterministic: the same bits for any thread count.
  The kernels check every shape relation they rely on (the registered ops are reachable
  directly); values (ids in range, monotone offsets, finite scores) are checked here when
  ``validate=True`` and are harmless when they are wrong.

Data parallel (``process_group``, :func:`_distributed`): a group's samples may be spread over
the ranks. Two more kernels of the dispatch table (C++, Triton, and the fp64 reference rows
that are their spec), as the custom ops ``rlvr_kernels::group_partials`` and
``rlvr_kernels::group_apply``:

  group_partials(scores, group_index, valid, lengths, response_mask, cu_seqlens, fparams, iparams)
      -> partials [Gn, 9] float64
  - Per group, over this rank's valid samples in sample order, the kernel's accumulators
    ``Acc`` (columns: ``contracts.advantages.PartialColumn``): n, the first valid score x₁,
    Σ(x − x₁), Σ(x − x₁)², "differs", OPO's Σw·x and Σw (0 for other plans), pass@k's
    incorrect count, and the non-zero count of GPG's α.
  group_apply(scores, group_index, valid, lengths, response_mask, cu_seqlens,
              partials [W, Gn, 9] float64, fparams, iparams, out_dtype)
      -> the outputs of group_advantages
  - The W tables merged in rank order 0..W−1 with the kernel's merge rule (``Acc::merge``),
    the kernel's per-group step over the merged accumulators, the batch σ (Chan's formula
    over the groups' moments) and GPG's α summed over the groups in a fixed order, then
    A = (r − b_g)·f_g (pass@k: b_g for r > 0, else f_g), rounded once to ``out_dtype`` and
    broadcast to the tokens. ``whiten`` must be OFF (whitening needs every rank's advantages).

Each rank runs ``group_partials`` on its samples; ONE ``all_gather`` carries the columns the
plan reads (5, 7 for OPO, 6 for pass@k and GPG: 40–56 bytes per group and rank); every rank
then runs ``group_apply`` over the same gathered bits in the same order, so the statistics are
bitwise equal on every rank. Before it, the handshake of ``_core.collectives`` (one small
all-reduce of each rank's validation outcome, ``num_groups`` and option fingerprints) makes a
bad input an error on every rank rather than a hang.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch

from .._core import collectives
from .._core import dispatch as _dispatch
from .._core.validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    INT_DTYPES,
    MASK_DTYPES,
    MAX_COUNT,
    check_cu_seqlens,
    check_int,
    check_out_dtype,
    check_shape,
    check_tensor,
    checks_enabled,
    fail_if,
)
from ..contracts.advantages import NUM_PARTIAL_COLUMNS, Baseline, GroupAdvantagesParams, PartialColumn, Scale, Whiten
from ..options import AdvantageOptions, GroupAdvantages, Whitening, options_or_resolve, resolve_advantage_options

_Out = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


# ------------------------------------------------------------------ custom op
@torch.library.custom_op("rlvr_kernels::group_advantages", mutates_args=())
def _group_advantages_op(
    scores: torch.Tensor,
    group_index: Optional[torch.Tensor],
    valid: Optional[torch.Tensor],
    lengths: Optional[torch.Tensor],
    response_mask: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    fparams: List[float],
    iparams: List[int],
    out_dtype: torch.dtype,
    backend: str,
) -> _Out:
    """One plan over one score column: the kernel contract above."""
    return _dispatch.run(
        "group_advantages",
        backend,
        scores.device,
        scores,
        group_index,
        valid,
        lengths,
        response_mask,
        cu_seqlens,
        fparams,
        iparams,
        out_dtype,
    )


@_group_advantages_op.register_fake
def _(scores, group_index, valid, lengths, response_mask, cu_seqlens, fparams, iparams, out_dtype, backend):
    return _fake_outputs(scores, response_mask, cu_seqlens, fparams, iparams, out_dtype)


def _fake_outputs(scores, response_mask, cu_seqlens, fparams, iparams, out_dtype) -> _Out:
    """The shapes and dtypes of the group_advantages (and group_apply) outputs."""
    params = GroupAdvantagesParams.unpack(fparams, iparams)
    B, Gn = scores.shape[0], params.num_groups
    if cu_seqlens is not None:
        token_shape = (response_mask.shape[0] if response_mask is not None else params.num_tokens,)
    elif response_mask is not None:
        token_shape = tuple(response_mask.shape)
    else:
        token_shape = (0,)
    new = scores.new_empty
    return (
        new((B,), dtype=out_dtype),
        new(token_shape, dtype=out_dtype),
        new((Gn,), dtype=out_dtype),
        new((Gn,), dtype=out_dtype),
        new((Gn,), dtype=torch.int64),
        new((Gn,), dtype=torch.bool),
        new((B,), dtype=torch.bool),
    )


@torch.library.custom_op("rlvr_kernels::group_partials", mutates_args=())
def _group_partials_op(
    scores: torch.Tensor,
    group_index: Optional[torch.Tensor],
    valid: Optional[torch.Tensor],
    lengths: Optional[torch.Tensor],
    response_mask: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    fparams: List[float],
    iparams: List[int],
    backend: str,
) -> torch.Tensor:
    """This rank's per-group partials ``[Gn, 9]`` float64 (module docstring)."""
    args = (scores, group_index, valid, lengths, response_mask, cu_seqlens, fparams, iparams)
    return _run_kernel("group_partials", backend, scores.device, *args)


@_group_partials_op.register_fake
def _(scores, group_index, valid, lengths, response_mask, cu_seqlens, fparams, iparams, backend):
    num_groups = GroupAdvantagesParams.unpack(fparams, iparams).num_groups
    return scores.new_empty((num_groups, NUM_PARTIAL_COLUMNS), dtype=torch.float64)


@torch.library.custom_op("rlvr_kernels::group_apply", mutates_args=())
def _group_apply_op(
    scores: torch.Tensor,
    group_index: Optional[torch.Tensor],
    valid: Optional[torch.Tensor],
    lengths: Optional[torch.Tensor],
    response_mask: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    partials: torch.Tensor,
    fparams: List[float],
    iparams: List[int],
    out_dtype: torch.dtype,
    backend: str,
) -> _Out:
    """The outputs of ``group_advantages`` from W ranks' partials ``[W, Gn, 9]`` (module docstring)."""
    args = (scores, group_index, valid, lengths, response_mask, cu_seqlens, partials, fparams, iparams, out_dtype)
    return _run_kernel("group_apply", backend, scores.device, *args)


@_group_apply_op.register_fake
def _(scores, group_index, valid, lengths, response_mask, cu_seqlens, partials, fparams, iparams, out_dtype, backend):
    return _fake_outputs(scores, response_mask, cu_seqlens, fparams, iparams, out_dtype)


def _run_kernel(kernel: str, backend: str, device: torch.device, *args):
    """A kernel row; ``backend="reference"`` runs the spec's row (imported only then)."""
    if backend == "reference":
        return _dispatch.kernel(kernel, "reference")(*args)
    return _dispatch.run(kernel, backend, device, *args)


# ------------------------------------------------------------------ validation
@dataclasses.dataclass(frozen=True)
class _Inputs:
    """Kernel-ready inputs of one call, as :func:`_validate` returns them."""

    scores: torch.Tensor  # [B] or [B, K] reward terms, detached
    group_index: Optional[torch.Tensor]  # [B] int32/int64 ids; None with group_size
    num_groups: int
    group_size: int  # G > 0: contiguous groups of G rows; 0: group_index given
    sample_mask: Optional[torch.Tensor]  # [B] bool
    response_mask: Optional[torch.Tensor]  # [B, L] padded, or [T] with cu_seqlens
    cu_seqlens: Optional[torch.Tensor]  # [B + 1] int32/int64
    lengths: Optional[torch.Tensor]  # [B]
    reward_weights: Optional[torch.Tensor]  # [K]
    num_tokens: int  # T of a packed layout without response_mask; -1 otherwise

    @property
    def has_layout(self) -> bool:
        return self.response_mask is not None or self.cu_seqlens is not None


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
    opts: AdvantageOptions,
    validate: bool,
) -> _Inputs:
    """Static checks (always: types, dtypes, shapes, devices, sizes) and value checks
    (``validate``, not under torch.compile nor on meta tensors); the inputs, kernel-ready."""
    check_tensor("scores", scores, dtypes=FLOAT_DTYPES, ndim=(1, 2))
    B = scores.shape[0]
    if B > MAX_COUNT:
        raise ValueError(f"scores: expected at most {MAX_COUNT} samples, got {B}")
    like = dict(like=scores, like_name="scores")
    tensors = (scores, group_index, sample_mask, response_mask, cu_seqlens, lengths, reward_weights)
    values = checks_enabled(validate, *tensors)
    if (group_index is None) == (group_size is None):
        raise ValueError("group_index / group_size: give exactly one of them")
    if group_size is not None:
        check_int("group_size", group_size, minimum=1)
        if B % group_size:
            raise ValueError(f"group_size: B = {B} samples do not split into groups of {group_size}")
        if num_groups is not None and num_groups != B // group_size:
            raise ValueError(f"num_groups: expected B / group_size = {B // group_size}, got {num_groups}")
        num_groups = B // group_size
    else:
        check_tensor("group_index", group_index, dtypes=INT_DTYPES, ndim=(1,), **like)
        check_shape("group_index", group_index, (B,), "one group id per row of scores")
        if group_index.dtype not in INDEX_DTYPES:
            group_index = group_index.long()
        if num_groups is None:
            num_groups = _infer_num_groups(group_index)
        check_int("num_groups", num_groups, minimum=0)
    if sample_mask is not None:
        check_tensor("sample_mask", sample_mask, dtypes=MASK_DTYPES, ndim=(1,), **like)
        check_shape("sample_mask", sample_mask, (B,), "one flag per sample")
        sample_mask = sample_mask != 0
    if scores.dim() == 2:
        if reward_weights is not None:
            check_tensor("reward_weights", reward_weights, dtypes=FLOAT_DTYPES, ndim=(1,), **like)
            check_shape("reward_weights", reward_weights, (scores.shape[1],), "one weight per reward term")
    elif reward_weights is not None:
        raise ValueError("reward_weights: only used with [B, K] scores (K reward terms)")
    num_tokens = -1
    if cu_seqlens is not None:
        if response_mask is not None:
            check_tensor("response_mask", response_mask, dtypes=MASK_DTYPES, ndim=(1,), **like)
        T = response_mask.shape[0] if response_mask is not None else None
        check_cu_seqlens(cu_seqlens, **like, num_seqs=B, num_tokens=T, total="equal", validate=validate)
        if response_mask is None:
            num_tokens = _packed_token_count(cu_seqlens)
    elif response_mask is not None:
        check_tensor("response_mask", response_mask, dtypes=MASK_DTYPES, ndim=(2,), **like)
        if response_mask.shape[0] != B:
            raise ValueError(
                f"response_mask: expected [B={B}, L] rows matching scores, got {tuple(response_mask.shape)}"
            )
    if lengths is not None:
        check_tensor("lengths", lengths, dtypes=FLOAT_DTYPES + INT_DTYPES, ndim=(1,), **like)
        check_shape("lengths", lengths, (B,), "one token count per sample")
    if opts.estimator == "opo" and lengths is None and response_mask is None and cu_seqlens is None:
        raise ValueError("lengths: estimator='opo' needs lengths, response_mask or cu_seqlens for its length weights")
    if values and B:
        _check_values(scores, group_index if group_size is None else None, num_groups, sample_mask, opts)
        if reward_weights is not None:
            fail_if(~torch.isfinite(reward_weights).all(), "reward_weights: expected finite weights")
        if lengths is not None:
            fail_if(~(torch.isfinite(lengths.double()) & (lengths >= 0)).all(), "lengths: expected finite counts >= 0")
    return _Inputs(
        scores=scores.detach(),  # advantages are constants of the loss: no gradient to rewards
        group_index=group_index if group_size is None else None,
        num_groups=num_groups,
        group_size=group_size or 0,
        sample_mask=sample_mask,
        response_mask=response_mask,
        cu_seqlens=cu_seqlens,
        lengths=lengths,
        reward_weights=reward_weights,
        num_tokens=num_tokens,
    )


def _check_values(scores, group_index, num_groups, sample_mask, opts) -> None:
    """Group ids in range and finite scores (of unmasked samples, with ``nan_policy="error"``):
    one reduction each; the exact search for the offending row only runs when it fails."""
    if group_index is not None:
        lo, hi = torch.aminmax(group_index)
        if int(lo) < 0 or int(hi) >= num_groups:
            bad = (group_index < 0) | (group_index >= num_groups)
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"group_index: expected ids in [0, num_groups={num_groups}), got {int(group_index[i])} at row {i}"
            )
    # A sum is finite iff every term is, unless finite terms overflow it: then the exact check.
    if opts.nan_policy == "error" and not bool(torch.isfinite(scores.sum())):
        finite = torch.isfinite(scores) if scores.dim() == 1 else torch.isfinite(scores).all(dim=1)
        counted = ~finite if sample_mask is None else ~finite & sample_mask
        if bool(counted.any()):
            i = int(counted.nonzero()[0])
            raise ValueError(
                f"scores: non-finite score at row {i} (pass nan_policy='unscorable' to exclude such "
                f"samples, or mask them with sample_mask)"
            )


def _resolve(preset, options, **overrides) -> AdvantageOptions:
    return options_or_resolve(AdvantageOptions, resolve_advantage_options, preset, options, **overrides)


# ------------------------------------------------------------------ public function
def group_advantages(
    scores: torch.Tensor,
    group_index: Optional[torch.Tensor] = None,
    *,
    group_size: Optional[int] = None,
    num_groups: Optional[int] = None,
    estimator: Optional[str] = None,
    preset: Optional[str] = None,
    options: Optional[AdvantageOptions] = None,
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
    batch_whiten: Optional[bool] = None,
    leave_one_out: Optional[bool] = None,
    skip_zero_std: Optional[bool] = None,
    out_dtype: torch.dtype = torch.float32,
    validate: bool = True,
    backend: str = "auto",
    process_group=None,
) -> GroupAdvantages:
    """Masked group-relative advantages, group statistics and dynamic-sampling flags (docs/advantages.md).

    Args:
        scores: ``[B]`` rewards, or ``[B, K]`` reward terms (combined with ``reward_weights``;
            ``gdpo`` normalises each term first). fp16/bf16/fp32/fp64; accumulated in fp32+.
        group_index: ``[B]`` integer group id in ``[0, num_groups)``, any order and group sizes
            (see :func:`uids_to_group_index` for verl's uid strings). Or give ``group_size``.
        group_size: G, meaning rows ``[k·G, (k+1)·G)`` form group k (TRL's layout).
        num_groups: Gn. Inferred as ``max(group_index) + 1`` when omitted (a host sync; required
            with meta tensors). At most ``2**31 - 1``, like every count the kernels allocate.
        estimator: ``grpo`` (default), ``dr_grpo``, ``rloo``, ``opo``, ``gpg``, ``passk``,
            ``reinforce_pp_baseline``, ``gdpo``.
        preset: ``"verl"``, ``"trl"``, ``"trl_async"``, ``"openrlhf"``, ``"slime"``,
            ``"areal"``, ``"nemo_rl"``, ``"skyrl"`` or ``"prime_rl"``: the peer's exact
            conventions (docs/presets.md); explicit keyword arguments override the preset.
        options: a full :class:`AdvantageOptions` (then neither ``preset`` nor any of
            ``estimator``, ``std``, ``eps``, ``eps_in_sqrt``, ``scale``, ``singleton``,
            ``nan_policy``, ``k``, ``whitening``, ``batch_whiten``, ``leave_one_out``,
            ``skip_zero_std`` may be given); those keywords are its fields.
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
        whitening: :class:`Whitening` for ``reinforce_pp_baseline``, ``gdpo`` and ``batch_whiten``.
        batch_whiten: apply ``whitening`` after any estimator (AReaL's group then batch
            normalisation); ``reinforce_pp_baseline`` and ``gdpo`` always whiten.
        leave_one_out: ``grpo`` only: A_i = D(r_i − μ₋ᵢ, σ₋ᵢ), the mean and std of the other
            valid samples of i's group (NeMo-RL).
        skip_zero_std: with ``leave_one_out``, A_i = r_i − μ₋ᵢ where σ₋ᵢ = 0 (NeMo-RL).
        out_dtype: dtype of the advantages, token advantages and group mean/std.
        validate: check values (group ids in range, finite scores, monotone ``cu_seqlens``);
            reads the data (a host sync on CUDA), skipped under ``torch.compile`` and for meta
            tensors. Wrong values never make a kernel read or write out of bounds.
        backend: ``"auto"``, or ``"reference"``, ``"cpu"``, ``"triton"`` for tests.
        process_group: a ``torch.distributed`` data-parallel group whose ranks each pass their
            own samples of one global batch (a group's samples may be on several ranks).
            ``group_index`` then holds GLOBAL group ids and ``num_groups`` (the global count)
            is required (``group_size`` is refused: contiguous rows are a per-rank notion).
            Statistics are over the whole batch: per-group float64 partials, one
            ``all_gather`` (after a small all-reduce of each rank's validation outcome and
            options: a bad input on any rank raises on every rank, never hangs), merged in
            rank order. Guarantees: (1) every rank gets bitwise-equal ``group_mean``,
            ``group_std``, ``group_count``, ``group_degenerate`` (the global ones); (2) each
            rank's advantages, token advantages and keep flags are computed with the CPU
            kernel's float64 formulas, and equal bitwise the single-process ``backend="cpu"``
            result on the batch concatenated in rank order whenever the float64 group sums are
            exact (e.g. 0/1 or integer rewards, dyadic values of bounded range: any order then
            gives the same sums); otherwise they agree to float64 rounding of those sums
            (~1e-16 relative before the ``out_dtype`` rounding). ``scale="batch"`` combines the
            groups' moments (Chan's formula) instead of the kernel's two-pass batch σ: equal
            to float64 rounding only. Supported: ``grpo`` (any scale), ``dr_grpo``, ``rloo``,
            ``opo``, ``gpg``, ``passk``; ``reinforce_pp_baseline`` and ``gdpo`` whiten over
            the batch after the baseline (a second collective) and raise NotImplementedError.
            On CUDA the Triton kernels compute the partials and the merge in float64 too
            (fixed-order sums, no atomics): statistics bitwise equal on every rank, advantages
            equal to one process to float64 rounding (the one-process Triton statistics are
            float32). ``backend="reference"`` runs the fp64 reference rows. Eager only
            (refused under ``torch.compile``).

    Returns:
        :class:`GroupAdvantages`.
    """
    if process_group is not None:
        return _distributed(
            process_group,
            backend,
            dict(
                preset=preset,
                options=options,
                estimator=estimator,
                std=std,
                eps=eps,
                eps_in_sqrt=eps_in_sqrt,
                scale=scale,
                singleton=singleton,
                nan_policy=nan_policy,
                k=k,
                whitening=whitening,
                batch_whiten=batch_whiten,
                leave_one_out=leave_one_out,
                skip_zero_std=skip_zero_std,
            ),
            (scores, group_index, num_groups, sample_mask, response_mask, cu_seqlens, lengths, reward_weights),
            group_size,
            out_dtype,
            validate,
        )
    _dispatch.check_backend(backend)
    opts = _resolve(
        preset,
        options,
        estimator=estimator,
        std=std,
        eps=eps,
        eps_in_sqrt=eps_in_sqrt,
        scale=scale,
        singleton=singleton,
        nan_policy=nan_policy,
        k=k,
        whitening=whitening,
        batch_whiten=batch_whiten,
        leave_one_out=leave_one_out,
        skip_zero_std=skip_zero_std,
    )
    out_dtype = check_out_dtype(out_dtype)
    x = _validate(
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
    if backend == "reference":
        return _reference(x, opts, out_dtype)
    if opts.estimator == "gdpo":
        terms = x.scores if x.scores.dim() == 2 else x.scores[:, None]
        finite = torch.isfinite(terms)
        valid = finite.any(dim=1) if x.sample_mask is None else x.sample_mask & finite.any(dim=1)
        return _gdpo(x, terms, finite, valid, _term_weights(x, terms), opts, out_dtype, backend)
    r, valid = _score_column(x)
    if opts.leave_one_out:
        return _leave_one_out(x, r, valid, opts, out_dtype, backend)
    baseline, scale_code, whiten = _plan(opts)
    adv, tok, mean, sd, count, degenerate, keep = _call(
        x, r, valid, opts, baseline, scale_code, whiten, out_dtype, backend
    )
    return GroupAdvantages(adv, tok if x.has_layout else None, mean, sd, count, degenerate, keep)


# ------------------------------------------------------------------ helpers
def _term_weights(x: _Inputs, terms: torch.Tensor) -> torch.Tensor:
    """The [K] reward-term weights in the compute dtype of the terms (ones by default)."""
    dtype = torch.float64 if terms.dtype == torch.float64 else torch.float32
    if x.reward_weights is not None:
        return x.reward_weights.to(dtype)
    return terms.new_ones(terms.shape[1], dtype=dtype)


def _score_column(x: _Inputs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The one score column of every estimator but gdpo and its sample mask: the scores, or
    r = Σ_k w_k r_k of ``[B, K]`` reward terms, NaN terms counted as 0 (TRL's nansum)."""
    if x.scores.dim() == 1:
        return x.scores, x.sample_mask  # the kernels exclude non-finite scores themselves
    # Reward terms: a row counts when some term is finite (TRL: all-NaN rows are unscorable).
    terms = x.scores
    finite = torch.isfinite(terms)
    valid = finite.any(dim=1) if x.sample_mask is None else x.sample_mask & finite.any(dim=1)
    w = _term_weights(x, terms)
    zero = torch.zeros((), dtype=w.dtype, device=terms.device)
    return torch.where(finite, terms.to(w.dtype) * w, zero).sum(1), valid


def _plan(opts: AdvantageOptions) -> Tuple[Baseline, Scale, Whiten]:
    """The one kernel plan of every estimator but gdpo."""
    baseline = {
        "grpo": Baseline.MEAN,
        "dr_grpo": Baseline.MEAN,
        "rloo": Baseline.RLOO,
        "opo": Baseline.OPO,
        "gpg": Baseline.GPG,
        "passk": Baseline.PASSK,
        "reinforce_pp_baseline": Baseline.MEAN,
    }[opts.estimator]
    scale = _SCALES[opts.scale] if opts.estimator == "grpo" else Scale.NONE
    whitens = opts.estimator == "reinforce_pp_baseline" or opts.batch_whiten
    return baseline, scale, _WHITEN[opts.whitening.over] if whitens else Whiten.OFF


_SCALES = {"none": Scale.NONE, "group": Scale.GROUP, "batch": Scale.BATCH}
_WHITEN = {"tokens": Whiten.TOKENS, "samples": Whiten.SAMPLES}


def _gdpo(x: _Inputs, terms, finite, valid, weights, opts, out_dtype, backend) -> GroupAdvantages:
    """GDPO: each reward term normalised within its groups (GRPO), a weighted sum in
    float64, then one whitening pass that also writes the token advantages."""
    total = torch.zeros(terms.shape[0], dtype=torch.float64, device=terms.device)
    means, stds, degs = [], [], []
    # The per-term plans need the token weights only (no token output).
    per_term = dataclasses.replace(x, response_mask=None, cu_seqlens=None, num_tokens=-1)
    for j in range(terms.shape[1]):
        a, _, mean, sd, _, deg, _ = _call(
            per_term,
            terms[:, j],
            valid & finite[:, j],
            opts,
            Baseline.MEAN,
            _SCALES[opts.scale],
            Whiten.OFF,
            torch.float64,
            backend,
        )
        total = total + weights[j].double() * a
        means.append(mean)
        stds.append(sd)
        degs.append(deg)
    whiten = _WHITEN[opts.whitening.over]
    adv, tok, _, _, count, _, _ = _call(x, total, valid, opts, Baseline.NONE, Scale.NONE, whiten, out_dtype, backend)
    # Degenerate: every reward term constant in the group; keep: valid and not degenerate.
    degenerate = torch.stack(degs, dim=1).all(dim=1)
    if x.group_size:
        keep = valid & ~degenerate.repeat_interleave(x.group_size)
    elif x.num_groups:
        gi = x.group_index
        in_range = (gi >= 0) & (gi < x.num_groups)
        keep = valid & in_range & ~degenerate[gi.clamp(0, x.num_groups - 1)]
    else:
        keep = torch.zeros_like(valid)
    return GroupAdvantages(
        adv,
        tok if x.has_layout else None,
        torch.stack(means, 1).to(out_dtype),
        torch.stack(stds, 1).to(out_dtype),
        count,
        degenerate,
        keep,
    )


def _call(x: _Inputs, r, valid, opts: AdvantageOptions, baseline, scale, whiten, out_dtype, backend) -> _Out:
    """One plan over the score column ``r`` through the custom op."""
    fparams, iparams = _params(x, opts, baseline, scale, whiten).pack()
    return _group_advantages_op(
        r, x.group_index, valid, x.lengths, x.response_mask, x.cu_seqlens, fparams, iparams, out_dtype, backend
    )


def _leave_one_out(x: _Inputs, r, valid, opts: AdvantageOptions, out_dtype, backend) -> GroupAdvantages:
    """``grpo`` with ``leave_one_out`` (NeMo-RL): per valid sample i of a group with n valid
    samples, from the group's float64 partials (``group_partials``: n, x₁, Σd, Σd² with
    d = x − x₁) without sample i (m = n − 1 others, S = Σd − d_i, S2 = Σd² − d_i²):
    r_i − μ₋ᵢ = d_i − S/m, σ₋ᵢ² = (S2 − S·S/m)/(m − 1 or m), and σ₋ᵢ := 0 exactly when every
    other valid score is equal (from the group's min, max and their counts);
    A_i = D(r_i − μ₋ᵢ, σ₋ᵢ) (``scale="group"``; with ``skip_zero_std`` r_i − μ₋ᵢ where
    σ₋ᵢ = 0) or r_i − μ₋ᵢ (``scale="none"``); a lone sample follows ``singleton``.
    Elementwise float64 torch between three kernel calls: the partials, the group statistics
    (the ``grpo`` plan's), and a NONE plan that writes A (whitened with ``batch_whiten``) and
    the token advantages."""
    group_scale = opts.scale == "group"
    # The statistics plans need no token layout (no token output, no token weights).
    per_sample = dataclasses.replace(x, response_mask=None, cu_seqlens=None, num_tokens=-1)
    fparams, iparams = _params(per_sample, opts, Baseline.MEAN, _SCALES[opts.scale], Whiten.OFF).pack()
    args = (r, x.group_index, valid, x.lengths, None, None)
    part = _group_partials_op(*args, fparams, iparams, backend)
    _, _, mean, sd, count, degenerate, keep = _group_advantages_op(*args, fparams, iparams, out_dtype, backend)
    xs = r.to(torch.float64)
    B, G = xs.shape[0], x.num_groups
    gi = torch.arange(B, device=xs.device) // x.group_size if x.group_size else x.group_index.long()
    ok = torch.isfinite(xs) & (gi >= 0) & (gi < G)
    if valid is not None:
        ok &= valid
    g = gi.clamp(0, max(G - 1, 0))
    zero = torch.zeros((), dtype=torch.float64, device=xs.device)
    if G == 0 or B == 0:
        a = torch.zeros_like(xs)
    else:
        C = PartialColumn
        pg = part[g]  # [B, 9] the partials of each sample's group
        n = pg[:, C.N]
        d = torch.where(ok, xs - pg[:, C.FIRST], zero)
        m = n - 1
        m_safe = torch.where(m > 0, m, torch.ones_like(m))
        s = pg[:, C.S] - d
        centred = d - s / m_safe  # r_i − μ₋ᵢ
        m2 = torch.clamp_min(pg[:, C.S2] - d * d - s * (s / m_safe), 0.0)
        denom = m - 1 if opts.std == "unbiased" else m
        sigma = torch.where(denom > 0, torch.sqrt(m2 / torch.where(denom > 0, denom, torch.ones_like(denom))), zero)
        sigma = torch.where(_others_equal(xs, g, ok, n, G), zero, sigma)
        if group_scale:
            divided = _divide_t(centred, sigma, opts.eps, opts.eps_in_sqrt)
            a = torch.where(sigma > 0, divided, centred) if opts.skip_zero_std else divided
        else:
            a = centred
        # A lone valid sample: A = 0, or verl's loop rule (mean 0, std 1).
        lone = xs if not group_scale else _divide_t(xs, torch.ones_like(xs), opts.eps, opts.eps_in_sqrt)
        a = torch.where(n == 1, lone if opts.singleton == "raw" else zero, a)
        a = torch.where(ok & (n >= 1), a, zero)
    whiten = _WHITEN[opts.whitening.over] if opts.batch_whiten else Whiten.OFF
    adv, tok, _, _, _, _, _ = _call(x, a, ok, opts, Baseline.NONE, Scale.NONE, whiten, out_dtype, backend)
    return GroupAdvantages(adv, tok if x.has_layout else None, mean, sd, count, degenerate, keep)


def _divide_t(x: torch.Tensor, sigma: torch.Tensor, eps: float, eps_in_sqrt: bool) -> torch.Tensor:
    """x/(σ + eps) or x/sqrt(σ² + eps); 0 for a zero divisor (the kernels' rule)."""
    den = torch.sqrt(sigma * sigma + eps) if eps_in_sqrt else sigma + eps
    return torch.where(den > 0, x / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(x))


def _others_equal(xs, g, ok, n, G) -> torch.Tensor:
    """[B] bool: every other valid sample of i's group has the same score (exact, from the
    group's min and max and how many valid samples hold each)."""
    inf = torch.full((G,), float("inf"), dtype=torch.float64, device=xs.device)
    lo = inf.scatter_reduce(0, g[ok], xs[ok], "amin")
    hi = (-inf).scatter_reduce(0, g[ok], xs[ok], "amax")
    at_lo = torch.zeros(G, dtype=torch.float64, device=xs.device).index_add_(0, g[ok], (xs[ok] == lo[g[ok]]).double())
    at_hi = torch.zeros(G, dtype=torch.float64, device=xs.device).index_add_(0, g[ok], (xs[ok] == hi[g[ok]]).double())
    lo_i, hi_i, c_lo, c_hi = lo[g], hi[g], at_lo[g], at_hi[g]
    constant = lo_i == hi_i
    lone_hi = (xs == hi_i) & (c_hi == 1) & (c_lo == n - 1)
    lone_lo = (xs == lo_i) & (c_lo == 1) & (c_hi == n - 1)
    return constant | lone_hi | lone_lo


def _params(x: _Inputs, opts: AdvantageOptions, baseline, scale, whiten) -> GroupAdvantagesParams:
    """The kernel parameters of one plan."""
    return GroupAdvantagesParams(
        num_groups=x.num_groups,
        group_size=x.group_size,
        num_tokens=x.num_tokens,
        baseline=baseline,
        scale=scale,
        std_unbiased=opts.std == "unbiased",
        eps=float(opts.eps),
        eps_in_sqrt=bool(opts.eps_in_sqrt),
        singleton_raw=opts.singleton == "raw",
        passk_k=int(opts.k or 0),
        whiten=whiten,
        whiten_eps=float(opts.whitening.eps),
        whiten_eps_in_sqrt=bool(opts.whitening.eps_in_sqrt),
        whiten_std_unbiased=opts.whitening.std == "unbiased",
        whiten_eps_clamp=bool(opts.whitening.clamp),
    )


def _reference(x: _Inputs, opts: AdvantageOptions, out_dtype: torch.dtype) -> GroupAdvantages:
    """``backend="reference"``: the spec, through the dispatch table (never imported here)."""
    group_index = x.group_index
    if x.group_size:
        group_index = torch.arange(x.scores.shape[0], device=x.scores.device) // x.group_size
    return _dispatch.kernel("group_advantages", "reference")(
        x.scores,
        group_index,
        x.num_groups,
        opts,
        sample_mask=x.sample_mask,
        response_mask=x.response_mask,
        cu_seqlens=x.cu_seqlens,
        lengths=x.lengths,
        reward_weights=x.reward_weights,
        out_dtype=out_dtype,
    )


def _infer_num_groups(group_index: torch.Tensor) -> int:
    """max(group_index) + 1 (a host sync), refused when it is no count the kernels allocate."""
    if group_index.device.type == "meta":
        raise ValueError("num_groups: required with meta tensors (group_index holds no values to infer it from)")
    if group_index.numel() == 0:
        return 0
    hi = int(group_index.max())
    if hi >= MAX_COUNT:
        i = int(torch.argmax(group_index))
        raise ValueError(
            f"group_index: ids must be < {MAX_COUNT} (num_groups is inferred as max id + 1), got {hi} at row {i}"
        )
    return hi + 1


def _packed_token_count(cu_seqlens: torch.Tensor) -> int:
    """T = cu_seqlens[-1] of a packed layout without a mask (a host sync; pass a [T] mask to
    avoid it): the size of the token output, so it is checked even with ``validate=False``."""
    if cu_seqlens.device.type == "meta":
        raise ValueError("cu_seqlens: with meta tensors, pass a [T] response_mask (cu_seqlens holds no token count)")
    T = int(cu_seqlens[-1])
    if not 0 <= T <= MAX_COUNT:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[-1] (the token count) in [0, {MAX_COUNT}], got {T}")
    return T


# ------------------------------------------------------------------ data parallel (process_group)
_DIST_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "opo", "gpg", "passk")


_HANDSHAKE_HINT = "every rank must pass the same global num_groups and options"
_FIELDS = (
    collectives.Field("num_groups", hint=_HANDSHAKE_HINT),
    collectives.Field("estimator options / score terms", show=False, hint=_HANDSHAKE_HINT),
    collectives.Field("out_dtype", show=False, hint=_HANDSHAKE_HINT),
)


def _distributed(group, backend, option_kwargs, tensors, group_size, out_dtype, validate) -> GroupAdvantages:
    """``group_advantages(..., process_group=group)``: validate locally, the handshake of
    ``_core.collectives`` (every rank raises if any rank failed or the ranks disagree), this
    rank's partials (``group_partials``), one all_gather of them, and ``group_apply`` over the
    gathered tables in rank order; the module docstring and the public docstring's
    ``process_group`` entry say what is guaranteed."""
    collectives.check_eager("group_advantages")
    scores, group_index, num_groups = tensors[:3]
    error, values = None, None
    try:
        x, opts = _validate_distributed(backend, option_kwargs, tensors, group_size, out_dtype, validate)
        options = (opts, scores.dim(), scores.shape[1] if scores.dim() == 2 else 0)
        values = [num_groups, collectives.fingerprint(*options), collectives.fingerprint(out_dtype)]
    except Exception as exc:  # raised below, after every rank has learnt that this one failed
        error = exc
    device = collectives.group_device(group)
    # Always checked on the host: the all_gather below must not wait for a rank that failed.
    collectives.handshake("group_advantages", group, _FIELDS, values, device=device, check=True)
    if error is not None:
        raise error
    r, valid = _score_column(x)
    baseline, scale, _ = _plan(opts)
    fparams, iparams = _params(x, opts, baseline, scale, Whiten.OFF).pack()
    args = (r, x.group_index, valid, x.lengths, x.response_mask, x.cu_seqlens)
    partial = _group_partials_op(*args, fparams, iparams, backend)
    cols = _gathered_columns(baseline)
    gathered = collectives.all_gather(partial[:, cols].contiguous().to(device), group)
    partials = partial.new_zeros((len(gathered), x.num_groups, NUM_PARTIAL_COLUMNS))
    partials[:, :, cols] = torch.stack(gathered).to(partial.device)
    adv, tok, mean, sd, count, degenerate, keep = _group_apply_op(*args, partials, fparams, iparams, out_dtype, backend)
    return GroupAdvantages(adv, tok if x.has_layout else None, mean, sd, count, degenerate, keep)


def _validate_distributed(backend, option_kwargs, tensors, group_size, out_dtype, validate):
    """The rank-local checks of the data-parallel path (each error is raised on this rank
    after the fingerprint exchange, and reported to the others)."""
    _dispatch.check_backend(backend)
    opts = _resolve(option_kwargs.pop("preset"), option_kwargs.pop("options"), **option_kwargs)
    for name in ("batch_whiten", "leave_one_out"):
        if getattr(opts, name):
            raise NotImplementedError(
                f"group_advantages: {name}=True with process_group is not supported (it needs every rank's "
                f"samples after the group statistics: a second collective)"
            )
    if opts.estimator not in _DIST_ESTIMATORS:
        raise NotImplementedError(
            f"group_advantages: estimator={opts.estimator!r} with process_group is not supported (its batch "
            f"whitening after the baseline needs a second collective); supported: {', '.join(_DIST_ESTIMATORS)}"
        )
    scores, group_index, num_groups, sample_mask, response_mask, cu_seqlens, lengths, reward_weights = tensors
    if group_size is not None:
        raise ValueError("group_size: with process_group, pass global group ids in group_index")
    if group_index is None:
        raise ValueError("group_index: required with process_group (global group ids)")
    if num_groups is None:
        raise ValueError(
            "num_groups: required with process_group (the global number of groups, the same on every rank)"
        )
    out_dtype = check_out_dtype(out_dtype)
    x = _validate(
        scores,
        group_index,
        None,
        num_groups,
        sample_mask,
        response_mask,
        cu_seqlens,
        lengths,
        reward_weights,
        opts,
        validate,
    )
    return x, opts


def _gathered_columns(baseline: Baseline) -> List[int]:
    """The partials a plan reads (the others stay 0): fewer bytes on the wire."""
    C = PartialColumn
    extra = {Baseline.OPO: [C.WX, C.W], Baseline.PASSK: [C.INCORRECT], Baseline.GPG: [C.NONZERO]}.get(baseline, [])
    return [int(c) for c in (C.N, C.FIRST, C.S, C.S2, C.DIFFERS, *extra)]
