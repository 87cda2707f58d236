// Masked group-relative advantages on the CPU (docs/advantages.md), one score column per call. The
// contract (tensors, parameters, outputs) is written down in rlvr_kernels/ops/advantages.py;
// the parameters are GroupAdvantagesParams (advantages.h).
//
// Phases, each deterministic whatever the thread count (every group's samples are visited in
// sample order by one task; batch sums are over fixed chunks, combined in chunk order):
//   0. checks: the op is registered and reachable directly (and from compiled graphs), so every
//      shape relation the kernel relies on is checked here, not only in Python, and
//      cu_seqlens is sanitised (spans.h) so that spans are in bounds and disjoint;
//   1. token weights w_i (row sums of the mask) when OPO or token whitening needs them;
//   2. batch scalars (batch σ, GPG α);
//   3. group statistics in float64, one pass over a group's valid samples in sample order,
//      shifted by its first valid score (see Acc): a constant group gets σ = 0 and A = 0 exactly;
//   4. per group, the affine map A = (r − b)·f (or pass@k's two values) every estimator
//      reduces to;
//   5. per-sample advantages and keep flags, batch whitening, then the token broadcast
//      A_i · m_{i,t} written with streaming stores.
// The ways through 3–5, each summing a group's samples in sample order:
//   - contiguous groups (group_size > 0) and sorted ids (verl's and TRL's layout, detected by
//     one scan): each group is a run of rows, swept once while it is in L1;
//   - arbitrary ids over a moderate id range: a table of every group's accumulators (up to
//     kDirectTableBytes) per fixed range of the batch, filled in one pass and merged;
//   - arbitrary ids over a large id range: the valid samples are partitioned by id block (a
//     stable counting sort on id >> shift), so a block's accumulators stay in cache;
//   then, for arbitrary ids, a per-sample pass reads each sample's affine map.
// Which one runs depends on the inputs only (never on the thread count): the results are the
// same bits for any thread count.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "advantages.h"
#include "alloc.h"
#include "simd.h"
#include "spans.h"

namespace rlvr {
namespace {

constexpr const char* kOp = "group_advantages";
// The largest count (samples, groups, tokens) a call may use: rlvr_kernels._core.validation.MAX_COUNT.
constexpr int64_t kMaxCount = (int64_t(1) << 31) - 1;
constexpr int64_t kChunk = 4096;  // samples per partial sum of a batch scalar

// ------------------------------------------------------------------ 0. checked inputs
struct Inputs {
  GroupAdvantagesParams p;
  Baseline baseline;
  Scale scale;
  Whiten whiten;
  int64_t B = 0, G = 0, group_size = 0;
  torch::Tensor scores;   // [B] float32 or float64, contiguous
  torch::Tensor ids;      // [B] int32/int64, contiguous; undefined with group_size > 0
  torch::Tensor valid;    // [B] bool, contiguous, or undefined
  torch::Tensor lengths;  // [B] real, or undefined
  torch::Tensor mask;     // [B, L] (padded) or [T] (packed), contiguous, or undefined
  bool packed = false;    // cu_seqlens given
  std::vector<int64_t> cu;  // B + 1 sanitised offsets when packed
  int64_t T = 0;            // tokens of the packed layout
  bool has_layout() const { return packed || mask.defined(); }
};

void check_cpu(const torch::Tensor& t, const char* name, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
}

void check_per_sample(const torch::Tensor& t, const char* name, int64_t B, const char* op) {
  check_cpu(t, name, op);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == B, op, ": ", name, " must be [B] = [", B, "] like scores, got ",
              t.sizes());
  TORCH_CHECK(!t.is_complex(), op, ": ", name, " must be real, got ", t.scalar_type());
}

// Every relation the kernel relies on to stay in bounds: a violation is an error, never an
// out-of-bounds access (this is the only check a direct caller of the registered op meets).
Inputs check_inputs(const torch::Tensor& scores, const c10::optional<torch::Tensor>& group_index,
                    const c10::optional<torch::Tensor>& valid, const c10::optional<torch::Tensor>& lengths,
                    const c10::optional<torch::Tensor>& response_mask, const c10::optional<torch::Tensor>& cu_seqlens,
                    c10::ArrayRef<double> fparams, c10::ArrayRef<int64_t> iparams, at::ScalarType out_dtype,
                    const char* op) {
  Inputs in;
  in.p = GroupAdvantagesParams::unpack(fparams, iparams);
  const GroupAdvantagesParams& p = in.p;
  TORCH_CHECK(valid_Baseline(p.baseline), op, ": unknown baseline code ", p.baseline);
  TORCH_CHECK(valid_Scale(p.scale), op, ": unknown scale code ", p.scale);
  TORCH_CHECK(valid_Whiten(p.whiten), op, ": unknown whiten code ", p.whiten);
  in.baseline = Baseline(p.baseline);
  in.scale = Scale(p.scale);
  in.whiten = Whiten(p.whiten);
  TORCH_CHECK(in.baseline != Baseline::PASSK || p.passk_k >= 1, op, ": passk_k must be >= 1, got ", p.passk_k);
  TORCH_CHECK(at::isFloatingType(out_dtype), op, ": out_dtype must be a floating dtype, got ", out_dtype);

  check_cpu(scores, "scores", op);
  TORCH_CHECK(scores.dim() == 1 && at::isFloatingType(scores.scalar_type()), op,
              ": scores must be a 1-D float tensor [B], got ", scores.sizes(), " ", scores.scalar_type());
  const int64_t B = in.B = scores.size(0);
  TORCH_CHECK(B <= kMaxCount, op, ": B = ", B, " samples exceeds ", kMaxCount);
  const auto st = scores.scalar_type();
  in.scores = (st == torch::kFloat64 || st == torch::kFloat32 ? scores : scores.to(torch::kFloat32)).contiguous();

  const int64_t G = in.G = p.num_groups, gs = in.group_size = p.group_size;
  TORCH_CHECK(G >= 0 && G <= kMaxCount, op, ": num_groups must be in [0, ", kMaxCount, "], got ", G);
  TORCH_CHECK(gs >= 0 && gs <= kMaxCount, op, ": group_size must be in [0, ", kMaxCount, "], got ", gs);
  if (gs > 0) {
    TORCH_CHECK(!group_index.has_value(), op, ": group_index must be None with group_size > 0");
    TORCH_CHECK(G * gs == B, op, ": contiguous groups must cover the batch: num_groups ", G, " x group_size ", gs,
                " != B = ", B);
  } else {
    TORCH_CHECK(group_index.has_value(), op, ": group_index is required with group_size = 0");
    const torch::Tensor& g = *group_index;
    check_per_sample(g, "group_index", B, op);
    TORCH_CHECK(at::isIntegralType(g.scalar_type(), /*includeBool=*/false), op,
                ": group_index must hold integers, got ", g.scalar_type());
    const auto gt = g.scalar_type();
    in.ids = (gt == torch::kInt32 || gt == torch::kInt64 ? g : g.to(torch::kInt64)).contiguous();
  }
  if (valid.has_value()) {
    check_per_sample(*valid, "valid", B, op);
    in.valid = valid->to(torch::kBool).contiguous();
  }
  if (lengths.has_value()) {
    check_per_sample(*lengths, "lengths", B, op);
    in.lengths = *lengths;
  }
  if (response_mask.has_value()) {
    check_cpu(*response_mask, "response_mask", op);
    TORCH_CHECK(!response_mask->is_complex(), op, ": response_mask must be real, got ",
                response_mask->scalar_type());
    in.mask = response_mask->contiguous();
  }
  if (cu_seqlens.has_value()) {
    check_cpu(*cu_seqlens, "cu_seqlens", op);
    in.packed = true;
    if (in.mask.defined()) {
      TORCH_CHECK(in.mask.dim() == 1, op, ": a packed response_mask must be [T], got ", in.mask.sizes());
      in.T = in.mask.size(0);
    } else {
      in.T = p.num_tokens;
      TORCH_CHECK(in.T >= 0 && in.T <= kMaxCount, op, ": num_tokens must be in [0, ", kMaxCount,
                  "] for a packed layout without response_mask, got ", in.T);
    }
    TORCH_CHECK(cu_seqlens->dim() == 1 && cu_seqlens->numel() == B + 1, op, ": cu_seqlens must be [B + 1] = [",
                B + 1, "], got ", cu_seqlens->sizes());
    in.cu = sanitized_offsets(*cu_seqlens, in.T, op);
  } else if (in.mask.defined()) {
    TORCH_CHECK(in.mask.dim() == 2 && in.mask.size(0) == B, op, ": a padded response_mask must be [B, L] with B = ",
                B, ", got ", in.mask.sizes());
  }
  return in;
}

// ------------------------------------------------------------------ small helpers
// x/(σ + eps) or x/sqrt(σ² + eps). A zero divisor only happens with eps = 0 and all
// scores equal, where x = 0 as well: the result is 0, never NaN.
inline double divide(double x, double sigma, double eps, bool eps_in_sqrt) {
  const double d = eps_in_sqrt ? std::sqrt(sigma * sigma + eps) : sigma + eps;
  return d > 0.0 ? x / d : 0.0;
}

// Σ over fixed chunks, combined in chunk order: the result does not depend on threads.
template <typename F>
double chunked_sum(int64_t n, const F& term) {
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(nchunks, 0.0);
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      double s = 0.0;
      const int64_t end = std::min(n, (c + 1) * kChunk);
      for (int64_t i = c * kChunk; i < end; ++i) s += term(i);
      partial[c] = s;
    }
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

// t in dtype: t itself when it has it, else a converted copy in an output from the cache
// (`Tensor::to` would allocate through ATen and pay fresh page faults on every call).
torch::Tensor cast_output(const torch::Tensor& t, at::ScalarType dtype) {
  if (t.scalar_type() == dtype) return t;
  torch::Tensor out = empty_output(t.sizes(), dtype);
  out.copy_(t);
  return out;
}

// A float64 copy of t in a workspace from the output cache (no page faults once warm).
torch::Tensor to_double(const torch::Tensor& t) {
  auto c = t.contiguous();
  torch::Tensor out = empty_output({c.numel()}, torch::kFloat64);
  double* o = out.data_ptr<double>();
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, c.scalar_type(), "rlvr_to_double", [&] {
    const scalar_t* p = c.data_ptr<scalar_t>();
    at::parallel_for(0, c.numel(), 1 << 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) o[i] = static_cast<double>(p[i]);
    });
  });
  return out;
}

