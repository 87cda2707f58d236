// Schemas of the C++ kernels. The public ops (namespace `rlvr_kernels`) are defined in
// Python (rlvr_kernels/ops/), validate their inputs and call these for CPU tensors.
#include <torch/extension.h>
#include <torch/library.h>

#include "advantages.h"
#include "alloc.h"

TORCH_LIBRARY(rlvr_kernels_C, m) {
  m.def(
      "group_advantages(Tensor scores, Tensor group_index, int num_groups, int group_size, Tensor? valid, Tensor? "
      "lengths, "
      "Tensor? response_mask, Tensor? cu_seqlens, int num_tokens, int baseline, int scale, bool std_unbiased, "
      "float eps, bool eps_in_sqrt, bool singleton_raw, int passk_k, int whiten, float whiten_eps, "
      "bool whiten_eps_in_sqrt, ScalarType out_dtype) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("cpu_cache_stats() -> int[]", &rlvr::cpu_cache_stats);
  m.def("empty_cpu_cache() -> ()", &rlvr::empty_cpu_cache);
}

TORCH_LIBRARY_IMPL(rlvr_kernels_C, CPU, m) { m.impl("group_advantages", &rlvr::group_advantages_cpu); }

// Importable as a Python module; the ops above register when the library loads.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
