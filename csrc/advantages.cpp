// Masked group-relative advantages on the CPU (SPEC §1), one score column per call.
//
// Phases, each deterministic whatever the thread count:
//   1. token weights w_i (row sums of the mask) when OPO or token whitening needs them;
//   2. batch scalars (batch σ, GPG α): partial sums over fixed chunks of kChunk samples,
//      combined in chunk order;
//   3. per-group statistics in float64 by Welford's update (never Σr² − (Σr)²/n), in one
//      scan of the batch that visits each group's samples in sample order (parallel over
//      group-id ranges; one cache line of accumulators per group, since with shuffled
//      group ids every sample's update is a random access);
//   4. per group, the affine map A = (r − b_g)·f_g (or pass@k's two values) that every
//      estimator reduces to, in a 16-byte table that stays in cache for the next pass;
//   5. per-sample advantages (and optional batch whitening, chunked as in 2), then the
//      token broadcast A_i · m_{i,t} written with streaming stores.
// Inputs were validated in Python; anything that would index out of bounds (a group id
// outside [0, G), cu_seqlens out of order) is still made harmless here: such samples are
// treated as excluded and offsets are clamped.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "advantages.h"
#include "alloc.h"

namespace rlvr {
namespace {

constexpr int64_t kChunk = 4096;

enum Baseline : int64_t { kNone = 0, kMean = 1, kRloo = 2, kOpo = 3, kGpg = 4, kPassk = 5 };
enum Scale : int64_t { kScaleNone = 0, kScaleGroup = 1, kScaleBatch = 2 };
enum Whiten : int64_t { kWhitenOff = 0, kWhitenTokens = 1, kWhitenSamples = 2 };

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

// 1/n for Welford's update: a table lookup for small n takes the division (the slowest
// step of the update's dependency chain) off the per-sample path.
inline double reciprocal(int64_t n) {
  constexpr int kTable = 4096;
  static const std::vector<double> table = [] {
    std::vector<double> t(kTable);
    for (int i = 1; i < kTable; ++i) t[i] = 1.0 / double(i);
    return t;
  }();
  return n < kTable ? table[n] : 1.0 / double(n);
}

// With shuffled group ids every update is a random access into a group table: prefetch
// the entry kPrefetch samples ahead so the misses overlap instead of stalling one by one.
constexpr int64_t kPrefetch = 16;

template <typename T>
inline void prefetch_group(const T* table, const int64_t* g, int64_t i, int64_t end, int64_t G) {
#if defined(__GNUC__)
  if (g != nullptr && i + kPrefetch < end) {
    const int64_t k = g[i + kPrefetch];
    if (k >= 0 && k < G) __builtin_prefetch(table + k, 1);
  }
#endif
}

// Calls f(i, k) for every valid sample i of group k, each group's samples in sample order.
// Contiguous groups (group_size > 0: group k is rows [k·G, (k+1)·G)) are walked one group
// per task. Arbitrary ids are split into id ranges, one scan of the batch per range in
// parallel. Either way results do not depend on the split, and no two tasks touch the
// same group.
template <typename T, typename F>
void for_each_by_group(int64_t B, int64_t G, int64_t group_size, const int64_t* g, const uint8_t* valid, T* table,
                       const F& f) {
  if (B == 0 || G == 0) return;
  if (group_size > 0) {
    at::parallel_for(0, G, std::max<int64_t>(1, 16384 / group_size), [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k)
        for (int64_t i = k * group_size, end = std::min(B, (k + 1) * group_size); i < end; ++i)
          if (valid[i]) f(i, k);
    });
    return;
  }
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>({int64_t(at::get_num_threads()), G, 8, B / 32768 + 1}));
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t lo = G * p / parts, hi = G * (p + 1) / parts;
      for (int64_t i = 0; i < B; ++i) {
        prefetch_group(table, g, i, B, G);
        const int64_t k = g[i];
        if (valid[i] && k >= lo && k < hi) f(i, k);
      }
    }
  });
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

