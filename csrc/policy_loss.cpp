// The GRPO-family policy loss on the CPU (SPEC §2, §4): one forward pass that writes the loss
// sums, the metrics and the per-token derivative grad_logprobs = a_t · ∂ℓ_t/∂logp_t, so the
// backward is a scalar multiply (rlvr_kernels/ops/policy_loss.py holds the contract).
//
// Layout of the work:
//   * an optional pre-pass per sequence (parallel over sequences), only when an option needs
//     a sequence statistic: n_i (seq-mean-token-mean), Σ δ·m (GSPO), Σ log w·m (seq_tis /
//     seq_mis), and the A3PO rank selection (stored as two bits per token);
//   * the main pass over fixed blocks of kBlock token slots (padded rows or packed spans laid
//     end to end), parallel over blocks. Each block writes its sums to its own row of a
//     [num_blocks, NUM_SUMS] double buffer, reduced in block order: the result does not depend
//     on the thread count. Every output slot is written exactly once (0 on padding, masked
//     tokens and tokens outside every packed span); runs of masked slots are skipped 8 at a time.
//
// Vectorisation: the token math is written once on GCC vector types, branch-free with selects.
// The build is portable (no -march), so the block loop is compiled twice, with 16-byte vectors
// for the baseline ISA and 32-byte ones for AVX2+FMA, and picked at run time. A block is walked
// in tiles of kTileGroups vectors; each stage (inputs, policy-gradient term, shaping, IS weight,
// KL, combination) is a short loop over the tile with its intermediates in L1 arrays, which
// keeps every loop within the register file and tests the options once per tile. Float exp is
// a Cephes-style polynomial (< 1 ulp; torch uses SLEEF's 1-ulp exp); double exp is libm.
//
// Numerics follow the fp32/fp64 reference (rlvr_kernels/reference/policy_loss.py) op for op:
// hyper-parameters enter the token math in the compute dtype (as a Python scalar does in a
// torch op), the shaping weight is computed in double and rounded once, derivatives follow
// torch's autograd conventions (clamp passes the gradient on the closed interval, maximum /
// minimum split a tie in halves). Sums are double, fed per tile (see Acc).
#include "policy_loss.h"

#include <ATen/Dispatch.h>
#include <ATen/ExpandUtils.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "alloc.h"
#include "simd.h"

namespace rlvr {
namespace {

using namespace policy_loss_index;

enum LossType : int64_t { kPpo = 0, kGspo = 1, kCispo = 2, kSapo = 3, kReinforce = 4 };
enum KlType : int64_t { kKlNone = 0, kK1 = 1, kK2 = 2, kK3 = 3, kK3Plus = 4 };
enum RcType : int64_t { kRcNone = 0, kTokenTis = 1, kSeqTis = 2, kTokenMis = 3, kSeqMis = 4, kDecoupled = 5 };

// Token slots per work item: small enough to balance ragged rows over threads, large enough
// that the per-block partial sums cost nothing.
constexpr int64_t kBlock = 4096;

// ------------------------------------------------------------------ vector lanes
// Lanes<T, VB>: VB-byte vectors of the compute type T (16 bytes for the baseline ISA, 32 for
// AVX2), their lane masks (−1 / 0), and double accumulators with one lane per T lane.
template <typename T, int VB>
struct Lanes;

#define RLVR_LANES(T_, VB_, I_, U_, DB_, BB_, BITS_)    \
  template <>                                           \
  struct Lanes<T_, VB_> {                               \
    static constexpr int W = VB_ / int(sizeof(T_));     \
    typedef T_ V __attribute__((vector_size(VB_)));     \
    typedef I_ M __attribute__((vector_size(VB_)));     \
    typedef U_ U __attribute__((vector_size(VB_)));     \
    typedef double D __attribute__((vector_size(DB_))); \
    typedef int8_t B __attribute__((vector_size(BB_))); \
    typedef BITS_ Bits;                                 \
  };
RLVR_LANES(float, 32, int32_t, uint32_t, 64, 8, uint64_t)
RLVR_LANES(float, 16, int32_t, uint32_t, 32, 4, uint32_t)
RLVR_LANES(double, 32, int64_t, uint64_t, 32, 4, uint32_t)
RLVR_LANES(double, 16, int64_t, uint64_t, 16, 2, uint16_t)
#undef RLVR_LANES

template <typename M, typename V>
RLVR_INLINE V sel(M m, V a, V b) {
  return m ? a : b;
}

// torch.maximum / torch.minimum: NaN in either operand gives NaN.
template <typename V>
RLVR_INLINE V vmax_nan(V a, V b) {
  const V r = a > b ? a : b;
  return a != a ? a : r;
}

template <typename V>
RLVR_INLINE V vmin_nan(V a, V b) {
  const V r = a < b ? a : b;
  return a != a ? a : r;
}

template <typename T, int VB, typename in_t>
RLVR_INLINE typename Lanes<T, VB>::V load(const in_t* p, int n) {
  using V = typename Lanes<T, VB>::V;
  constexpr int W = Lanes<T, VB>::W;
  V v;
  if (n == W) {
    if constexpr (std::is_same<in_t, T>::value) {
      std::memcpy(&v, p, sizeof(V));
    } else {
      for (int l = 0; l < W; ++l) v[l] = static_cast<T>(p[l]);
    }
    return v;
  }
  for (int l = 0; l < W; ++l) v[l] = l < n ? static_cast<T>(p[l]) : T(0);
  return v;
}

template <typename T, typename V>
RLVR_INLINE void store(T* p, V v, int n) {
  if (n == int(sizeof(V) / sizeof(T))) {
    std::memcpy(p, &v, sizeof(v));
  } else {
    for (int l = 0; l < n; ++l) p[l] = v[l];
  }
}

// Lanes [0, n) of a bool mask as −1/0 lanes; false when no lane is set.
template <typename T, int VB>
RLVR_INLINE bool load_mask(const bool* p, int n, typename Lanes<T, VB>::M& m) {
  using L = Lanes<T, VB>;
  if (n == L::W) {
    typename L::Bits bits;
    std::memcpy(&bits, p, sizeof(bits));
    if (bits == 0) {
      m = typename L::M{};
      return false;
    }
    typename L::B b;
    std::memcpy(&b, p, sizeof(b));
    m = __builtin_convertvector(b != 0, typename L::M);
    return true;
  }
  bool any = false;
  for (int l = 0; l < L::W; ++l) {
    const bool v = l < n && p[l];
    m[l] = v ? -1 : 0;
    any |= v;
  }
  return any;
}

template <typename T, int VB>
RLVR_INLINE typename Lanes<T, VB>::M lanes_below(int n) {
  typename Lanes<T, VB>::M m;
  for (int l = 0; l < Lanes<T, VB>::W; ++l) m[l] = l < n ? -1 : 0;
  return m;
}

// ------------------------------------------------------------------ options and context
struct Options {
  int64_t loss, kl, rc, token_out;
  bool kl_clamp, seq_mean, seq_adv, a3po, a3po_entropy, ent_quantile, need_entropy_grad;
  bool lrc_on, dual_clip, has_entropy, ent_term, shaping, prepass;
  double w_pos, w_neg, lambda, a3po_knobs[8];
};

// Per-sequence results of the pre-pass.
template <typename T>
struct SeqInfo {
  std::vector<int64_t> n;  // valid tokens
  std::vector<T> inv_n, gspo_s, seq_w;
  std::vector<uint8_t> gspo_pass, seq_rej;
  std::vector<double> a3po_high, a3po_low;  // the knob scales of the sequence's polarity (1: off)
  std::vector<uint8_t> a3po_sel;            // per token slot: bit 0 high-selected, bit 1 low-selected
};

template <typename in_t, typename T>
struct Ctx {
  const in_t *lp, *old, *ref, *roll, *ent;
  const T* adv;
  const bool* mask;
  int64_t B, L, slots;         // L = 0 for the packed layout; slots = B·L or T
  const int64_t *begin, *end;  // packed spans: disjoint, in order, inside [0, T]
  T *grad, *grad_ent, *tok;
  Options o;
  // Hyper-parameters in the compute dtype, as the reference's torch ops see them.
  T lo, hi, clip_c, lrc, gspo_clamp, beta, rc_low, rc_high, ent_coef, tau_pos, tau_neg, four_tau_pos, four_tau_neg;
  float threshold;
  const SeqInfo<T>* seq;  // nullptr without pre-pass
  uint8_t* has_valid;     // without pre-pass: sequences with a valid token