// Sample i counts (is "valid") when not masked out, its score is finite and its group id is
// in [0, G). Ids come from the caller: they are range-checked before they address anything.
template <typename T, typename idx_t>
struct SampleView {
  const T* r;
  const idx_t* g;     // ids; nullptr with contiguous groups (group of row i = i / group_size)
  const bool* vm;     // nullptr: no sample mask
  const double* w;    // token weights, or nullptr (weight 1)
  int64_t G, group_size;

  inline bool in_range(int64_t i) const { return g == nullptr || uint64_t(g[i]) < uint64_t(G); }
  inline bool ok(int64_t i) const { return (vm == nullptr || vm[i]) && std::isfinite(r[i]) && in_range(i); }
  inline int64_t group(int64_t i) const { return g == nullptr ? i / group_size : int64_t(g[i]); }
  inline double weight(int64_t i) const { return w == nullptr ? 1.0 : w[i]; }
};

// ------------------------------------------------------------------ 1. token weights
// w_i = Σ_t m_{i,t} (padded rows, or packed spans; a packed layout without a mask: span lengths).
torch::Tensor token_weights(const Inputs& in) {
  if (in.lengths.defined()) return to_double(in.lengths);
  if (!in.has_layout()) return torch::Tensor();
  const int64_t B = in.B;
  torch::Tensor wt = empty_output({B}, torch::kFloat64);
  double* w = wt.data_ptr<double>();
  if (!in.mask.defined()) {
    for (int64_t i = 0; i < B; ++i) w[i] = double(in.cu[i + 1] - in.cu[i]);
    return wt;
  }
  const int64_t L = in.packed ? 0 : in.mask.size(1);
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, in.mask.scalar_type(), "rlvr_token_weights", [&] {
    const scalar_t* m = in.mask.data_ptr<scalar_t>();
    at::parallel_for(0, B, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = in.packed ? in.cu[i] : i * L, e = in.packed ? in.cu[i + 1] : (i + 1) * L;
        double s = 0.0;
        for (int64_t t = b; t < e; ++t) s += static_cast<double>(m[t]);
        w[i] = s;
      }
    });
  });
  return wt;
}

// ------------------------------------------------------------------ 2. batch scalars
struct Batch {
  double sigma = 0.0;      // σ over all valid scores (Scale::BATCH)
  double gpg_alpha = 1.0;  // B_valid / max(#{valid r ≠ 0}, 1) (Baseline::GPG)
};

template <typename View>
Batch batch_scalars(const Inputs& in, const View& v) {
  Batch out;
  const bool batch_sigma = in.baseline == Baseline::MEAN && in.scale == Scale::BATCH;
  if (!batch_sigma && in.baseline != Baseline::GPG) return out;
  const int64_t B = in.B;
  const double n_valid = chunked_sum(B, [&](int64_t i) { return double(v.ok(i)); });
  if (batch_sigma && n_valid > 0) {
    const double mu = chunked_sum(B, [&](int64_t i) { return v.ok(i) ? double(v.r[i]) : 0.0; }) / n_valid;
    const double m2 = chunked_sum(B, [&](int64_t i) {
      const double d = double(v.r[i]) - mu;
      return v.ok(i) ? d * d : 0.0;
    });
    const double denom = in.p.std_unbiased ? n_valid - 1 : n_valid;
    out.sigma = denom > 0 ? std::sqrt(m2 / denom) : 0.0;
  }
  if (in.baseline == Baseline::GPG) {
    const double nonzero = chunked_sum(B, [&](int64_t i) { return double(v.ok(i) && v.r[i] != 0.0); });
    out.gpg_alpha = n_valid / std::max(nonzero, 1.0);
  }
  return out;
}

// ------------------------------------------------------------------ 3. group statistics
// The per-sample extras a baseline accumulates, a compile-time choice: the common baselines
// need none, and their accumulation loop is the hot one.
// ALL: every column of the data-parallel partials (group_partials / group_apply).
enum class Extras { NONE, OPO, PASSK, ALL };
template <Extras E>
using ExtrasTag = std::integral_constant<Extras, E>;

template <typename F>
void with_extras(Baseline baseline, const F& f) {
  if (baseline == Baseline::OPO)
    f(ExtrasTag<Extras::OPO>{});
  else if (baseline == Baseline::PASSK)
    f(ExtrasTag<Extras::PASSK>{});
  else
    f(ExtrasTag<Extras::NONE>{});
}

