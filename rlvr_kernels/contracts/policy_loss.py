"""Kernel contract of ``policy_loss_fwd`` (``policy_loss`` and ``shape_token_advantages``).

Mirrored in ``csrc/policy_loss.h`` (``RLVR_POLICY_LOSS_FPARAMS`` / ``_IPARAMS`` and the
``RLVR_<ENUM>_CODES`` lists); ``tests/common/test_contracts.py`` compares the two. The
tensors and what the kernels compute from them are described in
:mod:`rlvr_kernels.ops.policy_loss`.

Two inputs of the kernels are computed outside them, by torch ops every layer shares (the
op layer, the reference and the drop-ins): the validity of the packed layout
(``rlvr_kernels._core.layout.packed_mask``, with the other packed-layout rules) and the
entropy-quantile threshold (:func:`entropy_quantile_threshold`), which lives here, beside
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


class KlEstimator(enum.IntEnum):
    """The per-token KL estimate to the reference policy."""

    NONE = 0
    K1 = 1
    K2 = 2
    K3 = 3
    K3_PLUS = 4  # the value of k3 with the gradient of k2


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


class TokenOut(enum.IntEnum):
    """What the token-shaped ``token_out`` output holds."""

    NONE = 0  # not written (a [0] tensor)
    LOSS = 1  # ℓ·m, the per-token loss of agg="none"
    SHAPED_ADVANTAGES = 2  # Ã = A·w·m (shape_token_advantages)
    IS_WEIGHTS = 3  # the rollout-correction weight on valid tokens (after batch normalisation), else 0
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
    CLIP = 5  # Σ m·clipped (dppo: outside the trust region)
    CLIP_LOWER = 6  # Σ m·dual-clip active (dppo: kept with the ratio above the cap)
    NEG_DELTA = 7  # Σ m·(−δ)
    KL_RAW = 8  # Σ m·kl
    IS = 9  # Σ m·is_w
    IS_MAX = 10  # max over valid tokens of is_w (0 without valid tokens)
    REJECT = 11  # Σ m·rejected by a MIS/decoupled bound
    SHAPED = 12  # Σ m·[shaping weight ≠ 1]
    ENT = 13  # Σ m·entropy
    NONFINITE = 14  # valid tokens where an input the call reads is NaN/±inf (the value check)
    # The clip sides (ppo, gspo, cispo; 0 for the others). ρ is the ratio the loss type clips:
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


@dataclasses.dataclass(frozen=True)
class PolicyLossParams(KernelParams):
    """Scalar parameters of ``policy_loss_fwd`` (both kernels read them by name). Options
    that are off still carry a value (the kernels do not read it)."""

    CPP_NAME: ClassVar[str] = "POLICY_LOSS"

    ratio_low: float  # 1 − ε_low: the clip range in ratio space (dppo: the threshold δ_low itself)
    ratio_high: float  # 1 + ε_high (dppo: the threshold δ_high itself)
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
    loss_type: LossType
    kl: KlEstimator
    kl_clamp: bool  # k3 clamps (x to ±20, value to ±10), as verl
    rollout_correction: RolloutCorrectionCode
    seq_mean: bool  # agg_w = m_t / n_i (seq-mean-token-mean), else m_t
    token_out: TokenOut
    a3po_metric: A3poMetric
    a3po: bool  # a knob of the A3PO selection is on
    entropy_quantile: bool  # keep the pg term only where entropy >= entropy_threshold
    seq_adv: bool  # advantages are [B] (else token-shaped)
    kl_ratio_correction: bool  # the KL term times the ratio ρ (TRL's use_bias_correction_kl)
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


# The C++ X-macro list each branch-code enum mirrors.
CPP_CODES = {
    "RLVR_LOSS_TYPE_CODES": LossType,
    "RLVR_KL_ESTIMATOR_CODES": KlEstimator,
    "RLVR_ROLLOUT_CORRECTION_CODES": RolloutCorrectionCode,
    "RLVR_TOKEN_OUT_CODES": TokenOut,
    "RLVR_A3PO_METRIC_CODES": A3poMetric,
    "RLVR_POLICY_LOSS_SUM_CODES": PolicyLossSum,
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
