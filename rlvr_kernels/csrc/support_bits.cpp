// The CSR -> bitmap conversion of an explicit sampling support (support_bits.h). One row per task:
// each row writes only its own words, so duplicates are or-ed without atomics and the result is the
// same whatever the thread count. O(nnz + N·V/32), no sort.
#include "support_bits.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace rlvr {

torch::Tensor support_bits_cpu(const torch::Tensor& support_ids, const torch::Tensor& support_offsets,
                               int64_t vocab) {
  constexpr const char* kOp = "support_bits";
  TORCH_CHECK(support_ids.device().is_cpu() && support_offsets.device().is_cpu(), kOp,
              ": support_ids and support_offsets must be CPU tensors");
  TORCH_CHECK(support_ids.scalar_type() == at::kLong && support_offsets.scalar_type() == at::kLong, kOp,
              ": support_ids and support_offsets must be int64, got ", support_ids.scalar_type(), " and ",
              support_offsets.scalar_type());
  TORCH_CHECK(support_ids.dim() == 1 && support_offsets.dim() == 1 && support_offsets.size(0) >= 1, kOp,
              ": expected support_ids [nnz] and support_offsets [N + 1], got ", support_ids.sizes(), " and ",
              support_offsets.sizes());
  TORCH_CHECK(vocab >= 1, kOp, ": vocab must be >= 1, got ", vocab);
  const int64_t n = support_offsets.size(0) - 1;
  const int64_t words = (vocab + 31) / 32;
  const int64_t nnz = support_ids.size(0);
  auto ids_c = support_ids.contiguous();
  auto off_c = support_offsets.contiguous();
  auto bits = torch::zeros({n, words}, support_ids.options().dtype(at::kInt));
  const int64_t* ids = ids_c.data_ptr<int64_t>();
  const int64_t* off = off_c.data_ptr<int64_t>();
  uint32_t* out = reinterpret_cast<uint32_t*>(bits.data_ptr<int32_t>());
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      // Unchecked offsets are clamped, so no id is read outside [0, nnz).
      const int64_t b = std::clamp<int64_t>(off[r], 0, nnz);
      const int64_t e = std::clamp<int64_t>(off[r + 1], 0, nnz);
      uint32_t* row = out + r * words;
      for (int64_t j = b; j < e; ++j) {
        const int64_t v = ids[j];
        if (v >= 0 && v < vocab) row[v >> 5] |= uint32_t(1) << (v & 31);
      }
    }
  });
  return bits;
}

}  // namespace rlvr
