// The MASK sampling support of linear_logprobs / logprobs_from_logits from an explicit CSR: the
// entry point registered as rlvr_kernels_C::support_bits (csrc/ops.cpp). The contract is the
// docstring of rlvr_kernels/ops/logprobs.py ("Sampling support").
#pragma once

#include <torch/types.h>

namespace rlvr {

// bits [N, ceil(V / 32)] int32: bit (v % 32) of word v / 32 of row n is set iff id v in [0, V) is
// among support_ids[support_offsets[n] : support_offsets[n + 1]] (offsets clamped to [0, nnz];
// a reversed range is empty). int64 ids and offsets (N + 1 of them).
torch::Tensor support_bits_cpu(const torch::Tensor& support_ids, const torch::Tensor& support_offsets,
                               int64_t vocab);

}  // namespace rlvr