template <Extras E>
struct AccExtras {};
template <>
struct AccExtras<Extras::OPO> {
  double wx = 0.0, w = 0.0;  // Σ w·x, Σ w
};
template <>
struct AccExtras<Extras::PASSK> {
  double incorrect = 0.0;  // #{x <= 0}
};
template <>
struct AccExtras<Extras::ALL> {
  double wx = 0.0, w = 0.0, incorrect = 0.0;
  double nonzero = 0.0;  // #{x != 0} (GPG's α)
};
constexpr bool has_weights(Extras e) { return e == Extras::OPO || e == Extras::ALL; }
constexpr bool has_incorrect(Extras e) { return e == Extras::PASSK || e == Extras::ALL; }

// One group's accumulators, filled in one pass over its valid samples in sample order and
// shifted by its first valid score x₁ (d = x − x₁): n, Σd, Σd², so μ = x₁ + Σd/n and
// m2 = Σd² − (Σd)²/n. The shift keeps the cancellation harmless (Σd² ≤ (2n + 1)·m2 with x₁
// inside the group's range) and makes a constant group exact: d = 0, so μ = x₁, σ = 0, A = 0.
// 32 bytes without extras: two groups per cache line.
template <Extras E>
struct Acc {
  double first = 0.0;   // x₁
  double s = 0.0;       // Σd
  double s2 = 0.0;      // Σd²
  int32_t n = 0;        // (B < 2^31)
  int32_t differs = 0;  // some valid score differs from x₁ (group_degenerate is its negation)
  [[no_unique_address]] AccExtras<E> ex;

  RLVR_INLINE void add(double x, double w) {
    first = n == 0 ? x : first;
    n += 1;
    const double d = x - first;
    s += d;
    s2 += d * d;
    differs |= d != 0.0;
    if constexpr (has_weights(E)) {
      ex.wx += w * x;
      ex.w += w;
    }
    if constexpr (has_incorrect(E)) ex.incorrect += x <= 0.0 ? 1.0 : 0.0;
    if constexpr (E == Extras::ALL) ex.nonzero += x != 0.0 ? 1.0 : 0.0;
    (void)w;
  }
  // The accumulators of the samples that follow (the next range of the batch): their sums
  // re-shifted to x₁ (Δ = x₁' − x₁: Σ(x − x₁) = s' + n'Δ, Σ(x − x₁)² = s2' + 2Δs' + n'Δ²),
  // which is exact for a constant group (Δ = s' = s2' = 0).
  RLVR_INLINE void merge(const Acc& b) {
    if (b.n == 0) return;
    if (n == 0) {
      *this = b;
      return;
    }
    const double delta = b.first - first, nb = double(b.n);
    s2 += b.s2 + 2.0 * delta * b.s + nb * delta * delta;
    s += b.s + nb * delta;
    n += b.n;
    differs |= b.differs | int32_t(delta != 0.0);
    if constexpr (has_weights(E)) {
      ex.wx += b.ex.wx;
      ex.w += b.ex.w;
    }
    if constexpr (has_incorrect(E)) ex.incorrect += b.ex.incorrect;
    if constexpr (E == Extras::ALL) ex.nonzero += b.ex.nonzero;
  }
};

// 1/n from a table for small n: the per-group step of many small groups is otherwise bound by
// the divider (three divisions and a square root per group).
inline double reciprocal(int64_t n) {
  constexpr int64_t kTable = 4096;
  static const std::vector<double> table = [] {
    std::vector<double> t(kTable, 0.0);
    for (int64_t i = 1; i < kTable; ++i) t[i] = 1.0 / double(i);
    return t;
  }();
  return n < kTable ? table[n] : 1.0 / double(n);
}

// ------------------------------------------------------------------ 4. per-group affine map
struct Affine {
  double b, f;  // A = (r − b)·f; pass@k: A = b if r > 0 else f
};

// Analytic pass@k advantages of a group with n valid samples, n_neg of them incorrect.
void passk_values(int64_t n, int64_t n_neg, int64_t k, double eps, bool eps_in_sqrt, double& pos, double& neg) {
  if (n < k) {
    pos = neg = 0.0;
    return;
  }
  // C(n_neg, k)/C(n, k) = Π_{j<k} (n_neg − j)/(n − j); C(a, b) = 0 when a < b.
  double all_neg = 1.0;
  for (int64_t j = 0; j < k; ++j) all_neg *= double(std::max<int64_t>(n_neg - j, 0)) / double(n - j);
  double drop = n_neg >= 1 ? 1.0 : 0.0;  // C(n_neg − 1, k − 1)/C(n − 1, k − 1)
  for (int64_t j = 0; n_neg >= 1 && j < k - 1; ++j)
    drop *= double(std::max<int64_t>(n_neg - 1 - j, 0)) / double(n - 1 - j);
  // Written with a = 1 − R̄ = C(n_neg, k)/C(n, k) directly: 1 − (1 − a) would cancel.
  const double s = std::sqrt(all_neg * (1.0 - all_neg));
  pos = divide(all_neg, s, eps, eps_in_sqrt);
  neg = divide(all_neg - drop, s, eps, eps_in_sqrt);
}

// The per-group step: group k's outputs from its accumulators, and the affine map of its
// advantages. Everything it reads is a member (a copy made once per call), so the loops that
// call it keep these in registers across the stores of the outputs.
struct GroupFinish {
  Baseline baseline;
  Scale scale;
  bool std_unbiased, singleton_raw, eps_in_sqrt;
  double eps;
  int64_t passk_k;
  Batch batch;
  // The op's group outputs (mean and std staged in float64).
  int64_t* count;
  bool* degenerate;
  double* mean;
  double* sd;

  // 1/(σ + eps) or 1/sqrt(σ² + eps); 0 for a zero divisor.
  RLVR_INLINE double inverse(double sigma) const { return divide(1.0, sigma, eps, eps_in_sqrt); }

  RLVR_INLINE void set_empty(int64_t k) const {  // a group with no valid sample
    count[k] = 0;
    mean[k] = sd[k] = 0.0;
    degenerate[k] = true;
  }

  // Out of line for the sweeps, where inlining it crowds the registers of the per-row loops;
  // inlined into the loops over groups (direct and block statistics).
  template <Extras E>
  __attribute__((noinline)) Affine outlined(const Acc<E>& a, int64_t k) const {
    return (*this)(a, k);
  }

