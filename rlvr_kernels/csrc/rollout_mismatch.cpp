// Train–rollout log-prob mismatch metrics on the CPU (docs/rollout-mismatch.md). The contract
// (tensors, parameters, outputs) is written down in rlvr_kernels/ops/rollout_mismatch.py; the
// parameters are RolloutMismatchParams (rollout_mismatch.h), the stages those of
// rlvr_kernels/reference/rollout_mismatch.py.
//
// Phases, deterministic whatever the thread count:
//   0. checks: the op is registered and reachable directly, so every shape relation the kernel
//      relies on is checked here, and cu_seqlens is sanitised (spans.h);
//   1. per sequence, one task walks its valid tokens in order and accumulates in float64
//      (SeqAcc): the sequence's sums, extrema and ratio counts (float32 inputs: Δ and the exps
//      in float lanes, the sums in float64 lanes, reduced in lane order);
//   2. one pass over the sequences in order forms the batch metrics (MismatchOut).
// Every sum is accumulated in float64 and rounded once to the output dtype.
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "rollout_mismatch.h"
#include "simd.h"
#include "spans.h"

namespace rlvr {
namespace {

constexpr const char* kOp = "rollout_mismatch_stats";

// One sequence's sums over its valid tokens (Δ = train − rollout, ρ = exp(Δ)).
struct SeqAcc {
  int64_t n = 0, n_low = 0, n_high = 0;
  double sum_d = 0, sum_abs = 0, max_abs = 0, sum_k2 = 0, sum_k3 = 0, sum_ratio = 0, sum_chi2 = 0;
  double min_d = std::numeric_limits<double>::infinity(), max_d = -std::numeric_limits<double>::infinity();
  double sum_train = 0, sum_rollout = 0;
};

// Phase 1 on float64 inputs (the checking path): one token at a time.
void accumulate(const double* train, const double* rollout, const bool* mask, int64_t begin, int64_t end,
                const RolloutMismatchParams& p, SeqAcc& a) {
  const double bound = p.log_ratio_bound;
  for (int64_t t = begin; t < end; ++t) {
    // Only valid tokens are read: padding may hold anything (NaN, -inf) without reaching a sum.
    if (mask != nullptr && !mask[t]) continue;
    const double tr = train[t], ro = rollout[t];
    const double d = tr - ro, ad = std::fabs(d), e = std::exp(d);
    a.n += 1;
    a.sum_d += d;
    a.sum_abs += ad;
    a.max_abs = std::max(a.max_abs, ad);
    a.sum_k2 += 0.5 * d * d;
    a.sum_k3 += e - d - 1.0;
    a.sum_ratio += e;
    a.min_d = std::min(a.min_d, d);
    a.max_d = std::max(a.max_d, d);
    a.n_low += e < p.ratio_low;
    a.n_high += e > p.ratio_high;
    const double dc = std::min(std::max(d, -bound), bound);
    const double ec = dc == d ? e : std::exp(dc);
    a.sum_chi2 += ec * ec;
    a.sum_train += tr;
    a.sum_rollout += ro;
  }
}

// Phase 1 on float32 inputs: Δ and the exps in float lanes (simd.h), every sum in float64
// lanes, the lanes reduced in lane order at the end (the same bits for any thread count).
struct AccumulateF32 {
  struct Arg {
    const float* train;
    const float* rollout;
    const bool* mask;
    int64_t begin, end;
    const RolloutMismatchParams* p;
    SeqAcc* acc;
  };
  template <int VB>
  static void run(const Arg& a) {
    using L = Lanes<float, VB>;
    using V = typename L::V;
    using M = typename L::M;
    using D = typename L::D;
    constexpr int W = L::W;
    const V zero = splat<V>(0.0f), one = splat<V>(1.0f);
    const V low = splat<V>(float(a.p->ratio_low)), high = splat<V>(float(a.p->ratio_high));
    const V bound = splat<V>(float(a.p->log_ratio_bound));
    D s_d{}, s_abs{}, s_k2{}, s_k3{}, s_ratio{}, s_chi2{}, s_tr{}, s_ro{};
    V m_abs = zero, mn = splat<V>(std::numeric_limits<float>::infinity()), mx = -mn;
    M n{}, n_low{}, n_high{};
    for (int64_t t = a.begin; t < a.end; t += W) {
      const int k = int(std::min<int64_t>(W, a.end - t));
      M valid;
      if (a.mask != nullptr) {
        if (!load_mask<float, VB>(a.mask + t, k, valid)) continue;
      } else {
        valid = lanes_below<float, VB>(k);
      }
      // Invalid lanes may hold NaN: they are replaced before any arithmetic reaches a sum.
      const V tr = sel(valid, load<float, VB>(a.train + t, k), zero);
      const V ro = sel(valid, load<float, VB>(a.rollout + t, k), zero);
      const V d = tr - ro;
      const V e = vexp(d);
      const V ad = sel(d < zero, -d, d);
      const V ec = vexp(vclamp(d, -bound, bound));
      n -= valid;  // lanes are −1 where valid
      n_low -= valid & (e < low);
      n_high -= valid & (e > high);
      m_abs = ad > m_abs ? ad : m_abs;
      mn = sel(valid & (d < mn), d, mn);
      mx = sel(valid & (d > mx), d, mx);
      s_d += __builtin_convertvector(d, D);
      s_abs += __builtin_convertvector(ad, D);
      s_k2 += __builtin_convertvector(0.5f * d * d, D);
      s_k3 += __builtin_convertvector(sel(valid, e - d - one, zero), D);
      s_ratio += __builtin_convertvector(sel(valid, e, zero), D);
      s_chi2 += __builtin_convertvector(sel(valid, ec * ec, zero), D);
      s_tr += __builtin_convertvector(tr, D);
      s_ro += __builtin_convertvector(ro, D);
    }
    SeqAcc& acc = *a.acc;
    for (int l = 0; l < W; ++l) {
      acc.n += n[l];
      acc.n_low += n_low[l];
      acc.n_high += n_high[l];
      acc.sum_d += s_d[l];
      acc.sum_abs += s_abs[l];
      acc.max_abs = std::max(acc.max_abs, double(m_abs[l]));
      acc.sum_k2 += s_k2[l];
      acc.sum_k3 += s_k3[l];
      acc.sum_ratio += s_ratio[l];
      acc.sum_chi2 += s_chi2[l];
      acc.min_d = std::min(acc.min_d, double(mn[l]));
      acc.max_d = std::max(acc.max_d, double(mx[l]));
      acc.sum_train += s_tr[l];
      acc.sum_rollout += s_ro[l];
    }
  }
};

// Phase 2: the batch vector from the sequences' sums, in sequence order.
std::vector<double> batch_metrics(const std::vector<SeqAcc>& seqs, const RolloutMismatchParams& p,
                                  int64_t* num_tokens) {
  std::vector<double> out(kMismatchOut, 0.0);
  SeqAcc tot;
  for (const SeqAcc& a : seqs) {
    tot.n += a.n;
    tot.n_low += a.n_low;
    tot.n_high += a.n_high;
    tot.sum_d += a.sum_d;
    tot.sum_abs += a.sum_abs;
    tot.max_abs = std::max(tot.max_abs, a.max_abs);
    tot.sum_k2 += a.sum_k2;
    tot.sum_k3 += a.sum_k3;
    tot.sum_ratio += a.sum_ratio;
    tot.sum_chi2 += a.sum_chi2;
    tot.min_d = std::min(tot.min_d, a.min_d);
    tot.max_d = std::max(tot.max_d, a.max_d);
  }
  *num_tokens = tot.n;
  if (tot.n == 0) return out;  // no valid token: every metric is 0
  auto at = [&](MismatchOut m) -> double& { return out[int64_t(m)]; };
  const double N = double(tot.n);
  at(MismatchOut::ABS_DIFF_MEAN) = tot.sum_abs / N;
  at(MismatchOut::ABS_DIFF_MAX) = tot.max_abs;
  at(MismatchOut::K1) = -tot.sum_d / N;
  at(MismatchOut::K2) = tot.sum_k2 / N;
  at(MismatchOut::K3) = tot.sum_k3 / N;
  at(MismatchOut::RATIO_MEAN) = tot.sum_ratio / N;
  at(MismatchOut::RATIO_MIN) = std::exp(tot.min_d);
  at(MismatchOut::RATIO_MAX) = std::exp(tot.max_d);
  at(MismatchOut::RATIO_FRAC_LOW) = double(tot.n_low) / N;
  at(MismatchOut::RATIO_FRAC_HIGH) = double(tot.n_high) / N;
  at(MismatchOut::RATIO_FRAC_OUTSIDE) = double(tot.n_low + tot.n_high) / N;
  at(MismatchOut::CHI2_TOKEN) = tot.sum_chi2 / N - 1.0;

  // Sequence metrics over all B sequences (B >= 1 here); an empty one has mean 0, as in verl.
  const double bound = p.log_ratio_bound;
  double abs_mean = 0, lpd = 0, lpd_abs = 0, ppl_ratio = 0, chi2 = 0, tppl = 0, tlog = 0, rppl = 0, rlog = 0;
  double lpd_max = -std::numeric_limits<double>::infinity(), lpd_min = std::numeric_limits<double>::infinity();
  double sr_sum = 0, sr_min = std::numeric_limits<double>::infinity(), sr_max = 0;
  for (const SeqAcc& a : seqs) {
    const double inv = a.n > 0 ? 1.0 / double(a.n) : 0.0;
    const double d = -a.sum_d * inv;  // mean(rollout) − mean(train)
    const double tl = -a.sum_train * inv, rl = -a.sum_rollout * inv;
    abs_mean += a.sum_abs * inv;
    lpd += d;
    lpd_abs += std::fabs(d);
    lpd_max = std::max(lpd_max, d);
    lpd_min = std::min(lpd_min, d);
    ppl_ratio += std::exp(d);
    chi2 += std::exp(2.0 * std::min(std::max(a.sum_d, -bound), bound));
    tppl += std::exp(tl);
    tlog += tl;
    rppl += std::exp(rl);
    rlog += rl;
    const double sr = std::exp(a.sum_d);
    sr_sum += sr;
    sr_min = std::min(sr_min, sr);
    sr_max = std::max(sr_max, sr);
  }
  const double B = double(seqs.size());
  at(MismatchOut::SEQ_ABS_DIFF_MEAN) = abs_mean / B;
  at(MismatchOut::LOG_PPL_DIFF) = lpd / B;
  at(MismatchOut::LOG_PPL_ABS_DIFF) = lpd_abs / B;
  at(MismatchOut::LOG_PPL_DIFF_MAX) = lpd_max;
  at(MismatchOut::LOG_PPL_DIFF_MIN) = lpd_min;
  at(MismatchOut::PPL_RATIO) = ppl_ratio / B;
  at(MismatchOut::CHI2_SEQ) = chi2 / B - 1.0;
  at(MismatchOut::TRAINING_PPL) = tppl / B;
  at(MismatchOut::TRAINING_LOG_PPL) = tlog / B;
  at(MismatchOut::ROLLOUT_PPL) = rppl / B;
  at(MismatchOut::ROLLOUT_LOG_PPL) = rlog / B;
  at(MismatchOut::SEQ_RATIO_MEAN) = sr_sum / B;
  at(MismatchOut::SEQ_RATIO_MIN) = sr_min;
  at(MismatchOut::SEQ_RATIO_MAX) = sr_max;
  return out;
}

void check_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), kOp, ": ", name, " must be a CPU tensor, got ", t.device());
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rollout_mismatch_stats_cpu(
    const torch::Tensor& train_logprobs, const torch::Tensor& rollout_logprobs,
    const c10::optional<torch::Tensor>& response_mask, const c10::optional<torch::Tensor>& cu_seqlens,
    c10::ArrayRef<double> fparams, c10::ArrayRef<int64_t> iparams) {
  // ---- 0. checks
  const RolloutMismatchParams p = RolloutMismatchParams::unpack(fparams, iparams);
  check_cpu(train_logprobs, "train_logprobs");
  check_cpu(rollout_logprobs, "rollout_logprobs");
  TORCH_CHECK(at::isFloatingType(train_logprobs.scalar_type()) && at::isFloatingType(rollout_logprobs.scalar_type()),
              kOp, ": train_logprobs and rollout_logprobs must be floating, got ", train_logprobs.scalar_type(),
              " and ", rollout_logprobs.scalar_type());
  TORCH_CHECK(train_logprobs.sizes() == rollout_logprobs.sizes(), kOp,
              ": rollout_logprobs must have the shape of train_logprobs ", train_logprobs.sizes(), ", got ",
              rollout_logprobs.sizes());
  const bool packed = cu_seqlens.has_value();
  TORCH_CHECK(train_logprobs.dim() == (packed ? 1 : 2), kOp, ": train_logprobs must be ",
              packed ? "[T] with cu_seqlens" : "[B, L] without cu_seqlens", ", got ", train_logprobs.sizes());
  const bool f64 = train_logprobs.scalar_type() == torch::kFloat64 || rollout_logprobs.scalar_type() == torch::kFloat64;
  const auto cdt = f64 ? torch::kFloat64 : torch::kFloat32;
  const torch::Tensor train = train_logprobs.to(cdt).contiguous();
  const torch::Tensor rollout = rollout_logprobs.to(cdt).contiguous();
  torch::Tensor mask;
  if (response_mask.has_value()) {
    check_cpu(*response_mask, "response_mask");
    TORCH_CHECK(response_mask->sizes() == train_logprobs.sizes(), kOp,
                ": response_mask must have the shape of train_logprobs ", train_logprobs.sizes(), ", got ",
                response_mask->sizes());
    TORCH_CHECK(!response_mask->is_complex(), kOp, ": response_mask must be real, got ", response_mask->scalar_type());
    mask = (response_mask->scalar_type() == torch::kBool ? *response_mask : *response_mask != 0).contiguous();
  }
  int64_t B = 0, L = 0;
  std::vector<int64_t> cu;
  if (packed) {
    check_cpu(*cu_seqlens, "cu_seqlens");
    cu = sanitized_offsets(*cu_seqlens, train.size(0), kOp);
    B = int64_t(cu.size()) - 1;
  } else {
    B = train.size(0);
    L = train.size(1);
  }

  // ---- 1. per-sequence sums, one task per sequence
  std::vector<SeqAcc> seqs(B);
  const bool* m = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(L, 1));
  at::parallel_for(0, B, packed ? 1 : grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = packed ? cu[b] : b * L, end = packed ? cu[b + 1] : (b + 1) * L;
      if (f64) {
        accumulate(train.data_ptr<double>(), rollout.data_ptr<double>(), m, begin, end, p, seqs[b]);
      } else {
        run_isa<AccumulateF32>({train.data_ptr<float>(), rollout.data_ptr<float>(), m, begin, end, &p, &seqs[b]});
      }
    }
  });

  // ---- 2. batch metrics and the per-sequence columns
  int64_t num_tokens = 0;
  const std::vector<double> metrics = batch_metrics(seqs, p, &num_tokens);
  torch::Tensor out = torch::empty({kMismatchOut}, torch::dtype(torch::kFloat64));
  std::copy(metrics.begin(), metrics.end(), out.data_ptr<double>());
  torch::Tensor seq = torch::empty({B, kMismatchSeq}, torch::dtype(torch::kFloat64));
  double* s = seq.data_ptr<double>();
  for (int64_t b = 0; b < B; ++b) {
    const SeqAcc& a = seqs[b];
    s[b * kMismatchSeq + int64_t(MismatchSeq::ABS_DIFF_MEAN)] = a.n > 0 ? a.sum_abs / double(a.n) : 0.0;
    s[b * kMismatchSeq + int64_t(MismatchSeq::ABS_DIFF_MAX)] = a.max_abs;
    s[b * kMismatchSeq + int64_t(MismatchSeq::LOG_RATIO)] = a.sum_d;
  }
  return {out.to(cdt), seq.to(cdt), torch::tensor(num_tokens, torch::dtype(torch::kInt64))};
}

}  // namespace rlvr
