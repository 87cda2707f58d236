// Kernel contract of policy_loss_fwd: the mirror of rlvr_kernels/contracts/policy_loss.py (what
// each parameter means is written there; tests/common/test_contracts.py compares the two).
#pragma once

#include <torch/types.h>

#include <tuple>

#include "params.h"

// fparams, in order.
#define RLVR_POLICY_LOSS_FPARAMS(X)                                                                       \
  X(ratio_low) X(ratio_high) X(clip_ratio_c) X(log_ratio_clamp) X(gspo_log_clamp) X(tau_pos) X(tau_neg) \
  X(kl_coef) X(rc_low) X(rc_high) X(entropy_coef) X(w_pos) X(w_neg) X(probability)                      \
  X(a3po_pos_high_ratio) X(a3po_pos_high_scale) X(a3po_pos_low_ratio) X(a3po_pos_low_scale)             \
  X(a3po_neg_high_ratio) X(a3po_neg_high_scale) X(a3po_neg_low_ratio) X(a3po_neg_low_scale) X(dro_beta)      \
  X(kl_cov_coef) X(kl_clamp_input) X(kl_clamp_output) X(rs_token_k1_low) X(rs_token_k1_high) X(rs_token_k2)   \
  X(rs_token_k3) X(rs_seq_sum_k1_low) X(rs_seq_sum_k1_high) X(rs_seq_sum_k2) X(rs_seq_sum_k3)                  \
  X(rs_seq_mean_k1_low) X(rs_seq_mean_k1_high) X(rs_seq_mean_k2) X(rs_seq_mean_k3) X(rs_seq_max_k2)            \
  X(rs_seq_max_k3)
// iparams, in order.
#define RLVR_POLICY_LOSS_IPARAMS(X)                                                                \
  X(loss_type) X(kl) X(kl_clamp) X(rollout_correction) X(seq_mean) X(token_out) X(a3po_metric) X(a3po) \
  X(entropy_quantile) X(seq_adv) X(kl_ratio_correction) X(kl_score_grad) X(rs_options) X(rc_current)    \
  X(is_batch_normalize) X(is_gate) X(is_gate_seq)

#define RLVR_LOSS_TYPE_CODES(X)                                                                                \
  X(PPO, 0) X(GSPO, 1) X(CISPO, 2) X(SAPO, 3) X(REINFORCE, 4) X(DPPO_TV, 5) X(DPPO_KL, 6) X(GEO_MEAN, 7) X(DRO, 8) \
  X(CLIP_COV, 9) X(KL_COV, 10)
#define RLVR_KL_ESTIMATOR_CODES(X) X(NONE, 0) X(K1, 1) X(K2, 2) X(K3, 3) X(K3_PLUS, 4)
#define RLVR_KL_CLAMP_CODES(X) X(NONE, 0) X(K3, 1) X(ALL, 2)
#define RLVR_ROLLOUT_CORRECTION_CODES(X) \
  X(NONE, 0) X(TOKEN_TIS, 1) X(SEQ_TIS, 2) X(TOKEN_MIS, 3) X(SEQ_MIS, 4) X(DECOUPLED, 5) X(TOKEN_ICEPOP, 6) \
  X(SEQ_ICEPOP, 7) X(GATE, 8)
#define RLVR_IS_GATE_CODES(X) X(CLAMP, 0) X(RATIO, 1) X(BINARY_KL, 2) X(TV, 3)
#define RLVR_TOKEN_OUT_CODES(X) X(NONE, 0) X(LOSS, 1) X(SHAPED_ADVANTAGES, 2) X(IS_WEIGHTS, 3) X(KEEP, 4)
#define RLVR_A3PO_METRIC_CODES(X) X(PROB, 0) X(ENTROPY, 1)
// Entries of the `sums` output.
#define RLVR_POLICY_LOSS_SUM_CODES(X)                                                                           \
  X(TOTAL, 0) X(PG, 1) X(KL, 2) X(NTOK, 3) X(NSEQ, 4) X(CLIP, 5) X(CLIP_LOWER, 6) X(NEG_DELTA, 7) X(KL_RAW, 8) \
  X(IS, 9) X(IS_MAX, 10) X(REJECT, 11) X(SHAPED, 12) X(ENT, 13) X(NONFINITE, 14) X(CLIP_LOW, 15) X(CLIP_HIGH, 16) \
  X(SEQ_CLIP_LOW, 17) X(SEQ_CLIP_HIGH, 18) X(SEQ_CLIP_LOW_MIN, 19) X(SEQ_CLIP_HIGH_MAX, 20) X(NTOK_RAW, 21)      \
  X(RS_REJECT, 22) X(RS_SEQ_REJECT, 23) X(IS_NORM, 24)
