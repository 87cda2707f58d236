// Log-probabilities (and entropy) of a linear head or of given logits on the CPU (docs/logprobs.md). The
// contract is the module docstring of rlvr_kernels/ops/logprobs.py: the kernels return raw
// per-row statistics (max, Σ exp(z − max), Σ exp(z − max)·(z − max)) and target logits, and
// the backward turns the global lse / entropy back into dz.
//
// Linear head, forward. The [N, V] logits never exist: work items are (token block of kFwdRows
// rows, vocabulary chunk of kChunkTiles tiles of kTile columns), spread over the threads. An item
// multiplies its hidden block by each weight tile with one BLAS call, turns the [kFwdRows, kTile]
// tile into z in place while it is in cache, and folds the tile's statistics into per-row running
// statistics; the target logits are read from the same tile. The per-chunk statistics are merged
// in chunk order at the end.
//
// Determinism and batch invariance. The tiling depends on V only, a row's statistics are merged
// in a fixed order, and every forward GEMM has the same shape [kFwdRows, tile width, H] with its
// operands at the same alignment: the hidden block is copied into an aligned per-thread buffer,
// zero-padded past the last row. The GEMMs are called from inside our own OpenMP region, where
// MKL runs on the calling thread, so a row's result does not depend on the thread count, on the
// item that carried it, on its position in the block or on the other rows. MKL does not promise
// this for a fixed shape and alignment (its CNR mode is about other things); the tests in
// tests/logprobs/test_kernel_cpu.py check it: 1 vs 2 threads, every block position, batch sizes.
//
// Linear head, backward: 3 GEMMs. Token blocks of kBwdRows rows run in order. For each, the threads
// (1) recompute z tile by tile with the forward's very GEMMs and epilogue arithmetic (so z is the
// forward's, bit for bit) and write dz into a [kBwdRows, V] workspace (grad_bias is summed
// there, per tile, rows in order), then (2) share grad_hidden[block] = dz·W (by column chunks)
// and grad_weight += dzᵀ·hidden[block] (by row chunks). Each output element has one owner and
// the blocks are accumulated in order: bitwise the same whatever the threads.
//
// bf16 / fp16 inputs are converted tile by tile to fp32 before their GEMMs (exact, so the
// results are the fp32 computation on the rounded inputs); fp64 runs the same code in double.
//
// Logits: one pass over each row in kTile segments (parallel over rows), with the same segment
// code as the linear head; the backward writes grad_logits and nothing else of size [N, V]. Rows are
// read through the logits' row stride, which may be 0 (an expanded view: every row is the same
// memory, only read); grad_logits is always a fresh contiguous [N, V].
//
// Hot loops are `Body` structs run through run_isa (csrc/simd.h); a loop that also takes run-time
// flags as template parameters (need_entropy, grad_entropy given, the optional statistics or the
// soft-cap) goes through run_isa_flagged. The optional statistics (Σ exp², Σ z, argmax) and the
// soft-cap only run in their own instantiations (kExtra / kCap): the default path is the code it
// was before they existed.
//
// Logits precision (LogitsPrecision, docs/logprobs.md): TF32 / BF16 round the GEMM operands as they are
// loaded (the hidden block and each weight tile, in their compute-dtype buffers; BF16 rounds the bias too),
// so the GEMM of exact products accumulates in fp32 as a TF32 / bf16 tensor-core GEMM does; BF16 then
// rounds each y = acc + b of the tile to bf16 in place (round_tile), before the epilogue, which then adds
// no bias. The backward recomputes z the same way; its dz·W and dzᵀ·hidden use the operands as given.
//
// Soft-cap (tanh_scale ≠ 0): z = tanh(tanh_scale·y)·inv_T with y = acc + bias, the same inlined
// functor in the forward and the backward (so the backward's z is the forward's); the backward
// multiplies the row's dz by tanh_scale·(1 − t²) after the target terms.
#include "logprobs.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>

#include "alloc.h"
#include "simd.h"

namespace rlvr {
namespace {

// Vocabulary columns per GEMM tile and per segment of the statistics: a [kFwdRows, kTile] fp32
// tile (256 KiB) stays in L2 between the GEMM and the epilogue.
constexpr int64_t kTile = 512;
// Rows per forward GEMM: every call has this many (padded) rows, the price of batch invariance
// for small N. 128 rows keep the GEMM near its peak and the padding waste small.
constexpr int64_t kFwdRows = 128;
// Tiles per forward work item: enough items to balance the threads even for one token block,
// few enough per-chunk partial statistics ([N, V / (kChunkTiles·kTile)]).
constexpr int64_t kChunkTiles = 8;
// Rows per backward block: the dz workspace is [kBwdRows, V] (32 MiB for V = 32768 in fp32);
// grad_weight is read and written once per block, so fewer, larger blocks cost less traffic.
constexpr int64_t kBwdRows = 256;
// Backward item sizes: grad_hidden columns and grad_weight rows per item.
constexpr int64_t kHidCols = 128;
constexpr int64_t kWgtRows = 512;

template <typename T>
constexpr T kInf = std::numeric_limits<T>::infinity();

// exp(x) is 0 below this in T: z − max is clamped here so that p·(z − max) is 0, not 0·(−inf),
// for −inf logits (the limit the contract means).
template <typename T>
constexpr T kExpFloor = sizeof(T) == 4 ? T(-104) : T(-800);

// ------------------------------------------------------------------ small utilities
// 64-byte aligned scratch (the GEMM operands' alignment must not vary between calls).
template <typename T>
class Scratch {
 public:
  explicit Scratch(int64_t n) {
    if (n <= 0) return;
    const size_t bytes = (size_t(n) * sizeof(T) + 63) / 64 * 64;
    p_ = static_cast<T*>(std::aligned_alloc(64, bytes));
    TORCH_CHECK(p_ != nullptr, "rlvr_kernels: out of memory allocating ", bytes, " bytes");
  }
  ~Scratch() { std::free(p_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
};

// An exception must not leave an OpenMP region: the first one is kept and rethrown after it.
class Errors {
 public:
  template <typename F>
  void run(F&& f) noexcept {
    if (failed_.load(std::memory_order_relaxed)) return;
    try {
      f();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!e_) e_ = std::current_exception();
      failed_.store(true, std::memory_order_relaxed);
    }
  }
  void rethrow() const {
    if (e_) std::rethrow_exception(e_);
  }

 private:
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  std::exception_ptr e_;
};

template <typename out_t, typename in_t>
void convert(out_t* dst, const in_t* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<out_t>(src[i]);
}

// rows × cols of src (row stride ld) as a dense T matrix: src itself when it already is T,
// else a converted copy in buf (row stride cols). Returns the matrix and its row stride.
template <typename T, typename in_t>
const T* as_compute(const in_t* src, int64_t rows, int64_t cols, int64_t ld, T* buf, int64_t& ld_out) {
  if constexpr (std::is_same<in_t, T>::value) {
    ld_out = ld;
    return src;
  } else {
    for (int64_t r = 0; r < rows; ++r) convert(buf + r * cols, src + r * ld, cols);
    ld_out = cols;
    return buf;
  }
}

// MKL's per-thread thread count, where torch's BLAS is MKL (a weak reference: null elsewhere). The
// value-taking spelling: torch's static MKL exports mkl_set_num_threads_local as the Fortran entry,
// which takes a pointer.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

// One thread for the MKL calls of the calling thread while in scope (the previous setting after).
// Inside an active parallel region MKL runs sequentially anyway, but the kernel it picks can still
// depend on its global thread count (seen on Intel Xeons: a [256, 64] × K = 5000 product summed in
// another order with 2 threads than with 1); with the local count at 1 it is the same whatever the
// threads of the region.
struct OneBlasThread {
  int before = 0;
  OneBlasThread() {
    if (MKL_Set_Num_Threads_Local != nullptr) before = MKL_Set_Num_Threads_Local(1);
  }
  ~OneBlasThread() {
    if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(before);
  }
};

// C [m, n] (row stride ldc) = A·B, or C += A·B. A is [m, k] (row stride lda), or stored as
// [k, m] when a_t; B is [k, n], or stored as [n, k] when b_t. Through ATen, so through the
// BLAS torch was built with (MKL on x86-64); called from inside our parallel regions, it runs
// on the calling thread, with one MKL thread (OneBlasThread).
template <typename T>
void gemm(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, bool a_t, const T* b, int64_t ldb, bool b_t, T* c,
          int64_t ldc, bool accumulate) {
  const OneBlasThread one;
  const auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value).device(at::kCPU);
  auto view = [&](const T* p, int64_t rows, int64_t cols, int64_t ld, bool t) {
    const std::array<int64_t, 2> strides = t ? std::array<int64_t, 2>{1, ld} : std::array<int64_t, 2>{ld, 1};
    return at::from_blob(const_cast<T*>(p), {rows, cols}, strides, opts);
  };
  at::Tensor C = view(c, m, n, ldc, false);
  if (accumulate) {
    at::addmm_out(C, C, view(a, m, k, lda, a_t), view(b, k, n, ldb, b_t));
  } else {
    at::mm_out(C, view(a, m, k, lda, a_t), view(b, k, n, ldb, b_t));
  }
}

// Threads of our regions. A region is opened with all of them even when there are fewer work
// items: outside an active region MKL would use its own threads, and the GEMM's result could
// then depend on their number.
int region_threads() { return std::max(1, at::get_num_threads()); }

// ------------------------------------------------------------------ logits precision
// x to the nearest bf16 (ties to even, c10's conversion) and to the nearest tf32 (10-bit mantissa, ties
// away from zero: cvt.rna.tf32.f32, CUTLASS's round_half_ulp_truncate; ±inf and NaN kept), as floats.
inline float round_bf16(float x) { return static_cast<float>(c10::BFloat16(x)); }

inline float round_tf32(float x) {
  if (!std::isfinite(x)) return x;
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  b = (b + 0x1000u) & 0xFFFFE000u;  // sign-magnitude: the carry rounds |x| up
  std::memcpy(&x, &b, sizeof(b));
  return x;
}

// p[0, n) rounded in place as a GEMM operand of `prec` (double through float, as the reference).
template <typename T>
void round_operands(T* p, int64_t n, LogitsPrecision prec) {
  if (prec == LogitsPrecision::BF16) {
    for (int64_t i = 0; i < n; ++i) p[i] = T(round_bf16(float(p[i])));
  } else if (prec == LogitsPrecision::TF32) {
    for (int64_t i = 0; i < n; ++i) p[i] = T(round_tf32(float(p[i])));
  }
}

// ------------------------------------------------------------------ targets
// Row n's targets are the entries [begin(n), end(n)) of ids. For the CSR the pointer is
// sanitised: clamped into [0, M] and made non-decreasing (a decreasing pair is an empty row),
// so rows never overlap (one writer per entry) and no range leaves ids. Without a pointer, row n
// has the single entry n (the logits kernels). An id is only used as a column after the test
// that it is in the segment, a part of [0, V).
struct Targets {
  const int64_t* ptr;
  const int64_t* ids;

  int64_t begin(int64_t n) const { return ptr != nullptr ? ptr[n] : n; }
  int64_t end(int64_t n) const { return ptr != nullptr ? ptr[n + 1] : n + 1; }