  void span(int64_t i, int64_t& b, int64_t& e) const {
    if (L > 0 || begin == nullptr) {
      b = i * L;
      e = b + L;
    } else {
      b = begin[i];
      e = end[i];
    }
  }
};

// What a segment of one sequence needs from the sequence.
template <typename T>
struct SeqConst {
  T adv, a, neg_ce_a, gspo_s, seq_w;
  bool gspo_pass, seq_rej;
  double a3po_high, a3po_low;
};

// Lane accumulators of one block: double lanes, exact integer counts. Within a tile each stage
// sums in the compute type (at most kTileGroups values per lane: converting every group to
// double costs as much as the rest of the token math) and adds that into the double lanes once
// per tile, so the error does not grow with the number of tokens.
constexpr int kTileGroups = 16;

template <typename T, int VB>
struct Acc {
  using L = Lanes<T, VB>;
  using V = typename L::V;
  using D = typename L::D;
  enum { kTotal, kPg, kKl, kNegDelta, kKlRaw, kIs, kEnt, kNumSums };
  D sum[kNumSums];
  typename L::M ntok, clip, clip_lower, reject, shaped, nonfinite;
  V is_max;

  RLVR_INLINE void zero() {
    for (int k = 0; k < kNumSums; ++k) sum[k] = D{};
    ntok = clip = clip_lower = reject = shaped = nonfinite = typename L::M{};
    is_max = V{};
  }

  RLVR_INLINE void add(int k, V tile_sum) { sum[k] += __builtin_convertvector(tile_sum, D); }

  RLVR_INLINE void reduce(double* out) const {
    static constexpr int slot[kNumSums] = {S_TOTAL, S_PG, S_KL, S_NEG_DELTA, S_KL_RAW, S_IS, S_ENT};
    for (int k = 0; k < NUM_SUMS; ++k) out[k] = 0.0;
    double mx = 0.0;
    for (int l = 0; l < L::W; ++l) {
      for (int k = 0; k < kNumSums; ++k) out[slot[k]] += sum[k][l];
      out[S_NTOK] += double(ntok[l]);
      out[S_CLIP] += double(clip[l]);
      out[S_CLIP_LOWER] += double(clip_lower[l]);
      out[S_REJECT] += double(reject[l]);
      out[S_SHAPED] += double(shaped[l]);
      out[S_NONFINITE] += double(nonfinite[l]);
      mx = std::max(mx, double(is_max[l]));
    }
    out[S_IS_MAX] = mx;
  }
};

// The hyper-parameters as vectors, broadcast once per block.
template <typename T, int VB>
struct VConst {
  using V = typename Lanes<T, VB>::V;
  V zero, one, half, lo, hi, clip_c, lrc, beta, ent_coef, rc_low, rc_high, tau_pos, tau_neg, four_tau_pos, four_tau_neg,
      lim20, lim10;

