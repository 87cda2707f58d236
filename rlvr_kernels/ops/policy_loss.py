"""``policy_loss`` and ``shape_token_advantages`` (docs/token-shaping.md, docs/policy-loss.md):
the GRPO-family policy loss with token shaping, as the ``rlvr_kernels::policy_loss_fwd`` custom op (with its autograd)
over the C++ (CPU) and Triton (CUDA) kernels.

Why one forward pass is enough for the backward: every per-token term of the loss depends
on its own log-prob only (GSPO's sequence ratio, the IS weights, the shaping weights and
the entropy-quantile threshold are detached constants), and the aggregation is linear.
So the kernel writes, next to the loss sums, the per-token derivative
``grad_logprobs[t] = agg_w[t] · ∂ℓ_t/∂logp_t`` (the aggregation weight agg_w = m_t, or
m_t / n_i for ``seq-mean-token-mean``), and the backward is one scalar (or, for
``agg="none"``, per-token) multiply: the ``policy_loss_grad`` kernel. The scalar
normalisation (1/N_tok, 1/N_seq, dp_size, loss_scale_factor, global counts) stays outside
the kernel, in differentiable torch ops on the 0-d sum, so global counts may be tensors (an
all-reduce result) with no host sync.

Kernel contract (C++ ``csrc/policy_loss.cpp``, Triton ``triton/policy_loss.py``; both named
``policy_loss_fwd`` and ``policy_loss_grad`` in the dispatch table):

  policy_loss_fwd(logprobs, old_logprobs, advantages, mask, ref_logprobs, rollout_logprobs,
                  entropy, cu_seqlens, entropy_threshold,
                  fparams, iparams (PolicyLossParams.pack()), need_entropy_grad,
                  cov_selection=None, seq_stats=None)
      -> (sums [NUM_SUMS] (PolicyLossSum entries), grad_logprobs (token-shaped),
          grad_entropy (token-shaped if need_entropy_grad else [0]),
          token_out (token-shaped unless TokenOut.NONE, else [0]): ℓ·m for agg="none", or
          the shaped advantages Ã = A·w·m for ``shape_token_advantages``)
  - logprobs, old_logprobs [, ref_logprobs, rollout_logprobs, entropy]: one float dtype
    (this module casts), padded [B, L] or packed [T]. ref_logprobs / rollout_logprobs are
    given only when the options read them (a KL estimator, a rollout correction).
  - advantages: compute dtype (fp32; fp64 for fp64 inputs), [B] (``seq_adv``) or
    token-shaped. mask: token-shaped bool, or None (packed: every token inside
    cu_seqlens[-1] is valid). cu_seqlens: int64 [B + 1] or None (padded).
    entropy_threshold: 0-d fp32 (:func:`~rlvr_kernels.contracts.policy_loss.entropy_quantile_threshold`,
    or the caller's ``entropy_threshold=``) or None. Every output is in the compute dtype.
  - seq_stats: None, or [B, NUM_SEQ_STATS] fp64 (contracts ``SeqStat``): the whole sequences'
    statistics under ``cp_group`` (reference ``seq_statistics`` reduced over the group, then
    ``seq_rejection``); every sequence-level quantity comes from it instead of the kernel's
    own per-sequence pass (A3PO refused).
  - The per-sequence clip statistics (PolicyLossSum.SEQ_CLIP_*) are exact integer counts
    per sequence, reduced in sequence order: deterministic as every other sum.
  - Packed spans follow the one cu_seqlens rule (``csrc/spans.h``): in bounds and disjoint
    whatever the offsets; tokens outside every span get 0.
  - Results are deterministic: the same bits for any thread count or launch.
  The kernels check every shape relation they rely on (the registered ops are reachable
  directly); values (finite inputs, monotone offsets) are checked here when
  ``validate=True``, partly by the kernel itself (PolicyLossSum.NONFINITE), and are harmless
  when they are wrong.

  policy_loss_grad(coef, up, dtype) -> (coef · up).to(dtype): coef a contiguous compute-dtype
  tensor, up 1-element or coef-shaped.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List, NamedTuple, Optional, Tuple

import torch

from .._core import collectives
from .._core import dispatch as _dispatch
from .._core.layout import compute_dtype as _compute_dtype
from .._core.layout import local_counts, packed_mask
from .._core.layout import safe_div as _safe_div
from .._core.validation import (
    FLOAT_DTYPES,
    MASK_DTYPES,
    check_cu_seqlens,
    check_finite,
    check_like,
    check_tensor,
    checks_enabled,
)
from ..contracts.policy_loss import (
    NUM_SUMS,
    SEQ_STAT_MAXIMA,
    A3poMetric,
    IsGate,
    KlClamp,
    KlEstimator,
    LossType,
    PolicyLossParams,
    PolicyLossSum,
    RolloutCorrectionCode,
    SeqStat,
    TokenOut,
    entropy_quantile_threshold,
)
from ..contracts.policy_loss import cov_selection_of as _cov_select
from ..options import (
    RS_BOUND_FIELDS,
    PolicyLossMetrics,
    PolicyLossOptions,
    RolloutCorrection,
    TokenShaping,
    options_or_resolve,
    resolve_policy_loss_options,
)

S = PolicyLossSum
_RS_OFF = tuple(float("-inf") if f.endswith("_low") else float("inf") for f in RS_BOUND_FIELDS)
_Out = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


# ------------------------------------------------------------------ custom ops
class _FwdArgs(NamedTuple):
    """The arguments of ``rlvr_kernels::policy_loss_fwd``, by name: autograd binds its
    inputs (and returns their gradients) through this, never by position."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: Optional[torch.Tensor]
    ref_logprobs: Optional[torch.Tensor]
    rollout_logprobs: Optional[torch.Tensor]
    entropy: Optional[torch.Tensor]
    cu_seqlens: Optional[torch.Tensor]
    entropy_threshold: Optional[torch.Tensor]
    fparams: List[float]
    iparams: List[int]
    need_entropy_grad: bool
    backend: str
    cov_selection: Optional[torch.Tensor] = None
    seq_stats: Optional[torch.Tensor] = None


@torch.library.custom_op("rlvr_kernels::policy_loss_fwd", mutates_args=())
def _policy_loss_fwd(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor],
    ref_logprobs: Optional[torch.Tensor],
    rollout_logprobs: Optional[torch.Tensor],
    entropy: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    entropy_threshold: Optional[torch.Tensor],
    fparams: List[float],
    iparams: List[int],
    need_entropy_grad: bool,
    backend: str,
    cov_selection: Optional[torch.Tensor] = None,
    seq_stats: Optional[torch.Tensor] = None,
) -> _Out:
    """(sums, grad_logprobs, grad_entropy, token_out); see the module docstring."""
    return _dispatch.run(
        "policy_loss_fwd",
        backend,
        logprobs.device,
        logprobs,
        old_logprobs,
        advantages,
        mask,
        ref_logprobs,
        rollout_logprobs,
        entropy,
        cu_seqlens,
        entropy_threshold,
        fparams,
        iparams,
        need_entropy_grad,
        cov_selection,
        seq_stats,
    )


@_policy_loss_fwd.register_fake
def _(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    ref_logprobs,
    rollout_logprobs,
    entropy,
    cu_seqlens,
    entropy_threshold,
    fparams,
    iparams,
    need_entropy_grad,
    backend,
    cov_selection=None,
    seq_stats=None,
):
    dt = _compute_dtype(logprobs.dtype)
    shape = logprobs.shape
    token_out = PolicyLossParams.unpack(fparams, iparams).token_out != TokenOut.NONE
    return (
        logprobs.new_empty((NUM_SUMS,), dtype=dt),
        logprobs.new_empty(shape, dtype=dt),
        logprobs.new_empty(shape if need_entropy_grad else (0,), dtype=dt),
        logprobs.new_empty(shape if token_out else (0,), dtype=dt),
    )


