// The one rule every kernel applies to `cu_seqlens` (packed layout), whatever it holds.
//
// Validation in the Python op layer rejects bad offsets, but the registered ops are reachable
// directly and `validate=False` skips the value checks, so a kernel must stay in bounds and race
// free on any input. The sanitised offsets are
//   c'[0] = clamp(cu[0], 0, T),   c'[i+1] = clamp(cu[i+1], c'[i], T),
// and sequence i covers [c'[i], c'[i+1]): always inside [0, T), in order and disjoint, so parallel
// workers that each own a sequence never write the same token. On valid offsets (cu[0] = 0,
// non-decreasing, cu[B] <= T) c' == cu. A decreasing pair is an empty sequence. The Triton launchers
// apply the same rule (rlvr_kernels._core.layout.sanitized_offsets).
#pragma once

#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace rlvr {

// cu_seqlens must be a 1-D integer tensor with B + 1 >= 1 entries (checked, naming `op`); returns
// the B + 1 sanitised offsets.
inline std::vector<int64_t> sanitized_offsets(const torch::Tensor& cu_seqlens, int64_t T, const char* op) {
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1, op,
              ": cu_seqlens must be a 1-D tensor of B + 1 >= 1 offsets, got shape ", cu_seqlens.sizes());
  TORCH_CHECK(!cu_seqlens.is_floating_point() && !cu_seqlens.is_complex(), op,
              ": cu_seqlens must hold integers, got ", cu_seqlens.scalar_type());
  const torch::Tensor cu = cu_seqlens.to(torch::kCPU, torch::kInt64).contiguous();
  const int64_t* c = cu.data_ptr<int64_t>();
  const int64_t n = cu.numel();
  std::vector<int64_t> out(n);
  int64_t prev = 0;
  for (int64_t i = 0; i < n; ++i) {
    prev = std::min(std::max(c[i], prev), T);
    out[i] = prev;
  }
  return out;
}

}  // namespace rlvr