  template <Extras E>
  RLVR_INLINE Affine operator()(const Acc<E>& a, int64_t k) const {
    const int64_t n = a.n;
    if (n == 0) {
      set_empty(k);
      return {0.0, 0.0};
    }
    const double d = a.s * reciprocal(n);
    const double mu = a.first + d;  // exact for a constant group: d = 0
    const int64_t denom = std_unbiased ? n - 1 : n;
    const double sigma = denom > 0 ? std::sqrt(std::max(0.0, a.s2 - a.s * d) * reciprocal(denom)) : 0.0;
    count[k] = n;
    mean[k] = mu;
    sd[k] = sigma;
    degenerate[k] = !a.differs;
    if (baseline == Baseline::NONE) return {0.0, 1.0};
    if constexpr (has_incorrect(E)) {
      if (E == Extras::PASSK || baseline == Baseline::PASSK) {
        Affine t;
        passk_values(n, int64_t(a.ex.incorrect), passk_k, eps, eps_in_sqrt, t.b, t.f);
        return t;
      }
    }
    if (n == 1) {
      // singleton: A = 0, or verl's loop rule (mean 0 and std 1 for a lone sample)
      const double f = baseline == Baseline::MEAN && scale != Scale::NONE ? inverse(1.0)
                       : baseline == Baseline::GPG                       ? batch.gpg_alpha
                                                                         : 1.0;
      return {0.0, singleton_raw ? f : 0.0};
    }
    switch (baseline) {
      case Baseline::MEAN:
        return {mu, scale == Scale::GROUP ? inverse(sigma) : scale == Scale::BATCH ? inverse(batch.sigma) : 1.0};
      case Baseline::RLOO:
        return {mu, double(n) / double(n - 1)};
      case Baseline::OPO:  // no tokens at all: equal weights
        if constexpr (has_weights(E)) return {a.ex.w > 0 ? a.ex.wx / a.ex.w : mu, 1.0};
        return {mu, 1.0};
      default:  // GPG
        return {mu, batch.gpg_alpha};
    }
  }
};

RLVR_INLINE double advantage(Baseline baseline, const Affine& t, double x) {
  return baseline == Baseline::PASSK ? (x > 0.0 ? t.b : t.f) : (x - t.b) * t.f;
}

// ------------------------------------------------------------------ 3–5 for contiguous groups
// A note on the hot loops below: they take the view, pointers and codes as local copies (by
// value), never through the references a lambda captures. Their stores go through bool
// pointers, which may alias anything, so values read through a reference would be reloaded
// from memory after every store.

// Rows [i0, i1) form group k: its statistics, affine map, advantages and keep flags in one
// sweep while the rows are in L1.
template <Extras E, typename View, typename out_t>
RLVR_INLINE void sweep_group(const View v, const GroupFinish& fin, int64_t k, int64_t i0, int64_t i1,
                             out_t* const adv, bool* const keep) {
  Acc<E> a;
  for (int64_t i = i0; i < i1; ++i)
    if (v.ok(i)) a.add(v.r[i], v.weight(i));
  const Affine t = fin.outlined(a, k);
  const bool kept = a.n > 0 && a.differs != 0;  // not degenerate
  for (int64_t i = i0; i < i1; ++i) {
    const bool ok = v.ok(i);
    adv[i] = static_cast<out_t>(ok ? advantage(fin.baseline, t, v.r[i]) : 0.0);
    keep[i] = ok && kept;
  }
}

// group_size > 0: group k is rows [k·G, (k+1)·G).
template <typename View, typename out_t>
void sweep_fixed_groups(const Inputs& in, const View v, const GroupFinish& fin, out_t* adv, bool* keep) {
  const int64_t gs = in.group_size;
  with_extras(in.baseline, [&](auto tag) {
    at::parallel_for(0, in.G, std::max<int64_t>(1, 16384 / gs), [&](int64_t k0, int64_t k1) {
      const View lv = v;
      const GroupFinish lf = fin;
      out_t* const o = adv;
      bool* const kp = keep;
      for (int64_t k = k0; k < k1; ++k) sweep_group<decltype(tag)::value>(lv, lf, k, k * gs, (k + 1) * gs, o, kp);
    });
  });
}

// Whether the ids are non-decreasing (verl and TRL lay a batch out group by group): then each
// group is one run of rows and needs no partition.
template <typename idx_t>
bool ids_sorted(const idx_t* g, int64_t B) {
  constexpr int64_t kPiece = 1 << 16;
  std::atomic<bool> sorted{true};
  at::parallel_for(0, (B + kPiece - 1) / kPiece, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1 && sorted.load(std::memory_order_relaxed); ++c) {
      const int64_t i0 = std::max<int64_t>(c * kPiece, 1), i1 = std::min(B, (c + 1) * kPiece);
      bool ok = true;
      for (int64_t i = i0; i < i1; ++i) ok &= g[i - 1] <= g[i];
      if (!ok) sorted.store(false, std::memory_order_relaxed);
    }
  });
  return sorted.load();
}

// Sorted ids: every run of equal ids is one group (or, for an id outside [0, G), excluded
// rows). Pieces of the batch start at run starts, so a run is swept by exactly one task;
// groups no row names are empty.
template <typename View, typename out_t>
void sweep_sorted_runs(const Inputs& in, const View v, const GroupFinish& fin, out_t* adv, bool* keep) {
  const int64_t B = in.B, G = in.G;
  at::parallel_for(0, G, 1 << 14, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) fin.set_empty(k);
  });
  const int64_t pieces = std::min<int64_t>(B, 8 * int64_t(std::max(1, at::get_num_threads())));
  std::vector<int64_t> start(size_t(pieces + 1), B);
  for (int64_t p = 0; p < pieces; ++p) {
    const int64_t i = B * p / pieces;  // forward to the next run start (a binary search: the ids are sorted)
    start[p] = i == 0 ? 0 : std::upper_bound(v.g + i, v.g + B, v.g[i - 1]) - v.g;
  }
  with_extras(in.baseline, [&](auto tag) {
    at::parallel_for(0, pieces, 1, [&](int64_t p0, int64_t p1) {
      const View lv = v;
      const GroupFinish lf = fin;
      out_t* const o = adv;
      bool* const kp = keep;
      for (int64_t p = p0; p < p1; ++p) {
        for (int64_t i = start[p], end = std::max(start[p], start[p + 1]); i < end;) {
          int64_t j = i + 1;
          while (j < B && lv.g[j] == lv.g[i]) ++j;
          if (lv.in_range(i)) {
            sweep_group<decltype(tag)::value>(lv, lf, lv.group(i), i, j, o, kp);
          } else {
            for (int64_t t = i; t < j; ++t) o[t] = static_cast<out_t>(0.0), kp[t] = false;
          }
          i = j;
        }
      }
    });
  });
}

// ------------------------------------------------------------------ 3–5 for arbitrary ids
// A moderate id range (a table of every group's accumulators fits in L2/L3): no partition.
// The batch is split into a fixed number of sample ranges (it depends on B only, so the
// numbers do not depend on the thread count); each range accumulates the groups it names into
// its own table in sample order, and the tables are merged in range order (Acc::merge).
constexpr int64_t kDirectTableBytes = int64_t(4) << 20;

// Two ranges for a large batch: its halves are filled in parallel (each range costs a table,
// so more ranges would buy parallelism with memory traffic); one for a small batch.
int64_t direct_parts(int64_t B) { return B >= (int64_t(1) << 17) ? 2 : 1; }

template <Extras E>
bool use_direct_tables(int64_t G) {
  return G * int64_t(sizeof(Acc<E>)) <= kDirectTableBytes;
}