  template <typename in_t>
  explicit VConst(const Ctx<in_t, T>& c)
      : zero(splat<V>(T(0))),
        one(splat<V>(T(1))),
        half(splat<V>(T(0.5))),
        lo(splat<V>(c.lo)),
        hi(splat<V>(c.hi)),
        clip_c(splat<V>(c.clip_c)),
        lrc(splat<V>(c.lrc)),
        beta(splat<V>(c.beta)),
        ent_coef(splat<V>(c.ent_coef)),
        rc_low(splat<V>(c.rc_low)),
        rc_high(splat<V>(c.rc_high)),
        tau_pos(splat<V>(c.tau_pos)),
        tau_neg(splat<V>(c.tau_neg)),
        four_tau_pos(splat<V>(c.four_tau_pos)),
        four_tau_neg(splat<V>(c.four_tau_neg)),
        lim20(splat<V>(T(20))),
        lim10(splat<V>(T(10))) {}
};

template <typename in_t, typename T>
RLVR_INLINE SeqConst<T> seq_const(const Ctx<in_t, T>& c, int64_t i) {
  SeqConst<T> s{};
  s.adv = c.o.seq_adv ? c.adv[i] : T(0);
  s.a = c.o.seq_mean ? c.seq->inv_n[i] : T(1);
  s.neg_ce_a = -c.ent_coef * s.a;
  s.gspo_s = c.o.loss == kGspo ? c.seq->gspo_s[i] : T(0);
  s.gspo_pass = c.o.loss == kGspo ? c.seq->gspo_pass[i] != 0 : false;
  const bool seq_rc = c.o.rc == kSeqTis || c.o.rc == kSeqMis;
  s.seq_w = seq_rc ? c.seq->seq_w[i] : T(1);
  s.seq_rej = seq_rc ? c.seq->seq_rej[i] != 0 : false;
  s.a3po_high = c.o.a3po ? c.seq->a3po_high[i] : 1.0;
  s.a3po_low = c.o.a3po ? c.seq->a3po_low[i] : 1.0;
  return s;
}

template <typename in_t, typename T>
RLVR_INLINE void zero_slots(const Ctx<in_t, T>& c, int64_t t0, int64_t t1) {
  if (t1 <= t0) return;
  std::fill(c.grad + t0, c.grad + t1, T(0));
  if (c.grad_ent != nullptr) std::fill(c.grad_ent + t0, c.grad_ent + t1, T(0));
  if (c.tok != nullptr) std::fill(c.tok + t0, c.tok + t1, T(0));
}

// pg = max(l1, l2) with l1 = −A·x, l2 = −A·clamp(x, lo, hi) (PPO / GSPO), and
// coef = ∂pg/∂x / (−A): torch.maximum sends a tie half to each side, clamp passes [lo, hi].
template <typename V, typename M>
RLVR_INLINE V clip_branch(V neg_adv, V x, V lo, V hi, V zero, V one, V half, V& coef, M& clipped) {
  const V l1 = neg_adv * x;
  const V l2 = neg_adv * vclamp(x, lo, hi);
  const M gt = l1 > l2, lt = l2 > l1;
  const M inside = (x >= lo) & (x <= hi);
  const V w1 = sel(gt, one, sel(lt, zero, half));
  const V w2 = sel(lt, one, sel(gt, zero, half));
  coef = w1 + sel(inside, w2, zero);
  clipped = lt;
  return vmax_nan(l1, l2);
}

// One tile: up to kTileGroups groups of W token slots [t0, t0 + ns) of one sequence. Each stage
// is its own short loop over the tile with its intermediates in small arrays (L1), so every loop
// keeps its values in registers and tests the options once per tile. Returns whether a slot was
// valid.
template <int VB, typename in_t, typename T>
RLVR_INLINE bool tile(const Ctx<in_t, T>& c, const VConst<T, VB>& k, const SeqConst<T>& sc, int64_t t0, int ns,
                      Acc<T, VB>& acc) {
  using L = Lanes<T, VB>;
  using V = typename L::V;
  using M = typename L::M;
  using Sums = Acc<T, VB>;
  constexpr int W = L::W, G = kTileGroups;
  const Options& o = c.o;
  const V zero = k.zero, one = k.one;
  const M none = M{}, all = none == none;
  const int ng = (ns + W - 1) / W;
  auto lanes = [&](int g) __attribute__((always_inline)) { return std::min(W, ns - g * W); };
  M valid[G];
  V lp[G], old[G], adv[G], ent[G], ref[G], roll[G], pg[G], dpg[G], w[G], shaped_adv[G], is_w[G], kl[G], dkl[G];

  // Inputs, and the count of valid slots where one of them is not finite (S_NONFINITE):
  // x·0 is ±0 for finite x and NaN for NaN/±inf, so a sum of them is NaN exactly when an
  // input of the lane is not finite (no overflow is possible), one FMA per input.
  bool any = false;
  {
    M ntok = none, nonfinite = none;
    const V nf0 = o.seq_adv ? splat<V>(sc.adv * T(0)) : zero;
    for (int g = 0; g < ng; ++g) {
      const int64_t t = t0 + g * W;
      const int n = lanes(g);
      if (c.mask != nullptr) {
        any |= load_mask<T, VB>(c.mask + t, n, valid[g]);
      } else {
        valid[g] = lanes_below<T, VB>(n);
        any = true;
      }
      ntok -= valid[g];
      lp[g] = load<T, VB>(c.lp + t, n);
      old[g] = load<T, VB>(c.old + t, n);
      adv[g] = o.seq_adv ? splat<V>(sc.adv) : load<T, VB>(c.adv + t, n);
      V nf = nf0 + lp[g] * zero + old[g] * zero;
      if (!o.seq_adv) nf = nf + adv[g] * zero;
      if (o.has_entropy) {
        ent[g] = load<T, VB>(c.ent + t, n);
        nf = nf + ent[g] * zero;
      }
      if (c.ref != nullptr) {
        ref[g] = load<T, VB>(c.ref + t, n);
        nf = nf + ref[g] * zero;
      }
      if (c.roll != nullptr) {
        roll[g] = load<T, VB>(c.roll + t, n);
        nf = nf + roll[g] * zero;
      }
      nonfinite -= valid[g] & (nf != nf);
    }
    acc.ntok += ntok;
    acc.nonfinite += nonfinite;
  }
  if (!any) {
    zero_slots(c, t0, t0 + ns);
    return false;
  }

  // Policy-gradient term pg, its derivative dpg = ∂pg/∂logp, the clip flags and −δ.
  {
    V neg_delta_sum = zero;
    M clip = none, clip_lower = none;
    switch (o.loss) {
      case kPpo:
        for (int g = 0; g < ng; ++g) {
          const V neg_adv = -adv[g], delta_raw = lp[g] - old[g];
          V delta = delta_raw;
          M pass = all;
          if (o.lrc_on) {
            delta = vclamp(delta_raw, -k.lrc, k.lrc);
            pass = (delta_raw >= -k.lrc) & (delta_raw <= k.lrc);
          }
          const V ratio = vexp(delta);
          V coef;
          M clipped;
          V p = clip_branch(neg_adv, ratio, k.lo, k.hi, zero, one, k.half, coef, clipped);
          if (o.dual_clip) {
            const V l3 = neg_adv * k.clip_c;
            const M neg = adv[g] < zero;
            const V gm = sel(p < l3, one, sel(p == l3, k.half, zero));
            clip_lower -= valid[g] & neg & (p > l3);
            coef = sel(neg, coef * gm, coef);
            p = sel(neg, vmin_nan(p, l3), p);
          }
          pg[g] = p;
          dpg[g] = sel(pass, neg_adv * coef * ratio, zero);
          clip -= valid[g] & clipped;
          neg_delta_sum += sel(valid[g], -delta, zero);
        }
        break;
      case kGspo: {
        // log s_{i,t} = logp − sg(logp) + sg(log s_i): the value is the sequence's, the
        // derivative w.r.t. its own logp is s (while log s_i is under the clamp).
        const V s = splat<V>(sc.gspo_s);
        for (int g = 0; g < ng; ++g) {
          const V neg_adv = -adv[g];
          V coef;
          M clipped;
          pg[g] = clip_branch(neg_adv, s, k.lo, k.hi, zero, one, k.half, coef, clipped);
          dpg[g] = sc.gspo_pass ? neg_adv * coef * s : zero;
          clip -= valid[g] & clipped;
          neg_delta_sum += sel(valid[g], old[g] - lp[g], zero);
        }
        break;
      }
      case kCispo:
        for (int g = 0; g < ng; ++g) {
          const V delta = o.lrc_on ? vclamp(lp[g] - old[g], -k.lrc, k.lrc) : lp[g] - old[g];
          const V ratio = vexp(delta);
          const V clipped_ratio = vclamp(ratio, k.lo, k.hi);
          dpg[g] = -clipped_ratio * adv[g];  // the clipped ratio is a constant
          pg[g] = dpg[g] * lp[g];
          clip -= valid[g] & (ratio != clipped_ratio);
          neg_delta_sum += sel(valid[g], -delta, zero);
        }
        break;
      case kSapo:
        for (int g = 0; g < ng; ++g) {
          const V delta_raw = lp[g] - old[g];
          V delta = delta_raw;
          M pass = all;
          if (o.lrc_on) {
            delta = vclamp(delta_raw, -k.lrc, k.lrc);
            pass = (delta_raw >= -k.lrc) & (delta_raw <= k.lrc);
          }
          const V ratio = vexp(delta);
          const M pos = adv[g] > zero;
          const V tau = sel(pos, k.tau_pos, k.tau_neg);
          const V four_tau = sel(pos, k.four_tau_pos, k.four_tau_neg);
          const V sig = one / (one + vexp(-(tau * (ratio - one))));
          pg[g] = -(sig * four_tau) * adv[g];
          dpg[g] = sel(pass, -adv[g] * four_tau * (sig * (one - sig)) * tau * ratio, zero);
          neg_delta_sum += sel(valid[g], -delta, zero);
        }
        break;
      default:  // reinforce
        for (int g = 0; g < ng; ++g) {
          pg[g] = -adv[g] * lp[g];
          dpg[g] = -adv[g];
          neg_delta_sum += sel(valid[g], old[g] - lp[g], zero);
        }
        break;
    }
    acc.add(Sums::kNegDelta, neg_delta_sum);
    acc.clip += clip;
    acc.clip_lower += clip_lower;
  }

  // Shaping weight w (a constant): computed in double and rounded once, as the reference.
  if (o.shaping) {
    M shaped = none;
    for (int g = 0; g < ng; ++g) {
      const int n = lanes(g);
      for (int l = 0; l < W; ++l) {
        const double a = double(adv[g][l]);
        double wl = a > 0 ? o.w_pos : a < 0 ? o.w_neg : 1.0;
        if (o.lambda != 0.0) {
          const double p = std::exp(double(old[g][l]));
          const double wp = a > 0 ? 1.0 - p : a < 0 ? p : 0.0;
          wl *= (1.0 - o.lambda) + o.lambda * wp;
        }
        if (o.a3po) {
          const uint8_t f = l < n ? c.seq->a3po_sel[t0 + g * W + l] : 0;
          double s = 1.0;
          if (f & 1) s *= sc.a3po_high;
          if (f & 2) s *= sc.a3po_low;
          wl *= s;
        }
        if (o.ent_quantile) wl *= static_cast<float>(ent[g][l]) >= c.threshold ? 1.0 : 0.0;
        w[g][l] = static_cast<T>(wl);
        shaped_adv[g][l] = static_cast<T>(a * wl);  // Ã for shape_token_advantages, from the double weight
      }
      shaped -= valid[g] & (w[g] != one);
    }
    acc.shaped += shaped;
  }

  // Rollout-correction weight (a constant).
  if (o.rc != kRcNone) {
    V is_sum = zero, is_max = acc.is_max;
    M reject = none;
    for (int g = 0; g < ng; ++g) {
      V iw;
      M rej = none;
      if (o.rc == kSeqTis || o.rc == kSeqMis) {
        iw = splat<V>(sc.seq_w);
        rej = sc.seq_rej ? all : none;
      } else {
        const V rw = vexp(vclamp(old[g] - roll[g], -k.lim20, k.lim20));
        if (o.rc == kTokenTis) {
          iw = rw > k.rc_high ? k.rc_high : rw;
        } else if (o.rc == kTokenMis) {
          rej = (rw < k.rc_low) | (rw > k.rc_high);
          iw = sel(rej, zero, one);
        } else {  // decoupled
          rej = rw > k.rc_high;
          iw = sel(rej, zero, rw);
        }
      }
      is_w[g] = iw;
      const V iv = sel(valid[g], iw, zero);
      is_sum += iv;
      is_max = vmax_nan(is_max, iv);
      reject -= valid[g] & rej;
    }
    acc.add(Sums::kIs, is_sum);
    acc.is_max = is_max;
    acc.reject += reject;
  }

  // KL to the reference.
  if (o.kl != kKlNone) {
    V kl_sum = zero;
    for (int g = 0; g < ng; ++g) {
      const V x = lp[g] - ref[g];
      V v, d;
      if (o.kl == kK1) {
        v = x;
        d = one;
      } else if (o.kl == kK2) {
        v = k.half * (x * x);
        d = x;
      } else {
        V y = ref[g] - lp[g];
        M pass = all;
        if (o.kl_clamp) {
          pass = (y >= -k.lim20) & (y <= k.lim20);
          y = vclamp(y, -k.lim20, k.lim20);
        }
        const V e = vexp(y);
        v = e - y - one;
        if (o.kl_clamp) {
          pass = pass & (v >= -k.lim10) & (v <= k.lim10);
          v = vclamp(v, -k.lim10, k.lim10);
        }
        d = o.kl == kK3 ? sel(pass, one - e, zero) : x;  // k3+: the value of k3, the gradient of k2
      }
      kl[g] = v;
      dkl[g] = d;
      kl_sum += sel(valid[g], v, zero);
    }
    acc.add(Sums::kKlRaw, kl_sum);
    acc.add(Sums::kKl, o.seq_mean ? kl_sum * sc.a : kl_sum);
  }

  // ℓ = pg·w·is_w + β·kl − c_H·H, the outputs and the loss sums.
  {
    V total = zero, pg_sum = zero;
    const V neg_ce_a = splat<V>(sc.neg_ce_a);
    for (int g = 0; g < ng; ++g) {
      const int64_t t = t0 + g * W;
      const int n = lanes(g);
      V p = pg[g], d = dpg[g];
      if (o.shaping) {
        p = p * w[g];
        d = d * w[g];
      }
      if (o.rc != kRcNone) {
        p = p * is_w[g];
        d = d * is_w[g];
      }
      V loss = p;
      if (o.kl != kKlNone) {
        loss = loss + k.beta * kl[g];
        d = d + k.beta * dkl[g];
      }
      if (o.ent_term) loss = loss - k.ent_coef * ent[g];
      if (o.seq_mean) d = d * sc.a;
      store<T>(c.grad + t, sel(valid[g], d, zero), n);
      if (c.grad_ent != nullptr) store<T>(c.grad_ent + t, sel(valid[g], neg_ce_a, zero), n);
      if (o.token_out == 1) {
        store<T>(c.tok + t, sel(valid[g], loss, zero), n);
      } else if (o.token_out == 2) {
        store<T>(c.tok + t, sel(valid[g], o.shaping ? shaped_adv[g] : adv[g], zero), n);
      }
      total += sel(valid[g], loss, zero);
      pg_sum += sel(valid[g], p, zero);
    }
    // seq-mean-token-mean: a = 1/n_i is constant over the tile, so Σ a·x = a·Σ x.
    acc.add(Sums::kTotal, o.seq_mean ? total * sc.a : total);
    acc.add(Sums::kPg, o.seq_mean ? pg_sum * sc.a : pg_sum);
  }
  if (o.has_entropy) {
    V ent_sum = zero;
    for (int g = 0; g < ng; ++g) ent_sum += sel(valid[g], ent[g], zero);
    acc.add(Sums::kEnt, ent_sum);
  }
  return true;
}

template <int VB, typename in_t, typename T>
RLVR_INLINE void block_body(const Ctx<in_t, T>& shared, int64_t blk, double* out) {
  constexpr int kTileSlots = kTileGroups * Lanes<T, VB>::W;
  // A private copy: the float stores to the outputs could otherwise alias the float fields of
  // the shared context, and the compiler would reload them for every group.
  const Ctx<in_t, T> c = shared;
  const VConst<T, VB> k(c);
  Acc<T, VB> acc;
  acc.zero();
  const int64_t t0 = blk * kBlock, t1 = std::min(t0 + kBlock, c.slots);
  auto segment = [&](int64_t i, int64_t s0, int64_t s1) __attribute__((always_inline)) {
    const SeqConst<T> sc = seq_const(c, i);
    bool any = false;
    for (int64_t t = s0; t < s1;) {
      if (c.mask != nullptr) {  // a run of masked slots (padding) in 8-byte steps
        int64_t r = t;
        for (uint64_t bits; r + 8 <= s1; r += 8) {
          std::memcpy(&bits, c.mask + r, 8);
          if (bits != 0) break;
        }
        if (r > t) {
          zero_slots(c, t, r);
          t = r;
          if (t >= s1) break;
        }
      }
      const int ns = int(std::min<int64_t>(kTileSlots, s1 - t));
      any |= tile<VB>(c, k, sc, t, ns, acc);
      t += ns;
    }
    if (any && c.has_valid != nullptr) __atomic_store_n(c.has_valid + i, uint8_t(1), __ATOMIC_RELAXED);
  };
  int64_t t = t0;
  if (c.L > 0) {
    for (int64_t i = t0 / c.L; t < t1; ++i) {
      const int64_t e = std::min((i + 1) * c.L, t1);
      segment(i, t, e);
      t = e;
    }
  } else {
    // The first sequence ending after t0 (spans are disjoint and in order).
    int64_t i = std::upper_bound(c.end, c.end + c.B, t0) - c.end;
    for (; t < t1 && i < c.B; ++i) {
      const int64_t b = std::min(std::max(c.begin[i], t), t1);
      zero_slots(c, t, b);
      t = b;
      const int64_t e = std::min(c.end[i], t1);
      if (e > t) {
        segment(i, t, e);
        t = e;
      }
    }
    zero_slots(c, t, t1);
  }
  acc.reduce(out);
}

template <typename in_t, typename T>
__attribute__((noinline)) void block_baseline(const Ctx<in_t, T>& c, int64_t blk, double* out) {
  block_body<16>(c, blk, out);
}

#if RLVR_AVX2_CLONE
template <typename in_t, typename T>
__attribute__((noinline, target("avx2,fma"))) void block_avx2(const Ctx<in_t, T>& c, int64_t blk, double* out) {
  block_body<32>(c, blk, out);
}
#endif

// ------------------------------------------------------------------ pre-pass
// Strict total order for the A3PO ranking: by metric (descending for "high", ascending for
// "low"), ties to the lower token index; NaN (only reachable with validate=False) ranks last.
struct RankOrder {
  bool high;
  bool operator()(const std::pair<double, int64_t>& a, const std::pair<double, int64_t>& b) const {
    const bool na = std::isnan(a.first), nb = std::isnan(b.first);
    if (na != nb) return nb;
    if (!na && a.first != b.first) return high ? a.first > b.first : a.first < b.first;
    return a.second < b.second;
  }
};

template <typename in_t, typename T>
void prepass(const Ctx<in_t, T>& c, SeqInfo<T>& s) {
  const Options& o = c.o;
  const bool gspo = o.loss == kGspo, seq_rc = o.rc == kSeqTis || o.rc == kSeqMis;
#pragma omp parallel if (c.B > 1)
  {
    std::vector<std::pair<double, int64_t>> cand;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < c.B; ++i) {
      int64_t b, e;
      c.span(i, b, e);
      int64_t n = 0;
      double sum_delta = 0.0, sum_logw = 0.0, polarity = 0.0;
      for (int64_t t = b; t < e; ++t) {
        if (c.mask != nullptr && !c.mask[t]) continue;
        ++n;
        if (gspo) sum_delta += double(static_cast<T>(c.lp[t]) - static_cast<T>(c.old[t]));
        if (seq_rc) sum_logw += double(static_cast<T>(c.old[t]) - static_cast<T>(c.roll[t]));
        if (o.a3po) polarity += double(o.seq_adv ? c.adv[i] : c.adv[t]);
      }
      s.n[i] = n;
      s.inv_n[i] = n > 0 ? T(1) / static_cast<T>(n) : T(0);
      if (gspo) {
        // log s_i = Σ δ·m / max(n, 1), clamped above; the clamp stops the gradient.
        const T log_s = static_cast<T>(sum_delta / double(std::max<int64_t>(n, 1)));
        s.gspo_pass[i] = log_s <= c.gspo_clamp;
        s.gspo_s[i] = std::exp(log_s > c.gspo_clamp ? c.gspo_clamp : log_s);
      }
      if (seq_rc) {
        T lw = static_cast<T>(sum_logw);
        lw = lw < T(-20) ? T(-20) : lw > T(20) ? T(20) : lw;
        const T w = std::exp(lw);
        if (o.rc == kSeqTis) {
          s.seq_w[i] = w > c.rc_high ? c.rc_high : w;
          s.seq_rej[i] = 0;
        } else {
          const bool rej = w < c.rc_low || w > c.rc_high;
          s.seq_w[i] = rej ? T(0) : T(1);
          s.seq_rej[i] = rej;
        }
      }
      if (o.a3po) {
        s.a3po_high[i] = s.a3po_low[i] = 1.0;
        if (polarity == 0.0) continue;
        cand.clear();
        for (int64_t t = b; t < e; ++t) {
          if (c.mask != nullptr && !c.mask[t]) continue;
          const double m =
              o.a3po_entropy ? double(static_cast<T>(c.ent[t])) : std::exp(double(static_cast<T>(c.old[t])));
          if (m != 0.0) cand.emplace_back(m, t);
        }
        const int64_t nc = int64_t(cand.size());
        if (nc == 0) continue;
        const int base = polarity > 0 ? 0 : 2;  // knobs: pos-high, pos-low, neg-high, neg-low
        for (int k = 0; k < 2; ++k) {
          const double ratio = o.a3po_knobs[2 * (base + k)], scale = o.a3po_knobs[2 * (base + k) + 1];
          if (!(ratio > 0 && scale != 1)) continue;
          const int64_t top = std::min(nc, std::max<int64_t>(1, int64_t(double(nc) * ratio)));
          std::nth_element(cand.begin(), cand.begin() + (top - 1), cand.end(), RankOrder{k == 0});
          for (int64_t j = 0; j < top; ++j) s.a3po_sel[cand[j].second] |= uint8_t(1 << k);
          (k == 0 ? s.a3po_high[i] : s.a3po_low[i]) = scale;
        }
      }
    }
  }
}

// ------------------------------------------------------------------ driver
template <typename in_t, typename T>
void run(Ctx<in_t, T>& c, double* sums) {
  const Options& o = c.o;
  SeqInfo<T> seq;
  std::vector<uint8_t> has_valid;
  if (o.prepass) {
    seq.n.assign(c.B, 0);
    seq.inv_n.assign(c.B, T(0));
    if (o.loss == kGspo) {
      seq.gspo_s.assign(c.B, T(0));
      seq.gspo_pass.assign(c.B, 0);
    }
    if (o.rc == kSeqTis || o.rc == kSeqMis) {
      seq.seq_w.assign(c.B, T(1));
      seq.seq_rej.assign(c.B, 0);
    }
    if (o.a3po) {
      seq.a3po_high.assign(c.B, 1.0);
      seq.a3po_low.assign(c.B, 1.0);
      seq.a3po_sel.assign(c.slots, 0);
    }
    c.seq = &seq;
    prepass(c, seq);
  } else {
    has_valid.assign(c.B, 0);
    c.has_valid = has_valid.data();
  }

  const int64_t nblocks = (c.slots + kBlock - 1) / kBlock;
  std::vector<double> partial(nblocks * NUM_SUMS);
  void (*fn)(const Ctx<in_t, T>&, int64_t, double*) = &block_baseline<in_t, T>;
#if RLVR_AVX2_CLONE
  if (use_avx2()) fn = &block_avx2<in_t, T>;
#endif
  const Ctx<in_t, T>& cc = c;
#pragma omp parallel for schedule(dynamic, 1) if (nblocks > 1)
  for (int64_t b = 0; b < nblocks; ++b) fn(cc, b, partial.data() + b * NUM_SUMS);

  for (int k = 0; k < NUM_SUMS; ++k) sums[k] = 0.0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const double* p = partial.data() + b * NUM_SUMS;
    for (int k = 0; k < NUM_SUMS; ++k) sums[k] = k == S_IS_MAX ? std::max(sums[k], p[k]) : sums[k] + p[k];
  }
  int64_t nseq = 0;
  for (int64_t i = 0; i < c.B; ++i) nseq += o.prepass ? seq.n[i] > 0 : has_valid[i] != 0;
  sums[S_NSEQ] = double(nseq);
  if (o.rc == kRcNone) {  // is_w = 1
    sums[S_IS] = sums[S_NTOK];
    sums[S_IS_MAX] = sums[S_NTOK] > 0 ? 1.0 : 0.0;
  }
}

