// Masked group-relative advantages on the CPU (SPEC §1), one score column per call.
//
// Phases, each deterministic whatever the thread count:
//   1. token weights w_i (row sums of the mask) when OPO or token whitening needs them;
//   2. a counting sort of the valid samples by group (serial, O(B));
//   3. per-group statistics in float64, two-pass (never Σr² − (Σr)²/n), parallel over
//      groups, each group summed in sample order;
//   4. batch scalars (batch σ, GPG α) and whitening moments: partial sums over fixed
//      chunks of kChunk samples, combined in chunk order;
//   5. per-sample advantages, then the token broadcast A_i · m_{i,t} written with
//      streaming stores (the output is not read back by this op).
// Inputs were validated in Python; anything that would index out of bounds (a group id
// outside [0, G), cu_seqlens out of order) is still made harmless here: such samples are
// treated as excluded and offsets are clamped.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
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

std::vector<double> to_double(const torch::Tensor& t) {
  auto c = t.contiguous();
  std::vector<double> out(c.numel());
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, c.scalar_type(), "rlvr_to_double", [&] {
    const scalar_t* p = c.data_ptr<scalar_t>();
    for (int64_t i = 0; i < c.numel(); ++i) out[i] = static_cast<double>(p[i]);
  });
  return out;
}

// Clamped [begin, end) of packed sequence i: never outside [0, T], never negative length.
inline void packed_span(const int64_t* cu, int64_t i, int64_t T, int64_t& b, int64_t& e) {
  b = std::min(std::max(cu[i], int64_t(0)), T);
  e = std::min(std::max(cu[i + 1], b), T);
}