template <Extras E, typename View>
void direct_statistics(const Inputs& in, const View v, const GroupFinish& fin, Affine* affine) {
  const int64_t B = in.B, G = in.G, M = direct_parts(B);
  torch::Tensor tables_t = empty_output({M * G * int64_t(sizeof(Acc<E>))}, torch::kUInt8);
  Acc<E>* const tables = reinterpret_cast<Acc<E>*>(tables_t.data_ptr<uint8_t>());
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    const View lv = v;
    for (int64_t m = m0; m < m1; ++m) {
      Acc<E>* const t = tables + m * G;
      std::fill(t, t + G, Acc<E>{});  // (by the thread that fills it)
      const int64_t i0 = B * m / M, end = B * (m + 1) / M;
      constexpr int64_t kAhead = 24;  // the table outgrows L2: fetch a sample's accumulators early
      for (int64_t i = i0; i < end; ++i) {
        if (i + kAhead < end && lv.in_range(i + kAhead)) __builtin_prefetch(t + lv.group(i + kAhead), 1);
        if (lv.ok(i)) t[lv.group(i)].add(lv.r[i], lv.weight(i));
      }
    }
  });
  at::parallel_for(0, G, 2048, [&](int64_t k0, int64_t k1) {
    const GroupFinish lf = fin;
    const Acc<E>* const t = tables;
    Affine* const af = affine;
    for (int64_t k = k0; k < k1; ++k) {
      Acc<E> a = t[k];
      for (int64_t m = 1; m < M; ++m) a.merge(t[m * G + k]);
      af[k] = lf(a, k);
    }
  });
}

// A large id range: the valid samples grouped by id block (id >> shift) by a stable counting
// sort, chunk by chunk: chunk c's records (id, score) are [c·chunk, c·chunk + n_c) of the
// array, block b's part of them [seg(c, b), seg(c, b + 1)), in sample order. Counting and
// scattering a chunk back to back reads its ids and scores from memory once. The layout
// depends on the chunk size only.
template <typename T>
struct Record {
  int32_t key;  // group id
  T x;          // score
};

template <typename T>
struct Blocks {
  int shift = 0;
  int64_t count = 0, nchunks = 0;
  std::vector<int64_t> seg;  // nchunks × (count + 1)
  torch::Tensor records;     // Record<T> [B] (as bytes)
  torch::Tensor weights;     // double [B] (OPO's token weights) or undefined
  const Record<T>* data() const { return reinterpret_cast<const Record<T>*>(records.data_ptr<uint8_t>()); }
  const int64_t* segments(int64_t c) const { return seg.data() + c * (count + 1); }
};

// Blocks small enough that a block's accumulators stay in L1 (Acc: 32 to 48 bytes), and enough of
// them for every thread to have several; capped in number (the counting sort's tables grow
// with it), so a huge id range gets larger blocks.
int block_shift(int64_t G) {
  constexpr int kFine = 9, kMaxBlocks = 1024;  // kMaxBlocks + 1 < 2^16: a block id fits uint16
  int coarse = 0;
  while ((G >> coarse) > kMaxBlocks) ++coarse;
  const int64_t want = 4 * int64_t(std::max(1, at::get_num_threads()));
  int fine = kFine;
  while (fine > 0 && (G >> fine) < want) --fine;
  return std::max(coarse, fine);
}

template <typename T, typename View>
Blocks<T> partition_by_block(const Inputs& in, const View v, bool with_weights) {
  Blocks<T> out;
  const int64_t B = in.B, G = in.G;
  const int shift = out.shift = block_shift(G);
  const int64_t nb = out.count = G == 0 ? 0 : ((G - 1) >> shift) + 1;
  const int64_t chunk = std::max<int64_t>(16384, (B + 255) / 256);
  const int64_t nchunks = out.nchunks = (B + chunk - 1) / chunk;
  out.seg.assign(size_t(nchunks * (nb + 1)), 0);
  out.records = empty_output({B * int64_t(sizeof(Record<T>))}, torch::kUInt8);
  if (with_weights) out.weights = empty_output({B}, torch::kFloat64);
  Record<T>* rec = reinterpret_cast<Record<T>*>(out.records.template data_ptr<uint8_t>());
  double* w = with_weights ? out.weights.template data_ptr<double>() : nullptr;
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    // A chunk's block of each sample (nb: excluded), counted in four interleaved histograms:
    // runs of one block (nearly sorted ids) would otherwise chain every increment through the
    // same counter.
    const View lv = v;
    const int64_t nbl = nb, nh = nb + 1, n = B;
    const int sh = shift;
    std::vector<int32_t> hist_v(static_cast<size_t>(4 * nh));
    std::vector<int64_t> cur_v(static_cast<size_t>(nb));
    std::vector<uint16_t> block_v(static_cast<size_t>(chunk));
    int32_t* const hist = hist_v.data();
    int64_t* const cur = cur_v.data();
    uint16_t* const block = block_v.data();
    Record<T>* const rp = rec;
    double* const wp = w;
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t i0 = c * chunk, i1 = std::min(n, i0 + chunk);
      std::fill(hist, hist + 4 * nh, 0);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = lv.ok(i) ? lv.group(i) >> sh : nbl;
        block[i - i0] = uint16_t(b);
        ++hist[(i & 3) * nh + b];
      }
      int64_t* seg = out.seg.data() + c * nh;
      int64_t pos = i0;
      for (int64_t b = 0; b < nbl; ++b) {
        seg[b] = cur[b] = pos;
        pos += int64_t(hist[b]) + hist[nh + b] + hist[2 * nh + b] + hist[3 * nh + b];
      }
      seg[nbl] = pos;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = block[i - i0];
        if (b == nbl) continue;
        const int64_t j = cur[b]++;
        rp[j].key = int32_t(lv.g[i]);
        rp[j].x = lv.r[i];
        if (wp != nullptr) wp[j] = lv.weight(i);
      }
    }
  });
  return out;
}

// Statistics of every group from the blocks, block by block in parallel (block b's groups are
// the id range [b << shift, (b + 1) << shift), its records chunk by chunk in sample order);
// fills the group outputs and the affine table.
template <typename T>
void block_statistics(const Inputs& in, const Blocks<T>& blocks, const GroupFinish& fin, Affine* affine) {
  const int64_t G = in.G, width = std::min<int64_t>(G, int64_t(1) << blocks.shift);
  const Record<T>* rec = blocks.data();
  const double* w = blocks.weights.defined() ? blocks.weights.template data_ptr<double>() : nullptr;
  with_extras(in.baseline, [&](auto tag) {
    at::parallel_for(0, blocks.count, 1, [&](int64_t b0, int64_t b1) {
      constexpr Extras E = decltype(tag)::value;
      std::vector<Acc<E>> acc_v(static_cast<size_t>(width));
      Acc<E>* const acc = acc_v.data();
      const Record<T>* const rp = rec;
      const double* const wp = w;
      const int shift = blocks.shift;
      const int64_t nchunks = blocks.nchunks;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t k0 = b << shift, k1 = std::min(G, k0 + width);
        std::fill(acc, acc + (k1 - k0), Acc<E>{});
        for (int64_t c = 0; c < nchunks; ++c) {
          const int64_t* seg = blocks.segments(c);
          // Every id of block b is in [k0, k1) (the partition put it there): acc[id − k0] is in bounds.
          for (int64_t j = seg[b], j1 = seg[b + 1]; j < j1; ++j)
            acc[rp[j].key - k0].add(rp[j].x, wp == nullptr ? 1.0 : wp[j]);
        }
        const GroupFinish lf = fin;
        for (int64_t k = k0; k < k1; ++k) affine[k] = lf(acc[k - k0], k);
      }
    });
  });
}