void check_token_tensor(const char* name, const torch::Tensor& t, const torch::Tensor& like) {
  TORCH_CHECK(t.device().is_cpu(), "policy_loss_fwd: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.sizes() == like.sizes(), "policy_loss_fwd: ", name, " must have shape ", like.sizes(), ", got ",
              t.sizes());
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> policy_loss_fwd_cpu(
    const torch::Tensor& logprobs, const torch::Tensor& old_logprobs, const torch::Tensor& advantages,
    const c10::optional<torch::Tensor>& mask_opt, const c10::optional<torch::Tensor>& ref_opt,
    const c10::optional<torch::Tensor>& rollout_opt, const c10::optional<torch::Tensor>& entropy_opt,
    const c10::optional<torch::Tensor>& cu_seqlens_opt, const c10::optional<torch::Tensor>& threshold_opt,
    c10::ArrayRef<double> fparams, c10::ArrayRef<int64_t> iparams, bool need_entropy_grad) {
  TORCH_CHECK(fparams.size() == NUM_FPARAMS, "policy_loss_fwd: expected ", NUM_FPARAMS, " fparams, got ",
              fparams.size());
  TORCH_CHECK(iparams.size() == NUM_IPARAMS, "policy_loss_fwd: expected ", NUM_IPARAMS, " iparams, got ",
              iparams.size());
  const auto dtype = logprobs.scalar_type();
  TORCH_CHECK(
      dtype == torch::kFloat32 || dtype == torch::kFloat64 || dtype == torch::kFloat16 || dtype == torch::kBFloat16,
      "policy_loss_fwd: logprobs must be float16, bfloat16, float32 or float64, got ", dtype);
  TORCH_CHECK(logprobs.device().is_cpu(), "policy_loss_fwd: logprobs must be a CPU tensor");
  const auto cdt = dtype == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;

  Options o{};
  o.loss = iparams[I_LOSS_TYPE];
  o.kl = iparams[I_KL];
  o.rc = iparams[I_RC];
  o.token_out = iparams[I_TOKEN_OUT];
  TORCH_CHECK(o.loss >= kPpo && o.loss <= kReinforce, "policy_loss_fwd: unknown loss type ", o.loss);
  TORCH_CHECK(o.kl >= kKlNone && o.kl <= kK3Plus, "policy_loss_fwd: unknown kl ", o.kl);
  TORCH_CHECK(o.rc >= kRcNone && o.rc <= kDecoupled, "policy_loss_fwd: unknown rollout correction ", o.rc);
  TORCH_CHECK(o.token_out >= 0 && o.token_out <= 2, "policy_loss_fwd: unknown token_out ", o.token_out);
  o.kl_clamp = iparams[I_KL_CLAMP] != 0;
  o.seq_mean = iparams[I_SEQ_MEAN] != 0;
  o.seq_adv = iparams[I_SEQ_ADV] != 0;
  o.a3po = iparams[I_A3PO_ON] != 0;
  o.a3po_entropy = iparams[I_A3PO_METRIC] != 0;
  o.ent_quantile = iparams[I_ENT_QUANTILE] != 0;
  o.need_entropy_grad = need_entropy_grad;
  o.lrc_on = fparams[F_LOG_RATIO_CLAMP] > 0;
  o.dual_clip = o.loss == kPpo && fparams[F_CLIP_C] > 0;
  o.has_entropy = entropy_opt.has_value();
  o.ent_term = o.has_entropy && fparams[F_ENT_COEF] != 0;
  // The polarity weights enter the double shaping weight exactly (as the reference's).
  o.w_pos = fparams[F_W_POS];
  o.w_neg = fparams[F_W_NEG];
  o.lambda = fparams[F_PROB_LAMBDA];
  for (int k = 0; k < 8; ++k) o.a3po_knobs[k] = fparams[F_A3PO + k];
  o.shaping = o.w_pos != 1.0 || o.w_neg != 1.0 || o.lambda != 0.0 || o.a3po || o.ent_quantile;
  o.prepass = o.seq_mean || o.loss == kGspo || o.rc == kSeqTis || o.rc == kSeqMis || o.a3po;

  // Layout.
  const bool packed = cu_seqlens_opt.has_value();
  TORCH_CHECK(logprobs.dim() == (packed ? 1 : 2), "policy_loss_fwd: logprobs must be ",
              packed ? "[T] with cu_seqlens" : "[B, L] without cu_seqlens", ", got shape ", logprobs.sizes());
  TORCH_CHECK(packed || mask_opt.has_value(), "policy_loss_fwd: the padded layout needs a mask");
  const torch::Tensor lp = logprobs.contiguous();
  auto same = [&](const char* name, const c10::optional<torch::Tensor>& t, bool needed) -> torch::Tensor {
    TORCH_CHECK(t.has_value() || !needed, "policy_loss_fwd: these options need ", name);
    if (!t.has_value()) return torch::Tensor();
    check_token_tensor(name, *t, lp);
    TORCH_CHECK(t->scalar_type() == dtype, "policy_loss_fwd: ", name, " must have dtype ", dtype, ", got ",
                t->scalar_type());
    return t->contiguous();
  };
  const torch::Tensor old = same("old_logprobs", old_logprobs, true);
  const torch::Tensor ref = same("ref_logprobs", ref_opt, o.kl != kKlNone);
  const torch::Tensor roll = same("rollout_logprobs", rollout_opt, o.rc != kRcNone);
  const bool needs_entropy = o.ent_term || o.ent_quantile || (o.a3po && o.a3po_entropy) || need_entropy_grad;
  const torch::Tensor ent = same("entropy", entropy_opt, needs_entropy);
  torch::Tensor mask;
  if (mask_opt.has_value()) {
    check_token_tensor("mask", *mask_opt, lp);
    mask = mask_opt->scalar_type() == torch::kBool ? mask_opt->contiguous() : (*mask_opt != 0).contiguous();
  }
  const int64_t B = packed ? cu_seqlens_opt->numel() - 1 : lp.size(0);
  const int64_t L = packed ? 0 : lp.size(1);
  const int64_t slots = lp.numel();
  std::vector<int64_t> begin, end;
  if (packed) {
    TORCH_CHECK(cu_seqlens_opt->dim() == 1 && B >= 0, "policy_loss_fwd: cu_seqlens must be [B + 1]");
    const torch::Tensor cu = cu_seqlens_opt->to(torch::kCPU, torch::kInt64).contiguous();
    const int64_t* cp = cu.data_ptr<int64_t>();
    begin.resize(B);
    end.resize(B);
    // Clamped to [0, T]; a span never starts before the previous one ends, so a decreasing
    // pair (or any disorder, possible with validate=False) gives empty sequences, never an
    // out-of-bounds or doubly written slot.
    int64_t prev = 0;
    for (int64_t i = 0; i < B; ++i) {
      const int64_t b = std::max(std::min(std::max(cp[i], int64_t(0)), slots), prev);
      const int64_t e = std::max(std::min(std::max(cp[i + 1], int64_t(0)), slots), b);
      begin[i] = b;
      end[i] = e;
      prev = e;
    }
  }
  const torch::Tensor adv = advantages.to(cdt).contiguous();
  TORCH_CHECK(adv.device().is_cpu(), "policy_loss_fwd: advantages must be a CPU tensor");
  if (o.seq_adv) {
    TORCH_CHECK(adv.dim() == 1 && adv.numel() == B, "policy_loss_fwd: advantages must be [B = ", B, "], got ",
                adv.sizes());
  } else {
    check_token_tensor("advantages", adv, lp);
  }
  float threshold = 0.0f;
  if (o.ent_quantile) {
    TORCH_CHECK(threshold_opt.has_value() && threshold_opt->numel() == 1,
                "policy_loss_fwd: the entropy quantile needs a 1-element entropy_threshold");
    threshold = threshold_opt->to(torch::kCPU, torch::kFloat32).item<float>();
  }

  // Outputs (token-shaped ones from the huge-page cache).
  const auto shape = lp.sizes();
  torch::Tensor grad = empty_output(shape, cdt);
  torch::Tensor grad_ent = need_entropy_grad ? empty_output(shape, cdt) : torch::empty({0}, torch::dtype(cdt));
  torch::Tensor tok = o.token_out != 0 ? empty_output(shape, cdt) : torch::empty({0}, torch::dtype(cdt));
  double sums[NUM_SUMS];

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rlvr_policy_loss_fwd", [&] {
    using in_t = scalar_t;
    using T = std::conditional_t<std::is_same<in_t, double>::value, double, float>;
    auto ptr = [](const torch::Tensor& t) { return t.defined() ? t.data_ptr<in_t>() : nullptr; };
    Ctx<in_t, T> c{};
    c.lp = lp.data_ptr<in_t>();
    c.old = old.data_ptr<in_t>();
    c.ref = ptr(ref);
    c.roll = ptr(roll);
    c.ent = ptr(ent);
    c.adv = adv.data_ptr<T>();
    c.mask = mask.defined() ? mask.data_ptr<bool>() : nullptr;
    c.B = B;
    c.L = L;
    c.slots = slots;
    c.begin = packed ? begin.data() : nullptr;
    c.end = packed ? end.data() : nullptr;
    c.grad = grad.data_ptr<T>();
    c.grad_ent = need_entropy_grad ? grad_ent.data_ptr<T>() : nullptr;
    c.tok = o.token_out != 0 ? tok.data_ptr<T>() : nullptr;
    c.o = o;
    c.lo = static_cast<T>(fparams[F_CLIP_LO]);
    c.hi = static_cast<T>(fparams[F_CLIP_HI]);
    c.clip_c = static_cast<T>(fparams[F_CLIP_C]);
    c.lrc = static_cast<T>(fparams[F_LOG_RATIO_CLAMP]);
    c.gspo_clamp = static_cast<T>(fparams[F_GSPO_CLAMP]);
    c.beta = static_cast<T>(fparams[F_KL_COEF]);
    c.rc_low = static_cast<T>(fparams[F_RC_LOW]);
    c.rc_high = static_cast<T>(fparams[F_RC_HIGH]);
    c.ent_coef = o.ent_term ? static_cast<T>(fparams[F_ENT_COEF]) : T(0);
    c.tau_pos = static_cast<T>(fparams[F_TAU_POS]);
    c.tau_neg = static_cast<T>(fparams[F_TAU_NEG]);
    c.four_tau_pos = T(4) / c.tau_pos;
    c.four_tau_neg = T(4) / c.tau_neg;
    c.threshold = threshold;
    run(c, sums);
  });

  torch::Tensor sums_t = torch::empty({NUM_SUMS}, torch::dtype(cdt));
  AT_DISPATCH_FLOATING_TYPES(cdt, "rlvr_policy_loss_sums", [&] {
    scalar_t* p = sums_t.data_ptr<scalar_t>();
    for (int k = 0; k < NUM_SUMS; ++k) p[k] = static_cast<scalar_t>(sums[k]);
  });
  return {sums_t, grad, grad_ent, tok};
}