  // f(k, column − c0) for the entries k of row n whose id is in [c0, c1).
  template <typename F>
  RLVR_INLINE void each_in(int64_t n, int64_t c0, int64_t c1, F&& f) const {
    for (int64_t k = begin(n), e = end(n); k < e; ++k) {
      const int64_t t = ids[k];
      if (t >= c0 && t < c1) f(k, t - c0);
    }
  }
};

std::vector<int64_t> sanitize_row_ptr(const int64_t* row_ptr, int64_t N, int64_t M) {
  std::vector<int64_t> out(N + 1);
  int64_t lo = 0;
  for (int64_t n = 0; n <= N; ++n) {
    lo = std::max(lo, std::min(std::max<int64_t>(row_ptr[n], 0), M));
    out[n] = lo;
  }
  return out;
}

// v (a vector or a float) as a value in a register: the compiler cannot fuse the multiply that
// made it into a following add (GCC contracts to FMA by default, and an FMA would use the
// unrounded product).
template <typename V>
RLVR_INLINE V rounded(V v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#else
  asm("" : "+m"(v));
#endif
  return v;
}

// run_isa for a Body whose hot loop takes a run-time flag as a template parameter: Body has
// `using Arg`, `static bool flag(const Arg&)` and `template <int VB, bool kFlag> static void
// body(const Arg&)`. Both instantiations are inlined into each ISA's entry point.
template <typename Body>
struct WithFlag {
  using Arg = typename Body::Arg;
  template <int VB>
  RLVR_INLINE static void run(const Arg& a) {
    if (Body::flag(a)) {
      Body::template body<VB, true>(a);
    } else {
      Body::template body<VB, false>(a);
    }
  }
};

template <typename Body>
void run_isa_flagged(const typename Body::Arg& a) {
  run_isa<WithFlag<Body>>(a);
}

// The same with two flags: Body has `static bool flag(const Arg&)`, `static bool flag2(const Arg&)` and
// `template <int VB, bool kFlag, bool kFlag2> static void body(const Arg&)`.
template <typename Body>
struct WithFlags2 {
  using Arg = typename Body::Arg;
  template <int VB>
  RLVR_INLINE static void run(const Arg& a) {
    const bool f1 = Body::flag(a), f2 = Body::flag2(a);
    if (f2) {
      if (f1) {
        Body::template body<VB, true, true>(a);
      } else {
        Body::template body<VB, false, true>(a);
      }
    } else if (f1) {
      Body::template body<VB, true, false>(a);
    } else {
      Body::template body<VB, false, false>(a);
    }
  }
};

template <typename Body>
void run_isa_flagged2(const typename Body::Arg& a) {
  run_isa<WithFlags2<Body>>(a);
}

// tanh on vector lanes. Float: tanh|x| = (1 − e)/(1 + e) with e = exp(−2|x|) (absolute error of a
// few ulp of 1, exact limits ±1), and the odd Taylor series through x⁹ below |x| = 1/8, where the
// quotient would lose relative accuracy (the series' remainder is below 1e-11 relative there).
// Double lanes (checks rather than speed): libm.
template <typename V>
RLVR_INLINE V vtanh(V x) {
  using S = std::remove_reference_t<decltype(x[0])>;
  if constexpr (std::is_same<S, double>::value) {
    for (int l = 0; l < int(sizeof(V) / sizeof(double)); ++l) x[l] = std::tanh(x[l]);
    return x;
  } else {
    const V zero = splat<V>(0.0f), one = splat<V>(1.0f);
    const V ax = x < zero ? -x : x;
    const V e = vexp(ax * -2.0f);
    const V q = (one - e) / (one + e);
    const V x2 = x * x;
    V p = x2 * (62.0f / 2835.0f) - 17.0f / 315.0f;
    p = p * x2 + 2.0f / 15.0f;
    p = p * x2 - 1.0f / 3.0f;
    const V small = x + x * x2 * p;
    const V big = x < zero ? -q : q;
    return ax < splat<V>(0.125f) ? small : big;
  }
}

// ------------------------------------------------------------------ row statistics
// (max, Σ exp(z − max), Σ exp(z − max)·(z − max)) of a part of a row; max = −inf: empty.
template <typename T>
struct Stats {
  T m = -kInf<T>, s = T(0), e = T(0);

  // Folds in another part of the row (rescaling both to the common max).
  RLVR_INLINE void merge(const Stats& o) {
    if (o.m == -kInf<T>) return;
    if (m == -kInf<T>) {
      *this = o;
      return;
    }
    const T mx = max_nan(m, o.m), d1 = m - mx, d2 = o.m - mx;
    const T a1 = std::exp(d1), a2 = std::exp(d2);
    e = a1 * (e + s * d1) + a2 * (o.e + o.s * d2);
    s = a1 * s + a2 * o.s;
    m = mx;
  }

  // Row n of the stats output [N, kNumStats] (columns: LogprobsStat); the entropy column is 0
  // unless it was computed, the optional columns are 0 (StatsX::store fills them when asked).
  RLVR_INLINE void store(T* stats, int64_t n, bool entropy) const {
    T* row = stats + n * kNumStats;
    row[int64_t(LogprobsStat::MAX)] = m;
    row[int64_t(LogprobsStat::SUM_EXP)] = s;
    row[int64_t(LogprobsStat::SUM_EXP_SHIFT)] = entropy ? e : T(0);
    row[int64_t(LogprobsStat::SUM_EXP_SQ)] = T(0);
    row[int64_t(LogprobsStat::SUM_Z)] = T(0);
    row[int64_t(LogprobsStat::ARGMAX)] = T(0);
  }
};

// The optional statistics of a part of a row, beside its Stats (kept apart, so the default path's
// Stats code and its rounding are exactly what they were before these existed): q = Σ exp(2·(z −
// max)), zs = Σ z, am = the first column holding the max (a column index, as a T).
template <typename T>
struct StatsX {
  T q = T(0), zs = T(0), am = T(0);

  // Folds in another part o (later columns; ox its optional statistics); mine and o are the two
  // parts' Stats *before* Stats::merge combines them. A tie of the maxima keeps this part's argmax.
  RLVR_INLINE void merge(const Stats<T>& mine, const Stats<T>& o, const StatsX& ox) {
    zs += ox.zs;
    if (o.m == -kInf<T>) return;
    if (mine.m == -kInf<T>) {
      q = ox.q;
      am = ox.am;
      return;
    }
    const T mx = max_nan(mine.m, o.m);
    const T a1 = std::exp(mine.m - mx), a2 = std::exp(o.m - mx);
    q = a1 * a1 * q + a2 * a2 * ox.q;
    if (o.m > mine.m) am = ox.am;
  }

  RLVR_INLINE void store(T* stats, int64_t n) const {
    T* row = stats + n * kNumStats;
    row[int64_t(LogprobsStat::SUM_EXP_SQ)] = q;
    row[int64_t(LogprobsStat::SUM_Z)] = zs;
    row[int64_t(LogprobsStat::ARGMAX)] = am;
  }
};

// Which optional statistics the linear forward computes.
struct StatFlags {
  bool sum_sq, sum_z, argmax;
  bool any() const { return sum_sq || sum_z || argmax; }
};

// z lanes of a GEMM tile row: (acc + bias)·inv_T.
template <typename T, int VB>
struct LinearZ {
  const T* acc;
  const T* bias;  // nullptr: none
  T inv_t;
  RLVR_INLINE typename Lanes<T, VB>::V operator()(int64_t i, int n) const {
    auto x = load<T, VB>(acc + i, n);
    if (bias != nullptr) x += load<T, VB>(bias + i, n);
    return x * inv_t;
  }
};

// z lanes of a soft-capped GEMM tile row: tanh(a·(acc + bias))·inv_T.
template <typename T, int VB>
struct LinearZCap {
  const T* acc;
  const T* bias;  // nullptr: none
  T inv_t, a;
  RLVR_INLINE typename Lanes<T, VB>::V operator()(int64_t i, int n) const {
    auto x = load<T, VB>(acc + i, n);
    if (bias != nullptr) x += load<T, VB>(bias + i, n);
    return vtanh(rounded(x * a)) * inv_t;
  }
};

// z lanes of a logits row: logits·inv_T.
template <typename T, int VB, typename in_t>
struct LogitsZ {
  const in_t* x;
  T inv_t;
  RLVR_INLINE typename Lanes<T, VB>::V operator()(int64_t i, int n) const { return load<T, VB>(x + i, n) * inv_t; }
};

// ------------------------------------------------------------------ sampling support
// The columns a call keeps (SupportMode, the contract in ops/logprobs.py): a bitmap [N, words] (MASK) or
// a per-row threshold on z (THRESHOLD).
template <typename T>
struct Support {
  SupportMode mode = SupportMode::NONE;
  const int32_t* mask = nullptr;  // MASK: [N, words]
  int64_t words = 0;
  const T* thr = nullptr;  // THRESHOLD: [N]
};

// The kernels' bitmap words are read 32 columns at a time: a segment starts at a multiple of 32 and its
// lanes (W of them, W dividing 32) never straddle two words.
static_assert(kTile % 32 == 0, "a segment starts on a bitmap word");

// zof with the columns row n does not keep set to −inf (kMode MASK or THRESHOLD): the statistics, the
// target logits and dz then see the contract's "a column not kept counts as z = −inf" with no other
// change to their code, and a support that keeps every column gives the NONE path's bits.
template <typename T, int VB, SupportMode kMode, typename ZOf>
struct KeptZ {
  using L = Lanes<T, VB>;
  ZOf zof;
  const int32_t* bits;  // MASK: the row's words
  int64_t c0;           // MASK: the column of lane 0 at i = 0 (a multiple of 32)
  T thr;                // THRESHOLD

  RLVR_INLINE typename L::V operator()(int64_t i, int n) const {
    const typename L::V z = zof(i, n);
    return keep(i, z) ? z : splat<typename L::V>(-kInf<T>);
  }
  // i: a multiple of W, so the lanes' bits are bits (c0 + i) % 32 + [0, W) of one word.
  RLVR_INLINE typename L::M keep(int64_t i, typename L::V z) const {
    if constexpr (kMode == SupportMode::MASK) {
      const int64_t col = c0 + i;
      const auto w = splat<typename L::U>(uint32_t(bits[col >> 5]) >> uint32_t(col & 31));
      typename L::U lane;
      for (int l = 0; l < L::W; ++l) lane[l] = l;
      return (typename L::M)(((w >> lane) & 1) != 0);
    } else {
      return z >= splat<typename L::V>(thr);
    }
  }
  // Whether column c0 + j is kept (any j: a scalar test, for the target terms).
  RLVR_INLINE bool keep_at(int64_t j) const {
    if constexpr (kMode == SupportMode::MASK) {
      const int64_t col = c0 + j;
      return ((uint32_t(bits[col >> 5]) >> uint32_t(col & 31)) & 1u) != 0;
    } else {
      return zof(j, 1)[0] >= thr;
    }
  }
};

// zof as row n keeps it, for a segment starting at column c0: zof itself for NONE (the default path's
// code, unchanged).
template <SupportMode kMode, typename T, int VB, typename ZOf>
RLVR_INLINE auto kept_z(const ZOf& zof, const Support<T>& s, int64_t n, int64_t c0) {
  if constexpr (kMode == SupportMode::NONE) {
    return zof;
  } else if constexpr (kMode == SupportMode::MASK) {
    return KeptZ<T, VB, kMode, ZOf>{zof, s.mask + n * s.words, c0, T(0)};
  } else {
    return KeptZ<T, VB, kMode, ZOf>{zof, nullptr, c0, s.thr[n]};
  }
}

// f(ModeTag<kMode>{}) for the run-time mode: the mode is a template parameter of the hot loops, chosen
// once per call of their body.
template <SupportMode kMode>
using ModeTag = std::integral_constant<SupportMode, kMode>;

template <typename F>
RLVR_INLINE void with_mode(SupportMode mode, F&& f) {
  switch (mode) {
    case SupportMode::MASK:
      f(ModeTag<SupportMode::MASK>{});
      break;
    case SupportMode::THRESHOLD:
      f(ModeTag<SupportMode::THRESHOLD>{});
      break;
    default:
      f(ModeTag<SupportMode::NONE>{});
  }
}

// Statistics of one row segment of n columns, relative to the segment's max. z is written to
// dst (the caller reads the target logits back from there, so they are the very values the
// statistics saw); dst may be the memory zof reads.
template <typename T, int VB, bool kEntropy, typename ZOf>
RLVR_INLINE Stats<T> segment_stats(T* dst, int64_t n, const ZOf& zof) {
  using L = Lanes<T, VB>;
  using V = typename L::V;
  constexpr int W = L::W;
  const V ninf = splat<V>(-kInf<T>);
  V vm = ninf;
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const V z = zof(i, W);
    std::memcpy(dst + i, &z, sizeof(z));
    vm = vmax_nan(vm, z);
  }
  const int tail = int(n - i);
  if (tail > 0) {
    const V z = zof(i, tail);
    store(dst + i, z, tail);
    vm = vmax_nan(vm, lanes_below<T, VB>(tail) ? z : ninf);
  }
  Stats<T> st;
  for (int l = 0; l < W; ++l) st.m = max_nan(st.m, vm[l]);
  if (st.m == -kInf<T>) return st;  // all −inf: adds nothing