# Below this many elements the CPU backward is torch's own multiply: a deliberate size
# threshold (no OpenMP region and no cache block for a tensor that fits in L2), not a
# fallback; above it the C++ kernel writes into a block of the huge-page output cache, since a
# fresh multi-MB tensor per backward would cost more in page faults than the multiply.
_CPU_GRAD_MIN_NUMEL = 1 << 16


@torch.library.custom_op("rlvr_kernels::policy_loss_grad", mutates_args=())
def _policy_loss_grad(coef: torch.Tensor, up: torch.Tensor, dtype: torch.dtype, backend: str) -> torch.Tensor:
    """``(coef · up).to(dtype)``: the backward of ``policy_loss_fwd``."""
    resolved = _dispatch.resolve_backend(backend, coef.device)
    if resolved == "cpu" and coef.numel() < _CPU_GRAD_MIN_NUMEL:
        return (coef * up).to(dtype)
    return _dispatch.kernel("policy_loss_grad", resolved)(coef, up.contiguous(), dtype)


@_policy_loss_grad.register_fake
def _(coef, up, dtype, backend):
    return coef.new_empty(coef.shape, dtype=dtype)


def _setup_context(ctx, inputs, output):
    args = _FwdArgs(*inputs)
    _, grad_logprobs, grad_entropy, _ = output  # the saved per-token derivatives
    ctx.save_for_backward(grad_logprobs, grad_entropy)
    # The saved derivatives are outputs nobody differentiates: without this, autograd would
    # fill a [B, L] tensor of zeros as their incoming gradient on every backward.
    ctx.set_materialize_grads(False)
    ctx.backend = args.backend
    ctx.logprobs_dtype = args.logprobs.dtype
    has_entropy_grad = args.entropy is not None and args.need_entropy_grad
    ctx.entropy_dtype = args.entropy.dtype if has_entropy_grad else None


_NO_GRADS = (None,) * len(_FwdArgs._fields)
# The positions of the inputs that get a gradient, looked up by name once.
_LOGPROBS, _ENTROPY = _FwdArgs._fields.index("logprobs"), _FwdArgs._fields.index("entropy")


def _backward(ctx, g_sums, g_logp, g_ent, g_tok):
    # Only sums[TOTAL] and token_out (agg="none") carry gradient; the other sums are metrics
    # and the saved per-token derivatives are not differentiated again.
    coef_logp, coef_ent = ctx.saved_tensors
    up = None if g_sums is None else g_sums[S.TOTAL]  # (None: only token_out is used)
    if g_tok is not None and g_tok.numel():
        up = g_tok if up is None else up + g_tok
    if up is None:  # an empty token_out, or only the saved derivatives: a zero gradient
        up = torch.zeros((), dtype=coef_logp.dtype, device=coef_logp.device)
    grads = list(_NO_GRADS)
    grads[_LOGPROBS] = _policy_loss_grad(coef_logp, up, ctx.logprobs_dtype, ctx.backend)
    if ctx.entropy_dtype is not None:
        grads[_ENTROPY] = _policy_loss_grad(coef_ent, up, ctx.entropy_dtype, ctx.backend)
    return tuple(grads)


_policy_loss_fwd.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------ validation
@dataclasses.dataclass(frozen=True)
class _Inputs:
    """A call's inputs, checked and kernel-ready (:func:`_validate`)."""

    logprobs: torch.Tensor  # contiguous, keeps its autograd edge
    old_logprobs: torch.Tensor  # detached, in logprobs' dtype
    advantages: torch.Tensor  # detached, in the compute dtype
    mask: Optional[torch.Tensor]  # bool
    ref_logprobs: Optional[torch.Tensor]  # detached; None unless a KL estimator reads it
    rollout_logprobs: Optional[torch.Tensor]  # detached; None unless a rollout correction reads it
    entropy: Optional[torch.Tensor]  # in logprobs' dtype, keeps its autograd edge (entropy bonus)
    cu_seqlens: Optional[torch.Tensor]  # int64
    entropy_threshold: Optional[torch.Tensor]  # 0-d fp32, with shaping.entropy_quantile
    cov_selection: Optional[torch.Tensor]  # token-shaped bool, clip_cov / kl_cov only
    seq_adv: bool  # advantages are [B]
    logprobs_name: str  # the caller's name of the logprobs argument

    def named(self):
        """(caller's name, tensor) of each input the kernel reads, for error messages."""
        return (
            (self.logprobs_name, self.logprobs),
            ("old_logprobs", self.old_logprobs),
            ("advantages", self.advantages),
            ("ref_logprobs", self.ref_logprobs),
            ("rollout_logprobs", self.rollout_logprobs),
            ("entropy", self.entropy),
        )


def _validate(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    ref_logprobs,
    rollout_logprobs,
    entropy,
    cu_seqlens,
    opts: PolicyLossOptions,
    validate: bool,
    logprobs_name: str = "logprobs",
    entropy_threshold: Optional[torch.Tensor] = None,
    cov_selection: Optional[torch.Tensor] = None,
) -> _Inputs:
    """Static checks (always) and value checks (``validate``); returns kernel-ready inputs."""
    check_tensor(logprobs_name, logprobs, dtypes=FLOAT_DTYPES, ndim=(1, 2))
    shape, dt = tuple(logprobs.shape), logprobs.dtype

    def like(name, t):
        return None if t is None else check_like(name, t, logprobs, logprobs_name, dtypes=FLOAT_DTYPES)

    old, ref, roll, ent = (
        like("old_logprobs", old_logprobs),
        like("ref_logprobs", ref_logprobs),
        like("rollout_logprobs", rollout_logprobs),
        like("entropy", entropy),
    )
    if cu_seqlens is None:
        if logprobs.dim() != 2:
            raise ValueError(
                f"{logprobs_name}: a 1-D (packed [T]) tensor needs cu_seqlens; give [B, L] with a mask "
                f"for the padded layout"
            )
        if mask is None:
            raise ValueError("mask: the padded [B, L] layout needs a token mask")
        cu, B = None, shape[0]
    else:
        if logprobs.dim() != 1:
            raise ValueError(f"{logprobs_name}: with cu_seqlens expected a packed 1-D [T] tensor, got shape {shape}")
        cu = check_cu_seqlens(cu_seqlens, like=logprobs, like_name=logprobs_name, validate=False)
        B = cu.shape[0] - 1
    if mask is not None:
        check_like("mask", mask, logprobs, logprobs_name, dtypes=MASK_DTYPES)
        mask = (mask if mask.dtype == torch.bool else mask != 0).contiguous()
    check_tensor("advantages", advantages, dtypes=FLOAT_DTYPES, like=logprobs, like_name=logprobs_name)
    if tuple(advantages.shape) not in (shape, (B,)):
        raise ValueError(
            f"advantages: expected [B={B}] (per sequence) or {shape} (per token), got {tuple(advantages.shape)}"
        )
    _check_needed_inputs(opts, ref, roll, ent)

    if cu is not None and checks_enabled(validate, logprobs, cu):
        check_cu_seqlens(cu_seqlens, like=logprobs, like_name=logprobs_name, num_tokens=shape[0], validate=True)
    if ent is not None:
        ent = ent.to(dt).contiguous()  # keeps the autograd edge for the entropy bonus
    threshold = None
    if entropy_threshold is not None:
        if opts.shaping.entropy_quantile is None:
            raise ValueError("entropy_threshold: only used with shaping.entropy_quantile")
        check_tensor(
            "entropy_threshold", entropy_threshold, dtypes=FLOAT_DTYPES, like=logprobs, like_name=logprobs_name
        )
        if entropy_threshold.numel() != 1:
            raise ValueError(f"entropy_threshold: expected one element, got shape {tuple(entropy_threshold.shape)}")
        threshold = entropy_threshold.detach().reshape(()).float()
    elif opts.shaping.entropy_quantile is not None:
        valid = packed_mask(mask, cu, shape[0], logprobs.device) if cu is not None else mask
        threshold = entropy_quantile_threshold(ent, valid, opts.shaping.entropy_quantile)
    return _Inputs(
        logprobs=logprobs.contiguous(),
        old_logprobs=old.detach().to(dt).contiguous(),
        advantages=advantages.detach().to(_compute_dtype(dt)).contiguous(),
        mask=mask,
        ref_logprobs=ref.detach().to(dt).contiguous() if ref is not None and opts.kl is not None else None,
        rollout_logprobs=(roll.detach().to(dt).contiguous() if roll is not None and opts.rc is not None else None),
        entropy=ent,
        cu_seqlens=cu,
        entropy_threshold=threshold,
        cov_selection=_cov_selection(opts, logprobs, old, advantages, mask, cu, cov_selection),
        seq_adv=tuple(advantages.shape) != shape,
        logprobs_name=logprobs_name,
    )


