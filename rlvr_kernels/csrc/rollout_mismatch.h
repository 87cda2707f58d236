// rollout_mismatch on the CPU: the kernel contract's C++ mirror (rlvr_kernels/contracts/rollout_mismatch.py)
// and the entry point registered as rlvr_kernels_C::rollout_mismatch_stats (csrc/ops.cpp).
#pragma once

#include <torch/types.h>

#include <tuple>

#include "params.h"

// Scalar parameters, in the order of RolloutMismatchParams' float and int fields (no int field).
#define RLVR_ROLLOUT_MISMATCH_FPARAMS(X) X(ratio_low) X(ratio_high) X(log_ratio_bound)
#define RLVR_ROLLOUT_MISMATCH_IPARAMS(X)

// Entries of the batch vector: contracts.rollout_mismatch.MismatchOut.
#define RLVR_MISMATCH_OUT_CODES(X)                                                                                \
  X(ABS_DIFF_MEAN, 0) X(ABS_DIFF_MAX, 1) X(K1, 2) X(K2, 3) X(K3, 4) X(RATIO_MEAN, 5) X(RATIO_MIN, 6)             \
      X(RATIO_MAX, 7) X(RATIO_FRAC_LOW, 8) X(RATIO_FRAC_HIGH, 9) X(RATIO_FRAC_OUTSIDE, 10) X(CHI2_TOKEN, 11)      \
          X(SEQ_ABS_DIFF_MEAN, 12) X(LOG_PPL_DIFF, 13) X(LOG_PPL_ABS_DIFF, 14) X(LOG_PPL_DIFF_MAX, 15)           \
              X(LOG_PPL_DIFF_MIN, 16) X(PPL_RATIO, 17) X(CHI2_SEQ, 18) X(TRAINING_PPL, 19) X(TRAINING_LOG_PPL, 20) \
                  X(ROLLOUT_PPL, 21) X(ROLLOUT_LOG_PPL, 22) X(SEQ_RATIO_MEAN, 23) X(SEQ_RATIO_MIN, 24)          \
                      X(SEQ_RATIO_MAX, 25)
// Columns of the per-sequence output: contracts.rollout_mismatch.MismatchSeq.
#define RLVR_MISMATCH_SEQ_CODES(X) X(ABS_DIFF_MEAN, 0) X(ABS_DIFF_MAX, 1) X(LOG_RATIO, 2)

namespace rlvr {

RLVR_DEFINE_PARAMS(RolloutMismatchParams, RLVR_ROLLOUT_MISMATCH_FPARAMS, RLVR_ROLLOUT_MISMATCH_IPARAMS)
RLVR_DEFINE_ENUM(MismatchOut, RLVR_MISMATCH_OUT_CODES)
RLVR_DEFINE_ENUM(MismatchSeq, RLVR_MISMATCH_SEQ_CODES)
constexpr int64_t kMismatchOut = 26;
constexpr int64_t kMismatchSeq = 3;

// (out [kMismatchOut], seq [B, kMismatchSeq], num_tokens [] int64); out and seq in float32, or
// float64 when an input is float64. See rollout_mismatch.cpp.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rollout_mismatch_stats_cpu(
    const torch::Tensor& train_logprobs, const torch::Tensor& rollout_logprobs,
    const c10::optional<torch::Tensor>& response_mask, const c10::optional<torch::Tensor>& cu_seqlens,
    c10::ArrayRef<double> fparams, c10::ArrayRef<int64_t> iparams);

}  // namespace rlvr