  const V mx = splat<V>(st.m), floor = splat<V>(kExpFloor<T>);
  V vs = V{}, ve = V{};
  for (i = 0; i + W <= n; i += W) {
    V d;
    std::memcpy(&d, dst + i, sizeof(d));
    d = vclamp(d - mx, floor, splat<V>(T(0)));
    const V ex = vexp(d);
    vs += ex;
    if constexpr (kEntropy) ve += ex * d;
  }
  if (tail > 0) {
    const V d = vclamp(load<T, VB>(dst + i, tail) - mx, floor, splat<V>(T(0)));
    const V ex = lanes_below<T, VB>(tail) ? vexp(d) : V{};
    vs += ex;
    if constexpr (kEntropy) ve += ex * d;
  }
  for (int l = 0; l < W; ++l) {
    st.s += vs[l];
    st.e += ve[l];
  }
  return st;
}

// segment_stats plus the optional statistics of the segment (StatFlags), from the z it wrote to
// dst: Σ exp(2·(z − max)), Σ z and the first column holding the max (local to the segment). Extra
// passes over the segment while it is in cache; only the kExtra instantiations call this. With a support
// (kSupport) Σ z is over the kept columns: those that zof did not set to −inf.
template <typename T, int VB, bool kEntropy, bool kSupport, typename ZOf>
RLVR_INLINE Stats<T> segment_stats_extra(T* dst, int64_t n, const ZOf& zof, const StatFlags& f, StatsX<T>& sx) {
  using L = Lanes<T, VB>;
  using V = typename L::V;
  constexpr int W = L::W;
  const Stats<T> st = segment_stats<T, VB, kEntropy>(dst, n, zof);
  sx = StatsX<T>{};
  if (f.sum_z) {
    T zs = T(0);
    for (int64_t i = 0; i < n; ++i) {
      if (!kSupport || dst[i] != -kInf<T>) zs += dst[i];
    }
    sx.zs = zs;
  }
  if (st.m == -kInf<T>) return st;  // all −inf: no mass, argmax 0
  if (f.sum_sq) {
    const V mx = splat<V>(st.m), floor = splat<V>(kExpFloor<T>);
    V vq = V{};
    for (int64_t i = 0; i < n; i += W) {
      const int cnt = int(std::min<int64_t>(W, n - i));
      const V d = vclamp(load<T, VB>(dst + i, cnt) - mx, floor, splat<V>(T(0)));
      const V ex = lanes_below<T, VB>(cnt) ? vexp(d) : V{};
      vq += ex * ex;
    }
    for (int l = 0; l < W; ++l) sx.q += vq[l];
  }
  if (f.argmax) {
    for (int64_t i = 0; i < n; ++i) {
      if (dst[i] == st.m) {
        sx.am = T(i);
        break;
      }
    }
  }
  return st;
}

// What dz of one row needs: dz = inv_T·(Σ_{t_k = v} g_k − G·p − h·p·(z − lse + entropy)).
template <typename T>
struct RowGrad {
  T inv_t, lse, ent, G, h;
};

// dz of one row segment (without the target terms), written to dst (may be what zof reads). With a
// support (kSupport: zof sets the columns not kept to −inf) those get dz = 0, selected: an empty row's
// lse = −inf makes z − lse NaN there.
template <typename T, int VB, bool kEntGrad, bool kSupport = false, typename ZOf>
RLVR_INLINE void segment_dz(T* dst, int64_t n, const ZOf& zof, const RowGrad<T>& r) {
  using L = Lanes<T, VB>;
  using V = typename L::V;
  constexpr int W = L::W;
  const V lse = splat<V>(r.lse), ent = splat<V>(r.ent), G = splat<V>(r.G), h = splat<V>(r.h);
  const V neg_inv_t = splat<V>(-r.inv_t), floor = splat<V>(kExpFloor<T>), big = splat<V>(kInf<T>);
  for (int64_t i = 0; i < n; i += W) {
    const int cnt = int(std::min<int64_t>(W, n - i));
    // z exactly as the forward rounded it; −inf logits get p = 0 and a finite factor.
    const V z = rounded(zof(i, cnt));
    const V zl = vclamp(z - lse, floor, big);
    const V p = vexp(zl);
    V coef = G;
    if constexpr (kEntGrad) coef += h * (zl + ent);
    if constexpr (kSupport) {
      store(dst + i, z == splat<V>(-kInf<T>) ? V{} : (neg_inv_t * p) * coef, cnt);
    } else {
      store(dst + i, (neg_inv_t * p) * coef, cnt);
    }
  }
}

// The target terms of a segment: dst[t − c0] += inv_T·g_k, the product rounded as in −inv_T·p·G,
// so that a row whose one target has p = 1 gets dz = 0 exactly.
template <typename T>
RLVR_INLINE void add_targets(T* dst, const Targets& tg, int64_t n, int64_t c0, int64_t c1, T inv_t, const T* g) {
  tg.each_in(n, c0, c1, [&](int64_t k, int64_t j) { dst[j] += rounded(inv_t * g[k]); });
}

// add_targets for a support: only the kept columns get their targets' terms (a column not kept has dz = 0
// whatever g the op passes; zof is the segment's KeptZ).
template <typename T, SupportMode kMode, typename ZOf>
RLVR_INLINE void add_kept_targets(T* dst, const Targets& tg, int64_t n, int64_t c0, int64_t c1, T inv_t, const T* g,
                                  const ZOf& zof) {
  if constexpr (kMode == SupportMode::NONE) {
    add_targets(dst, tg, n, c0, c1, inv_t, g);
  } else {
    // (always inlined: keep_at forms a vector of the caller's ISA, which a lambda compiled on
    // its own, as at -O1, could not hold)
    tg.each_in(n, c0, c1, [&](int64_t k, int64_t j) __attribute__((always_inline)) {
      if (zof.keep_at(j)) dst[j] += rounded(inv_t * g[k]);
    });
  }
}

// The soft-cap's chain factor: dst[i] *= a·(1 − t²), t = tanh(a·(acc + bias)) as the forward made it.
template <typename T, int VB>
RLVR_INLINE void cap_factor(T* dst, int64_t n, const T* acc, const T* bias, T a) {
  using V = typename Lanes<T, VB>::V;
  constexpr int W = Lanes<T, VB>::W;
  const V va = splat<V>(a), one = splat<V>(T(1));
  for (int64_t i = 0; i < n; i += W) {
    const int cnt = int(std::min<int64_t>(W, n - i));
    V x = load<T, VB>(acc + i, cnt);
    if (bias != nullptr) x += load<T, VB>(bias + i, cnt);
    const V t = vtanh(rounded(x * va));
    store(dst + i, load<T, VB>(dst + i, cnt) * (va * (one - t * t)), cnt);
  }
}

// acc[0, n) += Σ_r src[r·ld + (0, n)], rows in order.
template <typename T, int VB>
RLVR_INLINE void add_rows(T* acc, const T* src, int64_t ld, int64_t rows, int64_t n) {
  using V = typename Lanes<T, VB>::V;
  constexpr int W = Lanes<T, VB>::W;
  for (int64_t i = 0; i < n; i += W) {
    const int cnt = int(std::min<int64_t>(W, n - i));
    V a = load<T, VB>(acc + i, cnt);
    for (int64_t r = 0; r < rows; ++r) a += load<T, VB>(src + r * ld + i, cnt);
    store(acc + i, a, cnt);
  }
}

// ------------------------------------------------------------------ linear head
// The hidden rows [row0, row0 + rows) in the compute dtype, zero-padded to kFwdRows rows.
template <typename T, typename in_t>
void load_rows(T* dst, const in_t* hidden, int64_t row0, int64_t rows, int64_t H) {
  for (int64_t r = 0; r < rows; ++r) convert(dst + r * H, hidden + (row0 + r) * H, H);
  std::fill(dst + rows * H, dst + kFwdRows * H, T(0));
}

// The [kFwdRows, w] accumulators hidden·Wᵀ of one tile, hrows and tile 64-byte aligned. The one
// GEMM both passes use: the backward recomputes bit for bit the forward's z, which a peaked row
// needs (lse = z_t there, and a 1-ulp change of z_t − lse is all of 1 − p_t).
template <typename T>
void tile_gemm(const T* hrows, const T* wt, int64_t ldw, int64_t w, int64_t H, T* tile) {
  gemm<T>(kFwdRows, w, H, hrows, H, false, wt, ldw, true, tile, kTile, false);
}

template <typename T, typename in_t>
struct Linear {
  const in_t *hidden, *weight;
  const T* bias;  // compute dtype; nullptr: none
  const T* inv_t;
  Targets tg;
  int64_t N, H, V;
  T tanh_scale;  // 0: no soft-cap
  LogitsPrecision prec;
  Support<T> sup;
  // The bias the epilogues add: none with BF16, where round_tile has added it before rounding y.
  const T* epilogue_bias(int64_t c0) const {
    return bias != nullptr && prec != LogitsPrecision::BF16 ? bias + c0 : nullptr;
  }
  // forward
  bool need_entropy;
  StatFlags extra;
  T* target_logits;
  // backward
  const T *g, *lse, *ent, *h;  // h: nullptr without grad_entropy
  const T* G;                  // Σ of each row's g