// ------------------------------------------------------------------ backward
// out = (coef · up).to(dtype), with torch's type promotion (at::result_type: a 0-d up does
// not promote coef). Fixed chunks over the threads; the chunk loop is compiled twice (baseline
// and AVX2, picked at run time) and left to the auto-vectoriser, conversions included.
namespace {

constexpr int64_t kGradChunk = 1 << 15;

template <typename T, typename c_t, typename u_t, typename out_t, bool kScalar>
RLVR_INLINE void grad_chunk_body(const c_t* __restrict coef, const u_t* __restrict up, T u0, out_t* __restrict out,
                                 int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T u = kScalar ? u0 : static_cast<T>(up[i]);
    out[i] = static_cast<out_t>(static_cast<T>(coef[i]) * u);
  }
}

template <typename T, typename c_t, typename u_t, typename out_t, bool kScalar>
__attribute__((noinline)) void grad_chunk_baseline(const c_t* coef, const u_t* up, T u0, out_t* out, int64_t n) {
  grad_chunk_body<T, c_t, u_t, out_t, kScalar>(coef, up, u0, out, n);
}

#if RLVR_AVX2_CLONE
template <typename T, typename c_t, typename u_t, typename out_t, bool kScalar>
__attribute__((noinline, target("avx2,fma"))) void grad_chunk_avx2(const c_t* coef, const u_t* up, T u0, out_t* out,
                                                                    int64_t n) {
  grad_chunk_body<T, c_t, u_t, out_t, kScalar>(coef, up, u0, out, n);
}
#endif

