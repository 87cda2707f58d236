"""Kernel contract of ``policy_loss_fwd`` (``policy_loss`` and ``shape_token_advantages``).

Mirrored in ``csrc/policy_loss.h`` (``RLVR_POLICY_LOSS_FPARAMS`` / ``_IPARAMS`` and the
``RLVR_<ENUM>_CODES`` lists); ``tests/common/test_contracts.py`` compares the two. The
tensors and what the kernels compute from them are described in
:mod:`rlvr_kernels.ops.policy_loss`.

Three inputs of the kernels are computed outside them, by torch ops every layer shares (the
op layer, the reference and the drop-ins): the validity of the packed layout
(``rlvr_kernels._core.layout.packed_mask``, with the other packed-layout rules), the
entropy-quantile threshold (:func:`entropy_quantile_threshold`) and the covariance
selection of clip_cov / kl_cov (:func:`cov_selection`); the last two live here, beside
the parameters, so that the fast path never imports the reference and the reference never
imports a backend.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar

import torch

from ._base import KernelParams


class LossType(enum.IntEnum):
    """The policy-gradient term (docs/policy-loss.md); ``gpg`` is ``REINFORCE``."""

    PPO = 0
    GSPO = 1
    CISPO = 2
    SAPO = 3
    REINFORCE = 4
    DPPO_TV = 5  # DPPO-Binary-TV: trust region on p − p_old
    DPPO_KL = 6  # DPPO-Binary-KL: trust region on the binary KL of (p_old, p)
    GEO_MEAN = 7  # GMPO: the geometric mean of the sign-aware clipped token ratios, per sequence
    DRO = 8  # DRO: −A·logp + ½·β·δ²
    CLIP_COV = 9  # Clip-Cov: the PPO clip, the selected tokens' term zeroed (cov_selection)
    KL_COV = 10  # KL-Cov: −A·ρ, plus kl_cov_coef·|δ| on the selected tokens (cov_selection)


class KlEstimator(enum.IntEnum):
    """The per-token KL estimate to the reference policy."""

    NONE = 0
    K1 = 1
    K2 = 2
    K3 = 3
    K3_PLUS = 4  # the value of k3 with the gradient of k2


class KlClamp(enum.IntEnum):
    """Which KL estimators the input / output clamps (``kl_clamp_input`` / ``_output``) apply to."""

    NONE = 0
    K3 = 1  # k3 and k3+ (verl's low_var_kl)
    ALL = 2  # every estimator


class RolloutCorrectionCode(enum.IntEnum):
    """The rollout-correction (importance-sampling) weight: level × mode of
    ``rlvr_kernels.RolloutCorrection`` (docs/policy-loss.md)."""

    NONE = 0
    TOKEN_TIS = 1  # token, truncate
    SEQ_TIS = 2  # sequence, truncate
    TOKEN_MIS = 3  # token, mask
    SEQ_MIS = 4  # sequence, mask
    DECOUPLED = 5  # token, decoupled
    TOKEN_ICEPOP = 6  # token, icepop
    SEQ_ICEPOP = 7  # sequence, icepop
    GATE = 8  # OpenRLHF's is_correction: token weights, a gate (IsGate) zeroes them, tokens stay counted


class IsGate(enum.IntEnum):
    """What the GATE rollout correction reads (``RolloutCorrection.is_mode`` clamp / gate with
    ``is_gate``). w = exp(clamp(x, ±20)) is the token's weight; p = clamp(exp(rollout), 1e-6,
    1 − 1e-6), q = clamp(exp(base), 1e-6, 1 − 1e-6)."""

    CLAMP = 0  # clamp(w, rc_low, rc_high); the tokens outside count as rejected (token level)
    RATIO = 1  # keep w where the statistic w (per sequence: exp(mean x)) is in [rc_low, rc_high], else 0
    BINARY_KL = 2  # ... the statistic p·log(p/q) + (1 − p)·log((1 − p)/(1 − q)) (per sequence: its mean)
    TV = 3  # ... the statistic |p − q| (per sequence: its mean)


class TokenOut(enum.IntEnum):
    """What the token-shaped ``token_out`` output holds."""

    NONE = 0  # not written (a [0] tensor)
    LOSS = 1  # ℓ·m, the per-token loss of agg="none"
    SHAPED_ADVANTAGES = 2  # Ã = A·w·m (shape_token_advantages)
    IS_WEIGHTS = 3  # the rollout-correction weight on valid tokens before rejection (after batch normalisation), else 0
    KEEP = 4  # 1 on valid tokens the rejection keeps, else 0 (verl's modified response_mask)


class A3poMetric(enum.IntEnum):
    """What A3PO ranks the tokens of a sequence by."""

    PROB = 0  # exp(old_logprobs)
    ENTROPY = 1  # the given entropy


class PolicyLossSum(enum.IntEnum):
    """The entries of the ``sums`` output (compute dtype). a_t is the aggregation weight
    (``agg_w``: m_t / n_i for seq-mean-token-mean, else m_t), m_t the valid flag."""

    TOTAL = 0  # Σ a·ℓ (the only differentiable entry)
    PG = 1  # Σ a·pg·shaping·is_w
    KL = 2  # Σ a·kl
    NTOK = 3  # Σ m
    NSEQ = 4  # sequences with n_i > 0
    CLIP = 5  # Σ m·clipped (dppo: outside the trust region; geo_mean: δ outside [−ε_low, ε_high] with A > 0;
    # clip_cov / kl_cov: selected)
    CLIP_LOWER = 6  # Σ m·dual-clip active (dppo: kept with the ratio above the cap; geo_mean: δ outside with A < 0)
    NEG_DELTA = 7  # Σ m·(−δ) (kl_cov: Σ m·|δ|)
    KL_RAW = 8  # Σ m·kl
    IS = 9  # Σ m·is_w
    IS_MAX = 10  # max over valid tokens of is_w (0 without valid tokens)
    REJECT = 11  # Σ m·rejected by a MIS/IcePop/decoupled/GATE bound (GATE CLAMP: outside its bounds)
    SHAPED = 12  # Σ m·[shaping weight ≠ 1]
    ENT = 13  # Σ m·entropy
    NONFINITE = 14  # valid tokens where an input the call reads is NaN/±inf (the value check)
    # The clip sides (ppo, gspo, cispo, clip_cov; 0 for the others). ρ is the ratio the loss type clips:
    # exp(δ) (δ after log_ratio_clamp), GSPO's s_i. low_t = [ρ < 1 − ε_low and A < 0],
    # high_t = [ρ > 1 + ε_high and A > 0] (A the unshaped advantage). f_i = Σ_t m·low / n_i
    # (resp. high) over the sequences with n_i > 0.
    CLIP_LOW = 15  # Σ m·low
    CLIP_HIGH = 16  # Σ m·high
    SEQ_CLIP_LOW = 17  # Σ_i f_low_i
    SEQ_CLIP_HIGH = 18  # Σ_i f_high_i
    SEQ_CLIP_LOW_MIN = 19  # min_i f_low_i (0 without a sequence with n_i > 0)
    SEQ_CLIP_HIGH_MAX = 20  # max_i f_high_i (0 without a sequence with n_i > 0)
    # Rollout correction (RolloutCorrection). m⁰ is the valid flag before rejection, m = m⁰·keep.
    # NTOK, NSEQ and every sum above are over the kept tokens m.
    NTOK_RAW = 21  # Σ m⁰
    RS_REJECT = 22  # Σ m⁰·(1 − keep): tokens the rejection chain removed
    RS_SEQ_REJECT = 23  # sequences with a removed token
    IS_NORM = 24  # the batch-normalisation mean of the IS weights (1 when <= 1e-8; 0 when off)


NUM_SUMS = len(PolicyLossSum)


class SeqStat(enum.IntEnum):
    """The columns of the optional ``seq_stats`` input of ``policy_loss_fwd`` ([B, NUM_SEQ_STATS]
    fp64): per-sequence sums (and two maxima) over the tokens of a sequence, which the op layer
    reduces over a context-parallel group (``cp_group=``) so that a rank holding a slice of each
    sequence sees the whole sequence's statistics. m⁰ is the valid flag before rejection, m the
    flag after the rejection chain's token options (``reference.seq_statistics``); after the
    reduction ``reference.seq_rejection`` applies the sequence options by setting N to 0 for a
    rejected sequence, so a kernel keeps a token iff its token options pass and N_i > 0. Given
    ``seq_stats``, a kernel takes every sequence-level quantity (n_i, GSPO's s_i, geo_mean's share,
    the sequence IS weight, the batch-normalisation mean) from it instead of from its own tokens."""

    N = 0  # Σ m (the sequence's n_i; 0 for a sequence the rejection chain removes)
    N_RAW = 1  # Σ m⁰
    DELTA = 2  # Σ m·(logp − old) (GSPO)
    DMIN = 3  # Σ m·δ_min (geo_mean)
    ADV = 4  # Σ m·A (geo_mean)
    LOGW = 5  # Σ m⁰·x, x the rollout log-ratio (sequence IS weights)
    IS_W = 6  # Σ m⁰·(token IS weight before normalisation) (token-level batch normalisation)
    K1 = 7  # Σ m⁰·k1 (rejection chain; k1, k2, k3 of rs_statistics)
    K2 = 8  # Σ m⁰·k2
    K3 = 9  # Σ m⁰·k3
    CLIP_LOW = 10  # Σ m·low (GSPO: Σ m·[A < 0]; the sequence ratio decides after the reduction)
    CLIP_HIGH = 11  # Σ m·high (GSPO: Σ m·[A > 0])
    K2_MAX = 12  # max over m⁰ of k2 (−inf without a valid token): reduced by MAX (SEQ_STAT_MAXIMA), the others by SUM
    K3_MAX = 13  # max over m⁰ of k3
    GATE = 14  # Σ m⁰·(the sequence-level gate's statistic: x for ratio, else the divergence; IsGate)


NUM_SEQ_STATS = len(SeqStat)
SEQ_STAT_MAXIMA = (SeqStat.K2_MAX, SeqStat.K3_MAX)  # the columns reduced by MAX over the group


@dataclasses.dataclass(frozen=True)
class PolicyLossParams(KernelParams):
    """Scalar parameters of ``policy_loss_fwd`` (both kernels read them by name). Options
    that are off still carry a value (the kernels do not read it)."""

    CPP_NAME: ClassVar[str] = "POLICY_LOSS"

    ratio_low: float  # 1 − ε_low: the clip range in ratio space (dppo: the threshold δ_low itself; geo_mean: ε_low)
    ratio_high: float  # 1 + ε_high (dppo: the threshold δ_high itself; geo_mean: ε_high)
    clip_ratio_c: float  # dual-clip bound c (> 1) of ppo and gspo, dppo's truncation cap, or 0 = off
    log_ratio_clamp: float  # δ clamped to ±this before exp (> 0), or 0 = off
    gspo_log_clamp: float  # upper clamp of log s_i (+inf = off)
    tau_pos: float  # SAPO temperatures
    tau_neg: float
    kl_coef: float  # β (0 without KL)
    rc_low: float  # the MIS lower bound
    rc_high: float  # C: the TIS cap, the MIS upper bound, the decoupled cap
    entropy_coef: float  # c_H of the entropy bonus
    w_pos: float  # polarity weights of the shaping
    w_neg: float
    probability: float  # λ of the probability shaping
    a3po_pos_high_ratio: float  # A3PO knobs (ratio, scale), applied in this order
    a3po_pos_high_scale: float
    a3po_pos_low_ratio: float
    a3po_pos_low_scale: float
    a3po_neg_high_ratio: float
    a3po_neg_high_scale: float
    a3po_neg_low_ratio: float
    a3po_neg_low_scale: float
    dro_beta: float  # β of dro's ½·β·δ² (0 for the other loss types)
    kl_cov_coef: float  # kl_cov: the coefficient of |δ| on the selected tokens
    loss_type: LossType
    kl: KlEstimator
    kl_clamp: KlClamp  # the estimators the two KL clamps apply to (K3 = 1 is verl's)
    rollout_correction: RolloutCorrectionCode
    seq_mean: bool  # agg_w = m_t / n_i (seq-mean-token-mean), else m_t
    token_out: TokenOut
    a3po_metric: A3poMetric
    a3po: bool  # a knob of the A3PO selection is on
    entropy_quantile: bool  # keep the pg term only where entropy >= entropy_threshold
    seq_adv: bool  # advantages are [B] (else token-shaped)
    kl_ratio_correction: bool  # the KL term times the ratio ρ (TRL's use_bias_correction_kl)
    kl_clamp_input: float  # x = logp − ref clamped to ±this before the estimator (> 0), or 0 = off
    kl_clamp_output: float  # the estimate clamped to ±this (> 0), or 0 = off
    kl_score_grad: bool  # ∂/∂logp of the KL term gains kl where no clamp is active (NeMo-RL)
    # Rollout correction's rejection chain (RolloutCorrection.rs_bounds, in this order): with
    # x = clamp(base − rollout, ±20), k1 = −x, k2 = x²/2, k3 = eˣ − 1 − x; k1 bounds in log
    # space, the others upper bounds (±inf when the option is off).
    rs_token_k1_low: float
    rs_token_k1_high: float
    rs_token_k2: float
    rs_token_k3: float
    rs_seq_sum_k1_low: float
    rs_seq_sum_k1_high: float
    rs_seq_sum_k2: float
    rs_seq_sum_k3: float
    rs_seq_mean_k1_low: float
    rs_seq_mean_k1_high: float
    rs_seq_mean_k2: float
    rs_seq_mean_k3: float
    rs_seq_max_k2: float
    rs_seq_max_k3: float
    rs_options: int  # bit j: options.RS_OPTIONS[j] is on (0: no rejection)
    rc_current: bool  # base = logprobs (detached; verl's bypass mode), else old_logprobs
    is_batch_normalize: bool  # the IS weights divided by their mean over the call (IS_NORM)
    # rollout_correction GATE: what the gate reads, and whether its statistic is the sequence's
    # (over the valid tokens before rejection; the weights stay per token).
    is_gate: IsGate
    is_gate_seq: bool


# The C++ X-macro list each branch-code enum mirrors.
CPP_CODES = {
    "RLVR_LOSS_TYPE_CODES": LossType,
    "RLVR_KL_ESTIMATOR_CODES": KlEstimator,
    "RLVR_KL_CLAMP_CODES": KlClamp,
    "RLVR_ROLLOUT_CORRECTION_CODES": RolloutCorrectionCode,
    "RLVR_TOKEN_OUT_CODES": TokenOut,
    "RLVR_IS_GATE_CODES": IsGate,
    "RLVR_A3PO_METRIC_CODES": A3poMetric,
    "RLVR_POLICY_LOSS_SUM_CODES": PolicyLossSum,
    "RLVR_SEQ_STAT_CODES": SeqStat,
}


# ------------------------------------------------------------------ inputs computed outside the kernels
def entropy_quantile_threshold(entropy: torch.Tensor, valid: torch.Tensor, rho: float) -> torch.Tensor:
    """The (1 − ρ) quantile of ``entropy`` over ``valid`` tokens, linear interpolation
    (``torch.quantile``'s rule), as a 0-d fp32 tensor; +inf when no token is valid. The
    kernels' ``entropy_threshold``.

    Sort-based with invalid tokens pushed to +inf, so the shapes stay static (no
    ``masked_select``): works under torch.compile, on meta tensors and for more than 2^24
    tokens, where ``torch.quantile`` refuses.
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
    # (index_select, not x[lo_i]: indexing by a 0-d tensor reads it on the host)
    a, b = x.index_select(0, lo_i.reshape(1)).squeeze(0), x.index_select(0, hi_i.reshape(1)).squeeze(0)
    t = torch.lerp(a, b, w)
    return torch.where(n > 0, t, torch.full((), float("inf"), device=entropy.device))


# The covariance selection of clip_cov / kl_cov (docs/policy-loss.md).
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x·c mod 2^32 for int64 x in [0, 2^32): c split in 16-bit halves, so that no product
    leaves int64 (torch's overflow is not defined behaviour)."""
    hi, lo = c >> 16, c & 0xFFFF
    return (((x * hi) & 0xFFFF) * 65536 + x * lo) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply, constants 0x7feb352d / 0x846ca68b) on
    int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def cov_hash(seed: int, n: int, device) -> torch.Tensor:
    """h_t = H(H(H(H(seed_lo ^ 0x9e3779b9) ^ seed_hi) ^ t_hi) ^ t_lo) for the flat token indices t < n,
    int64 in [0, 2^32): a counter-based hash, the same on every device, H = :func:`_hash32`,
    lo / hi the 32-bit halves."""
    t = torch.arange(n, device=device, dtype=torch.int64)
    h = _hash32(torch.full((), (seed & _M32) ^ 0x9E3779B9, device=device, dtype=torch.int64))
    h = _hash32(h ^ ((seed >> 32) & _M32))
    h = _hash32(h ^ (t >> 32))
    return _hash32(h ^ (t & _M32))


def _first_k(key: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The k eligible entries of the flat ``key`` with the smallest keys, ties to the lower
    index (a stable sort; k a 0-d tensor, no host sync)."""
    big = torch.full((), float("inf"), dtype=key.dtype, device=key.device) if key.is_floating_point() else 1 << 40
    order = torch.where(eligible, key, big).sort(stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(0, order, torch.arange(order.numel(), device=key.device, dtype=order.dtype))
    return eligible & (rank < k)


def covariance(logprobs: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """cov_t = (A_t − Ā)·(logp_t − l̄), the means over the ``valid`` tokens (0 when there is
    none), in fp64, token-shaped."""
    v = valid.double()
    n = v.sum().clamp(min=1)
    a, lp = advantages.detach().double(), logprobs.detach().double()
    return (a - (a * v).sum() / n) * (lp - (lp * v).sum() / n)


def cov_selection(
    loss_type: LossType,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    *,
    cov_ratio: float,
    cov_lb: float,
    cov_ub: float,
    clip_low: float,
    clip_high: float,
    log_ratio_clamp: float,
    cov_seed: int,
) -> torch.Tensor:
    """The tokens clip_cov / kl_cov treat apart (the kernels' ``cov_selection``), a bool
    tensor shaped like ``logprobs``, from the batch covariance cov_t = :func:`covariance`
    (fp64; ``advantages`` token-shaped) over the N ``valid`` tokens of the call;
    k = max(1, ⌊N·cov_ratio⌋), none when N = 0.

    - KL_COV: the k valid tokens with the largest cov_t, ties to the lower flat index.
    - CLIP_COV: the candidates are the valid tokens the PPO clip leaves alone (l2 <= l1 with
      l1 = −A·ρ, l2 = −A·clamp(ρ, 1 − clip_low, 1 + clip_high), ρ = exp(δ), δ clamped to
      ±log_ratio_clamp when > 0) with cov_lb < cov_t < cov_ub; min(k, #candidates) of them
      are selected: those with the smallest :func:`cov_hash` (seed ``cov_seed``, the flat
      token index), ties to the lower index — a random choice that is a pure function of
      the inputs and the seed.

    Computed in fp64 from the inputs as given (bf16 / fp32 values are exact in fp64), so every
    backend and the fp64 reference see the same selection. Static shapes, no host sync.
    """
    flat_valid = valid.reshape(-1)
    cov = covariance(logprobs, advantages, valid).reshape(-1)
    n = flat_valid.sum()
    k = torch.where(n > 0, (n.double() * cov_ratio).floor().long().clamp(min=1), torch.zeros_like(n))
    if loss_type == LossType.KL_COV:
        return _first_k(-cov, flat_valid, k).reshape(valid.shape)
    adv = advantages.detach().double().reshape(-1)
    delta = (logprobs.detach().double() - old_logprobs.detach().double()).reshape(-1)
    if log_ratio_clamp > 0:
        delta = delta.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(delta)
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high) > -adv * ratio
    cand = flat_valid & ~clipped & (cov > cov_lb) & (cov < cov_ub)
    key = cov_hash(cov_seed, cand.numel(), cand.device)
    return _first_k(key, cand, k).reshape(valid.shape)


def cov_selection_of(opts, logprobs, old_logprobs, advantages, valid) -> torch.Tensor:
    """:func:`cov_selection` with the options of ``opts`` (a ``PolicyLossOptions`` with
    loss_type clip_cov / kl_cov; an unset ``log_ratio_clamp`` is 0), the one mapping the op
    layer and the reference share. ``advantages`` token-shaped, all in the caller's layout."""
    return cov_selection(
        LossType.CLIP_COV if opts.loss_type == "clip_cov" else LossType.KL_COV,
        logprobs,
        old_logprobs,
        advantages,
        valid,
        cov_ratio=opts.cov_ratio,
        cov_lb=opts.cov_lb,
        cov_ub=opts.cov_ub,
        clip_low=opts.clip_low,
        clip_high=opts.clip_high,
        log_ratio_clamp=float(opts.log_ratio_clamp or 0.0),
        cov_seed=opts.cov_seed,
    )