  RowGrad<T> row_grad(int64_t n) const { return {inv_t[n], lse[n], ent[n], G[n], h != nullptr ? h[n] : T(0)}; }
};

// The GEMM operands of one weight tile (rows [c0, c0 + w)) in the compute dtype: the weight itself
// (fp32 / fp64 inputs at FP32), else a converted, rounded copy in wbuf.
template <typename T, typename in_t>
const T* weight_tile(const Linear<T, in_t>& c, int64_t c0, int64_t w, T* wbuf, int64_t& ldw) {
  const in_t* src = c.weight + c0 * c.H;
  if (c.prec == LogitsPrecision::FP32) return as_compute(src, w, c.H, c.H, wbuf, ldw);
  for (int64_t r = 0; r < w; ++r) convert(wbuf + r * c.H, src + r * c.H, c.H);
  round_operands(wbuf, w * c.H, c.prec);
  ldw = c.H;
  return wbuf;
}

// BF16: y = bf16(acc + b) in place for the tile's rows (the bias already rounded; the epilogues then add
// none). The padded rows past `rows` are left alone (never read).
template <typename T, typename in_t>
void round_tile(const Linear<T, in_t>& c, T* tile, int64_t rows, int64_t c0, int64_t w) {
  if (c.prec != LogitsPrecision::BF16) return;
  const T* b = c.bias != nullptr ? c.bias + c0 : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    T* y = tile + r * kTile;
    for (int64_t j = 0; j < w; ++j) y[j] = T(round_bf16(float(b != nullptr ? y[j] + b[j] : y[j])));
  }
}

template <typename T, typename in_t>
struct LinearFwdTileArg {
  const Linear<T, in_t>* c;
  T* tile;  // [kFwdRows, kTile]
  int64_t row0, rows, c0, w;
  Stats<T>* run;    // per row of the block
  StatsX<T>* runx;  // per row of the block, with optional statistics (else unused)
};

// Forward epilogue of one GEMM tile: z in place, the rows' running statistics, target logits (kMode:
// the support's, c.sup.mode).
template <typename T, typename in_t, SupportMode kMode>
struct LinearFwdTile {
  using Arg = LinearFwdTileArg<T, in_t>;
  static constexpr bool kSupport = kMode != SupportMode::NONE;

  static bool flag(const Arg& a) { return a.c->need_entropy; }
  // The optional statistics or the soft-cap.
  static bool flag2(const Arg& a) { return a.c->extra.any() || a.c->tanh_scale != T(0); }

  template <int VB, bool kEntropy, bool kExtra>
  RLVR_INLINE static void body(const Arg& a) {
    const Linear<T, in_t>& c = *a.c;
    const T* bias = c.epilogue_bias(a.c0);
    for (int64_t r = 0; r < a.rows; ++r) {
      const int64_t n = a.row0 + r;
      T* z = a.tile + r * kTile;
      if constexpr (!kExtra) {
        const auto zof = kept_z<kMode, T, VB>(LinearZ<T, VB>{z, bias, c.inv_t[n]}, c.sup, n, a.c0);
        a.run[r].merge(segment_stats<T, VB, kEntropy>(z, a.w, zof));
      } else {
        Stats<T> st;
        StatsX<T> sx;
        if (c.tanh_scale != T(0)) {
          const auto zof = kept_z<kMode, T, VB>(LinearZCap<T, VB>{z, bias, c.inv_t[n], c.tanh_scale}, c.sup, n, a.c0);
          st = segment_stats_extra<T, VB, kEntropy, kSupport>(z, a.w, zof, c.extra, sx);
        } else {
          const auto zof = kept_z<kMode, T, VB>(LinearZ<T, VB>{z, bias, c.inv_t[n]}, c.sup, n, a.c0);
          st = segment_stats_extra<T, VB, kEntropy, kSupport>(z, a.w, zof, c.extra, sx);
        }
        sx.am += T(a.c0);
        a.runx[r].merge(a.run[r], st, sx);
        a.run[r].merge(st);
      }
      c.tg.each_in(n, a.c0, a.c0 + a.w, [&](int64_t k, int64_t j) { c.target_logits[k] = z[j]; });
    }
  }
};

// Backward epilogue of one GEMM tile: dz of its rows into the workspace, then (after the last
// sub-block of the token block) grad_bias over all the block's rows, in order.
template <typename T, typename in_t>
struct LinearBwdTileArg {
  const Linear<T, in_t>* c;
  const T* tile;  // [kFwdRows, kTile]
  T* dz;          // the tile's first row in the workspace [block rows, V]
  int64_t row0, rows, c0, w;
  T* db;              // grad_bias accumulator [V]; nullptr: not now
  const T* dz_block;  // the workspace and its rows, for grad_bias
  int64_t block_rows;
};

template <typename T, typename in_t, SupportMode kMode>
struct LinearBwdTile {
  using Arg = LinearBwdTileArg<T, in_t>;
  static constexpr bool kSupport = kMode != SupportMode::NONE;

  static bool flag(const Arg& a) { return a.c->h != nullptr; }
  static bool flag2(const Arg& a) { return a.c->tanh_scale != T(0); }

  template <int VB, bool kEntGrad, bool kCap>
  RLVR_INLINE static void body(const Arg& a) {
    const Linear<T, in_t>& c = *a.c;
    const T* bias = c.epilogue_bias(a.c0);
    for (int64_t r = 0; r < a.rows; ++r) {
      const int64_t n = a.row0 + r;
      T* d = a.dz + r * c.V + a.c0;
      const T* acc = a.tile + r * kTile;
      if constexpr (!kCap) {
        const auto zof = kept_z<kMode, T, VB>(LinearZ<T, VB>{acc, bias, c.inv_t[n]}, c.sup, n, a.c0);
        segment_dz<T, VB, kEntGrad, kSupport>(d, a.w, zof, c.row_grad(n));
        add_kept_targets<T, kMode>(d, c.tg, n, a.c0, a.c0 + a.w, c.inv_t[n], c.g, zof);
      } else {
        const auto zof = kept_z<kMode, T, VB>(LinearZCap<T, VB>{acc, bias, c.inv_t[n], c.tanh_scale}, c.sup, n, a.c0);
        segment_dz<T, VB, kEntGrad, kSupport>(d, a.w, zof, c.row_grad(n));
        add_kept_targets<T, kMode>(d, c.tg, n, a.c0, a.c0 + a.w, c.inv_t[n], c.g, zof);
        cap_factor<T, VB>(d, a.w, acc, bias, c.tanh_scale);  // 0 stays 0: the factor is finite
      }
    }
    if (a.db != nullptr) add_rows<T, VB>(a.db + a.c0, a.dz_block + a.c0, c.V, a.block_rows, a.w);
  }
};

template <typename T, typename in_t>
void linear_fwd(const Linear<T, in_t>& c, T* stats) {
  constexpr bool kConvert = !std::is_same<in_t, T>::value;
  const int64_t N = c.N, H = c.H, V = c.V;
  const int64_t chunk = kChunkTiles * kTile;
  const int64_t nchunks = (V + chunk - 1) / chunk, nblocks = (N + kFwdRows - 1) / kFwdRows;
  const int64_t items = nblocks * nchunks;
  std::vector<Stats<T>> partial(N * nchunks);  // [N, nchunks]
  const bool extra = c.extra.any() || c.tanh_scale != T(0);
  std::vector<StatsX<T>> partialx(extra ? N * nchunks : 0);

  const int nt = region_threads();
  const bool copy_w = kConvert || c.prec != LogitsPrecision::FP32;
  const int64_t per_thread = kFwdRows * H + kFwdRows * kTile + (copy_w ? kTile * H : 0);
  Scratch<T> scratch(nt * per_thread);
  Errors errors;
#pragma omp parallel num_threads(nt)
  {
    at::AutoDispatchBelowAutograd no_autograd;
    T* hbuf = scratch.get() + omp_get_thread_num() * per_thread;
    T* tile = hbuf + kFwdRows * H;
    T* wbuf = tile + kFwdRows * kTile;
    Stats<T> run[kFwdRows];
    StatsX<T> runx[kFwdRows];
    int64_t loaded = -1;  // the token block in hbuf
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      errors.run([&] {
        const int64_t b = item / nchunks, ch = item % nchunks;
        const int64_t row0 = b * kFwdRows, rows = std::min(kFwdRows, N - row0);
        if (b != loaded) {
          load_rows(hbuf, c.hidden, row0, rows, H);
          round_operands(hbuf, rows * H, c.prec);
          loaded = b;
        }
        std::fill(run, run + rows, Stats<T>{});
        if (extra) std::fill(runx, runx + rows, StatsX<T>{});
        for (int64_t c0 = ch * chunk; c0 < std::min(V, (ch + 1) * chunk); c0 += kTile) {
          const int64_t w = std::min(kTile, V - c0);
          int64_t ldw;
          const T* wt = weight_tile(c, c0, w, wbuf, ldw);
          tile_gemm(hbuf, wt, ldw, w, H, tile);
          round_tile(c, tile, rows, c0, w);
          const LinearFwdTileArg<T, in_t> arg{&c, tile, row0, rows, c0, w, run, runx};
          with_mode(c.sup.mode, [&](auto mode) { run_isa_flagged2<LinearFwdTile<T, in_t, decltype(mode)::value>>(arg); });
        }
        for (int64_t r = 0; r < rows; ++r) partial[(row0 + r) * nchunks + ch] = run[r];
        if (extra) {
          for (int64_t r = 0; r < rows; ++r) partialx[(row0 + r) * nchunks + ch] = runx[r];
        }
      });
    }
  }
  errors.rethrow();

  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      Stats<T> st;
      for (int64_t ch = 0; ch < nchunks; ++ch) st.merge(partial[n * nchunks + ch]);
      st.store(stats, n, c.need_entropy);
    }
  });
  if (extra) {  // apart from the loop above, which stays the default path's own code
    at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        Stats<T> st;
        StatsX<T> sx;
        for (int64_t ch = 0; ch < nchunks; ++ch) {
          sx.merge(st, partial[n * nchunks + ch], partialx[n * nchunks + ch]);
          st.merge(partial[n * nchunks + ch]);
        }
        sx.store(stats, n);
      }
    });
  }
}

// Columns [h0, h0 + kHidCols) of grad_hidden[row0, row0 + rows) = dz·W, dz the block's [rows, V]
// workspace. For narrower inputs the weight columns are converted one vocabulary tile at a time
// (into pbuf) and the product accumulated in dh (the compute dtype, [rows, H]), rounded once.
template <typename T, typename in_t>
void grad_hidden_cols(const Linear<T, in_t>& c, const T* dz, int64_t row0, int64_t rows, int64_t h0, T* pbuf, T* dh,
                      in_t* grad_hidden) {
  const int64_t H = c.H, V = c.V, hw = std::min(kHidCols, H - h0);
  if constexpr (std::is_same<in_t, T>::value) {
    gemm<T>(rows, hw, V, dz, V, false, c.weight + h0, H, false, grad_hidden + row0 * H + h0, H, false);
  } else {
    for (int64_t c0 = 0; c0 < V; c0 += kTile) {
      const int64_t w = std::min(kTile, V - c0);
      int64_t ldp;
      const T* wp = as_compute(c.weight + c0 * H + h0, w, hw, H, pbuf, ldp);
      gemm<T>(rows, hw, w, dz + c0, V, false, wp, ldp, false, dh + h0, H, c0 > 0);
    }
    for (int64_t r = 0; r < rows; ++r) convert(grad_hidden + (row0 + r) * H + h0, dh + r * H + h0, hw);
  }
}

