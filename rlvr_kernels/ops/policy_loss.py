"""``policy_loss`` and ``shape_token_advantages``: validation, the
``rlvr_kernels::policy_loss_fwd`` custom op with its autograd, and dispatch to the C++
(CPU) and Triton (CUDA) kernels.

Why one forward pass is enough for the backward: every per-token term of the loss depends
on its own log-prob only (GSPO's sequence ratio, the IS weights, the shaping weights and
the entropy-quantile threshold are detached constants), and the aggregation is linear.
So the kernel writes, next to the loss sums, the per-token derivative
``grad_logprobs[t] = a_t · ∂ℓ_t/∂logp_t`` (a_t = m_t, or m_t / n_i for
``seq-mean-token-mean``), and the backward is one scalar (or, for ``agg="none"``,
per-token) multiply. The scalar normalisation (1/N_tok, 1/N_seq, dp_size,
loss_scale_factor, global counts) stays outside the kernel, in differentiable torch ops
on the 0-d sum, so global counts may be tensors (an all-reduce result) with no host sync.

Kernel contract (both backends; indices below are shared with csrc/policy_loss.h):
  inputs   logprobs, old_logprobs [, ref_logprobs, rollout_logprobs, entropy] — one float
           dtype (the wrapper casts), padded [B, L] or packed [T] (contiguous);
           advantages — compute dtype (fp32, fp64 for fp64 inputs), [B] (I_SEQ_ADV = 1) or
           token-shaped; mask — bool, token-shaped, or None (packed: all tokens inside
           cu_seqlens[-1] are valid); cu_seqlens — int64 [B+1] or None (padded);
           entropy_threshold — 0-d fp32 or None.
  outputs  sums [NUM_SUMS] (compute dtype), grad_logprobs (token-shaped, compute dtype),
           grad_entropy (token-shaped if need_entropy_grad else [0]),
           token_out (token-shaped if I_TOKEN_OUT else [0]): ℓ·m for agg="none", or the
           shaped advantages Ã for ``shape_token_advantages``.
Kernels must stay in bounds whatever cu_seqlens holds (offsets clamped to [0, T], a
decreasing pair is an empty sequence).
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch

from .. import reference
from ..options import PolicyLossMetrics, PolicyLossOptions, TokenShaping, resolve_policy_loss_options
from ..reference.policy_loss import entropy_quantile_threshold, packed_mask
from . import _dispatch
from ._validation import FLOAT_DTYPES, MASK_DTYPES, check_tensor, checks_enabled

# --- float parameters (fparams)
F_CLIP_LO = 0  # 1 − ε_low (ratio space)
F_CLIP_HI = 1  # 1 + ε_high
F_CLIP_C = 2  # dual-clip c (> 1), or 0 = off
F_LOG_RATIO_CLAMP = 3  # δ clamp (> 0), or 0 = off
F_GSPO_CLAMP = 4  # upper clamp of log s_i (+inf = off)
F_TAU_POS = 5
F_TAU_NEG = 6
F_KL_COEF = 7  # β
F_RC_LOW = 8  # MIS lower bound
F_RC_HIGH = 9  # C: TIS cap, MIS upper bound, decoupled cap
F_ENT_COEF = 10
F_W_POS = 11
F_W_NEG = 12
F_PROB_LAMBDA = 13
F_A3PO = 14  # 8 values: (ratio, scale) for pos-high, pos-low, neg-high, neg-low
NUM_FPARAMS = 22
# --- int parameters (iparams)
I_LOSS_TYPE = 0  # LOSS_CODES
I_KL = 1  # KL_CODES (0 = none)
I_KL_CLAMP = 2  # 1: k3 clamps (x to ±20, value to ±10)
I_RC = 3  # RC_CODES (0 = none)
I_SEQ_MEAN = 4  # 1: a_t = m_t / n_i (seq-mean-token-mean), else a_t = m_t
I_TOKEN_OUT = 5  # 0: none; 1: token_out = ℓ·m; 2: token_out = Ã (shaped advantages, A·w·m)
I_A3PO_METRIC = 6  # 0: prob = exp(old_logprobs), 1: entropy
I_A3PO_ON = 7
I_ENT_QUANTILE = 8  # 1: keep the pg term only where entropy >= entropy_threshold
I_SEQ_ADV = 9  # 1: advantages are [B]
NUM_IPARAMS = 10
LOSS_CODES = {"ppo": 0, "gspo": 1, "cispo": 2, "sapo": 3, "reinforce": 4}
KL_CODES = {None: 0, "k1": 1, "k2": 2, "k3": 3, "k3+": 4}
RC_CODES = {None: 0, "token_tis": 1, "seq_tis": 2, "token_mis": 3, "seq_mis": 4, "decoupled": 5}
# --- sums (compute dtype). a_t as above, m_t the valid flag.
S_TOTAL = 0  # Σ a·ℓ                       (the only differentiable entry)
S_PG = 1  # Σ a·pg·shaping·is_w
S_KL = 2  # Σ a·kl
S_NTOK = 3  # Σ m
S_NSEQ = 4  # sequences with n_i > 0
S_CLIP = 5  # Σ m·clipped
S_CLIP_LOWER = 6  # Σ m·dual-clip active
S_NEG_DELTA = 7  # Σ m·(−δ)
S_KL_RAW = 8  # Σ m·kl
S_IS = 9  # Σ m·is_w
S_IS_MAX = 10  # max over valid tokens of is_w (0 without valid tokens)
S_REJECT = 11  # Σ m·rejected by a MIS/decoupled bound
S_SHAPED = 12  # Σ m·[shaping weight ≠ 1]
S_ENT = 13  # Σ m·entropy
S_NONFINITE = 14  # valid tokens where an input the call reads is NaN/±inf (the value check)
NUM_SUMS = 15

_Out = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


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
) -> _Out:
    """(sums, grad_logprobs, grad_entropy, token_out); see the module docstring."""
    args = (
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
    )
    if _dispatch.resolve_backend(backend, logprobs.device) == "cpu":
        return torch.ops.rlvr_kernels_C.policy_loss_fwd(*args)
    from ..triton.policy_loss import policy_loss_triton

    return policy_loss_triton(*args)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


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
):
    dt = _compute_dtype(logprobs.dtype)
    shape = logprobs.shape
    return (
        logprobs.new_empty((NUM_SUMS,), dtype=dt),
        logprobs.new_empty(shape, dtype=dt),
        logprobs.new_empty(shape if need_entropy_grad else (0,), dtype=dt),
        logprobs.new_empty(shape if iparams[I_TOKEN_OUT] else (0,), dtype=dt),
    )


@functools.lru_cache(maxsize=None)
def _has_cpu_grad_kernel() -> bool:
    return _dispatch.load_extension() and hasattr(torch.ops.rlvr_kernels_C, "policy_loss_grad")


@torch.library.custom_op("rlvr_kernels::policy_loss_grad", mutates_args=())
def _policy_loss_grad(coef: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(coef · up).to(dtype)``: the backward of ``policy_loss_fwd``. On CPU a C++ kernel
    writes it into a block of the huge-page output cache: a fresh multi-MB tensor per
    backward would otherwise cost more in page faults than the multiply."""
    if coef.device.type == "cpu" and coef.numel() >= (1 << 16) and _has_cpu_grad_kernel():
        return torch.ops.rlvr_kernels_C.policy_loss_grad(coef, up.contiguous(), dtype)
    return (coef * up).to(dtype)