def _cov_selection(opts: PolicyLossOptions, logprobs, old, advantages, mask, cu, given) -> Optional[torch.Tensor]:
    """The kernels' covariance selection for clip_cov / kl_cov: the caller's ``cov_selection=``
    (token-shaped, bool), else :func:`~rlvr_kernels.contracts.policy_loss.cov_selection` of
    this call's inputs (in logprobs' dtype, the advantages in the compute dtype)."""
    cov = opts.loss_type in ("clip_cov", "kl_cov")
    if given is not None:
        if not cov:
            raise ValueError("cov_selection: only used with loss_type='clip_cov' or 'kl_cov'")
        check_like("cov_selection", given, logprobs, "logprobs", dtypes=MASK_DTYPES)
        return (given if given.dtype == torch.bool else given != 0).detach().contiguous()
    if not cov:
        return None
    shape = tuple(logprobs.shape)
    valid = packed_mask(mask, cu, shape[0], logprobs.device) if cu is not None else mask
    adv = advantages.detach().to(_compute_dtype(logprobs.dtype))
    if tuple(adv.shape) != shape:  # per sequence: each token reads its sequence's advantage
        if cu is None:
            adv = adv[:, None].expand(shape)
        else:
            t = torch.arange(shape[0], device=logprobs.device)
            seq = torch.searchsorted(cu[1:], t, right=True).clamp(max=max(adv.shape[0] - 1, 0))
            adv = adv[seq] if adv.numel() else torch.zeros(shape, dtype=adv.dtype, device=adv.device)
    return _cov_select(opts, logprobs, old.to(logprobs.dtype), adv, valid)


def _check_needed_inputs(opts: PolicyLossOptions, ref, roll, ent) -> None:
    if opts.kl is not None and ref is None:
        raise ValueError(f"ref_logprobs: kl={opts.kl!r} needs the reference log-probs")
    if opts.rc is not None and roll is None:
        raise ValueError(f"rollout_logprobs: rollout_correction={opts.rollout_correction!r} needs them")
    sh = opts.shaping
    if ent is None:
        if opts.entropy_coef != 0:
            raise ValueError("entropy: entropy_coef != 0 needs the per-token entropy")
        if sh.entropy_quantile is not None:
            raise ValueError("entropy: shaping.entropy_quantile needs the per-token entropy")
        if sh.a3po_active and sh.a3po_metric == "entropy":
            raise ValueError("entropy: shaping.a3po_metric='entropy' needs the per-token entropy")


def _check_agg_args(
    opts, cu_seqlens, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor, group_size=None
) -> int:
    """Checks the aggregation arguments; returns the dp_size to use (the group's size by
    default with a process group, else 1)."""
    if dp_size is None:
        dp_size = 1 if group_size is None else group_size
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size: expected an int >= 1, got {dp_size!r}")
    if group_size is not None:
        if dp_size != group_size:
            raise ValueError(
                f"dp_size: {dp_size} conflicts with the process group's size {group_size} (with process_group "
                f"it defaults to the group size; omit it)"
            )
        if opts.agg == "none":
            raise ValueError(
                "process_group: agg='none' returns the per-token losses unreduced; aggregate them with "
                "rlvr_kernels.distributed.global_counts, or pick a reducing agg"
            )
    for name, v in (("global_num_tokens", global_num_tokens), ("global_num_seqs", global_num_seqs)):
        if v is None or isinstance(v, torch.Tensor):
            if isinstance(v, torch.Tensor) and v.numel() != 1:
                raise ValueError(f"{name}: expected a number or a 1-element tensor, got shape {tuple(v.shape)}")
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0) or v == float("inf"):
            raise ValueError(f"{name}: expected a finite count >= 0, got {v!r}")
    if loss_scale_factor is not None:
        if (
            isinstance(loss_scale_factor, bool)
            or not isinstance(loss_scale_factor, (int, float))
            or not (0 < loss_scale_factor < float("inf"))
        ):
            raise ValueError(f"loss_scale_factor: expected a finite number > 0, got {loss_scale_factor!r}")
    if opts.agg == "seq-mean-token-sum-norm" and cu_seqlens is not None and loss_scale_factor is None:
        raise ValueError(
            "loss_scale_factor: agg='seq-mean-token-sum-norm' on the packed layout needs it "
            "(the padded layout defaults to L)"
        )
    return dp_size


def _resolve(preset, options, **overrides) -> PolicyLossOptions:
    return options_or_resolve(PolicyLossOptions, resolve_policy_loss_options, preset, options, **overrides)


def _check_finite(sums: Optional[torch.Tensor], x: _Inputs, validate: bool) -> None:
    """Non-finite inputs on valid tokens are an error. The kernel counts them in the same
    pass (PolicyLossSum.NONFINITE), which costs far less than a reduction per input before
    it; the error is raised before anything is returned, so no caller ever sees results
    computed from them. Only when the count is non-zero (or without a kernel count: the
    reference backend) are the inputs searched for the message."""
    if not checks_enabled(validate, x.logprobs, sums) or (sums is not None and not bool(sums[S.NONFINITE] > 0)):
        return
    valid = x.mask
    if x.cu_seqlens is not None:
        valid = packed_mask(x.mask, x.cu_seqlens, x.logprobs.shape[0], x.logprobs.device)
    for name, t in x.named():
        if t is not None:
            per_sequence = name == "advantages" and x.seq_adv
            check_finite(name, t.detach(), None if per_sequence else valid)
    if sums is not None:
        raise ValueError("non-finite input on a valid token")  # (unreachable unless a search above missed it)


# ------------------------------------------------------------------ data parallel (process_group)
# With ``process_group``, ``policy_loss`` runs exactly one collective: the handshake of
# ``_core.collectives`` (an all-reduce of a [world, 7] fp64 table where each rank fills only
# its own row), which carries the counts too: every rank gets every rank's row bitwise, so
# the global counts (summed in rank order) are the same bits on every rank, and the
# cross-rank checks compare the options fingerprint, the effective loss_scale_factor and the
# given global counts. A rank whose own checks failed still joins with a failure status and
# then raises its own error, so the other ranks raise too instead of waiting.
_NTOK, _NSEQ = 0, 1
_GIVEN_TOK, _GIVEN_SEQ = 4, 5
_GIVEN_HINT = "with process_group it is the count of the whole step over every rank, the same on each"
_FIELDS = (
    collectives.Field("num_tokens", agree=False),
    collectives.Field("num_seqs", agree=False),
    collectives.Field(
        "the loss options (loss type, agg, clipping, KL, shaping, dp_size, ...)",
        show=False,
        hint="every rank must pass the same options",
    ),
    collectives.Field(
        "loss_scale_factor",
        hint="the padded default is each rank's length L: pass the same loss_scale_factor on every rank",
    ),
    collectives.Field("global_num_tokens", hint=_GIVEN_HINT),
    collectives.Field("global_num_seqs", hint=_GIVEN_HINT),
)