// Per-sample advantages and keep flags of arbitrary ids, from the affine table.
template <typename View, typename out_t>
void sample_advantages(const Inputs& in, const View v, const Affine* affine, const bool* degenerate, out_t* adv,
                       bool* keep) {
  at::parallel_for(0, in.B, 1 << 14, [&](int64_t i0, int64_t i1) {
    const View lv = v;
    const Baseline baseline = in.baseline;
    const Affine* const table = affine;
    const bool* const deg = degenerate;
    out_t* const o = adv;
    bool* const kp = keep;
    for (int64_t i = i0; i < i1; ++i) {
      if (lv.ok(i)) {
        const int64_t k = lv.group(i);
        o[i] = static_cast<out_t>(advantage(baseline, table[k], lv.r[i]));
        kp[i] = !deg[k];
      } else {
        o[i] = static_cast<out_t>(0.0);
        kp[i] = false;
      }
    }
  });
}

// ------------------------------------------------------------------ 5. whitening and tokens
// A ← (A − mean_w)/σ_w with weights w_i (tokens) or 1 (samples) over valid samples; the
// variance ÷(W − 1) (whiten_std_unbiased) or ÷W, and eps added or, with whiten_eps_clamp, a
// floor of the divisor (OpenRLHF's var.clamp(min=eps).rsqrt()).
template <typename View>
void whiten(const Inputs& in, const View& v, double* a) {
  const bool by_tokens = in.whiten == Whiten::TOKENS && v.w != nullptr;
  auto weight = [&](int64_t i) { return v.ok(i) ? (by_tokens ? v.w[i] : 1.0) : 0.0; };
  const int64_t B = in.B;
  const double W = chunked_sum(B, weight);
  const double mu = W > 0 ? chunked_sum(B, [&](int64_t i) { return weight(i) * a[i]; }) / W : 0.0;
  const double m2 = chunked_sum(B, [&](int64_t i) { return weight(i) * (a[i] - mu) * (a[i] - mu); });
  const bool unbiased = in.p.whiten_std_unbiased != 0;
  const double var = unbiased ? (W > 1 ? m2 / (W - 1) : 0.0) : (W > 0 ? m2 / W : 0.0);
  const double sigma = std::sqrt(var), eps = in.p.whiten_eps;
  const bool in_sqrt = in.p.whiten_eps_in_sqrt != 0;
  // The clamp as a divisor with eps 0: sqrt(max(v, eps)) or max(sqrt(v), eps).
  const double clamped = in_sqrt ? std::sqrt(std::max(var, eps)) : std::max(sigma, eps);
  const bool clamp = in.p.whiten_eps_clamp != 0;
  at::parallel_for(0, B, 1 << 14, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      a[i] = weight(i) > 0 ? (clamp ? divide(a[i] - mu, clamped, 0.0, false) : divide(a[i] - mu, sigma, eps, in_sqrt))
                           : 0.0;
  });
}

// Token values are computed in float (what `adv[:, None] * mask` gives for a float32
// result) and in double for a float64 result.
template <typename out_t>
using token_math_t = std::conditional_t<std::is_same<out_t, double>::value, double, float>;

// out[t] = a · m[t] for t in [0, n).
template <typename mask_t, typename out_t>
inline void scale_row(out_t* out, const mask_t* m, double a, int64_t n) {
  using T = token_math_t<out_t>;
  const T av = static_cast<T>(a);
  for (int64_t t = 0; t < n; ++t) out[t] = static_cast<out_t>(av * static_cast<T>(m[t]));
}

#if defined(__SSE2__)
// The common case (fp32 mask, fp32 output): streaming stores skip the read-for-ownership
// of the output lines, a third of the memory traffic of a plain `torch.mul`.
template <>
inline void scale_row<float, float>(float* out, const float* m, double a_in, int64_t n) {
  const float a = static_cast<float>(a_in);
  int64_t t = 0;
  for (; t < n && (reinterpret_cast<uintptr_t>(out + t) & 15) != 0; ++t) out[t] = a * m[t];
  const __m128 va = _mm_set1_ps(a);
  for (; t + 16 <= n; t += 16) {
    _mm_stream_ps(out + t, _mm_mul_ps(va, _mm_loadu_ps(m + t)));
    _mm_stream_ps(out + t + 4, _mm_mul_ps(va, _mm_loadu_ps(m + t + 4)));
    _mm_stream_ps(out + t + 8, _mm_mul_ps(va, _mm_loadu_ps(m + t + 8)));
    _mm_stream_ps(out + t + 12, _mm_mul_ps(va, _mm_loadu_ps(m + t + 12)));
  }
  for (; t + 4 <= n; t += 4) _mm_stream_ps(out + t, _mm_mul_ps(va, _mm_loadu_ps(m + t)));
  for (; t < n; ++t) out[t] = a * m[t];
}
#endif

template <typename out_t>
inline void fill_row(out_t* out, double a, int64_t n) {
  const out_t v = static_cast<out_t>(static_cast<token_math_t<out_t>>(a));
  for (int64_t t = 0; t < n; ++t) out[t] = v;
}

// Token advantages A_i · m_{i,t}: row i of a padded layout, or span [cu'[i], cu'[i+1]) of the
// packed one (sanitised offsets: in bounds and disjoint, so the parallel rows never overlap).
void broadcast_to_tokens(const Inputs& in, const double* adv, torch::Tensor& out) {
  const int64_t B = in.B;
  const int64_t L = in.packed ? 0 : out.size(1);
  const torch::Tensor& m = in.mask;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "rlvr_broadcast_out", [&] {
    using out_t = scalar_t;
    out_t* o = out.data_ptr<out_t>();
    if (in.packed) {  // tokens outside every span (only possible with validate=False) are zeroed
      fill_row(o, 0.0, in.cu[0]);
      fill_row(o + in.cu[B], 0.0, in.T - in.cu[B]);
    }
    auto rows = [&](auto* mp) {
      at::parallel_for(0, B, 16, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t b = in.packed ? in.cu[i] : i * L, e = in.packed ? in.cu[i + 1] : (i + 1) * L;
          if (mp == nullptr)
            fill_row(o + b, adv[i], e - b);
          else
            scale_row(o + b, mp + b, adv[i], e - b);
        }
      });
    };
    if (!m.defined()) {
      rows(static_cast<const float*>(nullptr));
    } else {
      AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, m.scalar_type(), "rlvr_broadcast_mask",
                                 [&] { rows(m.data_ptr<scalar_t>()); });
    }
  });
#if defined(__SSE2__)
  _mm_sfence();  // order the streaming stores before the tensor is handed out
#endif
}

using Result =
    std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>;

// The op's group outputs (mean and std staged in float64) and the per-group step writing them.
struct GroupOutputs {
  torch::Tensor count, degenerate, mean, sd;
  explicit GroupOutputs(int64_t G)
      : count(empty_output({G}, torch::kInt64)),
        degenerate(empty_output({G}, torch::kBool)),
        mean(empty_output({G}, torch::kFloat64)),
        sd(empty_output({G}, torch::kFloat64)) {}
  GroupFinish finish(const Inputs& in, const Batch& batch) {
    const GroupAdvantagesParams& p = in.p;
    return GroupFinish{in.baseline,
                       in.scale,
                       p.std_unbiased != 0,
                       p.singleton_raw != 0,
                       p.eps_in_sqrt != 0,
                       p.eps,
                       p.passk_k,
                       batch,
                       count.data_ptr<int64_t>(),
                       degenerate.data_ptr<bool>(),
                       mean.data_ptr<double>(),
                       sd.data_ptr<double>()};
  }
};