@_policy_loss_grad.register_fake
def _(coef, up, dtype):
    return coef.new_empty(coef.shape, dtype=dtype)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])
    ctx.logprobs_dtype = inputs[0].dtype
    ctx.entropy_dtype = inputs[6].dtype if inputs[6] is not None and inputs[11] else None


def _backward(ctx, g_sums, g_logp, g_ent, g_tok):
    # Only sums[S_TOTAL] and token_out (agg="none") carry gradient; the other sums are
    # metrics and the saved per-token derivatives are not differentiated again.
    coef_logp, coef_ent = ctx.saved_tensors
    up = g_sums[S_TOTAL]
    if g_tok is not None and g_tok.numel():
        up = up + g_tok
    grad_logprobs = _policy_loss_grad(coef_logp, up, ctx.logprobs_dtype)
    grad_entropy = None
    if ctx.entropy_dtype is not None:
        grad_entropy = _policy_loss_grad(coef_ent, up, ctx.entropy_dtype)
    return grad_logprobs, None, None, None, None, None, grad_entropy, None, None, None, None, None, None


_policy_loss_fwd.register_autograd(_backward, setup_context=_setup_context)


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
    kl: Optional[str] = None,
    kl_coef: Optional[float] = None,
    rollout_correction: Optional[str] = None,
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
    dp_size: int = 1,
    loss_scale_factor: Optional[float] = None,
    validate: bool = True,
    backend: str = "auto",
) -> Tuple[torch.Tensor, PolicyLossMetrics]:
    """The GRPO-family policy loss (SPEC §4), forward and backward in one fused pass.

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
            ranks is the full-batch one).
        loss_scale_factor: divisor of ``seq-mean-token-sum-norm`` (Dr.GRPO); default L
            (padded); required for the packed layout.
        validate: check values (finite log-probs on valid tokens, ``cu_seqlens``), a host
            sync on CUDA; skipped under torch.compile.
        backend: ``"auto"``, or ``"reference"``, ``"cpu"``, ``"triton"``.

    Returns:
        ``(loss, metrics)``: the loss, 0-d fp32 (fp64 for fp64 inputs), or per-token for
        ``agg="none"``; :class:`PolicyLossMetrics` of detached 0-d tensors.
    """
    _dispatch.check_backend(backend)
    opts = _resolve(
        preset,
        options,
        loss_type=loss_type,
        clip_low=clip_low,
        clip_high=clip_high,
        clip_ratio_c=clip_ratio_c,
        kl=kl,
        kl_coef=kl_coef,
        rollout_correction=rollout_correction,
        rollout_threshold=rollout_threshold,
        entropy_coef=entropy_coef,
        agg=agg,
        shaping=shaping,
    )
    x = _validate(
        logprobs, old_logprobs, advantages, mask, ref_logprobs, rollout_logprobs, entropy, cu_seqlens, opts, validate
    )
    _check_agg_args(opts, cu_seqlens, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor)
    if backend == "reference":
        _check_finite(None, x, validate)  # (no kernel count: search every input)
        return reference.policy_loss(
            logprobs,
            old_logprobs,
            advantages,
            x["mask"],
            opts,
            ref_logprobs=ref_logprobs,
            rollout_logprobs=rollout_logprobs,
            entropy=entropy,
            cu_seqlens=x["cu_seqlens"],
            global_num_tokens=global_num_tokens,
            global_num_seqs=global_num_seqs,
            dp_size=dp_size,
            loss_scale_factor=loss_scale_factor,
        )
    token_out = 1 if opts.agg == "none" else 0
    need_entropy_grad = x["entropy"] is not None and opts.entropy_coef != 0 and entropy.requires_grad
    sums, _, _, tok = _policy_loss_fwd(
        x["logprobs"],
        x["old_logprobs"],
        x["advantages"],
        x["mask"],
        x["ref_logprobs"],
        x["rollout_logprobs"],
        x["entropy"],
        x["cu_seqlens"],
        x["threshold"],
        _fparams(opts),
        _iparams(opts, x, token_out),
        need_entropy_grad,
        backend,
    )
    _check_finite(sums, x, validate)
    dt = sums.dtype
    if opts.agg == "none":
        loss = tok
        norm = torch.ones((), dtype=dt, device=sums.device)
    else:
        norm = _norm(opts, sums, logprobs, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor)
        loss = sums[S_TOTAL] * norm
    return loss, _metrics(sums.detach(), norm.detach())


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
    """Token advantages Ã = A · w (SPEC §2), the shaping ``policy_loss`` fuses, as a tensor
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
        return reference.shape_token_advantages(
            advantages, old_logprobs, x["mask"], shaping, entropy=entropy, cu_seqlens=x["cu_seqlens"]
        )
    lp = x["logprobs"].detach()
    sums, _, _, tok = _policy_loss_fwd(
        lp,
        lp,
        x["advantages"],
        x["mask"],
        None,
        None,
        None if x["entropy"] is None else x["entropy"].detach(),
        x["cu_seqlens"],
        x["threshold"],
        _fparams(opts),
        _iparams(opts, x, 2),
        False,
        backend,
    )
    _check_finite(sums, x, validate)
    return tok


# ------------------------------------------------------------------ helpers
_OPTION_NAMES = (
    "loss_type",
    "clip_low",
    "clip_high",
    "clip_ratio_c",
    "kl",
    "kl_coef",
    "rollout_correction",
    "rollout_threshold",
    "entropy_coef",
    "agg",
    "shaping",
)


def _resolve(preset, options, **overrides) -> PolicyLossOptions:
    if options is not None:
        if not isinstance(options, PolicyLossOptions):
            raise TypeError(f"options: expected a rlvr_kernels.PolicyLossOptions, got {type(options).__name__}")
        given = [k for k, v in overrides.items() if v is not None]
        if given or preset is not None:
            raise ValueError(
                f"options: give either options= or preset/keyword options, not both (got {given or preset})"
            )
        return options
    return resolve_policy_loss_options(preset, **overrides)


def _fparams(o: PolicyLossOptions) -> List[float]:
    s = o.shaping
    a3 = [float(v) for knob in s.a3po_knobs for v in knob]
    return [
        1.0 - o.clip_low,
        1.0 + o.clip_high,
        float(o.clip_ratio_c or 0.0),
        float(o.log_ratio_clamp or 0.0),
        float(o.gspo_log_clamp) if o.gspo_log_clamp is not None else float("inf"),
        float(o.tau_pos),
        float(o.tau_neg),
        float(o.kl_coef if o.kl else 0.0),
        float(o.mis_low),
        float(o.rollout_threshold),
        float(o.entropy_coef),
        float(s.w_pos),
        float(s.w_neg),
        float(s.probability),
        *a3,
    ]


def _iparams(o: PolicyLossOptions, x, token_out: int) -> List[int]:
    s = o.shaping
    return [
        LOSS_CODES[o.loss_type],
        KL_CODES[o.kl],
        int(o.kl_clamp),
        RC_CODES[o.rollout_correction],
        int(o.agg == "seq-mean-token-mean"),
        token_out,
        int(s.a3po_metric == "entropy"),
        int(s.a3po_active),
        int(s.entropy_quantile is not None),
        int(x["seq_adv"]),
    ]


def _safe_div(num, den):
    return torch.where(den != 0, num / torch.where(den != 0, den, torch.ones_like(den)), torch.zeros_like(num))


def _as_count(value, like: torch.Tensor) -> torch.Tensor:
    return (
        torch.as_tensor(value, device=like.device).to(like.dtype)
        if not isinstance(value, torch.Tensor)
        else value.to(like.device, like.dtype)
    )


def _norm(opts, sums, logprobs, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor) -> torch.Tensor:
    """The scalar d loss / d sums[S_TOTAL] for the aggregation (0 when the count is 0)."""
    one = torch.ones((), dtype=sums.dtype, device=sums.device)
    if opts.agg == "token-sum":
        return one * dp_size
    if opts.agg == "token-mean":
        den = sums[S_NTOK] if global_num_tokens is None else _as_count(global_num_tokens, sums)
    else:
        den = sums[S_NSEQ] if global_num_seqs is None else _as_count(global_num_seqs, sums)
    norm = _safe_div(one * dp_size, den)
    if opts.agg == "seq-mean-token-sum-norm":
        norm = norm / (loss_scale_factor if loss_scale_factor is not None else logprobs.shape[-1])
    return norm


def _metrics(sums: torch.Tensor, norm: torch.Tensor) -> PolicyLossMetrics:
    s = sums.float()
    ntok = s[S_NTOK]

    def mean(i):
        return _safe_div(s[i], ntok)

    has = (ntok > 0).float()
    return PolicyLossMetrics(
        pg_loss=(sums[S_PG] * norm).float(),
        kl_loss=(sums[S_KL] * norm).float(),
        pg_clipfrac=mean(S_CLIP),
        pg_clipfrac_lower=mean(S_CLIP_LOWER),
        ppo_kl=mean(S_NEG_DELTA),
        kl=mean(S_KL_RAW),
        is_weight_mean=mean(S_IS),
        is_weight_max=s[S_IS_MAX] * has,
        is_masked_frac=mean(S_REJECT),
        shaped_frac=mean(S_SHAPED),
        entropy_mean=mean(S_ENT),
        num_tokens=ntok,
        num_seqs=s[S_NSEQ],
    )


def _check_agg_args(opts, cu_seqlens, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor):
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size: expected an int >= 1, got {dp_size!r}")
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


def _validate(
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
    logprobs_name="logprobs",
):
    """Static checks (always) and value checks (``validate``); returns kernel-ready inputs."""
    check_tensor(logprobs_name, logprobs, dtypes=FLOAT_DTYPES, ndim=(1, 2))
    dev, shape, dt = logprobs.device, tuple(logprobs.shape), logprobs.dtype
    cdt = _compute_dtype(dt)

    def same(name, t):
        if t is None:
            return None
        check_tensor(name, t, dtypes=FLOAT_DTYPES)
        if t.device != dev:
            raise ValueError(f"{name}: expected a tensor on {dev} (where {logprobs_name} lives), got {t.device}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} (like {logprobs_name}), got {tuple(t.shape)}")
        return t.detach().to(dt).contiguous()

    old = same("old_logprobs", old_logprobs)
    ref = same("ref_logprobs", ref_logprobs)
    roll = same("rollout_logprobs", rollout_logprobs)
    ent = None
    if entropy is not None:
        check_tensor("entropy", entropy, dtypes=FLOAT_DTYPES)
        same("entropy", entropy)  # shape/device checks
        ent = entropy.to(dt).contiguous()  # keeps the autograd edge for the entropy bonus

    if cu_seqlens is None:
        if logprobs.dim() != 2:
            raise ValueError(
                f"{logprobs_name}: a 1-D (packed [T]) tensor needs cu_seqlens; give [B, L] with a mask "
                f"for the padded layout"
            )
        if mask is None:
            raise ValueError("mask: the padded [B, L] layout needs a token mask")
        B = shape[0]
    else:
        if logprobs.dim() != 1:
            raise ValueError(f"{logprobs_name}: with cu_seqlens expected a packed 1-D [T] tensor, got shape {shape}")
        check_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32, torch.int64), ndim=(1,))
        if cu_seqlens.device != dev:
            raise ValueError(f"cu_seqlens: expected a tensor on {dev}, got {cu_seqlens.device}")
        if cu_seqlens.shape[0] < 1:
            raise ValueError("cu_seqlens: expected B + 1 >= 1 offsets, got an empty tensor")
        B = cu_seqlens.shape[0] - 1
    if mask is not None:
        check_tensor("mask", mask, dtypes=MASK_DTYPES)
        if mask.device != dev:
            raise ValueError(f"mask: expected a tensor on {dev}, got {mask.device}")
        if tuple(mask.shape) != shape:
            raise ValueError(f"mask: expected shape {shape} (like {logprobs_name}), got {tuple(mask.shape)}")
        mask = (mask if mask.dtype == torch.bool else mask != 0).contiguous()

    check_tensor("advantages", advantages, dtypes=FLOAT_DTYPES)
    if advantages.device != dev:
        raise ValueError(f"advantages: expected a tensor on {dev}, got {advantages.device}")
    if tuple(advantages.shape) == shape:
        seq_adv = False
    elif tuple(advantages.shape) == (B,):
        seq_adv = True
    else:
        raise ValueError(
            f"advantages: expected [B={B}] (per sequence) or {shape} (per token), got {tuple(advantages.shape)}"
        )
    adv = advantages.detach().to(cdt).contiguous()

    if opts.kl is not None and ref is None:
        raise ValueError(f"ref_logprobs: kl={opts.kl!r} needs the reference log-probs")
    if opts.rollout_correction is not None and roll is None:
        raise ValueError(f"rollout_logprobs: rollout_correction={opts.rollout_correction!r} needs them")
    sh = opts.shaping
    if ent is None:
        if opts.entropy_coef != 0:
            raise ValueError("entropy: entropy_coef != 0 needs the per-token entropy")
        if sh.entropy_quantile is not None:
            raise ValueError("entropy: shaping.entropy_quantile needs the per-token entropy")
        if sh.a3po_active and sh.a3po_metric == "entropy":
            raise ValueError("entropy: shaping.a3po_metric='entropy' needs the per-token entropy")

    cu = cu_seqlens.long().contiguous() if cu_seqlens is not None else None
    if checks_enabled(validate):
        if cu is not None and cu.numel():
            if int(cu[0]) != 0:
                raise ValueError(f"cu_seqlens: expected cu_seqlens[0] == 0, got {int(cu[0])}")
            if bool((cu[1:] < cu[:-1]).any()):
                raise ValueError("cu_seqlens: expected non-decreasing offsets")
            if int(cu[-1]) > shape[0]:
                raise ValueError(f"cu_seqlens: expected cu_seqlens[-1] <= T = {shape[0]}, got {int(cu[-1])}")
    threshold = None
    if sh.entropy_quantile is not None:
        valid = packed_mask(mask, cu, shape[0], dev) if cu is not None else mask
        threshold = entropy_quantile_threshold(ent, valid, sh.entropy_quantile)
    return dict(
        logprobs=logprobs.contiguous(),
        old_logprobs=old,
        advantages=adv,
        mask=mask,
        ref_logprobs=ref,
        rollout_logprobs=roll,
        entropy=ent,
        cu_seqlens=cu,
        threshold=threshold,
        seq_adv=seq_adv,
        names=(logprobs_name, "old_logprobs", "advantages", "ref_logprobs", "rollout_logprobs", "entropy"),
    )


def _check_finite(sums: torch.Tensor, x, validate: bool) -> None:
    """Non-finite inputs on valid tokens are an error. The kernel counts them in the same
    pass (S_NONFINITE), which costs far less than a reduction per input before it; the
    error is raised before anything is returned, so no caller ever sees results computed
    from them. Only when the count is non-zero are the inputs searched for the message."""
    if not checks_enabled(validate) or (sums is not None and not bool(sums[S_NONFINITE] > 0)):
        return
    inputs = (x["logprobs"], x["old_logprobs"], x["advantages"], x["ref_logprobs"], x["rollout_logprobs"], x["entropy"])
    for name, t in zip(x["names"], inputs):
        if t is not None and t.numel():
            _find_non_finite(name, t.detach(), x["mask"], x["cu_seqlens"], x["seq_adv"] and name == "advantages")
    if sums is not None:
        raise ValueError("non-finite input on a valid token")  # (unreachable unless a search above missed it)


def _find_non_finite(name, t, mask, cu, per_sequence):
    bad = ~torch.isfinite(t)
    if not per_sequence:
        bad = bad & (packed_mask(mask, cu, t.shape[0], t.device) if cu is not None else mask)
    if bool(bad.any()):
        idx = tuple(int(v) for v in bad.nonzero()[0])
        raise ValueError(f"{name}: non-finite value {float(t[idx])} at {idx} on a valid token")
