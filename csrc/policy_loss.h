#pragma once

#include <torch/types.h>

#include <tuple>

namespace rlvr {

// Indices of the kernel contract, shared with rlvr_kernels/ops/policy_loss.py (its module
// docstring is the contract: what each entry means).
namespace policy_loss_index {
// fparams
constexpr int F_CLIP_LO = 0;
constexpr int F_CLIP_HI = 1;
constexpr int F_CLIP_C = 2;
constexpr int F_LOG_RATIO_CLAMP = 3;
constexpr int F_GSPO_CLAMP = 4;
constexpr int F_TAU_POS = 5;
constexpr int F_TAU_NEG = 6;
constexpr int F_KL_COEF = 7;
constexpr int F_RC_LOW = 8;
constexpr int F_RC_HIGH = 9;
constexpr int F_ENT_COEF = 10;
constexpr int F_W_POS = 11;
constexpr int F_W_NEG = 12;
constexpr int F_PROB_LAMBDA = 13;
constexpr int F_A3PO = 14;  // 8 values: (ratio, scale) for pos-high, pos-low, neg-high, neg-low
constexpr int NUM_FPARAMS = 22;
// iparams
constexpr int I_LOSS_TYPE = 0;
constexpr int I_KL = 1;
constexpr int I_KL_CLAMP = 2;
constexpr int I_RC = 3;
constexpr int I_SEQ_MEAN = 4;
constexpr int I_TOKEN_OUT = 5;
constexpr int I_A3PO_METRIC = 6;
constexpr int I_A3PO_ON = 7;
constexpr int I_ENT_QUANTILE = 8;
constexpr int I_SEQ_ADV = 9;
constexpr int NUM_IPARAMS = 10;
// sums
constexpr int S_TOTAL = 0;
constexpr int S_PG = 1;
constexpr int S_KL = 2;
constexpr int S_NTOK = 3;
constexpr int S_NSEQ = 4;
constexpr int S_CLIP = 5;
constexpr int S_CLIP_LOWER = 6;
constexpr int S_NEG_DELTA = 7;
constexpr int S_KL_RAW = 8;
constexpr int S_IS = 9;
constexpr int S_IS_MAX = 10;
constexpr int S_REJECT = 11;
constexpr int S_SHAPED = 12;
constexpr int S_ENT = 13;
constexpr int S_NONFINITE = 14;  // valid tokens where an input the call reads is NaN or ±inf
constexpr int NUM_SUMS = 15;
}  // namespace policy_loss_index

// (sums, grad_logprobs, grad_entropy, token_out); see policy_loss.cpp and the contract.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> policy_loss_fwd_cpu(
    const torch::Tensor& logprobs, const torch::Tensor& old_logprobs, const torch::Tensor& advantages,
    const c10::optional<torch::Tensor>& mask, const c10::optional<torch::Tensor>& ref_logprobs,
    const c10::optional<torch::Tensor>& rollout_logprobs, const c10::optional<torch::Tensor>& entropy,
    const c10::optional<torch::Tensor>& cu_seqlens, const c10::optional<torch::Tensor>& entropy_threshold,
    c10::ArrayRef<double> fparams, c10::ArrayRef<int64_t> iparams, bool need_entropy_grad);

// The backward: (coef · up).to(dtype), coef contiguous fp32/fp64, up 1-element or coef-shaped;
// the output comes from the huge-page cache (empty_output). See policy_loss.cpp.
torch::Tensor policy_loss_grad_cpu(const torch::Tensor& coef, const torch::Tensor& up, at::ScalarType dtype);

}  // namespace rlvr