// Outputs: grad_hidden [N, H], grad_weight [V, H], grad_bias [V] (each nullptr when not needed).
template <typename T, typename in_t>
void linear_bwd(const Linear<T, in_t>& c, in_t* grad_hidden, in_t* grad_weight, in_t* grad_bias) {
  static_assert(kBwdRows % kFwdRows == 0, "a backward block is whole forward blocks");
  constexpr bool kConvert = !std::is_same<in_t, T>::value;
  const int64_t N = c.N, H = c.H, V = c.V;
  const int64_t block_rows = std::min(kBwdRows, N);
  const int64_t nblocks = (N + kBwdRows - 1) / kBwdRows, ntiles = (V + kTile - 1) / kTile;
  const int64_t hid_items = grad_hidden != nullptr ? (H + kHidCols - 1) / kHidCols : 0;
  const int64_t wgt_items = grad_weight != nullptr ? (V + kWgtRows - 1) / kWgtRows : 0;

  at::Tensor dz_ws = empty_output({block_rows, V}, c10::CppTypeToScalarType<T>::value);
  T* dz = dz_ws.data_ptr<T>();
  // The block's hidden rows, in forward blocks of kFwdRows (padded) rows for tile_gemm.
  const int64_t hblock_size = (block_rows + kFwdRows - 1) / kFwdRows * kFwdRows * H;
  Scratch<T> hblock(hblock_size);
  // TF32 / BF16: the rounded rows for tile_gemm (hblock keeps them as given, for grad_weight).
  const bool rounds = c.prec != LogitsPrecision::FP32;
  Scratch<T> hblock_r(rounds ? hblock_size : 0);
  // Accumulators in the compute dtype for narrower outputs; T outputs accumulate in place.
  at::Tensor acc_ws;
  T *dW = nullptr, *dh = nullptr;
  if constexpr (kConvert) {
    const int64_t n = (grad_weight != nullptr ? V * H : 0) + (grad_hidden != nullptr ? block_rows * H : 0);
    acc_ws = empty_output({n}, c10::CppTypeToScalarType<T>::value);
    dh = grad_hidden != nullptr ? acc_ws.data_ptr<T>() : nullptr;
    dW = grad_weight != nullptr ? acc_ws.data_ptr<T>() + (grad_hidden != nullptr ? block_rows * H : 0) : nullptr;
  } else {
    dW = grad_weight;
  }
  std::vector<T> db(grad_bias != nullptr ? V : 0, T(0));

  const int nt = region_threads();
  const int64_t per_thread =
      kFwdRows * kTile + (kConvert || rounds ? kTile * H : 0) + (kConvert ? kTile * kHidCols : 0);
  Scratch<T> scratch(nt * per_thread);
  Errors errors;
#pragma omp parallel num_threads(nt)
  {
    at::AutoDispatchBelowAutograd no_autograd;
    T* tile = scratch.get() + omp_get_thread_num() * per_thread;
    T* wbuf = tile + kFwdRows * kTile;
    T* pbuf = wbuf + kTile * H;
    const T* hb = hblock.get();
    const T* hz = rounds ? hblock_r.get() : hb;  // the rows tile_gemm multiplies
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t row0 = b * kBwdRows, rows = std::min(kBwdRows, N - row0);
      const int64_t nsub = (rows + kFwdRows - 1) / kFwdRows;
#pragma omp for schedule(static)
      for (int64_t s = 0; s < nsub; ++s) {
        load_rows(hblock.get() + s * kFwdRows * H, c.hidden, row0 + s * kFwdRows,
                  std::min(kFwdRows, rows - s * kFwdRows), H);
        if (rounds) {
          std::copy(hb + s * kFwdRows * H, hb + (s + 1) * kFwdRows * H, hblock_r.get() + s * kFwdRows * H);
          round_operands(hblock_r.get() + s * kFwdRows * H, kFwdRows * H, c.prec);
        }
      }

      // (1) dz, tile by tile: the forward's GEMMs and z, then the dz epilogue into the workspace.
#pragma omp for schedule(dynamic, 1)
      for (int64_t j = 0; j < ntiles; ++j) {
        errors.run([&] {
          const int64_t c0 = j * kTile, w = std::min(kTile, V - c0);
          int64_t ldw;
          const T* wt = weight_tile(c, c0, w, wbuf, ldw);
          for (int64_t s = 0; s < nsub; ++s) {
            tile_gemm(hz + s * kFwdRows * H, wt, ldw, w, H, tile);
            round_tile(c, tile, std::min(kFwdRows, rows - s * kFwdRows), c0, w);
            T* db_now = s == nsub - 1 && !db.empty() ? db.data() : nullptr;
            const LinearBwdTileArg<T, in_t> arg{&c,    tile,   dz + s * kFwdRows * V, row0 + s * kFwdRows,
                                                std::min(kFwdRows, rows - s * kFwdRows), c0, w, db_now, dz, rows};
            with_mode(c.sup.mode, [&](auto mode) { run_isa_flagged2<LinearBwdTile<T, in_t, decltype(mode)::value>>(arg); });
          }
        });
      }

      // (2) grad_hidden[block] = dz·W by column chunks; grad_weight += dzᵀ·hidden[block] by row chunks.
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < hid_items + wgt_items; ++item) {
        errors.run([&] {
          if (item < hid_items) {
            grad_hidden_cols(c, dz, row0, rows, item * kHidCols, pbuf, dh, grad_hidden);
          } else {
            const int64_t v0 = (item - hid_items) * kWgtRows, vw = std::min(kWgtRows, V - v0);
            gemm<T>(vw, H, rows, dz + v0, V, true, hb, H, false, dW + v0 * H, H, b > 0);
          }
        });
      }
    }

    if constexpr (kConvert) {
      if (grad_weight != nullptr) {
#pragma omp for schedule(static)
        for (int64_t v = 0; v < V; ++v) convert(grad_weight + v * H, dW + v * H, H);
      }
    }
  }
  errors.rethrow();
  if (grad_bias != nullptr) convert(grad_bias, db.data(), V);
}

// ------------------------------------------------------------------ logits
template <typename T, typename in_t>
struct Logits {
  const in_t* x;
  int64_t ld;  // row stride of the logits (0: every row is the same memory)
  const T* inv_t;
  Targets tg;
  int64_t N, V;
  // forward
  bool need_entropy;
  T *stats, *target_logits;
  // backward
  const T *g, *lse, *ent, *h;
  in_t* grad;  // [N, V]
  Support<T> sup;

  RowGrad<T> row_grad(int64_t n) const { return {inv_t[n], lse[n], ent[n], g[n], h != nullptr ? h[n] : T(0)}; }
};

template <typename T, typename in_t>
struct LogitsRowsArg {
  const Logits<T, in_t>* c;
  int64_t n0, n1;
};

template <typename T, typename in_t, SupportMode kMode>
struct LogitsFwdRows {
  using Arg = LogitsRowsArg<T, in_t>;

  static bool flag(const Arg& a) { return a.c->need_entropy; }

  template <int VB, bool kEntropy>
  RLVR_INLINE static void body(const Arg& a) {
    const Logits<T, in_t>& c = *a.c;
    alignas(64) T z[kTile];
    for (int64_t n = a.n0; n < a.n1; ++n) {
      const in_t* x = c.x + n * c.ld;
      Stats<T> st;
      T target = T(0);
      for (int64_t c0 = 0; c0 < c.V; c0 += kTile) {
        const int64_t w = std::min(kTile, c.V - c0);
        const auto zof = kept_z<kMode, T, VB>(LogitsZ<T, VB, in_t>{x + c0, c.inv_t[n]}, c.sup, n, c0);
        st.merge(segment_stats<T, VB, kEntropy>(z, w, zof));
        c.tg.each_in(n, c0, c0 + w, [&](int64_t, int64_t j) { target = z[j]; });
      }
      st.store(c.stats, n, kEntropy);
      c.target_logits[n] = target;
    }
  }
};

template <typename T, typename in_t, SupportMode kMode>
struct LogitsBwdRows {
  using Arg = LogitsRowsArg<T, in_t>;

  static bool flag(const Arg& a) { return a.c->h != nullptr; }

  template <int VB, bool kEntGrad>
  RLVR_INLINE static void body(const Arg& a) {
    const Logits<T, in_t>& c = *a.c;
    alignas(64) T buf[kTile];  // dz before its rounding to a narrower output dtype
    for (int64_t n = a.n0; n < a.n1; ++n) {
      const in_t* x = c.x + n * c.ld;
      in_t* out = c.grad + n * c.V;
      for (int64_t c0 = 0; c0 < c.V; c0 += kTile) {
        const int64_t w = std::min(kTile, c.V - c0);
        T* d;
        if constexpr (std::is_same<in_t, T>::value) {
          d = out + c0;
        } else {
          d = buf;
        }
        const auto zof = kept_z<kMode, T, VB>(LogitsZ<T, VB, in_t>{x + c0, c.inv_t[n]}, c.sup, n, c0);
        segment_dz<T, VB, kEntGrad, kMode != SupportMode::NONE>(d, w, zof, c.row_grad(n));
        add_kept_targets<T, kMode>(d, c.tg, n, c0, c0 + w, c.inv_t[n], c.g, zof);
        if constexpr (!std::is_same<in_t, T>::value) convert(out + c0, buf, w);
      }
    }
  }
};

template <template <typename, typename, SupportMode> class Body, typename T, typename in_t>
void logits_rows(const Logits<T, in_t>& c) {
  // Rows are independent: any split gives the same bits.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(c.V, 1));
  at::parallel_for(0, c.N, grain, [&](int64_t n0, int64_t n1) {
    const LogitsRowsArg<T, in_t> arg{&c, n0, n1};
    with_mode(c.sup.mode, [&](auto mode) { run_isa_flagged<Body<T, in_t, decltype(mode)::value>>(arg); });
  });
}

// ------------------------------------------------------------------ sampling thresholds
// The THRESHOLD support of the engine's filters (contract: linear_logprobs_threshold), a row at a time from
// its z as the forward forms it: the max and min-p's bound in a pass each, top-k's k-th largest value and
// top-p's bound by bisection on the values' order-preserving integer keys over a candidate list that each
// step compacts (the steps together cost a few passes over the row unless it has huge ties; never a sort).

template <typename T>
struct KeyType;
template <>
struct KeyType<float> {
  using type = uint32_t;
};
template <>
struct KeyType<double> {
  using type = uint64_t;
};
template <typename T>
using key_t = typename KeyType<T>::type;

// x's key: unsigned integers in the order of the values, −0 as +0 (they compare equal, so they tie). x is
// not NaN.
template <typename T>
RLVR_INLINE key_t<T> order_key(T x) {
  using K = key_t<T>;
  constexpr K sign = K(1) << (8 * sizeof(K) - 1);
  if (x == T(0)) x = T(0);
  K b;
  std::memcpy(&b, &x, sizeof(b));
  return (b & sign) != 0 ? K(~b) : K(b | sign);
}

template <typename T>
RLVR_INLINE T from_key(key_t<T> k) {
  using K = key_t<T>;
  constexpr K sign = K(1) << (8 * sizeof(K) - 1);
  const K b = (k & sign) != 0 ? K(k & ~sign) : K(~k);
  T x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
}

// e = exp(x − m) of src[0, n) into dst (nullptr: not stored) and their sum in double, in order; a NaN x
// adds nothing. The clamp and exp of the statistics (segment_stats).
template <typename T>
struct ExpShift {
  struct Arg {
    const T* src;
    T* dst;
    int64_t n;
    T m;
    double* sum;
  };