class _GroupCall(NamedTuple):
    """What one rank contributes to the handshake (:func:`_group_reduce`)."""

    x: _Inputs
    opts: PolicyLossOptions
    dp_size: int
    loss_scale_factor: Optional[float]
    global_num_tokens: object  # None, a number or a 1-element tensor
    global_num_seqs: object
    counts: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # (tokens, sequences) of the cp group, else this call's


def _group_size(process_group) -> Optional[int]:
    """The group's size (None without a group); refuses torch.compile before any collective."""
    if process_group is None:
        return None
    collectives.check_eager(
        "policy_loss",
        "; compute the counts outside the compiled region with rlvr_kernels.distributed.global_counts "
        "and pass global_num_tokens / global_num_seqs / dp_size",
    )
    return collectives.world_size(process_group)


def _group_reduce(process_group, call: Optional[_GroupCall], like, validate: bool):
    """The handshake; returns ``(global_num_tokens, global_num_seqs)`` for the
    normalisation: the given ones if the caller passed them (the whole step's counts, for
    micro-batches), else the sums of the ranks' counts (0-d fp64 tensors, no host sync).
    ``call`` None: this rank failed its checks (it joins, the caller re-raises). With
    ``validate``, the table is read on the host (a sync on CUDA) and every rank raises the
    same error for inconsistent options or counts or a failed rank."""
    device = collectives.group_device(process_group, like)
    values = None
    if call is not None:
        x, opts = call.x, call.opts
        ntok, nseq = call.counts if call.counts is not None else local_counts(x.mask, x.cu_seqlens, x.logprobs.shape[0])
        lsf = _loss_scale_factor(call.loss_scale_factor, x.logprobs) if opts.agg == "seq-mean-token-sum-norm" else 0.0
        given = [-1.0 if v is None else v for v in (call.global_num_tokens, call.global_num_seqs)]
        values = [ntok, nseq, collectives.fingerprint(opts, call.dp_size), lsf, *given]
    check = checks_enabled(validate)
    table = collectives.handshake("policy_loss", process_group, _FIELDS, values, device=device, check=check)
    if call is None:
        return None, None  # the caller raises its own error
    if check:
        _check_given_counts(table.tolist())
    ntok, nseq = table[:, _NTOK].sum(), table[:, _NSEQ].sum()
    return (
        ntok if call.global_num_tokens is None else call.global_num_tokens,
        nseq if call.global_num_seqs is None else call.global_num_seqs,
    )


def _check_given_counts(rows) -> None:
    """Given global counts cover at least this call's counts over the group (every rank
    runs this on the same rows)."""
    for slot, name, count in ((_GIVEN_TOK, "global_num_tokens", _NTOK), (_GIVEN_SEQ, "global_num_seqs", _NSEQ)):
        total = sum(row[count] for row in rows)
        if rows[0][slot] >= 0 and rows[0][slot] < total:
            raise ValueError(
                f"{name}: {rows[0][slot]:g} is less than this call's {total:g} over the process group; with "
                f"process_group pass the whole step's global count (rlvr_kernels.distributed.global_counts) or omit it"
            )


# ------------------------------------------------------------------ context parallel (cp_group)
# Every rank of a context-parallel group holds a slice of the same B sequences. Each
# sequence-level quantity of the loss is a detached sum (or maximum) over a sequence's tokens
# (contracts SeqStat), so: a handshake (the same B and options on every rank), each rank's
# statistics of its slice (reference seq_statistics), ONE all-gather of them, summed (maxima:
# max) in rank order, so every rank holds the same bits; then the rejection chain's sequence
# options (reference seq_rejection). The kernels take the result (seq_stats) in place of their
# own per-sequence pass; the counts it gives are the normalisation's. After the kernel, one
# more all-gather reduces the metrics. Reducing the statistics is exact, so a rank's token
# gradients are those of one process holding the whole sequences.
_CP_FIELDS = (
    collectives.Field("the number of sequences B", hint="every rank of cp_group passes a slice of the same sequences"),
    collectives.Field(
        "the loss options (loss type, agg, clipping, KL, shaping, loss_scale_factor, ...)",
        show=False,
        hint="every rank of cp_group must pass the same options",
    ),
)
# Metrics that are means over the valid tokens (reduced as sums of mean·count), sums, maxima.
_CP_MEANS = (
    "pg_clipfrac",
    "pg_clipfrac_lower",
    "ppo_kl",
    "kl",
    "is_weight_mean",
    "is_masked_frac",
    "shaped_frac",
    "entropy_mean",
    "pg_clipfrac_low",
    "pg_clipfrac_high",
)
_CP_SUMS = ("pg_loss", "kl_loss", "num_tokens")
_CP_MAXES = ("is_weight_max", "is_batch_norm_factor")


def _check_cp(opts: PolicyLossOptions, cp_group, process_group, entropy_threshold, cov_selection, loss_scale_factor):
    """The options a context-parallel group cannot reduce exactly raise, naming the option."""
    if process_group is not None and process_group is cp_group:
        raise ValueError("cp_group: the context-parallel group must differ from process_group (the data-parallel one)")
    sh = opts.shaping
    if sh.a3po_active:
        raise NotImplementedError(
            "shaping (A3PO knobs): A3PO ranks the tokens within a sequence, which cp_group cannot reduce from "
            "slices; gather the sequences or drop the A3PO knobs"
        )
    if sh.entropy_quantile is not None and entropy_threshold is None:
        raise NotImplementedError(
            "shaping.entropy_quantile: the quantile of a slice is not the batch's; with cp_group pass "
            "entropy_threshold= (the quantile over the group's tokens)"
        )
    if opts.loss_type in ("clip_cov", "kl_cov") and cov_selection is None:
        raise NotImplementedError(
            f"loss_type={opts.loss_type!r}: the covariance selection is a top-k over the whole batch, which "
            f"cp_group cannot reduce; pass cov_selection= (this rank's tokens of the batch's selection)"
        )
    if opts.agg == "seq-mean-token-sum-norm" and loss_scale_factor is None:
        raise ValueError(
            "loss_scale_factor: agg='seq-mean-token-sum-norm' with cp_group needs it (a rank's L is its slice's)"
        )


def _cp_seq_stats(cp_group, x: Optional[_Inputs], opts: Optional[PolicyLossOptions], like, lsf):
    """The handshake and the group's per-sequence statistics ([B, NUM_SEQ_STATS] fp64 on
    ``like``'s device, seq_rejection applied); ``x`` None: this rank failed its checks (it
    joins the handshake; the caller raises its own error)."""
    # (the sequence statistics are the reference's torch code: imported on the cp path only,
    # so the fast path never loads the reference)
    from ..reference.policy_loss import seq_rejection, seq_statistics

    device = collectives.group_device(cp_group, like)
    values = None if x is None else [_num_seqs(x), collectives.fingerprint(opts, lsf)]
    # (always read: the all-gathers that follow must not wait for a rank that failed)
    collectives.handshake("policy_loss", cp_group, _CP_FIELDS, values, device=device, check=True, arg="cp_group")
    if x is None:
        return None
    local = seq_statistics(
        opts,
        x.logprobs.detach(),
        x.old_logprobs,
        x.advantages,
        x.mask,
        rollout_logprobs=x.rollout_logprobs,
        cu_seqlens=x.cu_seqlens,
    )
    parts = torch.stack(collectives.all_gather(local.to(device), cp_group))
    is_max = torch.zeros(local.shape[1], dtype=torch.bool, device=parts.device)
    is_max[list(SEQ_STAT_MAXIMA)] = True
    stats = torch.where(is_max, parts.amax(0), parts.sum(0))
    return seq_rejection(opts, stats.to(like.device))