// Clamped [begin, end) of packed sequence i: never outside [0, T], never negative length.
inline void packed_span(const int64_t* cu, int64_t i, int64_t T, int64_t& b, int64_t& e) {
  b = std::min(std::max(cu[i], int64_t(0)), T);
  e = std::min(std::max(cu[i + 1], b), T);
}

// w_i = Σ_t m_{i,t} (padded rows, or packed spans; no mask in a packed layout: lengths).
torch::Tensor token_weights_from_layout(const torch::Tensor& mask, const std::vector<int64_t>& cu, int64_t B,
                                        int64_t num_tokens) {
  torch::Tensor wt = empty_output({B}, torch::kFloat64);
  double* w = wt.data_ptr<double>();
  const bool packed = !cu.empty();
  if (!mask.defined()) {
    const int64_t T = std::max<int64_t>(num_tokens, 0);
    for (int64_t i = 0; i < B; ++i) {
      int64_t b, e;
      packed_span(cu.data(), i, T, b, e);
      w[i] = double(e - b);
    }
    return wt;
  }
  auto m = mask.contiguous();
  const int64_t L = packed ? 0 : m.size(1);
  const int64_t T = packed ? m.size(0) : 0;
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, m.scalar_type(), "rlvr_token_weights", [&] {
    const scalar_t* p = m.data_ptr<scalar_t>();
    at::parallel_for(0, B, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        int64_t b = i * L, e = (i + 1) * L;
        if (packed) packed_span(cu.data(), i, T, b, e);
        double s = 0.0;
        for (int64_t t = b; t < e; ++t) s += static_cast<double>(p[t]);
        w[i] = s;
      }
    });
  });
  return wt;
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

