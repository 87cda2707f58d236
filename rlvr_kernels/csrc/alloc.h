// Large CPU output buffers backed by transparent huge pages and a bounded reuse cache.
//
// Why: the ops write outputs of hundreds of MB (token advantages, per-token gradients).
// With the default allocator every call mmaps fresh memory and the first touch of each
// 4 KiB page costs a fault plus a kernel zero-fill: on the 2-core CI machine that is
// ~60 ms for 134 MB, four times the cost of the write itself. 2 MiB-aligned blocks with
// MADV_HUGEPAGE cut the faults 512-fold, and a small cache of freed blocks (what CUDA's
// caching allocator does on the GPU) removes them for the steady state of a training loop.
//
// The cache holds at most RLVR_KERNELS_CPU_CACHE_MB MiB (default 1024; 0 disables it);
// `empty_cpu_cache()` returns everything to the OS. Outputs from 64 KiB to 1 MiB are cached in
// 64 KiB steps on ordinary pages; outputs under 64 KiB use ATen's allocator.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace rlvr {

// Uninitialised tensor on the CPU; large ones come from the huge-page block cache.
torch::Tensor empty_output(at::IntArrayRef sizes, at::ScalarType dtype);

// {bytes cached, bytes in use by live tensors, cache limit, allocations served from cache}.
std::vector<int64_t> cpu_cache_stats();
void empty_cpu_cache();

}  // namespace rlvr