def _num_seqs(x: _Inputs) -> int:
    return x.cu_seqlens.shape[0] - 1 if x.cu_seqlens is not None else x.logprobs.shape[0]


def _cp_counts(stats: torch.Tensor, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(valid tokens, sequences with one) of the whole sequences, 0-d in the compute dtype."""
    n = stats[:, SeqStat.N]
    dt = _compute_dtype(like.dtype)
    return n.sum().to(dt), (n > 0).sum().to(dt)


def _cp_metrics(m: PolicyLossMetrics, stats: torch.Tensor, opts: PolicyLossOptions, cp_group, rows: int):
    """The metrics of one process holding the group's whole sequences: token means from the
    ranks' sums (mean·count), sums, maxima (one all-gather); the sequence metrics from the
    group's statistics. pg_loss / kl_loss: the sum of the ranks' shares."""
    from ..reference.policy_loss import seq_clip_fractions, seq_stat

    device = collectives.group_device(cp_group, m.num_tokens)
    ntok = m.num_tokens.double()
    row = [getattr(m, f).double() * ntok for f in _CP_MEANS] + [getattr(m, f).double() for f in _CP_SUMS + _CP_MAXES]
    parts = torch.stack(collectives.all_gather(torch.stack(row).to(device), cp_group)).to(m.num_tokens.device)
    k = len(_CP_MEANS) + len(_CP_SUMS)
    tot, mx = parts[:, :k].sum(0), parts[:, k:].amax(0)
    total_tok = tot[_CP_MEANS.__len__() + _CP_SUMS.index("num_tokens")]
    out = {f: _safe_div(tot[j], total_tok).float() for j, f in enumerate(_CP_MEANS)}
    out.update({f: tot[len(_CP_MEANS) + j].float() for j, f in enumerate(_CP_SUMS)})
    out.update({f: mx[j].float() for j, f in enumerate(_CP_MAXES)})
    n, n_raw = stats[:, SeqStat.N], stats[:, SeqStat.N_RAW]
    f_low, f_high = seq_clip_fractions(opts, stats)
    out.update(
        num_seqs=(n > 0).sum().float(),
        seq_clipfrac_low_mean=seq_stat(f_low, "mean"),
        seq_clipfrac_high_mean=seq_stat(f_high, "mean"),
        seq_clipfrac_low_min=seq_stat(f_low, "min"),
        seq_clipfrac_high_max=seq_stat(f_high, "max"),
        rs_masked_frac=_safe_div((n_raw - n).sum(), n_raw.sum()).float(),
        rs_seq_masked_frac=((n_raw > n).sum().double() / max(rows, 1)).float(),
    )
    return m._replace(**out)


# ------------------------------------------------------------------ public functions
def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    preset: Optional[str] = None,
    options: Optional[PolicyLossOptions] = None,
    loss_type: Optional[str] = None,
    clip_low: Optional[float] = None,
    clip_high: Optional[float] = None,
    clip_ratio_c: Optional[float] = None,
    gspo_dual_clip: Optional[bool] = None,
    kl: Optional[str] = None,
    kl_coef: Optional[float] = None,
    kl_ratio_correction: Optional[bool] = None,
    rollout_correction=None,
    rollout_threshold: Optional[float] = None,
    entropy_coef: Optional[float] = None,
    agg: Optional[str] = None,
    shaping: Optional[TokenShaping] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    rollout_logprobs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    global_num_tokens=None,
    global_num_seqs=None,
    dp_size: Optional[int] = None,
    loss_scale_factor: Optional[float] = None,
    entropy_threshold: Optional[torch.Tensor] = None,
    cov_selection: Optional[torch.Tensor] = None,
    process_group=None,
    cp_group=None,
    validate: bool = True,
    backend: str = "auto",
) -> Tuple[torch.Tensor, PolicyLossMetrics]:
    """The GRPO-family policy loss (docs/policy-loss.md), forward and backward in one fused pass.

    (Long for its keyword options and their documentation; the body is resolve → validate →
    kernel → aggregate.)

    Args:
        logprobs: log π_θ of the sampled tokens, ``[B, L]`` (padded, with ``mask``) or
            ``[T]`` (packed, with ``cu_seqlens``); fp16/bf16/fp32/fp64. Gets the gradient.
        old_logprobs: log π_old (the proximal policy for ``decoupled``), same shape.
        advantages: ``[B]`` sequence advantages (never expanded in memory) or token-level,
            shaped like ``logprobs`` (in the packed layout a ``[T]`` tensor with T == B
            counts as token-level).
        mask: token mask shaped like ``logprobs`` (bool or 0/1 of any dtype); required
            for the padded layout; packed: defaults to every token inside ``cu_seqlens``.
        preset: ``"verl"`` (dual clip c = 3, δ clamp ±20, k3 clamps) or ``"trl"`` (no
            clamps); explicit arguments override it.
        options: a full :class:`PolicyLossOptions` (then no other option argument may be
            given). The keyword options below are its fields (see its docstring).
        ref_logprobs: log π_ref for ``kl``. rollout_logprobs: log π_behav for
            ``rollout_correction``. entropy: per-token entropy (gets a gradient when it
            requires one) for ``entropy_coef``, the entropy quantile and A3PO's entropy metric.
        cu_seqlens: ``[B + 1]`` offsets of the packed layout.
        global_num_tokens / global_num_seqs: the token / sequence count of the whole
            (global) batch, number or tensor, for micro-batches and data-parallel ranks
            (verl's ``batch_num_tokens`` / ``global_batch_size``); default: this call's.
        dp_size: multiplies the loss (verl's convention, so the gradient averaged over
            ranks is the full-batch one); default 1, or the group size with ``process_group``
            (an explicit value that differs from it is an error).
        loss_scale_factor: divisor of ``seq-mean-token-sum-norm`` (Dr.GRPO); default L
            (padded; 1 when L = 0: no token, a loss of 0); required for the packed layout.
        entropy_threshold: with ``shaping.entropy_quantile``, a 1-element tensor that
            replaces this call's own quantile of ``entropy`` (e.g. the quantile over every
            data-parallel rank's tokens, as TRL's ``top_entropy_quantile``); tokens with an
            (fp32) entropy >= it keep their policy-gradient term.
        cov_selection: with ``loss_type="clip_cov"`` / ``"kl_cov"``, a bool tensor shaped like
            ``logprobs`` that replaces this call's own covariance selection
            (:func:`rlvr_kernels.contracts.policy_loss.cov_selection`): the tokens whose
            term is zeroed (clip_cov) or gets ``kl_cov_coef``·|δ| (kl_cov).
        process_group: the data-parallel group (``torch.distributed``; every rank of it calls
            with its own batch, any sizes, possibly without a valid token). The op then runs
            ONE all-reduce (a small [world, 7] fp64 table, before the normalisation) for the
            global token and sequence counts the aggregation divides by, and ``dp_size``
            defaults to the group size: each rank's token gradients are world_size × the
            full-batch gradients of its tokens, so DDP/FSDP's average over ranks is the
            full-batch gradient. Given ``global_num_tokens`` / ``global_num_seqs`` are taken
            as the whole step's global counts (gradient accumulation: see
            :func:`rlvr_kernels.distributed.global_counts`) and must be equal on every rank.
            With ``validate``, the gathered table is checked on every rank (a host sync on
            CUDA): different options, ``dp_size``, effective ``loss_scale_factor`` (the padded
            default L must then agree) or given counts across ranks, a given count below the
            group's, or a rank whose own argument checks failed (it still joins the
            collective) raise on every rank instead of hanging. Not with ``agg="none"``.
            GSPO's sequence ratios stay per sequence (no collective). Eager only: under
            torch.compile pass the counts and ``dp_size`` instead.
        cp_group: the context-parallel group (docs/distributed.md): every rank of it passes its
            slice (a contiguous chunk of tokens, any split, possibly empty) of the SAME B
            sequences, in the same order and layout (padded ``[B, L_local]`` or packed with its
            own ``cu_seqlens``; ``advantages`` per sequence or per token of the slice). Every
            sequence-level quantity (n_i, GSPO's s_i, geo_mean's L_i / n_i, the sequence IS
            weights, the rejection chain's sequence options, the IS batch normalisation) and
            the counts are those of the whole sequences (two all-gathers: the per-sequence
            statistics before the kernel, the metrics after it). The loss is this rank's share
            (its tokens' terms over the group's counts): the ranks' losses sum to the one-process
            loss, and each rank's gradients of its ``logprobs`` / ``entropy`` are the one-process
            gradients of those tokens, so the sum over the group of the parameter gradients is
            the one-process gradient (a trainer that averages over the DP × CP ranks multiplies
            the loss by the CP size). The metrics are the group's (the same on every rank;
            ``pg_loss`` / ``kl_loss`` the sum of the shares). With ``process_group`` (the
            data-parallel group, of the ranks holding the same slice index) the counts are
            global over both. A3PO, the entropy quantile without ``entropy_threshold`` and
            clip_cov / kl_cov without ``cov_selection`` raise NotImplementedError;
            ``seq-mean-token-sum-norm`` needs ``loss_scale_factor``. Eager only.
        validate: check values (finite log-probs on valid tokens, ``cu_seqlens``), a host
            sync on CUDA; skipped under torch.compile and for meta tensors.
        backend: ``"auto"``, or ``"reference"``, ``"cpu"``, ``"triton"``.

    Returns:
        ``(loss, metrics)``: the loss, 0-d fp32 (fp64 for fp64 inputs), or per-token for
        ``agg="none"``; :class:`PolicyLossMetrics` of detached 0-d tensors. Data parallel
        (``process_group`` or ``dp_size`` > 1 with global counts), verl's convention: the loss
        is dp_size × this rank's share of the full-batch loss (its tokens' terms over the
        global count), so the mean of the ranks' losses is the full-batch loss. The metrics
        are this rank's own (means over its tokens, its counts); ``pg_loss`` / ``kl_loss``
        follow the loss convention.
    """
    _dispatch.check_backend(backend)
    group_size = _group_size(process_group)
    _group_size(cp_group)
    failed = None
    try:
        opts = _resolve(
            preset,
            options,
            loss_type=loss_type,
            clip_low=clip_low,
            clip_high=clip_high,
            clip_ratio_c=clip_ratio_c,
            gspo_dual_clip=gspo_dual_clip,
            kl=kl,
            kl_coef=kl_coef,
            kl_ratio_correction=kl_ratio_correction,
            rollout_correction=rollout_correction,
            rollout_threshold=rollout_threshold,
            entropy_coef=entropy_coef,
            agg=agg,
            shaping=shaping,
        )
        x = _validate(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            ref_logprobs,
            rollout_logprobs,
            entropy,
            cu_seqlens,
            opts,
            validate,
            entropy_threshold=entropy_threshold,
            cov_selection=cov_selection,
        )
        dp_size = _check_agg_args(
            opts, cu_seqlens, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor, group_size
        )
        if cp_group is not None:
            _check_cp(opts, cp_group, process_group, entropy_threshold, cov_selection, loss_scale_factor)
    except Exception as e:
        failed = e
    stats = counts = None
    if cp_group is not None:  # the whole sequences' statistics (a rank that failed joins, then raises)
        try:
            stats = _cp_seq_stats(
                cp_group, None if failed else x, None if failed else opts, logprobs, loss_scale_factor
            )
        except Exception as e:
            failed = e
        if stats is not None:
            counts = _cp_counts(stats, logprobs)
    if failed is not None:
        if group_size is not None:
            _group_reduce(process_group, None, logprobs, validate)  # joins the collective, then raises here
        raise failed
    if group_size is not None:  # the one all-reduce: global counts (and the cross-rank checks)
        call = _GroupCall(x, opts, dp_size, loss_scale_factor, global_num_tokens, global_num_seqs, counts)
        global_num_tokens, global_num_seqs = _group_reduce(process_group, call, logprobs, validate)
    elif counts is not None:  # the group's counts, unless the caller gave the step's
        global_num_tokens = counts[0] if global_num_tokens is None else global_num_tokens
        global_num_seqs = counts[1] if global_num_seqs is None else global_num_seqs
    agg_kw = dict(
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        dp_size=dp_size,
        loss_scale_factor=loss_scale_factor,
    )
    rows = x.cu_seqlens.numel() - 1 if x.cu_seqlens is not None else logprobs.shape[0]
    if backend == "reference":
        _check_finite(None, x, validate)
        loss, metrics = _dispatch.kernel("policy_loss", "reference")(
            logprobs,
            old_logprobs,
            advantages,
            x.mask,
            opts,
            ref_logprobs=ref_logprobs,
            rollout_logprobs=rollout_logprobs,
            entropy=entropy,
            cu_seqlens=x.cu_seqlens,
            entropy_threshold=x.entropy_threshold if entropy_threshold is not None else None,
            cov_selection=x.cov_selection,
            seq_stats=stats,
            **agg_kw,
        )
    else:
        token_out = TokenOut.LOSS if opts.agg == "none" else TokenOut.NONE
        need_entropy_grad = x.entropy is not None and opts.entropy_coef != 0 and entropy.requires_grad
        sums, _, _, tok = _run_fwd(x, opts, token_out, need_entropy_grad, backend, stats)
        _check_finite(sums, x, validate)
        loss, norm = _aggregate(opts, sums, tok, logprobs, **agg_kw)
        metrics = _metrics(sums.detach(), norm.detach(), rows)
    if stats is not None:
        metrics = _cp_metrics(metrics, stats, opts, cp_group, rows)
    return loss, metrics


def shape_token_advantages(
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    shaping: Optional[TokenShaping] = None,
    *,
    entropy: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    validate: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Token advantages Ã = A · w (docs/token-shaping.md), the shaping ``policy_loss`` fuses, as a tensor
    shaped like ``old_logprobs`` (fp32; fp64 for fp64 inputs); 0 on invalid tokens and
    on tokens the entropy quantile drops. Arguments as in :func:`policy_loss`."""
    _dispatch.check_backend(backend)
    shaping = TokenShaping() if shaping is None else shaping
    if not isinstance(shaping, TokenShaping):
        raise TypeError(f"shaping: expected a rlvr_kernels.TokenShaping, got {type(shaping).__name__}")
    opts = PolicyLossOptions(loss_type="reinforce", shaping=shaping)
    x = _validate(
        old_logprobs,
        old_logprobs,
        advantages,
        mask,
        None,
        None,
        entropy,
        cu_seqlens,
        opts,
        validate,
        logprobs_name="old_logprobs",
    )
    if backend == "reference":
        _check_finite(None, x, validate)
        return _dispatch.kernel("shape_token_advantages", "reference")(
            advantages, old_logprobs, x.mask, shaping, entropy=entropy, cu_seqlens=x.cu_seqlens
        )
    lp = x.logprobs.detach()
    ent = None if x.entropy is None else x.entropy.detach()
    x = dataclasses.replace(x, logprobs=lp, old_logprobs=lp, entropy=ent)
    sums, _, _, tok = _run_fwd(x, opts, TokenOut.SHAPED_ADVANTAGES, False, backend)
    _check_finite(sums, x, validate)
    return tok