// Columns of the optional seq_stats input ([B, kNumSeqStats] fp64; contracts SeqStat).
#define RLVR_SEQ_STAT_CODES(X)                                                                                 \
  X(N, 0) X(N_RAW, 1) X(DELTA, 2) X(DMIN, 3) X(ADV, 4) X(LOGW, 5) X(IS_W, 6) X(K1, 7) X(K2, 8) X(K3, 9)         \
  X(CLIP_LOW, 10) X(CLIP_HIGH, 11) X(K2_MAX, 12) X(K3_MAX, 13) X(GATE, 14)

namespace rlvr {

RLVR_DEFINE_PARAMS(PolicyLossParams, RLVR_POLICY_LOSS_FPARAMS, RLVR_POLICY_LOSS_IPARAMS)
RLVR_DEFINE_ENUM(LossType, RLVR_LOSS_TYPE_CODES)
RLVR_DEFINE_ENUM(KlEstimator, RLVR_KL_ESTIMATOR_CODES)
RLVR_DEFINE_ENUM(KlClamp, RLVR_KL_CLAMP_CODES)
RLVR_DEFINE_ENUM(RolloutCorrection, RLVR_ROLLOUT_CORRECTION_CODES)
RLVR_DEFINE_ENUM(TokenOut, RLVR_TOKEN_OUT_CODES)
RLVR_DEFINE_ENUM(IsGate, RLVR_IS_GATE_CODES)
RLVR_DEFINE_ENUM(A3poMetric, RLVR_A3PO_METRIC_CODES)
RLVR_DEFINE_ENUM(PolicyLossSum, RLVR_POLICY_LOSS_SUM_CODES)
RLVR_DEFINE_ENUM(SeqStat, RLVR_SEQ_STAT_CODES)

#define RLVR_COUNT_CODE(name, value) +1
constexpr int kNumPolicyLossSums = 0 RLVR_POLICY_LOSS_SUM_CODES(RLVR_COUNT_CODE);
constexpr int kNumSeqStats = 0 RLVR_SEQ_STAT_CODES(RLVR_COUNT_CODE);
#undef RLVR_COUNT_CODE

// (sums, grad_logprobs, grad_entropy, token_out); see rlvr_kernels/ops/policy_loss.py.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> policy_loss_fwd_cpu(
    const torch::Tensor& logprobs, const torch::Tensor& old_logprobs, const torch::Tensor& advantages,
    const c10::optional<torch::Tensor>& mask, const c10::optional<torch::Tensor>& ref_logprobs,
    const c10::optional<torch::Tensor>& rollout_logprobs, const c10::optional<torch::Tensor>& entropy,
    const c10::optional<torch::Tensor>& cu_seqlens, const c10::optional<torch::Tensor>& entropy_threshold,
    c10::ArrayRef<double> fparams, c10::ArrayRef<int64_t> iparams, bool need_entropy_grad,
    const c10::optional<torch::Tensor>& cov_selection, const c10::optional<torch::Tensor>& seq_stats);

// The backward: (coef · up).to(dtype), coef contiguous fp32/fp64, up 1-element or coef-shaped;
// the output comes from the huge-page cache (empty_output). See policy_loss.cpp.
torch::Tensor policy_loss_grad_cpu(const torch::Tensor& coef, const torch::Tensor& up, at::ScalarType dtype);

}  // namespace rlvr