  template <int VB>
  RLVR_INLINE static void run(const Arg& a) {
    using V = typename Lanes<T, VB>::V;
    constexpr int W = Lanes<T, VB>::W;
    const V mx = splat<V>(a.m), floor = splat<V>(kExpFloor<T>), zero = splat<V>(T(0));
    double s = 0;
    for (int64_t i = 0; i < a.n; i += W) {
      const int cnt = int(std::min<int64_t>(W, a.n - i));
      const V x = load<T, VB>(a.src + i, cnt);
      const V ex = vexp(vclamp(x - mx, floor, zero));
      const V e = x == x ? ex : zero;
      if (a.dst != nullptr) store(a.dst + i, e, cnt);
      for (int l = 0; l < cnt; ++l) s += double(e[l]);
    }
    *a.sum = s;
  }
};

// The largest key K with pred(h(K)), h(K) = Σ_{i : key_i >= K} w_i over the n candidates (kWeighted: w,
// else 1 each; sums in double, in the candidates' order); false if pred(h(min key)) fails. pred must be
// monotone (true up to some K, false after) and false for h = 0. The answer is a candidate's key (h
// changes only at one). Candidates (key, w) are compacted in place: each step keeps the side of its
// midpoint that holds the answer, [lo, hi] being the smallest and largest key left.
template <bool kWeighted, typename K, typename T, typename Pred>
bool largest_key(K* key, T* w, int64_t n, const Pred& pred, K& out) {
  if (n == 0) return false;
  double total = 0;
  K lo = key[0], hi = key[0];
  for (int64_t i = 0; i < n; ++i) {
    total += kWeighted ? double(w[i]) : 1.0;
    lo = std::min(lo, key[i]);
    hi = std::max(hi, key[i]);
  }
  if (!pred(total)) return false;
  double base = 0;  // h(hi + 1): the weight of the dropped candidates above the range
  while (lo < hi && n > 0) {
    const K mid = lo + (hi - lo) / 2 + 1;  // in (lo, hi]
    double s = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (key[i] >= mid) s += kWeighted ? double(w[i]) : 1.0;
    }
    const bool up = pred(base + s);  // the answer is >= mid
    if (!up) base += s;
    int64_t m = 0;
    K nlo = std::numeric_limits<K>::max(), nhi = 0;
    for (int64_t i = 0; i < n; ++i) {
      const K k = key[i];
      if ((k >= mid) == up) {
        key[m] = k;
        if constexpr (kWeighted) w[m] = w[i];
        ++m;
        nlo = std::min(nlo, k);
        nhi = std::max(nhi, k);
      }
    }
    n = m;
    lo = nlo;
    hi = nhi;
  }
  out = lo;
  return n > 0;
}

// One row's filter parameters (top_k <= 0 or >= V, top_p >= 1, min_p <= 0: off).
template <typename T>
struct RowFilter {
  int64_t top_k;
  T top_p, min_p;
};

template <typename T>
struct Filters {
  const int64_t* top_k;
  const T *top_p, *min_p;
  SamplingConvention conv;
  RowFilter<T> at(int64_t n) const { return {top_k[n], top_p[n], min_p[n]}; }
};

// The threshold of the contract for one row z[0, V) (key, w: [V] of workspace). NaN z are no row values:
// never counted, never kept (NaN >= t is false).
template <typename T>
T row_threshold(const T* z, int64_t V, const RowFilter<T>& f, SamplingConvention conv, key_t<T>* key, T* w) {
  using K = key_t<T>;
  T m = -kInf<T>;
  for (int64_t v = 0; v < V; ++v) m = z[v] > m ? z[v] : m;
  if (m == -kInf<T>) return m;  // no value above −inf: whatever is kept, the row is empty

  // min-p: the least z with exp(z − m) >= min_p (in double: decided by the log below unless within its
  // rounding of the bound). The max always qualifies.
  T t1 = -kInf<T>;
  if (f.min_p > T(0)) {
    const double mp = double(f.min_p), bound = std::log(mp), eps = 1e-9 * (1.0 + std::abs(bound));
    T least = m;
    for (int64_t v = 0; v < V; ++v) {
      const T x = z[v];
      if (!(x < least)) continue;  // (NaN too)
      const double d = double(x) - double(m);
      if (d > bound + eps || (d >= bound - eps && std::exp(d) >= mp)) least = x;
    }
    t1 = least;
  }
  // top-k: the k-th largest value, counted with multiplicity; only binding above t1, where it is the k-th
  // largest of the values >= t1.
  if (f.top_k > 0 && f.top_k < V) {
    int64_t n = 0;
    for (int64_t v = 0; v < V; ++v) {
      if (z[v] >= t1) key[n++] = order_key(z[v]);
    }
    K kk;
    const double k = double(f.top_k);
    if (largest_key<false>(key, w, n, [k](double h) { return h >= k; }, kk)) t1 = std::max(t1, from_key<T>(kk));
  }
  // top-p over U = {z >= t1}: the least value whose mass above is < P (VLLM) or <= P (SGLANG), i.e. the
  // largest key K with h(K) = Σ_{z >= K} e >= P (VLLM) or > P (SGLANG).
  T tp = -kInf<T>;
  if (f.top_p < T(1)) {
    int64_t n = 0;
    for (int64_t v = 0; v < V; ++v) {
      if (z[v] >= t1) {
        key[n] = order_key(z[v]);
        w[n] = z[v];
        ++n;
      }
    }
    double mass_u = 0, mass = 0;
    run_isa<ExpShift<T>>({w, w, n, m, &mass_u});
    mass = mass_u;
    if (conv == SamplingConvention::SGLANG && t1 > -kInf<T>) run_isa<ExpShift<T>>({z, nullptr, V, m, &mass});
    const double P = double(f.top_p) * mass;
    K kp;
    const bool found = conv == SamplingConvention::SGLANG
                           ? largest_key<true>(key, w, n, [P](double h) { return h > P; }, kp)
                           : largest_key<true>(key, w, n, [P](double h) { return h >= P; }, kp);
    if (found) tp = from_key<T>(kp);
  }
  const T t = std::max(t1, tp);
  if (t == -kInf<T>) return t;
  // Strictly between t and the largest value below it, so that z recomputed in another tiling (within
  // rounding of itself) falls on the same side; t itself when the midpoint rounds onto a neighbour.
  T lo = -kInf<T>;
  for (int64_t v = 0; v < V; ++v) {
    if (z[v] < t && z[v] > lo) lo = z[v];
  }
  if (lo == -kInf<T>) return t;
  const T r = lo + (t - lo) / T(2);
  return r > lo && r <= t ? r : t;
}

// z[0, n) of a segment as zof forms it, in the lanes of segment_stats (so bitwise its z).
template <typename T, int VB, typename ZOf>
RLVR_INLINE void write_z(T* dst, int64_t n, const ZOf& zof) {
  constexpr int W = Lanes<T, VB>::W;
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const auto z = zof(i, W);
    std::memcpy(dst + i, &z, sizeof(z));
  }
  if (i < n) store(dst + i, zof(i, int(n - i)), int(n - i));
}

// z of one GEMM tile's rows into the block's z rows [rows, V], as the forward's epilogue forms it.
template <typename T, typename in_t>
struct LinearZTile {
  struct Arg {
    const Linear<T, in_t>* c;
    const T* tile;  // [kFwdRows, kTile]
    int64_t row0, rows, c0, w;
    T* z;  // the block's z [rows, V]
  };

  static bool flag(const Arg& a) { return a.c->tanh_scale != T(0); }

  template <int VB, bool kCap>
  RLVR_INLINE static void body(const Arg& a) {
    const Linear<T, in_t>& c = *a.c;
    const T* bias = c.epilogue_bias(a.c0);
    for (int64_t r = 0; r < a.rows; ++r) {
      const int64_t n = a.row0 + r;
      const T* acc = a.tile + r * kTile;
      T* dst = a.z + r * c.V + a.c0;
      if constexpr (kCap) {
        write_z<T, VB>(dst, a.w, LinearZCap<T, VB>{acc, bias, c.inv_t[n], c.tanh_scale});
      } else {
        write_z<T, VB>(dst, a.w, LinearZ<T, VB>{acc, bias, c.inv_t[n]});
      }
    }
  }
};

// Token blocks of kFwdRows rows in order: the threads share the block's GEMM tiles (the forward's GEMMs and
// z: same shapes, operands and alignment), then its rows' thresholds. Memory: the block's z [kFwdRows, V]
// and [V] of keys and values per thread, whatever N.
template <typename T, typename in_t>
void linear_threshold(const Linear<T, in_t>& c, const Filters<T>& f, T* out) {
  constexpr bool kConvert = !std::is_same<in_t, T>::value;
  const int64_t N = c.N, H = c.H, V = c.V;
  const int64_t nblocks = (N + kFwdRows - 1) / kFwdRows, ntiles = (V + kTile - 1) / kTile;
  const int nt = region_threads();
  const bool copy_w = kConvert || c.prec != LogitsPrecision::FP32;
  const int64_t per_thread = kFwdRows * kTile + (copy_w ? kTile * H : 0);
  Scratch<T> hbuf(kFwdRows * H), zblock(kFwdRows * V), scratch(nt * per_thread), wsel(nt * V);
  Scratch<key_t<T>> ksel(nt * V);
  Errors errors;
#pragma omp parallel num_threads(nt)
  {
    at::AutoDispatchBelowAutograd no_autograd;
    const int tid = omp_get_thread_num();
    T* tile = scratch.get() + tid * per_thread;
    T* wbuf = tile + kFwdRows * kTile;
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t row0 = b * kFwdRows, rows = std::min(kFwdRows, N - row0);
#pragma omp single
      {
        load_rows(hbuf.get(), c.hidden, row0, rows, H);
        round_operands(hbuf.get(), rows * H, c.prec);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t j = 0; j < ntiles; ++j) {
        errors.run([&] {
          const int64_t c0 = j * kTile, w = std::min(kTile, V - c0);
          int64_t ldw;
          const T* wt = weight_tile(c, c0, w, wbuf, ldw);
          tile_gemm(hbuf.get(), wt, ldw, w, H, tile);
          round_tile(c, tile, rows, c0, w);
          run_isa_flagged<LinearZTile<T, in_t>>({&c, tile, row0, rows, c0, w, zblock.get()});
        });
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t r = 0; r < rows; ++r) {
        errors.run([&] {
          out[row0 + r] =
              row_threshold(zblock.get() + r * V, V, f.at(row0 + r), f.conv, ksel.get() + tid * V, wsel.get() + tid * V);
        });
      }
    }
  }
  errors.rethrow();
}

// A logits row's z = logits·inv_T, in the lanes of the forward's segments.
template <typename T, typename in_t>
struct LogitsZRow {
  struct Arg {
    const in_t* x;
    T inv_t;
    int64_t V;
    T* z;
  };

  template <int VB>
  RLVR_INLINE static void run(const Arg& a) {
    for (int64_t c0 = 0; c0 < a.V; c0 += kTile) {
      write_z<T, VB>(a.z + c0, std::min(kTile, a.V - c0), LogitsZ<T, VB, in_t>{a.x + c0, a.inv_t});
    }
  }
};