def rollout_correction(
    correction: RolloutCorrection,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    logprobs: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    validate: bool = True,
    backend: str = "auto",
) -> Tuple[torch.Tensor, torch.Tensor, PolicyLossMetrics]:
    """What ``policy_loss`` applies of a :class:`RolloutCorrection` (docs/policy-loss.md,
    "Rollout correction"), as tensors: ``(weights, keep, metrics)``, computed by the
    ``policy_loss_fwd`` kernel (token outputs ``IS_WEIGHTS`` and ``KEEP``).

    weights: the IS weight (after batch normalisation; 1 without ``is_level``) on the valid
    tokens before rejection, 0 elsewhere (verl's ``rollout_is_weights``). keep: 1 on the
    valid tokens the rejection chain keeps, 0 elsewhere (verl's modified ``response_mask``).
    Both shaped like ``old_logprobs``, in the compute dtype (fp32; fp64 for fp64 inputs),
    without gradient. metrics: :class:`PolicyLossMetrics`, of which the rollout-correction
    entries are meaningful (``is_weight_mean`` / ``is_weight_max`` over the kept tokens,
    ``is_masked_frac``, ``rs_masked_frac``, ``rs_seq_masked_frac``, ``num_tokens`` kept), and
    ``is_batch_norm_factor`` the mean the weights were divided by (1 when it is <= 1e-8; 0
    without batch normalisation), whatever the rejection kept. x = base − rollout_logprobs, base = ``old_logprobs``, or
    ``logprobs`` (required then) with ``correction.log_ratio="current"``. Layouts and
    ``validate`` / ``backend`` as in :func:`policy_loss`; no host sync without ``validate``.
    """
    _dispatch.check_backend(backend)
    if not isinstance(correction, RolloutCorrection):
        raise TypeError(f"correction: expected a rlvr_kernels.RolloutCorrection, got {type(correction).__name__}")
    if not correction.active:
        raise ValueError("correction: neither is_level nor a rejection (rs / geo_mean) is set")
    current = correction.log_ratio == "current"
    if current and logprobs is None:
        raise ValueError("logprobs: correction.log_ratio='current' computes the log ratio from them")
    if not current and logprobs is not None:
        raise ValueError("logprobs: only read with correction.log_ratio='current'")
    base = (logprobs if current else old_logprobs).detach() if old_logprobs is not None else None
    opts = PolicyLossOptions(loss_type="reinforce", rollout_correction=correction)
    check_tensor("old_logprobs", old_logprobs, dtypes=FLOAT_DTYPES, ndim=(1, 2))
    rows = old_logprobs.shape[0] if cu_seqlens is None else max(cu_seqlens.shape[0] - 1, 0)
    adv = torch.zeros(rows, dtype=_compute_dtype(old_logprobs.dtype), device=old_logprobs.device)
    x = _validate(
        base,
        old_logprobs.detach(),
        adv,
        mask,
        None,
        rollout_logprobs,
        None,
        cu_seqlens,
        opts,
        validate,
        logprobs_name="logprobs" if current else "old_logprobs",
    )
    if backend == "reference":
        _check_finite(None, x, validate)
        weights, keep, norm = _dispatch.kernel("rollout_correction", "reference")(
            x.logprobs, x.old_logprobs, x.rollout_logprobs, x.mask, correction, cu_seqlens=x.cu_seqlens
        )
        _, metrics = _dispatch.kernel("policy_loss", "reference")(
            x.logprobs,
            x.old_logprobs,
            adv,
            x.mask,
            opts,
            rollout_logprobs=x.rollout_logprobs,
            cu_seqlens=x.cu_seqlens,
        )
        return weights, keep, metrics._replace(is_batch_norm_factor=norm.float())
    sums, _, _, weights = _run_fwd(x, opts, TokenOut.IS_WEIGHTS, False, backend)
    _check_finite(sums, x, validate)
    if correction.rs_mask:
        _, _, _, keep = _run_fwd(x, opts, TokenOut.KEEP, False, backend)
    else:  # no rejection: the valid tokens
        valid = x.mask if x.cu_seqlens is None else packed_mask(x.mask, x.cu_seqlens, base.shape[0], base.device)
        keep = valid.to(weights.dtype)
    one = torch.ones((), dtype=sums.dtype, device=sums.device)
    metrics = _metrics(sums.detach(), one, rows)
    return weights, keep, metrics._replace(is_batch_norm_factor=sums[S.IS_NORM].detach().float())