template <typename T, typename idx_t>
SampleView<T, idx_t> sample_view(const Inputs& in, const torch::Tensor& w_t) {
  return SampleView<T, idx_t>{in.scores.data_ptr<T>(),
                              in.ids.defined() ? in.ids.data_ptr<idx_t>() : nullptr,
                              in.valid.defined() ? in.valid.data_ptr<bool>() : nullptr,
                              w_t.defined() ? w_t.data_ptr<double>() : nullptr,
                              in.G,
                              in.group_size};
}

// Phase 5 and the outputs: whitening and the token broadcast of staged (float64) advantages,
// rounded once to out_dtype.
template <typename View>
Result outputs(const Inputs& in, const View& v, torch::Tensor adv_t, bool staged, const GroupOutputs& g,
               const torch::Tensor& keep_t, at::ScalarType out_dtype) {
  torch::Tensor token_adv;
  if (staged) {
    double* a = adv_t.data_ptr<double>();
    if (in.whiten != Whiten::OFF) whiten(in, v, a);
    if (in.has_layout()) {
      token_adv = in.packed ? empty_output({in.T}, out_dtype) : empty_output({in.B, in.mask.size(1)}, out_dtype);
      broadcast_to_tokens(in, a, token_adv);
    }
    adv_t = cast_output(adv_t, out_dtype);
  }
  if (!token_adv.defined()) token_adv = torch::empty({0}, torch::TensorOptions().dtype(out_dtype));
  return {adv_t, token_adv, cast_output(g.mean, out_dtype), cast_output(g.sd, out_dtype), g.count, g.degenerate,
          keep_t};
}

// Phases 1–5 for scores of type T and ids of type idx_t (unused with contiguous groups).
template <typename T, typename idx_t>
Result run(const Inputs& in, at::ScalarType out_dtype) {
  const int64_t B = in.B, G = in.G;
  const bool opo = in.baseline == Baseline::OPO;
  torch::Tensor w_t;
  if (opo || in.whiten == Whiten::TOKENS) w_t = token_weights(in);
  const SampleView<T, idx_t> v = sample_view<T, idx_t>(in, w_t);
  const Batch batch = batch_scalars(in, v);

  GroupOutputs groups(G);
  const GroupFinish fin = groups.finish(in, batch);
  torch::Tensor keep_t = empty_output({B}, torch::kBool);
  bool* keep = keep_t.data_ptr<bool>();
  // Advantages go straight to the output unless whitening or the token broadcast needs them
  // in float64 first.
  const bool staged = in.whiten != Whiten::OFF || in.has_layout();
  torch::Tensor adv_t = empty_output({B}, staged ? torch::kFloat64 : out_dtype);
  const bool fixed = in.group_size > 0;  // (an empty batch's ids have no data pointer at all)
  const bool sorted = fixed || ids_sorted(v.g, B);
  torch::Tensor affine_t;
  if (!sorted) {
    affine_t = empty_output({G, 2}, torch::kFloat64);
    Affine* const affine = reinterpret_cast<Affine*>(affine_t.data_ptr<double>());
    with_extras(in.baseline, [&](auto tag) {
      constexpr Extras E = decltype(tag)::value;
      if (use_direct_tables<E>(G)) {
        direct_statistics<E>(in, v, fin, affine);
      } else {
        const Blocks<T> blocks = partition_by_block<T>(in, v, opo);
        block_statistics(in, blocks, fin, affine);
      }
    });
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, adv_t.scalar_type(), "rlvr_advantages", [&] {
    scalar_t* adv = adv_t.data_ptr<scalar_t>();
    if (fixed)
      sweep_fixed_groups(in, v, fin, adv, keep);
    else if (sorted)
      sweep_sorted_runs(in, v, fin, adv, keep);
    else
      sample_advantages(in, v, reinterpret_cast<const Affine*>(affine_t.data_ptr<double>()), fin.degenerate, adv,
                        keep);
  });
  return outputs(in, v, adv_t, staged, groups, keep_t, out_dtype);
}

// ------------------------------------------------------------------ data parallel
// group_partials / group_apply: the statistics of a batch spread over W ranks. A rank's
// partials are Acc<ALL> of its valid samples, in sample order, one row per group
// (kPartialColumns, in PartialColumn order); group_apply merges W tables in rank order
// (Acc::merge) and runs the per-group step of one process over the merged accumulators.
constexpr const char* kPartialsOp = "group_partials";
constexpr const char* kApplyOp = "group_apply";
using AllAcc = Acc<Extras::ALL>;

void to_row(const AllAcc& a, bool weights, double* row) {
  row[int(PartialColumn::N)] = double(a.n);
  row[int(PartialColumn::FIRST)] = a.first;
  row[int(PartialColumn::S)] = a.s;
  row[int(PartialColumn::S2)] = a.s2;
  row[int(PartialColumn::DIFFERS)] = a.differs ? 1.0 : 0.0;
  row[int(PartialColumn::WX)] = weights ? a.ex.wx : 0.0;
  row[int(PartialColumn::W)] = weights ? a.ex.w : 0.0;
  row[int(PartialColumn::INCORRECT)] = a.ex.incorrect;
  row[int(PartialColumn::NONZERO)] = a.ex.nonzero;
}

// A row of partials from anywhere (another rank, a direct caller): its count must be a count.
AllAcc from_row(const double* row) {
  const double n = row[int(PartialColumn::N)];
  TORCH_CHECK(n >= 0.0 && n <= double(kMaxCount) && n == std::floor(n), kApplyOp,
              ": partials hold a sample count that is no integer in [0, ", kMaxCount, "]: ", n);
  AllAcc a;
  a.n = int32_t(n);
  a.first = row[int(PartialColumn::FIRST)];
  a.s = row[int(PartialColumn::S)];
  a.s2 = row[int(PartialColumn::S2)];
  a.differs = row[int(PartialColumn::DIFFERS)] != 0.0;
  a.ex.wx = row[int(PartialColumn::WX)];
  a.ex.w = row[int(PartialColumn::W)];
  a.ex.incorrect = row[int(PartialColumn::INCORRECT)];
  a.ex.nonzero = row[int(PartialColumn::NONZERO)];
  return a;
}

template <typename T, typename idx_t>
torch::Tensor partials_run(const Inputs& in) {
  const bool opo = in.baseline == Baseline::OPO;
  torch::Tensor w_t;
  if (opo) w_t = token_weights(in);
  const SampleView<T, idx_t> v = sample_view<T, idx_t>(in, w_t);
  // One pass in sample order (a group's sums then do not depend on how the batch is split
  // over threads); the batch of one rank.
  std::vector<AllAcc> acc(static_cast<size_t>(in.G));
  for (int64_t i = 0; i < in.B; ++i)
    if (v.ok(i)) acc[v.group(i)].add(v.r[i], v.weight(i));
  torch::Tensor out = torch::empty({in.G, kPartialColumns}, torch::TensorOptions().dtype(torch::kFloat64));
  double* o = out.data_ptr<double>();
  for (int64_t k = 0; k < in.G; ++k) to_row(acc[k], opo, o + k * kPartialColumns);
  return out;
}

// Σ v in a fixed pairwise order: (v0 + v1) + (v2 + v3) ..., an odd level padded with 0.
double tree_sum(std::vector<double> v) {
  while (v.size() > 1) {
    if (v.size() % 2) v.push_back(0.0);
    const size_t half = v.size() / 2;
    for (size_t i = 0; i < half; ++i) v[i] = v[2 * i] + v[2 * i + 1];
    v.resize(half);
  }
  return v.empty() ? 0.0 : v[0];
}