template <typename T, typename c_t, typename u_t, typename out_t, bool kScalar>
void grad_run(const c_t* coef, const u_t* up, T u0, out_t* out, int64_t numel) {
  void (*fn)(const c_t*, const u_t*, T, out_t*, int64_t) = &grad_chunk_baseline<T, c_t, u_t, out_t, kScalar>;
#if RLVR_AVX2_CLONE
  if (use_avx2()) fn = &grad_chunk_avx2<T, c_t, u_t, out_t, kScalar>;
#endif
  const int64_t nchunks = (numel + kGradChunk - 1) / kGradChunk;
#pragma omp parallel for schedule(static) if (nchunks > 1)
  for (int64_t b = 0; b < nchunks; ++b) {
    const int64_t i0 = b * kGradChunk, n = std::min(kGradChunk, numel - i0);
    fn(coef + i0, kScalar ? up : up + i0, u0, out + i0, n);
  }
}

}  // namespace

torch::Tensor policy_loss_grad_cpu(const torch::Tensor& coef, const torch::Tensor& up, at::ScalarType dtype) {
  TORCH_CHECK(coef.device().is_cpu() && up.device().is_cpu(), "policy_loss_grad: coef and up must be CPU tensors");
  TORCH_CHECK(coef.scalar_type() == torch::kFloat32 || coef.scalar_type() == torch::kFloat64,
              "policy_loss_grad: coef must be float32 or float64, got ", coef.scalar_type());
  TORCH_CHECK(at::isFloatingType(up.scalar_type()) &&
                  (up.scalar_type() == torch::kFloat32 || up.scalar_type() == torch::kFloat64 ||
                   up.scalar_type() == torch::kBFloat16 || up.scalar_type() == torch::kFloat16),
              "policy_loss_grad: up must be float16, bfloat16, float32 or float64, got ", up.scalar_type());
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kFloat64 || dtype == torch::kBFloat16 ||
                  dtype == torch::kFloat16,
              "policy_loss_grad: dtype must be float16, bfloat16, float32 or float64, got ", dtype);
  TORCH_CHECK(coef.is_contiguous(), "policy_loss_grad: coef must be contiguous");
  const bool scalar = up.numel() == 1;
  TORCH_CHECK(scalar || up.sizes() == coef.sizes(), "policy_loss_grad: up must have 1 element or shape ",
              coef.sizes(), ", got ", up.sizes());
  TORCH_CHECK(scalar || up.is_contiguous(), "policy_loss_grad: up must be contiguous");
  // As torch: the product in the promoted dtype (a 0-d up does not promote), then cast;
  // a 1-element up of more dimensions broadcasts the shape.
  const auto ct = at::result_type(coef, up);
  TORCH_CHECK(ct == torch::kFloat32 || ct == torch::kFloat64, "policy_loss_grad: unexpected compute dtype ", ct);
  const std::vector<int64_t> shape = scalar ? at::infer_size(coef.sizes(), up.sizes()) : coef.sizes().vec();
  torch::Tensor out = empty_output(shape, dtype);
  const int64_t numel = coef.numel();
  if (numel == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(ct, "rlvr_policy_loss_grad_ct", [&] {
    using T = scalar_t;
    AT_DISPATCH_FLOATING_TYPES(coef.scalar_type(), "rlvr_policy_loss_grad_coef", [&] {
      using c_t = scalar_t;
      if (scalar) {
        const T u0 = up.to(torch::kCPU, c10::CppTypeToScalarType<T>::value).item<T>();
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rlvr_policy_loss_grad_out", [&] {
          grad_run<T, c_t, c_t, scalar_t, true>(coef.data_ptr<c_t>(), nullptr, u0, out.data_ptr<scalar_t>(), numel);
        });
        return;
      }
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, up.scalar_type(), "rlvr_policy_loss_grad_up", [&] {
        using u_t = scalar_t;
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rlvr_policy_loss_grad_out", [&] {
          grad_run<T, c_t, u_t, scalar_t, false>(coef.data_ptr<c_t>(), up.data_ptr<u_t>(), T(0),
                                                 out.data_ptr<scalar_t>(), numel);
        });
      });
    });
  });
  return out;
}

}  // namespace rlvr