# ------------------------------------------------------------------ helpers
_LOSS_TYPES = {
    "ppo": LossType.PPO,
    "gspo": LossType.GSPO,
    "cispo": LossType.CISPO,
    "sapo": LossType.SAPO,
    "reinforce": LossType.REINFORCE,
    "dppo_tv": LossType.DPPO_TV,
    "dppo_kl": LossType.DPPO_KL,
    "geo_mean": LossType.GEO_MEAN,
    "dro": LossType.DRO,
    "clip_cov": LossType.CLIP_COV,
    "kl_cov": LossType.KL_COV,
}
_KL_CLAMPS = {None: KlClamp.NONE, "k3": KlClamp.K3, "all": KlClamp.ALL}
_KL_ESTIMATORS = {
    None: KlEstimator.NONE,
    "k1": KlEstimator.K1,
    "k2": KlEstimator.K2,
    "k3": KlEstimator.K3,
    "k3+": KlEstimator.K3_PLUS,
}
# (RolloutCorrection.is_level, RolloutCorrection.mode) -> the kernels' code.
_RC_CODES = {
    ("token", "truncate"): RolloutCorrectionCode.TOKEN_TIS,
    ("sequence", "truncate"): RolloutCorrectionCode.SEQ_TIS,
    ("token", "mask"): RolloutCorrectionCode.TOKEN_MIS,
    ("sequence", "mask"): RolloutCorrectionCode.SEQ_MIS,
    ("token", "decoupled"): RolloutCorrectionCode.DECOUPLED,
    ("token", "icepop"): RolloutCorrectionCode.TOKEN_ICEPOP,
    ("sequence", "icepop"): RolloutCorrectionCode.SEQ_ICEPOP,
    ("token", "clamp"): RolloutCorrectionCode.GATE,
    ("token", "gate"): RolloutCorrectionCode.GATE,
    ("sequence", "gate"): RolloutCorrectionCode.GATE,
}
# RolloutCorrection (is_mode, is_gate) of the GATE code -> what it reads.
_IS_GATES = {"ratio": IsGate.RATIO, "binary_kl": IsGate.BINARY_KL, "tv": IsGate.TV}
_A3PO_METRICS = {"prob": A3poMetric.PROB, "entropy": A3poMetric.ENTROPY}


