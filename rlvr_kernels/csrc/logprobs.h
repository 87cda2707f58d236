// linear_logprobs / logprobs_from_logits on the CPU: the kernel contract's C++ mirror
// (rlvr_kernels/contracts/logprobs.py) and the entry points registered as rlvr_kernels_C::<name>
// (csrc/ops.cpp). The contract itself (arguments, outputs, dtypes) is the module docstring of
// rlvr_kernels/ops/logprobs.py; logprobs.cpp describes how the kernels meet it.
#pragma once

#include <torch/types.h>

#include <tuple>

#include "params.h"

// Scalar parameters, in the order of the dataclasses' float and int fields.
// LogprobsStatsParams: logprobs_from_logits_stats.
#define RLVR_LOGPROBS_STATS_FPARAMS(X)
#define RLVR_LOGPROBS_STATS_IPARAMS(X) X(need_entropy) X(support_mode)
// LogprobsBwdParams: logprobs_from_logits_bwd.
#define RLVR_LOGPROBS_BWD_FPARAMS(X)
#define RLVR_LOGPROBS_BWD_IPARAMS(X) X(support_mode)
// LinearLogprobsStatsParams: linear_logprobs_stats (tanh_scale = 0: no soft-cap).
#define RLVR_LINEAR_LOGPROBS_STATS_FPARAMS(X) X(tanh_scale)
#define RLVR_LINEAR_LOGPROBS_STATS_IPARAMS(X) \
  X(need_entropy) X(need_sum_sq) X(need_sum_z) X(need_argmax) X(logits_precision) X(support_mode)
// LinearLogprobsBwdParams: linear_logprobs_bwd.
#define RLVR_LINEAR_LOGPROBS_BWD_FPARAMS(X) X(tanh_scale)
#define RLVR_LINEAR_LOGPROBS_BWD_IPARAMS(X) \
  X(need_hidden) X(need_weight) X(need_bias) X(logits_precision) X(support_mode)
// LinearLogprobsThresholdParams: linear_logprobs_threshold.
#define RLVR_LINEAR_LOGPROBS_THRESHOLD_FPARAMS(X) X(tanh_scale)
#define RLVR_LINEAR_LOGPROBS_THRESHOLD_IPARAMS(X) X(logits_precision) X(convention)
// LogprobsThresholdParams: logprobs_from_logits_threshold.
#define RLVR_LOGPROBS_THRESHOLD_FPARAMS(X)
#define RLVR_LOGPROBS_THRESHOLD_IPARAMS(X) X(convention)

// Columns of the forward kernels' stats [N, kNumStats]: contracts.logprobs.LogprobsStat.
#define RLVR_LOGPROBS_STAT_CODES(X) \
  X(MAX, 0) X(SUM_EXP, 1) X(SUM_EXP_SHIFT, 2) X(SUM_EXP_SQ, 3) X(SUM_Z, 4) X(ARGMAX, 5)
// How the linear head forms y: contracts.logprobs.LogitsPrecision.
#define RLVR_LOGITS_PRECISION_CODES(X) X(FP32, 0) X(TF32, 1) X(BF16, 2)
// Which columns the kernels keep: contracts.logprobs.SupportMode.
#define RLVR_SUPPORT_MODE_CODES(X) X(NONE, 0) X(MASK, 1) X(THRESHOLD, 2)
// Whose top-k / top-p / min-p a computed support follows: contracts.logprobs.SamplingConvention.
#define RLVR_SAMPLING_CONVENTION_CODES(X) X(VLLM, 0) X(SGLANG, 1)

