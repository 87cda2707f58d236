#pragma once

#include <torch/types.h>

#include <tuple>

namespace rlvr {

// See advantages.cpp and rlvr_kernels/ops/advantages.py for the contract.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>
group_advantages_cpu(const torch::Tensor& scores, const torch::Tensor& group_index, int64_t num_groups,
                     int64_t group_size, const c10::optional<torch::Tensor>& valid,
                     const c10::optional<torch::Tensor>& lengths, const c10::optional<torch::Tensor>& response_mask,
                     const c10::optional<torch::Tensor>& cu_seqlens, int64_t num_tokens, int64_t baseline,
                     int64_t scale, bool std_unbiased, double eps, bool eps_in_sqrt, bool singleton_raw,
                     int64_t passk_k, int64_t whiten, double whiten_eps, bool whiten_eps_in_sqrt,
                     at::ScalarType out_dtype);

}  // namespace rlvr