def _kernel_params(o: PolicyLossOptions, seq_adv: bool, token_out: TokenOut) -> PolicyLossParams:
    s = o.shaping
    (r_ph, s_ph), (r_pl, s_pl), (r_nh, s_nh), (r_nl, s_nl) = s.a3po_knobs
    # thresholds of a divergence (dppo) or bounds of the log-ratio (geo_mean), not of the ratio
    raw = o.loss_type in ("dppo_tv", "dppo_kl", "geo_mean")
    dppo = o.loss_type in ("dppo_tv", "dppo_kl")
    rc = o.rc
    return PolicyLossParams(
        ratio_low=float(o.clip_low) if raw else 1.0 - o.clip_low,
        ratio_high=float(o.clip_high) if raw else 1.0 + o.clip_high,
        clip_ratio_c=float(o.clip_ratio_c or 0.0) if o.loss_type == "ppo" or o.gspo_dual_clip or dppo else 0.0,
        log_ratio_clamp=float(o.log_ratio_clamp or 0.0),
        gspo_log_clamp=float(o.gspo_log_clamp) if o.gspo_log_clamp is not None else float("inf"),
        tau_pos=float(o.tau_pos),
        tau_neg=float(o.tau_neg),
        kl_coef=float(o.kl_coef if o.kl else 0.0),
        rc_low=float(rc.low) if rc is not None else float(o.mis_low),
        rc_high=float(rc.is_threshold) if rc is not None else float(o.rollout_threshold),
        entropy_coef=float(o.entropy_coef),
        w_pos=float(s.w_pos),
        w_neg=float(s.w_neg),
        probability=float(s.probability),
        a3po_pos_high_ratio=float(r_ph),
        a3po_pos_high_scale=float(s_ph),
        a3po_pos_low_ratio=float(r_pl),
        a3po_pos_low_scale=float(s_pl),
        a3po_neg_high_ratio=float(r_nh),
        a3po_neg_high_scale=float(s_nh),
        a3po_neg_low_ratio=float(r_nl),
        a3po_neg_low_scale=float(s_nl),
        dro_beta=float(o.dro_beta) if o.loss_type == "dro" else 0.0,
        kl_cov_coef=float(o.kl_cov_coef),
        loss_type=_LOSS_TYPES[o.loss_type],
        kl=_KL_ESTIMATORS[o.kl],
        kl_clamp=_KL_CLAMPS[o.kl_clamp_scope],
        rollout_correction=_RC_CODES[(rc.is_level, rc.mode)]
        if rc is not None and rc.is_level is not None
        else RolloutCorrectionCode.NONE,
        seq_mean=o.agg == "seq-mean-token-mean",
        token_out=token_out,
        a3po_metric=_A3PO_METRICS[s.a3po_metric],
        a3po=bool(s.a3po_active),
        entropy_quantile=s.entropy_quantile is not None,
        seq_adv=bool(seq_adv),
        kl_ratio_correction=bool(o.kl_ratio_correction and o.kl is not None),
        kl_clamp_input=float(o.kl_clamp_input or 0.0),
        kl_clamp_output=float(o.kl_clamp_output or 0.0),
        kl_score_grad=bool(o.kl_score_grad and o.kl is not None),
        **dict(zip(RS_BOUND_FIELDS, rc.rs_bounds if rc is not None else _RS_OFF)),
        rs_options=rc.rs_mask if rc is not None else 0,
        rc_current=rc is not None and rc.log_ratio == "current",
        is_batch_normalize=rc is not None and rc.is_level is not None and rc.is_batch_normalize,
        is_gate=IsGate.CLAMP if rc is None or rc.mode != "gate" else _IS_GATES[rc.is_gate],
        is_gate_seq=rc is not None and rc.mode == "gate" and rc.is_level == "sequence",
    )


def _packed_params(o: PolicyLossOptions, seq_adv: bool, token_out: TokenOut) -> Tuple[List[float], List[int]]:
    """``_kernel_params(o, seq_adv, token_out).pack()``: the custom op's ``(fparams, iparams)``.
    Eager calls reuse them per options (building and packing the 32-field dataclass costs
    ~10 µs, a few percent of a small call). Under torch.compile they are built afresh: the
    options are not a constant dynamo can key a cache on."""
    if torch.compiler.is_compiling():
        return _kernel_params(o, seq_adv, token_out).pack()
    return _packed_params_cached(o, seq_adv, token_out)


@functools.lru_cache(maxsize=1024)
def _packed_params_cached(o: PolicyLossOptions, seq_adv: bool, token_out: TokenOut):
    # (shared lists: the kernels only read them)
    return _kernel_params(o, seq_adv, token_out).pack()


def _run_fwd(
    x: _Inputs,
    opts: PolicyLossOptions,
    token_out: TokenOut,
    need_entropy_grad: bool,
    backend: str,
    seq_stats: Optional[torch.Tensor] = None,
) -> _Out:
    fparams, iparams = _packed_params(opts, x.seq_adv, token_out)
    return _policy_loss_fwd(
        x.logprobs,
        x.old_logprobs,
        x.advantages,
        x.mask,
        x.ref_logprobs,
        x.rollout_logprobs,
        x.entropy,
        x.cu_seqlens,
        x.entropy_threshold,
        fparams,
        iparams,
        need_entropy_grad,
        backend,
        x.cov_selection,
        seq_stats,
    )


def _as_count(value, like: torch.Tensor) -> torch.Tensor:
    return (
        torch.as_tensor(value, device=like.device).to(like.dtype)
        if not isinstance(value, torch.Tensor)
        else value.to(like.device, like.dtype)
    )


def _loss_scale_factor(loss_scale_factor: Optional[float], logprobs: torch.Tensor) -> float:
    """The divisor of ``seq-mean-token-sum-norm``: the given one, else L. With L = 0 there is
    no token and the loss is 0, so any non-zero divisor gives that 0 (L itself would give 0/0)."""
    return loss_scale_factor if loss_scale_factor is not None else max(logprobs.shape[-1], 1)


def _aggregate(
    opts, sums, tok, logprobs, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The op layer's share of reference ``aggregate`` (the kernels weight and sum the tokens
    by a_t): ``(loss, norm)``, norm the scalar d loss / d sums[TOTAL] (0 when the count is 0),
    by which the pg / kl metric sums are scaled too. ``agg="none"``: the kernel's per-token
    loss ``tok`` with norm 1."""
    one = torch.ones((), dtype=sums.dtype, device=sums.device)
    if opts.agg == "none":
        return tok, one
    if opts.agg == "token-sum":
        norm = one * dp_size
    else:
        if opts.agg == "token-mean":
            den = sums[S.NTOK] if global_num_tokens is None else _as_count(global_num_tokens, sums)
        else:
            den = sums[S.NSEQ] if global_num_seqs is None else _as_count(global_num_seqs, sums)
        norm = _safe_div(one * dp_size, den)
        if opts.agg == "seq-mean-token-sum-norm":
            norm = norm / _loss_scale_factor(loss_scale_factor, logprobs)
    return sums[S.TOTAL] * norm, norm


def _metrics(sums: torch.Tensor, norm: torch.Tensor, rows: int) -> PolicyLossMetrics:
    s = sums.float()
    ntok = s[S.NTOK]
    # every sum divided by the valid-token count in one vector division (the same numbers as
    # one scalar division per metric, a sixth of the small ops)
    per_token = _safe_div(s, ntok)

    def mean(i):
        return per_token[i]

    has = (ntok > 0).float()
    return PolicyLossMetrics(
        pg_loss=(sums[S.PG] * norm).float(),
        kl_loss=(sums[S.KL] * norm).float(),
        pg_clipfrac=mean(S.CLIP),
        pg_clipfrac_lower=mean(S.CLIP_LOWER),
        ppo_kl=mean(S.NEG_DELTA),
        kl=mean(S.KL_RAW),
        is_weight_mean=mean(S.IS),
        is_weight_max=s[S.IS_MAX] * has,
        is_masked_frac=mean(S.REJECT),
        shaped_frac=mean(S.SHAPED),
        entropy_mean=mean(S.ENT),
        num_tokens=ntok,
        num_seqs=s[S.NSEQ],
        pg_clipfrac_low=mean(S.CLIP_LOW),
        pg_clipfrac_high=mean(S.CLIP_HIGH),
        seq_clipfrac_low_mean=_safe_div(s[S.SEQ_CLIP_LOW], s[S.NSEQ]),
        seq_clipfrac_high_mean=_safe_div(s[S.SEQ_CLIP_HIGH], s[S.NSEQ]),
        seq_clipfrac_low_min=s[S.SEQ_CLIP_LOW_MIN],
        seq_clipfrac_high_max=s[S.SEQ_CLIP_HIGH_MAX],
        rs_masked_frac=_safe_div(s[S.RS_REJECT], s[S.NTOK_RAW]),
        rs_seq_masked_frac=s[S.RS_SEQ_REJECT] / max(rows, 1),
        is_batch_norm_factor=torch.where(s[S.IS_NORM] > 0, s[S.IS_NORM], torch.ones_like(ntok)) * has,
    )