// The batch scalars of the merged groups: σ over all valid scores from the groups' moments
// (Chan et al.) and GPG's α, as sums over the groups in a fixed order.
Batch merged_batch_scalars(const Inputs& in, const std::vector<AllAcc>& acc) {
  Batch out;
  const bool batch_sigma = in.baseline == Baseline::MEAN && in.scale == Scale::BATCH;
  if (!batch_sigma && in.baseline != Baseline::GPG) return out;
  const size_t G = acc.size();
  std::vector<double> n(G), mu(G), m2(G), nonzero(G);
  for (size_t k = 0; k < G; ++k) {
    const AllAcc& a = acc[k];
    const double d = a.n > 0 ? a.s * reciprocal(a.n) : a.s;
    n[k] = double(a.n);
    mu[k] = a.n > 0 ? a.first + d : 0.0;
    m2[k] = std::max(0.0, a.s2 - a.s * d);
    nonzero[k] = a.ex.nonzero;
  }
  const double n_valid = tree_sum(n);
  if (batch_sigma && n_valid > 0) {
    std::vector<double> t(G);
    for (size_t k = 0; k < G; ++k) t[k] = n[k] * mu[k];
    const double mean = tree_sum(t) / n_valid;
    for (size_t k = 0; k < G; ++k) t[k] = m2[k] + n[k] * (mu[k] - mean) * (mu[k] - mean);
    const double total = tree_sum(t);
    const double denom = in.p.std_unbiased ? n_valid - 1 : n_valid;
    out.sigma = denom > 0 ? std::sqrt(total / denom) : 0.0;
  }
  if (in.baseline == Baseline::GPG) out.gpg_alpha = n_valid / std::max(tree_sum(nonzero), 1.0);
  return out;
}

template <typename T, typename idx_t>
Result apply_run(const Inputs& in, const torch::Tensor& partials, at::ScalarType out_dtype) {
  const int64_t B = in.B, G = in.G, W = partials.size(0);
  const double* P = partials.data_ptr<double>();
  std::vector<AllAcc> acc(static_cast<size_t>(G));
  at::parallel_for(0, G, 2048, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      AllAcc a;
      for (int64_t r = 0; r < W; ++r) {  // rank order: the batch concatenated rank after rank
        const AllAcc b = from_row(P + (r * G + k) * kPartialColumns);
        TORCH_CHECK(int64_t(a.n) + b.n <= kMaxCount, kApplyOp, ": group ", k, " has more than ", kMaxCount,
                    " samples");
        a.merge(b);
      }
      acc[k] = a;
    }
  });
  const SampleView<T, idx_t> v = sample_view<T, idx_t>(in, torch::Tensor());
  GroupOutputs groups(G);
  const GroupFinish fin = groups.finish(in, merged_batch_scalars(in, acc));
  torch::Tensor affine_t = empty_output({G, 2}, torch::kFloat64);
  Affine* const affine = reinterpret_cast<Affine*>(affine_t.data_ptr<double>());
  at::parallel_for(0, G, 2048, [&](int64_t k0, int64_t k1) {
    const GroupFinish lf = fin;
    for (int64_t k = k0; k < k1; ++k) affine[k] = lf(acc[k], k);
  });
  torch::Tensor keep_t = empty_output({B}, torch::kBool);
  const bool staged = in.has_layout();
  torch::Tensor adv_t = empty_output({B}, staged ? torch::kFloat64 : out_dtype);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, adv_t.scalar_type(), "rlvr_apply", [&] {
    sample_advantages(in, v, affine, fin.degenerate, adv_t.data_ptr<scalar_t>(), keep_t.data_ptr<bool>());
  });
  return outputs(in, v, adv_t, staged, groups, keep_t, out_dtype);
}

// The inputs' scalar types: float32/float64 scores, int32/int64 ids.
template <typename F>
auto with_types(const Inputs& in, const F& f) {
  const bool f64 = in.scores.scalar_type() == torch::kFloat64;
  const bool i32 = in.ids.defined() && in.ids.scalar_type() == torch::kInt32;
  if (f64) return i32 ? f(double(), int32_t()) : f(double(), int64_t());
  return i32 ? f(float(), int32_t()) : f(float(), int64_t());
}

}  // namespace

Result group_advantages_cpu(const torch::Tensor& scores, const c10::optional<torch::Tensor>& group_index,
                            const c10::optional<torch::Tensor>& valid, const c10::optional<torch::Tensor>& lengths,
                            const c10::optional<torch::Tensor>& response_mask,
                            const c10::optional<torch::Tensor>& cu_seqlens, c10::ArrayRef<double> fparams,
                            c10::ArrayRef<int64_t> iparams, at::ScalarType out_dtype) {
  const Inputs in = check_inputs(scores, group_index, valid, lengths, response_mask, cu_seqlens, fparams, iparams,
                                 out_dtype, kOp);
  return with_types(in, [&](auto t, auto i) { return run<decltype(t), decltype(i)>(in, out_dtype); });
}

torch::Tensor group_partials_cpu(const torch::Tensor& scores, const c10::optional<torch::Tensor>& group_index,
                                 const c10::optional<torch::Tensor>& valid, const c10::optional<torch::Tensor>& lengths,
                                 const c10::optional<torch::Tensor>& response_mask,
                                 const c10::optional<torch::Tensor>& cu_seqlens, c10::ArrayRef<double> fparams,
                                 c10::ArrayRef<int64_t> iparams) {
  const Inputs in = check_inputs(scores, group_index, valid, lengths, response_mask, cu_seqlens, fparams, iparams,
                                 torch::kFloat64, kPartialsOp);
  return with_types(in, [&](auto t, auto i) { return partials_run<decltype(t), decltype(i)>(in); });
}

Result group_apply_cpu(const torch::Tensor& scores, const c10::optional<torch::Tensor>& group_index,
                       const c10::optional<torch::Tensor>& valid, const c10::optional<torch::Tensor>& lengths,
                       const c10::optional<torch::Tensor>& response_mask,
                       const c10::optional<torch::Tensor>& cu_seqlens, const torch::Tensor& partials,
                       c10::ArrayRef<double> fparams, c10::ArrayRef<int64_t> iparams, at::ScalarType out_dtype) {
  const Inputs in = check_inputs(scores, group_index, valid, lengths, response_mask, cu_seqlens, fparams, iparams,
                                 out_dtype, kApplyOp);
  TORCH_CHECK(in.whiten == Whiten::OFF, kApplyOp,
              ": whiten must be OFF (whitening after the baseline needs every rank's advantages)");
  check_cpu(partials, "partials", kApplyOp);
  TORCH_CHECK(partials.scalar_type() == torch::kFloat64, kApplyOp, ": partials must be float64, got ",
              partials.scalar_type());
  TORCH_CHECK(partials.dim() == 3 && partials.size(1) == in.G && partials.size(2) == kPartialColumns, kApplyOp,
              ": partials must be [W, num_groups = ", in.G, ", ", kPartialColumns, "], got ", partials.sizes());
  const torch::Tensor p = partials.contiguous();
  return with_types(in, [&](auto t, auto i) { return apply_run<decltype(t), decltype(i)>(in, p, out_dtype); });
}

}  // namespace rlvr
