// group_advantages on the CPU: the kernel contract's C++ mirror (rlvr_kernels/contracts/advantages.py)
// and the entry point registered as rlvr_kernels_C::group_advantages (csrc/ops.cpp).
#pragma once

#include <torch/types.h>

#include <tuple>

#include "params.h"

// Scalar parameters, in the order of GroupAdvantagesParams' float and int fields.
#define RLVR_GROUP_ADVANTAGES_FPARAMS(X) X(eps) X(whiten_eps)
#define RLVR_GROUP_ADVANTAGES_IPARAMS(X)                                                                    \
  X(num_groups) X(group_size) X(num_tokens) X(baseline) X(scale) X(std_unbiased) X(eps_in_sqrt) \
      X(singleton_raw) X(passk_k) X(whiten) X(whiten_eps_in_sqrt) X(whiten_std_unbiased) X(whiten_eps_clamp)

// Branch codes: contracts.advantages.Baseline / Scale / Whiten.
#define RLVR_BASELINE_CODES(X) X(NONE, 0) X(MEAN, 1) X(RLOO, 2) X(OPO, 3) X(GPG, 4) X(PASSK, 5)
#define RLVR_SCALE_CODES(X) X(NONE, 0) X(GROUP, 1) X(BATCH, 2)
#define RLVR_WHITEN_CODES(X) X(OFF, 0) X(TOKENS, 1) X(SAMPLES, 2)
// Columns of the data-parallel partials: contracts.advantages.PartialColumn.
#define RLVR_PARTIAL_COLUMN_CODES(X) \
  X(N, 0) X(FIRST, 1) X(S, 2) X(S2, 3) X(DIFFERS, 4) X(WX, 5) X(W, 6) X(INCORRECT, 7) X(NONZERO, 8)

namespace rlvr {

RLVR_DEFINE_PARAMS(GroupAdvantagesParams, RLVR_GROUP_ADVANTAGES_FPARAMS, RLVR_GROUP_ADVANTAGES_IPARAMS)
RLVR_DEFINE_ENUM(Baseline, RLVR_BASELINE_CODES)
RLVR_DEFINE_ENUM(Scale, RLVR_SCALE_CODES)
RLVR_DEFINE_ENUM(Whiten, RLVR_WHITEN_CODES)
RLVR_DEFINE_ENUM(PartialColumn, RLVR_PARTIAL_COLUMN_CODES)
constexpr int64_t kPartialColumns = 9;

// (advantages [B], token_advantages ([B, L], [T] or [0]), group_mean [Gn], group_std [Gn],
//  group_count [Gn] int64, group_degenerate [Gn] bool, sample_keep [B] bool); see advantages.cpp.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>
group_advantages_cpu(const torch::Tensor& scores, const c10::optional<torch::Tensor>& group_index,
                     const c10::optional<torch::Tensor>& valid, const c10::optional<torch::Tensor>& lengths,
                     const c10::optional<torch::Tensor>& response_mask, const c10::optional<torch::Tensor>& cu_seqlens,
                     c10::ArrayRef<double> fparams, c10::ArrayRef<int64_t> iparams, at::ScalarType out_dtype);

// Data parallel: this rank's per-group partials [num_groups, kPartialColumns] float64, and the
// outputs of group_advantages_cpu from W ranks' partials [W, num_groups, kPartialColumns].
torch::Tensor group_partials_cpu(const torch::Tensor& scores, const c10::optional<torch::Tensor>& group_index,
                                 const c10::optional<torch::Tensor>& valid, const c10::optional<torch::Tensor>& lengths,
                                 const c10::optional<torch::Tensor>& response_mask,
                                 const c10::optional<torch::Tensor>& cu_seqlens, c10::ArrayRef<double> fparams,
                                 c10::ArrayRef<int64_t> iparams);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>
group_apply_cpu(const torch::Tensor& scores, const c10::optional<torch::Tensor>& group_index,
                const c10::optional<torch::Tensor>& valid, const c10::optional<torch::Tensor>& lengths,
                const c10::optional<torch::Tensor>& response_mask, const c10::optional<torch::Tensor>& cu_seqlens,
                const torch::Tensor& partials, c10::ArrayRef<double> fparams, c10::ArrayRef<int64_t> iparams,
                at::ScalarType out_dtype);

}  // namespace rlvr