template <typename T, typename in_t>
void logits_threshold(const in_t* x, int64_t ld, const T* inv_t, int64_t N, int64_t V, const Filters<T>& f, T* out) {
  const int64_t grain = std::max<int64_t>(1, 65536 / V);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<T> z(V), w(V);
    std::vector<key_t<T>> key(V);
    for (int64_t n = n0; n < n1; ++n) {
      run_isa<LogitsZRow<T, in_t>>({x + n * ld, inv_t[n], V, z.data()});
      out[n] = row_threshold(z.data(), V, f.at(n), f.conv, key.data(), w.data());
    }
  });
}

// ------------------------------------------------------------------ argument checks
void check_float(const char* op, const char* name, const torch::Tensor& t) {
  const auto st = t.scalar_type();
  TORCH_CHECK(st == torch::kFloat32 || st == torch::kFloat64 || st == torch::kBFloat16 || st == torch::kFloat16, op,
              ": ", name, " must be float32, float64, bfloat16 or float16, got ", st);
}

void check_cpu_contig(const char* op, const char* name, const torch::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_vec(const char* op, const char* name, const torch::Tensor& t, int64_t n, at::ScalarType dtype) {
  check_cpu_contig(op, name, t);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, op, ": ", name, " must have shape [", n, "], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
}

at::ScalarType compute_dtype(at::ScalarType st) { return st == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32; }

// The linear head's operands (hidden, weight, bias, inv_temperature); returns the compute dtype.
at::ScalarType check_head(const char* op, const torch::Tensor& hidden, const torch::Tensor& weight,
                          const c10::optional<torch::Tensor>& bias, const torch::Tensor& inv_temperature) {
  check_cpu_contig(op, "hidden", hidden);
  check_cpu_contig(op, "weight", weight);
  check_float(op, "hidden", hidden);
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1), op,
              ": expected hidden [N, H] and weight [V, H], got ", hidden.sizes(), " and ", weight.sizes());
  TORCH_CHECK(weight.size(0) >= 1, op, ": weight must have at least one row");
  TORCH_CHECK(weight.scalar_type() == hidden.scalar_type(), op, ": weight must have hidden's dtype");
  if (bias.has_value()) check_vec(op, "bias", *bias, weight.size(0), hidden.scalar_type());
  const auto ct = compute_dtype(hidden.scalar_type());
  check_vec(op, "inv_temperature", inv_temperature, hidden.size(0), ct);
  return ct;
}

// The linear head's common checks; returns the compute dtype.
at::ScalarType check_linear(const char* op, const torch::Tensor& hidden, const torch::Tensor& weight,
                            const c10::optional<torch::Tensor>& bias, const torch::Tensor& inv_temperature,
                            const torch::Tensor& row_ptr, const torch::Tensor& sorted_targets) {
  const auto ct = check_head(op, hidden, weight, bias, inv_temperature);
  check_vec(op, "row_ptr", row_ptr, hidden.size(0) + 1, torch::kInt64);
  check_cpu_contig(op, "sorted_targets", sorted_targets);
  TORCH_CHECK(sorted_targets.dim() == 1 && sorted_targets.scalar_type() == torch::kInt64, op,
              ": sorted_targets must be a 1-D int64 tensor");
  return ct;
}

// The logits alone; returns the compute dtype.
at::ScalarType check_logits_rows(const char* op, const torch::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu(), op, ": logits must be a CPU tensor");
  check_float(op, "logits", logits);
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1, op, ": logits must be [N, V] with V >= 1, got ",
              logits.sizes());
  // Any row stride: rows are only read, so rows that overlap or coincide (stride 0: an expanded view)
  // are fine; the backward writes a fresh gradient.
  TORCH_CHECK(logits.stride(1) == 1 || logits.size(1) == 1, op, ": logits rows must be contiguous");
  return compute_dtype(logits.scalar_type());
}

at::ScalarType check_logits(const char* op, const torch::Tensor& logits, const torch::Tensor& targets,
                            const torch::Tensor& inv_temperature) {
  const auto ct = check_logits_rows(op, logits);
  check_vec(op, "targets", targets, logits.size(0), torch::kInt64);
  check_vec(op, "inv_temperature", inv_temperature, logits.size(0), ct);
  return ct;
}

// The support of a call with `code` (its support_mode) over N rows of V columns: None for NONE, int32
// [N, ceil(V / 32)] for MASK, [N] in the compute dtype for THRESHOLD.
SupportMode check_support(const char* op, int64_t code, const c10::optional<torch::Tensor>& support, int64_t N,
                          int64_t V, at::ScalarType ct) {
  TORCH_CHECK(valid_SupportMode(code), op, ": support_mode must be a SupportMode code, got ", code);
  const auto mode = static_cast<SupportMode>(code);
  if (mode == SupportMode::NONE) {
    TORCH_CHECK(!support.has_value(), op, ": support must be None with SupportMode.NONE");
    return mode;
  }
  TORCH_CHECK(support.has_value(), op, ": support is required with support_mode ", code);
  if (mode == SupportMode::MASK) {
    const torch::Tensor& s = *support;
    check_cpu_contig(op, "support", s);
    const int64_t words = (V + 31) / 32;
    TORCH_CHECK(s.dim() == 2 && s.size(0) == N && s.size(1) == words, op, ": support (a MASK) must have shape [", N,
                ", ", words, "], got ", s.sizes());
    TORCH_CHECK(s.scalar_type() == torch::kInt32, op, ": support (a MASK) must be int32, got ", s.scalar_type());
  } else {
    check_vec(op, "support", *support, N, ct);
  }
  return mode;
}

template <typename T>
Support<T> support_of(SupportMode mode, const c10::optional<torch::Tensor>& support) {
  Support<T> s;
  s.mode = mode;
  if (mode == SupportMode::MASK) {
    s.mask = support->data_ptr<int32_t>();
    s.words = support->size(1);
  } else if (mode == SupportMode::THRESHOLD) {
    s.thr = support->data_ptr<T>();
  }
  return s;
}

// The threshold kernels' filters: top_k int64 [N], top_p and min_p [N] in the compute dtype.
SamplingConvention check_filters(const char* op, const torch::Tensor& top_k, const torch::Tensor& top_p,
                                 const torch::Tensor& min_p, int64_t convention, int64_t N, at::ScalarType ct) {
  check_vec(op, "top_k", top_k, N, torch::kInt64);
  check_vec(op, "top_p", top_p, N, ct);
  check_vec(op, "min_p", min_p, N, ct);
  TORCH_CHECK(valid_SamplingConvention(convention), op, ": convention must be a SamplingConvention code, got ",
              convention);
  return static_cast<SamplingConvention>(convention);
}

template <typename T>
Filters<T> filters_of(const torch::Tensor& top_k, const torch::Tensor& top_p, const torch::Tensor& min_p,
                      SamplingConvention conv) {
  return {top_k.data_ptr<int64_t>(), top_p.data_ptr<T>(), min_p.data_ptr<T>(), conv};
}

template <typename T>
const T* opt_ptr(const c10::optional<torch::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

// The bias in the compute dtype (a converted copy in store when needed; rounded to bf16 for BF16).
template <typename T, typename in_t>
const T* bias_ptr(const c10::optional<torch::Tensor>& bias, std::vector<T>& store, LogitsPrecision prec) {
  if (!bias.has_value()) return nullptr;
  const in_t* b = bias->data_ptr<in_t>();
  if (std::is_same<in_t, T>::value && prec != LogitsPrecision::BF16) return reinterpret_cast<const T*>(b);
  store.resize(bias->numel());
  convert(store.data(), b, bias->numel());
  if (prec == LogitsPrecision::BF16) round_operands(store.data(), bias->numel(), prec);
  return store.data();
}

LogitsPrecision check_precision(const char* op, int64_t v) {
  TORCH_CHECK(valid_LogitsPrecision(v), op, ": logits_precision must be a LogitsPrecision code, got ", v);
  return static_cast<LogitsPrecision>(v);
}

template <typename scalar_t>
using compute_t = std::conditional_t<std::is_same<scalar_t, double>::value, double, float>;

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> linear_logprobs_stats_cpu(
    const torch::Tensor& hidden, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
    const torch::Tensor& inv_temperature, const torch::Tensor& row_ptr, const torch::Tensor& sorted_targets,
    const c10::optional<torch::Tensor>& support, c10::ArrayRef<double> fparams, c10::ArrayRef<int64_t> iparams) {
  const char* op = "linear_logprobs_stats";
  const auto p = LinearLogprobsStatsParams::unpack(fparams, iparams);
  const LogitsPrecision prec = check_precision(op, p.logits_precision);
  const auto ct = check_linear(op, hidden, weight, bias, inv_temperature, row_ptr, sorted_targets);
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0), M = sorted_targets.size(0);
  const SupportMode mode = check_support(op, p.support_mode, support, N, V, ct);
  torch::Tensor stats = torch::empty({N, kNumStats}, torch::dtype(ct));
  torch::Tensor target_logits = torch::zeros({M}, torch::dtype(ct));
  if (N == 0) return {stats, target_logits};
  const std::vector<int64_t> ptr = sanitize_row_ptr(row_ptr.data_ptr<int64_t>(), N, M);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "linear_logprobs_stats", [&] {
    using T = compute_t<scalar_t>;
    std::vector<T> bias_store;
    Linear<T, scalar_t> c{};
    c.hidden = hidden.data_ptr<scalar_t>();
    c.weight = weight.data_ptr<scalar_t>();
    c.bias = bias_ptr<T, scalar_t>(bias, bias_store, prec);
    c.prec = prec;
    c.inv_t = inv_temperature.data_ptr<T>();
    c.tg = {ptr.data(), sorted_targets.data_ptr<int64_t>()};
    c.N = N;
    c.H = H;
    c.V = V;
    c.tanh_scale = T(p.tanh_scale);
    c.need_entropy = p.need_entropy != 0;
    c.extra = {p.need_sum_sq != 0, p.need_sum_z != 0, p.need_argmax != 0};
    c.sup = support_of<T>(mode, support);
    c.target_logits = target_logits.data_ptr<T>();
    linear_fwd(c, stats.data_ptr<T>());
  });
  return {stats, target_logits};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> linear_logprobs_bwd_cpu(
    const torch::Tensor& hidden, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
    const torch::Tensor& inv_temperature, const torch::Tensor& row_ptr, const torch::Tensor& sorted_targets,
    const torch::Tensor& sorted_grad, const torch::Tensor& lse, const torch::Tensor& entropy,
    const c10::optional<torch::Tensor>& grad_entropy, const c10::optional<torch::Tensor>& support,
    c10::ArrayRef<double> fparams, c10::ArrayRef<int64_t> iparams) {
  const char* op = "linear_logprobs_bwd";
  const auto p = LinearLogprobsBwdParams::unpack(fparams, iparams);
  const LogitsPrecision prec = check_precision(op, p.logits_precision);
  const bool need_hidden = p.need_hidden != 0, need_weight = p.need_weight != 0, need_bias = p.need_bias != 0;
  const auto ct = check_linear(op, hidden, weight, bias, inv_temperature, row_ptr, sorted_targets);
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0), M = sorted_targets.size(0);
  check_vec(op, "sorted_grad", sorted_grad, M, ct);
  check_vec(op, "lse", lse, N, ct);
  check_vec(op, "entropy", entropy, N, ct);
  if (grad_entropy.has_value()) check_vec(op, "grad_entropy", *grad_entropy, N, ct);
  const SupportMode mode = check_support(op, p.support_mode, support, N, V, ct);
  TORCH_CHECK(!need_bias || bias.has_value(), op, ": need_bias without a bias");

  const auto dt = hidden.scalar_type();
  const auto none = [&] { return torch::empty({0}, torch::dtype(dt)); };
  torch::Tensor gh = need_hidden ? empty_output({N, H}, dt) : none();
  torch::Tensor gw = need_weight ? empty_output({V, H}, dt) : none();
  torch::Tensor gb = need_bias ? empty_output({V}, dt) : none();
  if (N == 0 || !(need_hidden || need_weight || need_bias)) {
    gw.zero_();
    gb.zero_();
    return {gh, gw, gb};
  }
  const std::vector<int64_t> ptr = sanitize_row_ptr(row_ptr.data_ptr<int64_t>(), N, M);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dt, "linear_logprobs_bwd", [&] {
    using T = compute_t<scalar_t>;
    std::vector<T> bias_store;
    const T* g = sorted_grad.data_ptr<T>();
    std::vector<T> G(N, T(0));
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t k = ptr[n]; k < ptr[n + 1]; ++k) G[n] += g[k];
    }
    Linear<T, scalar_t> c{};
    c.hidden = hidden.data_ptr<scalar_t>();
    c.weight = weight.data_ptr<scalar_t>();
    c.bias = bias_ptr<T, scalar_t>(bias, bias_store, prec);
    c.prec = prec;
    c.inv_t = inv_temperature.data_ptr<T>();
    c.tg = {ptr.data(), sorted_targets.data_ptr<int64_t>()};
    c.N = N;
    c.H = H;
    c.V = V;
    c.g = g;
    c.lse = lse.data_ptr<T>();
    c.ent = entropy.data_ptr<T>();
    c.h = opt_ptr<T>(grad_entropy);
    c.G = G.data();
    c.tanh_scale = T(p.tanh_scale);
    c.sup = support_of<T>(mode, support);
    linear_bwd(c, need_hidden ? gh.data_ptr<scalar_t>() : nullptr, need_weight ? gw.data_ptr<scalar_t>() : nullptr,
               need_bias ? gb.data_ptr<scalar_t>() : nullptr);
  });
  return {gh, gw, gb};
}

