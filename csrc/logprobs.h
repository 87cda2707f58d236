#pragma once

#include <torch/types.h>

#include <tuple>

namespace rlvr {

// The kernel contract (arguments, outputs, dtypes) is the module docstring of
// rlvr_kernels/ops/logprobs.py; logprobs.cpp describes how the kernels meet it.

// (stats [N, 3], target_logits [M]).
std::tuple<torch::Tensor, torch::Tensor> linear_logprobs_fwd_cpu(
    const torch::Tensor& hidden, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
    const torch::Tensor& inv_temperature, const torch::Tensor& row_ptr, const torch::Tensor& sorted_targets,
    bool need_entropy);

// (grad_hidden, grad_weight, grad_bias); an output that is not needed is an empty [0] tensor.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> linear_logprobs_bwd_cpu(
    const torch::Tensor& hidden, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
    const torch::Tensor& inv_temperature, const torch::Tensor& row_ptr, const torch::Tensor& sorted_targets,
    const torch::Tensor& sorted_grad, const torch::Tensor& lse, const torch::Tensor& entropy,
    const c10::optional<torch::Tensor>& grad_entropy, bool need_hidden, bool need_weight, bool need_bias);

// (stats [N, 3], target_logits [N]).
std::tuple<torch::Tensor, torch::Tensor> logits_logprobs_fwd_cpu(const torch::Tensor& logits,
                                                                 const torch::Tensor& targets,
                                                                 const torch::Tensor& inv_temperature,
                                                                 bool need_entropy);

// grad_logits [N, V].
torch::Tensor logits_logprobs_bwd_cpu(const torch::Tensor& logits, const torch::Tensor& targets,
                                      const torch::Tensor& inv_temperature, const torch::Tensor& grad_logp,
                                      const torch::Tensor& lse, const torch::Tensor& entropy,
                                      const c10::optional<torch::Tensor>& grad_entropy);

}  // namespace rlvr