namespace rlvr {

RLVR_DEFINE_PARAMS(LogprobsStatsParams, RLVR_LOGPROBS_STATS_FPARAMS, RLVR_LOGPROBS_STATS_IPARAMS)
RLVR_DEFINE_PARAMS(LinearLogprobsStatsParams, RLVR_LINEAR_LOGPROBS_STATS_FPARAMS, RLVR_LINEAR_LOGPROBS_STATS_IPARAMS)
RLVR_DEFINE_PARAMS(LinearLogprobsBwdParams, RLVR_LINEAR_LOGPROBS_BWD_FPARAMS, RLVR_LINEAR_LOGPROBS_BWD_IPARAMS)
RLVR_DEFINE_PARAMS(LogprobsBwdParams, RLVR_LOGPROBS_BWD_FPARAMS, RLVR_LOGPROBS_BWD_IPARAMS)
RLVR_DEFINE_PARAMS(LinearLogprobsThresholdParams, RLVR_LINEAR_LOGPROBS_THRESHOLD_FPARAMS,
                   RLVR_LINEAR_LOGPROBS_THRESHOLD_IPARAMS)
RLVR_DEFINE_PARAMS(LogprobsThresholdParams, RLVR_LOGPROBS_THRESHOLD_FPARAMS, RLVR_LOGPROBS_THRESHOLD_IPARAMS)
RLVR_DEFINE_ENUM(LogprobsStat, RLVR_LOGPROBS_STAT_CODES)
RLVR_DEFINE_ENUM(LogitsPrecision, RLVR_LOGITS_PRECISION_CODES)
RLVR_DEFINE_ENUM(SupportMode, RLVR_SUPPORT_MODE_CODES)
RLVR_DEFINE_ENUM(SamplingConvention, RLVR_SAMPLING_CONVENTION_CODES)
#define RLVR_LOGPROBS_STAT_COUNT(name, value) +1
constexpr int64_t kNumStats = 0 RLVR_LOGPROBS_STAT_CODES(RLVR_LOGPROBS_STAT_COUNT);
#undef RLVR_LOGPROBS_STAT_COUNT

// (stats [N, kNumStats], target_logits [M]).
std::tuple<torch::Tensor, torch::Tensor> linear_logprobs_stats_cpu(
    const torch::Tensor& hidden, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
    const torch::Tensor& inv_temperature, const torch::Tensor& row_ptr, const torch::Tensor& sorted_targets,
    const c10::optional<torch::Tensor>& support, c10::ArrayRef<double> fparams, c10::ArrayRef<int64_t> iparams);

// (grad_hidden, grad_weight, grad_bias); an output that is not needed is an empty [0] tensor.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> linear_logprobs_bwd_cpu(
    const torch::Tensor& hidden, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
    const torch::Tensor& inv_temperature, const torch::Tensor& row_ptr, const torch::Tensor& sorted_targets,
    const torch::Tensor& sorted_grad, const torch::Tensor& lse, const torch::Tensor& entropy,
    const c10::optional<torch::Tensor>& grad_entropy, const c10::optional<torch::Tensor>& support,
    c10::ArrayRef<double> fparams, c10::ArrayRef<int64_t> iparams);

// (stats [N, kNumStats], target_logits [N]).
std::tuple<torch::Tensor, torch::Tensor> logprobs_from_logits_stats_cpu(const torch::Tensor& logits,
                                                                        const torch::Tensor& targets,
                                                                        const torch::Tensor& inv_temperature,
                                                                        const c10::optional<torch::Tensor>& support,
                                                                        c10::ArrayRef<double> fparams,
                                                                        c10::ArrayRef<int64_t> iparams);

// grad_logits [N, V] (contiguous, whatever the logits' row stride).
torch::Tensor logprobs_from_logits_bwd_cpu(const torch::Tensor& logits, const torch::Tensor& targets,
                                           const torch::Tensor& inv_temperature, const torch::Tensor& grad_logp,
                                           const torch::Tensor& lse, const torch::Tensor& entropy,
                                           const c10::optional<torch::Tensor>& grad_entropy,
                                           const c10::optional<torch::Tensor>& support, c10::ArrayRef<double> fparams,
                                           c10::ArrayRef<int64_t> iparams);

// logprobs_from_logits_bwd_: the same gradient written over the logits (contiguous; support NONE or MASK).
void logprobs_from_logits_bwd_inplace_cpu(const torch::Tensor& logits, const torch::Tensor& targets,
                                          const torch::Tensor& inv_temperature, const torch::Tensor& grad_logp,
                                          const torch::Tensor& lse, const torch::Tensor& entropy,
                                          const c10::optional<torch::Tensor>& grad_entropy,
                                          const c10::optional<torch::Tensor>& support, c10::ArrayRef<double> fparams,
                                          c10::ArrayRef<int64_t> iparams);

// threshold [N] (compute dtype): the THRESHOLD support of top_k / top_p / min_p over the rows' z.
torch::Tensor linear_logprobs_threshold_cpu(const torch::Tensor& hidden, const torch::Tensor& weight,
                                            const c10::optional<torch::Tensor>& bias,
                                            const torch::Tensor& inv_temperature, const torch::Tensor& top_k,
                                            const torch::Tensor& top_p, const torch::Tensor& min_p,
                                            c10::ArrayRef<double> fparams, c10::ArrayRef<int64_t> iparams);

torch::Tensor logprobs_from_logits_threshold_cpu(const torch::Tensor& logits, const torch::Tensor& inv_temperature,
                                                 const torch::Tensor& top_k, const torch::Tensor& top_p,
                                                 const torch::Tensor& min_p, c10::ArrayRef<double> fparams,
                                                 c10::ArrayRef<int64_t> iparams);

}  // namespace rlvr