void broadcast_to_tokens(const double* adv, int64_t B, const torch::Tensor& mask, const std::vector<int64_t>& cu,
                         torch::Tensor& out) {
  const bool packed = !cu.empty();
  const int64_t T = packed ? out.size(0) : 0;
  const int64_t L = packed ? 0 : out.size(1);
  torch::Tensor m = mask.defined() ? mask.contiguous() : mask;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "rlvr_broadcast_out", [&] {
    using out_t = scalar_t;
    out_t* o = out.data_ptr<out_t>();
    if (packed) {
      // Tokens outside every span (only possible with validate=False) are zeroed.
      const int64_t first = std::min(std::max(cu[0], int64_t(0)), T);
      const int64_t last = std::min(std::max(cu[B], first), T);
      fill_row(o, 0.0, first);
      fill_row(o + last, 0.0, T - last);
    }
    auto rows = [&](auto* mp) {
      at::parallel_for(0, B, 16, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          int64_t b = i * L, e = (i + 1) * L;
          if (packed) packed_span(cu.data(), i, T, b, e);
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

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>
group_advantages_cpu(const torch::Tensor& scores, const torch::Tensor& group_index, int64_t num_groups,
                     int64_t group_size, const c10::optional<torch::Tensor>& valid_opt,
                     const c10::optional<torch::Tensor>& lengths_opt,
                     const c10::optional<torch::Tensor>& response_mask_opt,
                     const c10::optional<torch::Tensor>& cu_seqlens_opt, int64_t num_tokens, int64_t baseline,
                     int64_t scale, bool std_unbiased, double eps, bool eps_in_sqrt, bool singleton_raw,
                     int64_t passk_k, int64_t whiten, double whiten_eps, bool whiten_eps_in_sqrt,
                     at::ScalarType out_dtype) {
  TORCH_CHECK(scores.dim() == 1, "scores: expected [B]");
  TORCH_CHECK(group_size > 0 || (group_index.dim() == 1 && group_index.numel() == scores.numel()),
              "group_index: expected [B]");
  TORCH_CHECK(num_groups >= 0, "num_groups: expected >= 0");
  TORCH_CHECK(group_size >= 0, "group_size: expected >= 0");
  TORCH_CHECK(baseline >= kNone && baseline <= kPassk, "unknown baseline ", baseline);
  const int64_t B = scores.numel();
  const int64_t G = num_groups;

  using Result = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                            torch::Tensor>;
  // The body reads the scores in place (float or double; half types are widened to float).
  auto body = [&](const auto* r) -> Result {
    // Contiguous groups need no ids: group k is rows [k·group_size, (k+1)·group_size).
    const torch::Tensor gi = group_size > 0 ? torch::Tensor() : group_index.to(torch::kInt64).contiguous();
    const int64_t* g = group_size > 0 ? nullptr : gi.data_ptr<int64_t>();
    // Rows [0, G·group_size) all have a group when groups are contiguous.
    const bool contiguous = group_size > 0;
    const int64_t covered = contiguous ? G * group_size : 0;
    torch::Tensor vmask = valid_opt.has_value() ? valid_opt->to(torch::kBool).contiguous() : torch::Tensor();
    TORCH_CHECK(!vmask.defined() || vmask.numel() == B, "valid: expected [B]");
    const bool* vm = vmask.defined() ? vmask.data_ptr<bool>() : nullptr;
    torch::Tensor valid_t = empty_output({B}, torch::kUInt8);
    uint8_t* valid = valid_t.data_ptr<uint8_t>();
    at::parallel_for(0, B, 1 << 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i)
        valid[i] =
            (vm == nullptr || vm[i]) && std::isfinite(r[i]) && (contiguous ? i < covered : g[i] >= 0 && g[i] < G);
    });

    torch::Tensor mask = response_mask_opt.has_value() ? *response_mask_opt : torch::Tensor();
    std::vector<int64_t> cu;
    if (cu_seqlens_opt.has_value()) {
      auto c = cu_seqlens_opt->to(torch::kInt64).contiguous();
      TORCH_CHECK(c.numel() == B + 1, "cu_seqlens: expected [B + 1]");
      cu.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + B + 1);
    }
    const bool has_layout = mask.defined() || !cu.empty();

    // 1. Token weights w_i, only when something uses them.
    torch::Tensor w_t;
    if (baseline == kOpo || whiten == kWhitenTokens) {
      if (lengths_opt.has_value())
        w_t = to_double(*lengths_opt);
      else if (has_layout)
        w_t = token_weights_from_layout(mask, cu, B, num_tokens);
    }
    const bool have_w = w_t.defined();
    const double* w = have_w ? w_t.data_ptr<double>() : nullptr;

    // 2. Batch scalars.
    const bool need_batch = (baseline == kMean && scale == kScaleBatch) || baseline == kGpg;
    const double n_valid = need_batch ? chunked_sum(B, [&](int64_t i) { return double(valid[i]); }) : 0.0;
    double batch_sigma = 0.0, gpg_alpha = 1.0;
    if (baseline == kMean && scale == kScaleBatch && n_valid > 0) {
      const double mu = chunked_sum(B, [&](int64_t i) { return valid[i] ? double(r[i]) : 0.0; }) / n_valid;
      const double m2 =
          chunked_sum(B, [&](int64_t i) { return valid[i] ? (double(r[i]) - mu) * (double(r[i]) - mu) : 0.0; });
      const double denom = std_unbiased ? n_valid - 1 : n_valid;
      batch_sigma = denom > 0 ? std::sqrt(m2 / denom) : 0.0;
    }
    if (baseline == kGpg) {
      const double nonzero = chunked_sum(B, [&](int64_t i) { return double(valid[i] && r[i] != 0.0); });
      gpg_alpha = n_valid / std::max(nonzero, 1.0);
    }

    // 3. Group statistics. Welford's update is exact for a constant group (r − mean = 0 at
    // every step), so such a group has σ = 0 and A = 0 exactly. "Degenerate" compares each
    // score with the group's first: all valid scores equal, exactly.
    struct alignas(32) Acc {  // two groups per cache line
      double mean = 0, m2 = 0, first = 0;
      int32_t n = 0, differs = 0;  // differs: some valid score differs from the first one
    };
    static_assert(sizeof(Acc) == 32, "Acc layout");
    TORCH_CHECK(B < (int64_t(1) << 31), "group_advantages: B must be < 2^31 on the CPU");
    std::vector<Acc> acc(G);
    // OPO (Σ w·r, Σ w) and pass@k (incorrect count) need more, only for those estimators.
    std::vector<double> extra(baseline == kOpo || baseline == kPassk ? G : 0, 0.0);
    std::vector<double> extra_w(baseline == kOpo ? G : 0, 0.0);
    for_each_by_group(B, G, group_size, g, valid, acc.data(), [&](int64_t i, int64_t k) {
      Acc& a = acc[k];
      const double x = r[i];
      if (a.n++ == 0) {
        a.mean = a.first = x;
      } else {
        const double d = x - a.mean;
        a.mean += d * reciprocal(a.n);
        a.m2 += d * (x - a.mean);
        a.differs |= x != a.first;
      }
      if (baseline == kOpo) {
        const double wi = have_w ? w[i] : 1.0;
        extra[k] += wi * x;
        extra_w[k] += wi;
      } else if (baseline == kPassk) {
        extra[k] += x <= 0.0 ? 1.0 : 0.0;
      }
    });

    // 4. Per group: A = (r − b)·f, or pass@k's (correct, incorrect) values in (b, f).
    struct Affine {
      double b, f;
    };
    std::vector<Affine> affine(G, Affine{0.0, 0.0});
    std::vector<double> mean(G, 0.0), sd(G, 0.0);
    std::vector<uint8_t> degenerate(G, 1);
    auto inverse = [&](double sigma) {  // 1/(σ + eps) or 1/sqrt(σ² + eps); 0 for a zero divisor
      const double d = eps_in_sqrt ? std::sqrt(sigma * sigma + eps) : sigma + eps;
      return d > 0.0 ? 1.0 / d : 0.0;
    };
    at::parallel_for(0, G, 1024, [&](int64_t g0, int64_t g1) {
      for (int64_t k = g0; k < g1; ++k) {
        const Acc& a = acc[k];
        const int64_t n = a.n;
        if (n == 0) continue;
        mean[k] = a.mean;
        const double denom = std_unbiased ? double(n - 1) : double(n);
        sd[k] = denom > 0 ? std::sqrt(a.m2 / denom) : 0.0;
        degenerate[k] = !a.differs;
        Affine& t = affine[k];
        if (baseline == kNone) {
          t = {0.0, 1.0};
        } else if (baseline == kPassk) {
          passk_values(n, int64_t(extra[k]), passk_k, eps, eps_in_sqrt, t.b, t.f);
        } else if (n == 1) {
          // singleton: A = 0, or verl's loop rule (mean 0 and std 1 for a lone sample)
          const double f = baseline == kMean && scale != kScaleNone ? inverse(1.0) : baseline == kGpg ? gpg_alpha : 1.0;
          t = {0.0, singleton_raw ? f : 0.0};
        } else if (baseline == kMean) {
          t = {a.mean, scale == kScaleGroup ? inverse(sd[k]) : scale == kScaleBatch ? inverse(batch_sigma) : 1.0};
        } else if (baseline == kRloo) {
          t = {a.mean, double(n) / double(n - 1)};
        } else if (baseline == kOpo) {
          t = {extra_w[k] > 0 ? extra[k] / extra_w[k] : a.mean, 1.0};  // no tokens at all: equal weights
        } else {                                                       // kGpg
          t = {a.mean, gpg_alpha};
        }
      }
    });

    // 5. Per-sample advantages and keep flags.
    torch::Tensor a_t = empty_output({B}, torch::kFloat64);
    double* a = a_t.data_ptr<double>();
    torch::Tensor keep_t = empty_output({B}, torch::kBool);
    bool* keep = keep_t.data_ptr<bool>();
    auto sample = [&](int64_t i, int64_t k) {
      if (!valid[i]) {
        a[i] = 0.0;
        keep[i] = false;
        return;
      }
      const Affine t = affine[k];
      const double x = r[i];
      a[i] = baseline == kPassk ? (x > 0.0 ? t.b : t.f) : (x - t.b) * t.f;
      keep[i] = !degenerate[k];
    };
    if (!contiguous) {
      at::parallel_for(0, B, 1 << 14, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          prefetch_group(affine.data(), g, i, i1, G);
          sample(i, std::min(std::max(g[i], int64_t(0)), std::max(G - 1, int64_t(0))));
        }
      });
    } else {
      at::parallel_for(0, G, std::max<int64_t>(1, 16384 / group_size), [&](int64_t k0, int64_t k1) {
        for (int64_t k = k0; k < k1; ++k)
          for (int64_t i = k * group_size; i < (k + 1) * group_size; ++i) sample(i, k);
      });
      for (int64_t i = covered; i < B; ++i) a[i] = 0.0, keep[i] = false;
    }

    // Whitening: A ← (A − mean_w)/σ_w with weights w_i (tokens) or 1 (samples), unbiased.
    if (whiten != kWhitenOff) {
      const bool by_tokens = whiten == kWhitenTokens && have_w;
      auto weight = [&](int64_t i) { return valid[i] ? (by_tokens ? w[i] : 1.0) : 0.0; };
      const double W = chunked_sum(B, weight);
      const double mu = W > 0 ? chunked_sum(B, [&](int64_t i) { return weight(i) * a[i]; }) / W : 0.0;
      const double m2 = chunked_sum(B, [&](int64_t i) { return weight(i) * (a[i] - mu) * (a[i] - mu); });
      const double sigma = W > 1 ? std::sqrt(m2 / (W - 1)) : 0.0;
      at::parallel_for(0, B, 1 << 14, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i)
          a[i] = weight(i) > 0 ? divide(a[i] - mu, sigma, whiten_eps, whiten_eps_in_sqrt) : 0.0;
      });
    }

    // Outputs.
    torch::Tensor adv = empty_output({B}, out_dtype);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "rlvr_adv_out", [&] {
      scalar_t* o = adv.data_ptr<scalar_t>();
      at::parallel_for(0, B, 1 << 16, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) o[i] = static_cast<scalar_t>(a[i]);
      });
    });
    const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
    // copy=true: the vectors die with this frame, even when out_dtype is float64.
    torch::Tensor mean_t = torch::from_blob(mean.data(), {G}, f64).to(out_dtype, false, true);
    torch::Tensor std_t = torch::from_blob(sd.data(), {G}, f64).to(out_dtype, false, true);
    torch::Tensor count_t = torch::empty({G}, torch::kInt64);
    torch::Tensor deg_t = torch::empty({G}, torch::kBool);
    int64_t* c = count_t.data_ptr<int64_t>();
    bool* d = deg_t.data_ptr<bool>();
    for (int64_t k = 0; k < G; ++k) {
      c[k] = acc[k].n;
      d[k] = degenerate[k] != 0;
    }

    torch::Tensor token_adv;
    if (has_layout) {
      if (cu.empty())
        token_adv = empty_output({B, mask.size(1)}, out_dtype);
      else
        token_adv = empty_output({mask.defined() ? mask.size(0) : std::max<int64_t>(num_tokens, 0)}, out_dtype);
      broadcast_to_tokens(a, B, mask, cu, token_adv);
    } else {
      token_adv = torch::empty({0}, torch::TensorOptions().dtype(out_dtype));
    }
    return {adv, token_adv, mean_t, std_t, count_t, deg_t, keep_t};
  };
  if (scores.scalar_type() == torch::kFloat64) return body(scores.contiguous().data_ptr<double>());
  const torch::Tensor scores_f = scores.to(torch::kFloat32).contiguous();
  return body(scores_f.data_ptr<float>());
}

}  // namespace rlvr
