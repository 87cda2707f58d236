#include "alloc.h"

#include <cstdlib>
#include <map>
#include <mutex>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace rlvr {
namespace {

constexpr size_t kHugePage = size_t(2) << 20;
// From 1 MiB, blocks are whole huge pages. Mid-sized outputs (per-group statistics, keep
// flags: 64 KiB to 1 MiB) are cached too, in 64 KiB steps on ordinary pages: between calls a
// trainer frees and allocates tens of MB, glibc trims its heap or unmaps, and each such
// output would pay its page faults again (measured: a third of group_advantages' time on
// 2^20 samples when other torch work runs between calls).
constexpr size_t kMinHugeBytes = size_t(1) << 20;
constexpr size_t kMinPooledBytes = size_t(64) << 10;
constexpr size_t kSmallStep = size_t(64) << 10;

class BlockCache {
 public:
  BlockCache() {
    const char* env = std::getenv("RLVR_KERNELS_CPU_CACHE_MB");
    long long mb = env ? std::atoll(env) : 1024;
    limit_ = mb > 0 ? size_t(mb) << 20 : 0;
  }

  void* get(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end()) {
        void* p = it->second;
        free_.erase(it);
        cached_ -= bytes;
        in_use_ += bytes;
        hits_ += 1;
        return p;
      }
    }
    const bool huge = bytes >= kMinHugeBytes;
    void* p = std::aligned_alloc(huge ? kHugePage : size_t(4096), bytes);
    TORCH_CHECK(p != nullptr, "rlvr_kernels: out of memory allocating ", bytes, " bytes");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (huge) madvise(p, bytes, MADV_HUGEPAGE);  // a hint: without THP it is a no-op
#endif
    std::lock_guard<std::mutex> lock(mu_);
    in_use_ += bytes;
    return p;
  }

  void put(void* p, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_use_ -= bytes;
      if (cached_ + bytes <= limit_) {
        free_.emplace(bytes, p);
        cached_ += bytes;
        return;
      }
    }
    std::free(p);
  }

  void clear() {
    std::multimap<size_t, void*> blocks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks.swap(free_);
      cached_ = 0;
    }
    for (auto& kv : blocks) std::free(kv.second);
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {int64_t(cached_), int64_t(in_use_), int64_t(limit_), int64_t(hits_)};
  }

 private:
  std::mutex mu_;
  std::multimap<size_t, void*> free_;
  size_t cached_ = 0, in_use_ = 0, limit_ = 0;
  int64_t hits_ = 0;
};

// Never destroyed: tensors may be freed during interpreter shutdown, after static
// destructors would have run.
BlockCache& cache() {
  static BlockCache* c = new BlockCache();
  return *c;
}

}  // namespace

torch::Tensor empty_output(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto opts = torch::TensorOptions().dtype(dtype).device(torch::kCPU);
  int64_t numel = 1;
  for (auto s : sizes) numel *= s;
  const size_t bytes = size_t(numel) * c10::elementSize(dtype);
  if (bytes < kMinPooledBytes) return torch::empty(sizes, opts);
  const size_t step = bytes >= kMinHugeBytes ? kHugePage : kSmallStep;
  const size_t rounded = (bytes + step - 1) / step * step;
  void* p = cache().get(rounded);
  return torch::from_blob(p, sizes, [rounded](void* q) { cache().put(q, rounded); }, opts);
}

std::vector<int64_t> cpu_cache_stats() { return cache().stats(); }

void empty_cpu_cache() { cache().clear(); }

}  // namespace rlvr