// w_i = Σ_t m_{i,t} (padded rows, or packed spans; no mask in a packed layout: lengths).
std::vector<double> token_weights_from_layout(const torch::Tensor& mask, const std::vector<int64_t>& cu, int64_t B,
                                              int64_t num_tokens) {
  std::vector<double> w(B, 0.0);
  const bool packed = !cu.empty();
  if (!mask.defined()) {
    const int64_t T = std::max<int64_t>(num_tokens, 0);
    for (int64_t i = 0; i < B; ++i) {
      int64_t b, e;
      packed_span(cu.data(), i, T, b, e);
      w[i] = double(e - b);
    }
    return w;
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
  return w;
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

void broadcast_to_tokens(const std::vector<double>& adv, const torch::Tensor& mask, const std::vector<int64_t>& cu,
                         torch::Tensor& out) {
  const int64_t B = int64_t(adv.size());
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
  for (int64_t j = 0; n_neg >= 1 && j < k - 1; ++j) drop *= double(std::max<int64_t>(n_neg - 1 - j, 0)) / double(n - 1 - j);
  // Written with a = 1 − R̄ = C(n_neg, k)/C(n, k) directly: 1 − (1 − a) would cancel.
  const double s = std::sqrt(all_neg * (1.0 - all_neg));
  pos = divide(all_neg, s, eps, eps_in_sqrt);
  neg = divide(all_neg - drop, s, eps, eps_in_sqrt);
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>
group_advantages_cpu(const torch::Tensor& scores, const torch::Tensor& group_index, int64_t num_groups,
                     const c10::optional<torch::Tensor>& valid_opt, const c10::optional<torch::Tensor>& lengths_opt,
                     const c10::optional<torch::Tensor>& response_mask_opt,
                     const c10::optional<torch::Tensor>& cu_seqlens_opt, int64_t num_tokens, int64_t baseline, int64_t scale,
                     bool std_unbiased, double eps, bool eps_in_sqrt, bool singleton_raw, int64_t passk_k,
                     int64_t whiten, double whiten_eps, bool whiten_eps_in_sqrt, at::ScalarType out_dtype) {
  TORCH_CHECK(scores.dim() == 1, "scores: expected [B]");
  TORCH_CHECK(group_index.dim() == 1 && group_index.numel() == scores.numel(), "group_index: expected [B]");
  TORCH_CHECK(num_groups >= 0, "num_groups: expected >= 0");
  const int64_t B = scores.numel();
  const int64_t G = num_groups;

  const std::vector<double> r = to_double(scores);
  const torch::Tensor gi = group_index.to(torch::kInt64).contiguous();
  const int64_t* g = gi.data_ptr<int64_t>();
  std::vector<uint8_t> valid(B, 1);
  if (valid_opt.has_value()) {
    const std::vector<double> v = to_double(*valid_opt);
    TORCH_CHECK(int64_t(v.size()) == B, "valid: expected [B]");
    for (int64_t i = 0; i < B; ++i) valid[i] = v[i] != 0.0;
  }
  for (int64_t i = 0; i < B; ++i) valid[i] = valid[i] && std::isfinite(r[i]) && g[i] >= 0 && g[i] < G;

  torch::Tensor mask = response_mask_opt.has_value() ? *response_mask_opt : torch::Tensor();
  std::vector<int64_t> cu;
  if (cu_seqlens_opt.has_value()) {
    auto c = cu_seqlens_opt->to(torch::kInt64).contiguous();
    TORCH_CHECK(c.numel() == B + 1, "cu_seqlens: expected [B + 1]");
    cu.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + B + 1);
  }
  const bool has_layout = mask.defined() || !cu.empty();

  // 1. Token weights w_i, only when something uses them.
  const bool need_w = baseline == kOpo || whiten == kWhitenTokens;
  std::vector<double> w;
  if (need_w) {
    if (lengths_opt.has_value())
      w = to_double(*lengths_opt);
    else if (has_layout)
      w = token_weights_from_layout(mask, cu, B, num_tokens);
  }
  const bool have_w = !w.empty();

  // 2. Counting sort of valid samples by group, stable in sample order.
  std::vector<int64_t> offset(G + 1, 0), member;
  for (int64_t i = 0; i < B; ++i)
    if (valid[i]) offset[g[i] + 1] += 1;
  for (int64_t k = 0; k < G; ++k) offset[k + 1] += offset[k];
  member.resize(offset[G]);
  {
    std::vector<int64_t> cursor(offset.begin(), offset.end() - 1);
    for (int64_t i = 0; i < B; ++i)
      if (valid[i]) member[cursor[g[i]]++] = i;
  }

  // 3. Group statistics.
  std::vector<double> mean(G, 0.0), sd(G, 0.0), ext_a(G, 0.0), ext_b(G, 0.0);
  std::vector<uint8_t> degenerate(G, 1);
  at::parallel_for(0, G, 256, [&](int64_t g0, int64_t g1) {
    for (int64_t k = g0; k < g1; ++k) {
      const int64_t b = offset[k], e = offset[k + 1], n = e - b;
      if (n == 0) continue;
      // Shifted by the first score: a constant group sums to exactly 0, so its mean is
      // exact and its advantages exactly 0.
      const double shift = r[member[b]];
      double s = 0.0;
      for (int64_t j = b; j < e; ++j) s += r[member[j]] - shift;
      const double mu = shift + s / double(n);
      double m2 = 0.0, lo = r[member[b]], hi = lo;
      for (int64_t j = b; j < e; ++j) {
        const double x = r[member[j]];
        m2 += (x - mu) * (x - mu);
        lo = std::min(lo, x);
        hi = std::max(hi, x);
      }
      mean[k] = mu;
      const double denom = std_unbiased ? double(n - 1) : double(n);
      sd[k] = denom > 0 ? std::sqrt(m2 / denom) : 0.0;
      degenerate[k] = lo == hi;
      if (baseline == kOpo) {
        double swr = 0.0, sw = 0.0;
        for (int64_t j = b; j < e; ++j) {
          const double wi = have_w ? w[member[j]] : 1.0;
          swr += wi * r[member[j]];
          sw += wi;
        }
        ext_a[k] = sw > 0 ? swr / sw : mu;  // no tokens at all: equal weights
      } else if (baseline == kPassk) {
        int64_t n_neg = 0;
        for (int64_t j = b; j < e; ++j) n_neg += r[member[j]] <= 0.0;
        passk_values(n, n_neg, passk_k, eps, eps_in_sqrt, ext_a[k], ext_b[k]);
      }
    }
  });

  // 4. Batch scalars.
  const double n_valid = chunked_sum(B, [&](int64_t i) { return double(valid[i]); });
  double batch_sigma = 0.0, gpg_alpha = 1.0;
  if (baseline == kMean && scale == kScaleBatch && n_valid > 0) {
    const double mu = chunked_sum(B, [&](int64_t i) { return valid[i] ? r[i] : 0.0; }) / n_valid;
    const double m2 = chunked_sum(B, [&](int64_t i) { return valid[i] ? (r[i] - mu) * (r[i] - mu) : 0.0; });
    const double denom = std_unbiased ? n_valid - 1 : n_valid;
    batch_sigma = denom > 0 ? std::sqrt(m2 / denom) : 0.0;
  }
  if (baseline == kGpg) {
    const double nonzero = chunked_sum(B, [&](int64_t i) { return double(valid[i] && r[i] != 0.0); });
    gpg_alpha = n_valid / std::max(nonzero, 1.0);
  }

  // 5. Per-sample advantages.
  std::vector<double> a(B, 0.0);
  at::parallel_for(0, B, 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (!valid[i]) continue;
      const int64_t k = g[i];
      const int64_t n = offset[k + 1] - offset[k];
      const double x = r[i];
      if (baseline == kNone) {
        a[i] = x;
        continue;
      }
      if (baseline == kPassk) {
        a[i] = x > 0.0 ? ext_a[k] : ext_b[k];
        continue;
      }
      if (n == 1) {
        if (!singleton_raw) continue;  // A = 0
        // verl's loop rule: mean 0 and std 1 for a lone sample.
        if (baseline == kMean && scale != kScaleNone)
          a[i] = divide(x, 1.0, eps, eps_in_sqrt);
        else
          a[i] = baseline == kGpg ? gpg_alpha * x : x;
        continue;
      }
      switch (baseline) {
        case kMean:
          a[i] = scale == kScaleGroup   ? divide(x - mean[k], sd[k], eps, eps_in_sqrt)
                 : scale == kScaleBatch ? divide(x - mean[k], batch_sigma, eps, eps_in_sqrt)
                                        : x - mean[k];
          break;
        case kRloo:
          a[i] = double(n) / double(n - 1) * (x - mean[k]);
          break;
        case kOpo:
          a[i] = x - ext_a[k];
          break;
        case kGpg:
          a[i] = gpg_alpha * (x - mean[k]);
          break;
        default:
          TORCH_CHECK(false, "unknown baseline ", baseline);
      }
    }
  });

  // Whitening: A ← (A − mean_w)/σ_w with weights w_i (tokens) or 1 (samples), unbiased.
  if (whiten != kWhitenOff) {
    const bool by_tokens = whiten == kWhitenTokens && have_w;
    auto weight = [&](int64_t i) { return valid[i] ? (by_tokens ? w[i] : 1.0) : 0.0; };
    const double W = chunked_sum(B, weight);
    if (W > 0) {
      const double mu = chunked_sum(B, [&](int64_t i) { return weight(i) * a[i]; }) / W;
      const double m2 = chunked_sum(B, [&](int64_t i) { return weight(i) * (a[i] - mu) * (a[i] - mu); });
      const double sigma = W > 1 ? std::sqrt(m2 / (W - 1)) : 0.0;
      for (int64_t i = 0; i < B; ++i) a[i] = weight(i) > 0 ? divide(a[i] - mu, sigma, whiten_eps, whiten_eps_in_sqrt) : 0.0;
    } else {
      std::fill(a.begin(), a.end(), 0.0);
    }
  }

  // Outputs.
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  // copy=true: the vectors die with this frame, even when out_dtype is float64.
  torch::Tensor adv = torch::from_blob(a.data(), {B}, f64).to(out_dtype, false, true);
  torch::Tensor mean_t = torch::from_blob(mean.data(), {G}, f64).to(out_dtype, false, true);
  torch::Tensor std_t = torch::from_blob(sd.data(), {G}, f64).to(out_dtype, false, true);
  torch::Tensor count_t = torch::empty({G}, torch::kInt64);
  torch::Tensor deg_t = torch::empty({G}, torch::kBool);
  torch::Tensor keep_t = torch::empty({B}, torch::kBool);
  {
    int64_t* c = count_t.data_ptr<int64_t>();
    bool* d = deg_t.data_ptr<bool>();
    for (int64_t k = 0; k < G; ++k) {
      c[k] = offset[k + 1] - offset[k];
      d[k] = degenerate[k] != 0;
    }
    bool* kp = keep_t.data_ptr<bool>();
    for (int64_t i = 0; i < B; ++i) kp[i] = valid[i] && !degenerate[g[i]];
  }

  torch::Tensor token_adv;
  if (has_layout) {
    if (cu.empty())
      token_adv = empty_output({B, mask.size(1)}, out_dtype);
    else
      token_adv = empty_output({mask.defined() ? mask.size(0) : std::max<int64_t>(num_tokens, 0)}, out_dtype);
    broadcast_to_tokens(a, mask, cu, token_adv);
  } else {
    token_adv = torch::empty({0}, torch::TensorOptions().dtype(out_dtype));
  }
  return {adv, token_adv, mean_t, std_t, count_t, deg_t, keep_t};
}

}  // namespace rlvr