std::tuple<torch::Tensor, torch::Tensor> logprobs_from_logits_stats_cpu(const torch::Tensor& logits,
                                                                        const torch::Tensor& targets,
                                                                        const torch::Tensor& inv_temperature,
                                                                        const c10::optional<torch::Tensor>& support,
                                                                        c10::ArrayRef<double> fparams,
                                                                        c10::ArrayRef<int64_t> iparams) {
  const char* op = "logprobs_from_logits_stats";
  const auto p = LogprobsStatsParams::unpack(fparams, iparams);
  const auto ct = check_logits(op, logits, targets, inv_temperature);
  const int64_t N = logits.size(0), V = logits.size(1);
  const SupportMode mode = check_support(op, p.support_mode, support, N, V, ct);
  torch::Tensor stats = torch::empty({N, kNumStats}, torch::dtype(ct));
  torch::Tensor target_logits = torch::empty({N}, torch::dtype(ct));
  if (N == 0) return {stats, target_logits};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "logprobs_from_logits_stats", [&] {
    using T = compute_t<scalar_t>;
    Logits<T, scalar_t> c{};
    c.x = logits.data_ptr<scalar_t>();
    c.ld = logits.stride(0);
    c.inv_t = inv_temperature.data_ptr<T>();
    c.tg = {nullptr, targets.data_ptr<int64_t>()};
    c.N = N;
    c.V = V;
    c.need_entropy = p.need_entropy != 0;
    c.sup = support_of<T>(mode, support);
    c.stats = stats.data_ptr<T>();
    c.target_logits = target_logits.data_ptr<T>();
    logits_rows<LogitsFwdRows>(c);
  });
  return {stats, target_logits};
}

namespace {

// logprobs_from_logits_bwd's checks and kernel, dz written to `grad` ([N, V] contiguous, the logits' dtype;
// the logits themselves for the in-place entry point: each tile of a row is read before it is written and the
// NONE / MASK target terms read no logits, so the aliasing is safe).
void logits_bwd_into(const torch::Tensor& logits, const torch::Tensor& targets, const torch::Tensor& inv_temperature,
                     const torch::Tensor& grad_logp, const torch::Tensor& lse, const torch::Tensor& entropy,
                     const c10::optional<torch::Tensor>& grad_entropy, const c10::optional<torch::Tensor>& support,
                     SupportMode mode, const torch::Tensor& grad) {
  const int64_t N = logits.size(0), V = logits.size(1);
  if (N == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "logprobs_from_logits_bwd", [&] {
    using T = compute_t<scalar_t>;
    Logits<T, scalar_t> c{};
    c.x = logits.data_ptr<scalar_t>();
    c.ld = logits.stride(0);
    c.inv_t = inv_temperature.data_ptr<T>();
    c.tg = {nullptr, targets.data_ptr<int64_t>()};
    c.N = N;
    c.V = V;
    c.g = grad_logp.data_ptr<T>();
    c.lse = lse.data_ptr<T>();
    c.ent = entropy.data_ptr<T>();
    c.h = opt_ptr<T>(grad_entropy);
    c.sup = support_of<T>(mode, support);
    c.grad = grad.data_ptr<scalar_t>();
    logits_rows<LogitsBwdRows>(c);
  });
}

SupportMode check_logits_bwd(const char* op, const torch::Tensor& logits, const torch::Tensor& targets,
                             const torch::Tensor& inv_temperature, const torch::Tensor& grad_logp,
                             const torch::Tensor& lse, const torch::Tensor& entropy,
                             const c10::optional<torch::Tensor>& grad_entropy,
                             const c10::optional<torch::Tensor>& support, const LogprobsBwdParams& p) {
  const auto ct = check_logits(op, logits, targets, inv_temperature);
  const int64_t N = logits.size(0), V = logits.size(1);
  check_vec(op, "grad_logp", grad_logp, N, ct);
  check_vec(op, "lse", lse, N, ct);
  check_vec(op, "entropy", entropy, N, ct);
  if (grad_entropy.has_value()) check_vec(op, "grad_entropy", *grad_entropy, N, ct);
  return check_support(op, p.support_mode, support, N, V, ct);
}

}  // namespace

torch::Tensor logprobs_from_logits_bwd_cpu(const torch::Tensor& logits, const torch::Tensor& targets,
                                           const torch::Tensor& inv_temperature, const torch::Tensor& grad_logp,
                                           const torch::Tensor& lse, const torch::Tensor& entropy,
                                           const c10::optional<torch::Tensor>& grad_entropy,
                                           const c10::optional<torch::Tensor>& support, c10::ArrayRef<double> fparams,
                                           c10::ArrayRef<int64_t> iparams) {
  const char* op = "logprobs_from_logits_bwd";
  const auto p = LogprobsBwdParams::unpack(fparams, iparams);
  const SupportMode mode =
      check_logits_bwd(op, logits, targets, inv_temperature, grad_logp, lse, entropy, grad_entropy, support, p);
  torch::Tensor grad = empty_output({logits.size(0), logits.size(1)}, logits.scalar_type());
  logits_bwd_into(logits, targets, inv_temperature, grad_logp, lse, entropy, grad_entropy, support, mode, grad);
  return grad;
}

void logprobs_from_logits_bwd_inplace_cpu(const torch::Tensor& logits, const torch::Tensor& targets,
                                          const torch::Tensor& inv_temperature, const torch::Tensor& grad_logp,
                                          const torch::Tensor& lse, const torch::Tensor& entropy,
                                          const c10::optional<torch::Tensor>& grad_entropy,
                                          const c10::optional<torch::Tensor>& support, c10::ArrayRef<double> fparams,
                                          c10::ArrayRef<int64_t> iparams) {
  const char* op = "logprobs_from_logits_bwd_";
  const auto p = LogprobsBwdParams::unpack(fparams, iparams);
  const SupportMode mode =
      check_logits_bwd(op, logits, targets, inv_temperature, grad_logp, lse, entropy, grad_entropy, support, p);
  TORCH_CHECK(logits.is_contiguous(), op, ": logits must be contiguous (their gradient is written over them)");
  // THRESHOLD keeps a target by its z, which the tile holding it has already overwritten.
  TORCH_CHECK(mode != SupportMode::THRESHOLD, op, ": a THRESHOLD support is not supported in place");
  logits_bwd_into(logits, targets, inv_temperature, grad_logp, lse, entropy, grad_entropy, support, mode, logits);
}

torch::Tensor linear_logprobs_threshold_cpu(const torch::Tensor& hidden, const torch::Tensor& weight,
                                            const c10::optional<torch::Tensor>& bias,
                                            const torch::Tensor& inv_temperature, const torch::Tensor& top_k,
                                            const torch::Tensor& top_p, const torch::Tensor& min_p,
                                            c10::ArrayRef<double> fparams, c10::ArrayRef<int64_t> iparams) {
  const char* op = "linear_logprobs_threshold";
  const auto p = LinearLogprobsThresholdParams::unpack(fparams, iparams);
  const LogitsPrecision prec = check_precision(op, p.logits_precision);
  const auto ct = check_head(op, hidden, weight, bias, inv_temperature);
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  const SamplingConvention conv = check_filters(op, top_k, top_p, min_p, p.convention, N, ct);
  torch::Tensor out = torch::empty({N}, torch::dtype(ct));
  if (N == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "linear_logprobs_threshold", [&] {
    using T = compute_t<scalar_t>;
    std::vector<T> bias_store;
    Linear<T, scalar_t> c{};
    c.hidden = hidden.data_ptr<scalar_t>();
    c.weight = weight.data_ptr<scalar_t>();
    c.bias = bias_ptr<T, scalar_t>(bias, bias_store, prec);
    c.prec = prec;
    c.inv_t = inv_temperature.data_ptr<T>();
    c.N = N;
    c.H = H;
    c.V = V;
    c.tanh_scale = T(p.tanh_scale);
    linear_threshold(c, filters_of<T>(top_k, top_p, min_p, conv), out.data_ptr<T>());
  });
  return out;
}

torch::Tensor logprobs_from_logits_threshold_cpu(const torch::Tensor& logits, const torch::Tensor& inv_temperature,
                                                 const torch::Tensor& top_k, const torch::Tensor& top_p,
                                                 const torch::Tensor& min_p, c10::ArrayRef<double> fparams,
                                                 c10::ArrayRef<int64_t> iparams) {
  const char* op = "logprobs_from_logits_threshold";
  const auto p = LogprobsThresholdParams::unpack(fparams, iparams);
  const auto ct = check_logits_rows(op, logits);
  const int64_t N = logits.size(0), V = logits.size(1);
  check_vec(op, "inv_temperature", inv_temperature, N, ct);
  const SamplingConvention conv = check_filters(op, top_k, top_p, min_p, p.convention, N, ct);
  torch::Tensor out = torch::empty({N}, torch::dtype(ct));
  if (N == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "logprobs_from_logits_threshold",
                                  [&] {
                                    using T = compute_t<scalar_t>;
                                    logits_threshold(logits.data_ptr<scalar_t>(), logits.stride(0),
                                                     inv_temperature.data_ptr<T>(), N, V,
                                                     filters_of<T>(top_k, top_p, min_p, conv), out.data_ptr<T>());
                                  });
  return out;
}

}  // namespace rlvr
