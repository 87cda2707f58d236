// The GRPO-family policy loss on the CPU (docs/token-shaping.md, docs/policy-loss.md): one forward pass that writes the loss
// sums, the metrics and the per-token derivative grad_logprobs = agg_w · ∂ℓ/∂logp, so the
// backward is a scalar multiply (rlvr_kernels/ops/policy_loss.py holds the contract, the
// parameters are PolicyLossParams of policy_loss.h).
//
// Layout of the work:
//   * an optional pre-pass per sequence (parallel over sequences), only when an option needs
//     a sequence statistic: n_i (seq-mean-token-mean), Σ δ·m (GSPO), Σ δ_min·m and Σ A·m
//     (geo_mean), Σ log w·m (seq_tis / seq_mis), and the A3PO rank selection (stored as two
//     bits per token);
//   * the main pass over fixed blocks of kBlock token slots (padded rows or packed spans laid
//     end to end), parallel over blocks. Each block writes its sums to its own row of a
//     [num_blocks, NUM_SUMS] double buffer, reduced in block order: the result does not depend
//     on the thread count. Every output slot is written exactly once (0 on padding, masked
//     tokens and tokens outside every packed span); runs of masked slots are skipped 8 at a time.
//
// The stages of a tile read, function by function, like rlvr_kernels/reference/policy_loss.py
// (and triton/policy_loss.py, whose helpers carry the same names with a leading underscore):
//   input_stage →
//   pg_stage: log_ratio → ppo_term | gspo_term | cispo_term | sapo_term | reinforce_term |
//             dppo_term | geo_mean_term | dro_term | clip_cov_term | kl_cov_term
//             (clipped_objective, then dual_clip for ppo / gspo; dppo_keep for dppo_tv /
//             dppo_kl; geo_mean_log_ratio in the pre-pass for geo_mean; clip_sides) →
//   shaping_stage: shaping_weights (polarity_weight, probability_weight, a3po_scale, entropy keep) →
//   is_weight_stage: is_weights (corrected_weight) →
//   kl_stage: kl_term = kl_estimate (k1, k2, k3, k3+) × importance_ratio (kl_ratio_correction) →
//   output_stage: token_loss (ℓ = pg·w·is_w + β·kl − c_H·H), then aggregate (the a_t weights);
// each helper's comment names the reference function it mirrors. Names: `adv` is the
// advantage A, `agg_w` the aggregation weight a_t (m_t / n_i for seq-mean-token-mean, else m_t).
//
// Vectorisation: the token math is written once on GCC vector types, branch-free with selects.
// The build is portable (no -march), so the block loop is compiled twice by run_isa (simd.h),
// with 16-byte vectors for the baseline ISA and 32-byte ones for AVX2+FMA, and picked at run
// time. A block is walked in tiles of kTileGroups vectors; each stage is a short loop over the
// tile with its intermediates in L1 arrays (Tile), which keeps every loop within the register
// file and tests the options once per tile. Float exp is a Cephes-style polynomial (< 1 ulp;
// torch uses SLEEF's 1-ulp exp); double exp is libm.
//
// Numerics follow the fp32/fp64 reference op for op: hyper-parameters enter the token math in
// the compute dtype (as a Python scalar does in a torch op), the shaping weight is computed in
// double and rounded once, derivatives follow torch's autograd conventions (clamp passes the
// gradient on the closed interval, maximum / minimum split a tie in halves). Sums are double,
// fed per tile (see Acc).
//
// Memory safety: the registered op is reachable directly (and by compiled graphs), so the entry
// point checks every shape relation the kernel relies on, and cu_seqlens goes through
// sanitized_offsets (spans.h): whatever the inputs hold, every access stays in bounds.
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
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "alloc.h"
#include "simd.h"
#include "spans.h"

namespace rlvr {
namespace {

using Sum = PolicyLossSum;
constexpr int NUM_SUMS = kNumPolicyLossSums;
constexpr int idx(Sum s) { return int(s); }
constexpr int idx(SeqStat s) { return int(s); }

// Token slots per work item: small enough to balance ragged rows over threads, large enough
// that the per-block partial sums cost nothing.
constexpr int64_t kBlock = 4096;

// ------------------------------------------------------------------ options and context
// PolicyLossParams decoded once, plus the switches the stages test once per tile.
struct Options {
  LossType loss;
  KlEstimator kl;
  RolloutCorrection rc;
  TokenOut token_out;
  bool seq_mean, seq_adv, a3po, a3po_entropy, ent_quantile, need_entropy_grad;
  bool kl_in3, kl_out3;  // the KL input / output clamps on k3 (and k3+'s value)
  bool kl_in2, kl_out2;  // ... on k1, k2 (and k3+'s gradient): kl_clamp = ALL
  bool kl_score;         // kl_score_grad: ∂/∂logp gains kl where no clamp is active
  bool lrc_on, dual_clip, has_entropy, ent_term, shaping, seq_rc, prepass;
  bool kl_ratio;    // the KL term times the ratio (kl_ratio_correction)
  uint32_t rs;      // the rejection chain (bit j: options.RS_OPTIONS[j]); 0 = off
  bool rc_current;  // the rollout log-ratio from logprobs (bypass), else from old_logprobs
  bool is_norm;     // the IS weights over their batch mean
  IsGate gate;      // rollout_correction GATE: what the gate reads
  bool gate_seq;    // ... a per-sequence statistic (the pre-pass's seq_rej), else per token
  bool clip_sides;  // the loss type clips (ppo, gspo, cispo): per-side and per-sequence clip counts
  bool dppo_cap;    // dppo with a truncation cap c
  bool cov;         // clip_cov / kl_cov: the kernel reads the covariance selection
  double w_pos, w_neg, lambda;
  double a3po_knobs[8];  // (ratio, scale) of pos-high, pos-low, neg-high, neg-low
};

// Per-sequence results of the pre-pass.
template <typename T>
struct SeqInfo {
  std::vector<int64_t> n;  // valid tokens
  std::vector<T> inv_n, gspo_s, seq_w;
  std::vector<T> geo_share;  // geo_mean: L_i / n_i, the share of the sequence loss on each valid token
  std::vector<uint8_t> gspo_pass, seq_rej;
  std::vector<double> a3po_high, a3po_low;  // the knob scales of the sequence's polarity (1: off)
  std::vector<uint8_t> a3po_sel;            // per token slot: bit 0 high-selected, bit 1 low-selected
  std::vector<int64_t> n_raw;               // rejection: valid tokens before it (n: those it keeps)
  std::vector<uint8_t> keep;                // rejection: per token slot, 1 where the chain keeps it
  std::vector<double> tok_w;                // token-level batch norm: Σ over valid tokens of the IS weight
};

template <typename in_t, typename T>
struct Ctx {
  const in_t *lp, *old, *ref, *roll, *ent;  // ref / roll / ent: nullptr when the call does not read them
  const T* adv;
  const bool* mask;
  const bool* cov_sel;         // clip_cov / kl_cov: the covariance selection (token-shaped), else nullptr
  int64_t B, L, slots;         // L = 0 for the packed layout; slots = B·L or T
  const int64_t* offsets;      // packed: the B + 1 sanitised offsets (disjoint, in order, inside [0, T])
  T *grad, *grad_ent, *tok;
  Options o;
  // Hyper-parameters in the compute dtype, as the reference's torch ops see them.
  T ratio_low, ratio_high, clip_c, lrc, gspo_clamp, beta, rc_low, rc_high, ent_coef, tau_pos, tau_neg, four_tau_pos,
      four_tau_neg, half_dro_beta, kl_cov_coef, kl_in, kl_out;
  float threshold;
  T rs[14];               // the rejection bounds (PolicyLossParams rs_*, in order)
  T is_mu;                // the batch-normalisation mean (1 when off)
  const bool* keep;       // rejection: the pre-pass's per-slot keep flags (nullptr when off)
  const SeqInfo<T>* seq;  // nullptr without pre-pass
  uint8_t* has_valid;     // without pre-pass: sequences with a valid token
  int64_t* seq_counts;    // clip_sides: per sequence (n_i, Σ m·low, Σ m·high), integer atomics
  const double* stats;    // given sequence statistics [B, kNumSeqStats] (contracts SeqStat; cp_group), else nullptr

  void span(int64_t i, int64_t& b, int64_t& e) const {
    if (L > 0 || offsets == nullptr) {
      b = i * L;
      e = b + L;
    } else {
      b = offsets[i];
      e = offsets[i + 1];
    }
  }
};

// What a segment of one sequence needs from the sequence.
template <typename T>
struct SeqConst {
  T adv, agg_w, grad_ent, gspo_s, seq_w, geo_share;  // grad_ent = −c_H·agg_w
  bool gspo_pass, seq_rej;
  double a3po_high, a3po_low;
};

template <typename in_t, typename T>
RLVR_INLINE SeqConst<T> seq_const(const Ctx<in_t, T>& c, int64_t i) {
  const Options& o = c.o;
  SeqConst<T> s{};
  s.adv = o.seq_adv ? c.adv[i] : T(0);
  s.agg_w = o.seq_mean ? c.seq->inv_n[i] : T(1);
  s.grad_ent = -c.ent_coef * s.agg_w;
  s.gspo_s = o.loss == LossType::GSPO ? c.seq->gspo_s[i] : T(0);
  s.gspo_pass = o.loss == LossType::GSPO ? c.seq->gspo_pass[i] != 0 : false;
  s.seq_w = o.seq_rc ? c.seq->seq_w[i] : T(1);
  s.geo_share = o.loss == LossType::GEO_MEAN ? c.seq->geo_share[i] : T(0);
  s.seq_rej = o.seq_rc || o.gate_seq ? c.seq->seq_rej[i] != 0 : false;
  s.a3po_high = o.a3po ? c.seq->a3po_high[i] : 1.0;
  s.a3po_low = o.a3po ? c.seq->a3po_low[i] : 1.0;
  return s;
}

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
  typename L::M ntok, clip, clip_lower, reject, shaped, nonfinite, clip_low, clip_high;
  V is_max;

  RLVR_INLINE void zero() {
    for (int k = 0; k < kNumSums; ++k) sum[k] = D{};
    ntok = clip = clip_lower = reject = shaped = nonfinite = clip_low = clip_high = typename L::M{};
    is_max = V{};
  }

  RLVR_INLINE void add(int k, V tile_sum) { sum[k] += __builtin_convertvector(tile_sum, D); }

  RLVR_INLINE void reduce(double* out) const {
    static constexpr int slot[kNumSums] = {idx(Sum::TOTAL),  idx(Sum::PG), idx(Sum::KL), idx(Sum::NEG_DELTA),
                                           idx(Sum::KL_RAW), idx(Sum::IS), idx(Sum::ENT)};
    for (int k = 0; k < NUM_SUMS; ++k) out[k] = 0.0;
    double mx = 0.0;
    for (int l = 0; l < L::W; ++l) {
      for (int k = 0; k < kNumSums; ++k) out[slot[k]] += sum[k][l];
      out[idx(Sum::NTOK)] += double(ntok[l]);
      out[idx(Sum::CLIP)] += double(clip[l]);
      out[idx(Sum::CLIP_LOWER)] += double(clip_lower[l]);
      out[idx(Sum::REJECT)] += double(reject[l]);
      out[idx(Sum::SHAPED)] += double(shaped[l]);
      out[idx(Sum::NONFINITE)] += double(nonfinite[l]);
      out[idx(Sum::CLIP_LOW)] += double(clip_low[l]);
      out[idx(Sum::CLIP_HIGH)] += double(clip_high[l]);
      mx = std::max(mx, double(is_max[l]));
    }
    out[idx(Sum::IS_MAX)] = mx;
  }
};

// The hyper-parameters as vectors, broadcast once per block.
template <typename T, int VB>
struct VConst {
  using V = typename Lanes<T, VB>::V;
  using M = typename Lanes<T, VB>::M;
  V zero, one, half, ratio_low, ratio_high, clip_c, lrc, beta, ent_coef, rc_low, rc_high, tau_pos, tau_neg,
      four_tau_pos, four_tau_neg, half_dro_beta, kl_cov_coef, lim20, lim10, kl_in, kl_out, is_mu;
  M none, all;

  template <typename in_t>
  explicit VConst(const Ctx<in_t, T>& c)
      : zero(splat<V>(T(0))),
        one(splat<V>(T(1))),
        half(splat<V>(T(0.5))),
        ratio_low(splat<V>(c.ratio_low)),
        ratio_high(splat<V>(c.ratio_high)),
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
        half_dro_beta(splat<V>(c.half_dro_beta)),
        kl_cov_coef(splat<V>(c.kl_cov_coef)),
        lim20(splat<V>(T(20))),
        lim10(splat<V>(T(10))),
        kl_in(splat<V>(c.kl_in)),
        kl_out(splat<V>(c.kl_out)),
        is_mu(splat<V>(c.is_mu)),
        none(M{}),
        all(M{} == M{}) {}
};

// One tile: up to kTileGroups groups of W token slots [t0, t0 + ns) of one sequence, with each
// stage's per-group results in small arrays (L1) between the stage loops.
template <typename T, int VB>
struct Tile {
  using L = Lanes<T, VB>;
  using V = typename L::V;
  using M = typename L::M;
  static constexpr int G = kTileGroups;
  int64_t t0;
  int ns, ng;
  M valid[G], cov[G];  // cov: the covariance selection (clip_cov / kl_cov)
  V lp[G], old[G], adv[G], ent[G], ref[G], roll[G];  // inputs in the compute dtype
  V pg[G], dpg[G];                                   // policy-gradient term, ∂pg/∂logp
  V w[G], shaped_adv[G];                             // shaping weight, Ã = A·w
  V is_w[G];                                         // rollout-correction weight
  V kl[G], dkl[G];                                   // KL estimate, ∂kl/∂logp

  RLVR_INLINE int lanes(int g) const { return std::min(L::W, ns - g * L::W); }
};

template <typename in_t, typename T>
RLVR_INLINE void zero_slots(const Ctx<in_t, T>& c, int64_t t0, int64_t t1) {
  if (t1 <= t0) return;
  std::fill(c.grad + t0, c.grad + t1, T(0));
  if (c.grad_ent != nullptr) std::fill(c.grad_ent + t0, c.grad_ent + t1, T(0));
  if (c.tok != nullptr) std::fill(c.tok + t0, c.tok + t1, T(0));
}

// ------------------------------------------------------------------ stages
// Mirrors reference aggregate, the kernel's share of it (the last stage, defined first: every
// stage's sums go through it): x times the aggregation weight a_t for the sums and the gradient.
// a_t = 1/n_i for seq-mean-token-mean, constant over a tile, so a tile sum is weighted once
// (Σ a·x = a·Σ x); else a_t = m_t, which the callers apply as the valid selection. The scalar
// normalisation (1/N_tok, 1/N_seq, dp_size, loss_scale_factor) is the op layer's _aggregate.
template <typename V, typename T>
RLVR_INLINE V aggregate(const Options& o, const SeqConst<T>& sc, V x) {
  return o.seq_mean ? x * sc.agg_w : x;
}

// Inputs of a tile in the compute dtype (reference.policy_loss rounds them the same way), the
// valid count and the value check (Sum::NONFINITE): x·0 is ±0 for finite x and NaN for NaN/±inf,
// so a sum of them is NaN exactly when an input of the lane is not finite (no overflow is
// possible), one FMA per input. Returns whether a slot of the tile is valid.
template <int VB, typename in_t, typename T>
RLVR_INLINE bool input_stage(const Ctx<in_t, T>& c, const VConst<T, VB>& k, const SeqConst<T>& sc, Tile<T, VB>& tl,
                             Acc<T, VB>& acc) {
  using V = typename Lanes<T, VB>::V;
  using M = typename Lanes<T, VB>::M;
  constexpr int W = Lanes<T, VB>::W;
  const Options& o = c.o;
  bool any = false;
  M ntok = k.none, nonfinite = k.none;
  const V nf0 = o.seq_adv ? splat<V>(sc.adv * T(0)) : k.zero;
  for (int g = 0; g < tl.ng; ++g) {
    const int64_t t = tl.t0 + g * W;
    const int n = tl.lanes(g);
    if (c.mask != nullptr) {
      any |= load_mask<T, VB>(c.mask + t, n, tl.valid[g]);
    } else {
      tl.valid[g] = lanes_below<T, VB>(n);
      any = true;
    }
    if (c.keep != nullptr) {  // the rejection chain (reference rejection_keep) removes tokens
      M kept;
      load_mask<T, VB>(c.keep + t, n, kept);
      tl.valid[g] = tl.valid[g] & kept;
    }
    ntok -= tl.valid[g];
    tl.lp[g] = load<T, VB>(c.lp + t, n);
    tl.old[g] = load<T, VB>(c.old + t, n);
    tl.adv[g] = o.seq_adv ? splat<V>(sc.adv) : load<T, VB>(c.adv + t, n);
    if (c.cov_sel != nullptr) load_mask<T, VB>(c.cov_sel + t, n, tl.cov[g]);
    V nf = nf0 + tl.lp[g] * k.zero + tl.old[g] * k.zero;
    if (!o.seq_adv) nf = nf + tl.adv[g] * k.zero;
    if (o.has_entropy) {
      tl.ent[g] = load<T, VB>(c.ent + t, n);
      nf = nf + tl.ent[g] * k.zero;
    }
    if (c.ref != nullptr) {
      tl.ref[g] = load<T, VB>(c.ref + t, n);
      nf = nf + tl.ref[g] * k.zero;
    }
    if (c.roll != nullptr) {
      tl.roll[g] = load<T, VB>(c.roll + t, n);
      nf = nf + tl.roll[g] * k.zero;
    }
    nonfinite -= tl.valid[g] & (nf != nf);
  }
  acc.ntok += ntok;
  acc.nonfinite += nonfinite;
  return any;
}

// Mirrors reference log_ratio: δ = logp − old, clamped to ±log_ratio_clamp when that is on;
// `pass` is where the clamp passes the gradient (torch.clamp: the closed interval).
template <typename V, typename M, typename K>
RLVR_INLINE V log_ratio(bool lrc_on, const K& k, V lp, V old, M& pass) {
  const V delta_raw = lp - old;
  pass = k.all;
  if (!lrc_on) return delta_raw;
  pass = (delta_raw >= -k.lrc) & (delta_raw <= k.lrc);
  return vclamp(delta_raw, -k.lrc, k.lrc);
}

// Mirrors reference clipped_objective: max(l1, l2) with l1 = −A·x, l2 = −A·clamp(x, lo, hi);
// coef = ∂/∂x divided by −A: torch.maximum sends a tie half to each side, clamp passes [lo, hi].
template <typename V, typename M, typename K>
RLVR_INLINE V clipped_objective(const K& k, V neg_adv, V x, V& coef, M& clipped) {
  const V l1 = neg_adv * x;
  const V l2 = neg_adv * vclamp(x, k.ratio_low, k.ratio_high);
  const M gt = l1 > l2, lt = l2 > l1;
  const M inside = (x >= k.ratio_low) & (x <= k.ratio_high);
  const V w1 = sel(gt, k.one, sel(lt, k.zero, k.half));
  const V w2 = sel(lt, k.one, sel(gt, k.zero, k.half));
  coef = w1 + sel(inside, w2, k.zero);
  clipped = lt;
  return vmax_nan(l1, l2);
}

// The per-tile partial sums of the policy-gradient stage.
template <typename T, int VB>
struct PgSums {
  typename Lanes<T, VB>::V neg_delta;
  typename Lanes<T, VB>::M clip, clip_lower, low, high;
};

// Mirrors reference clip_sides: the clip sides of the ratio x the loss type clips (CLIP_LOW /
// CLIP_HIGH): x below 1 − ε_low with A < 0, above 1 + ε_high with A > 0, on valid tokens.
template <int VB, typename T>
RLVR_INLINE void clip_sides(const VConst<T, VB>& k, const Tile<T, VB>& tl, int g, typename Lanes<T, VB>::V x,
                            PgSums<T, VB>& s) {
  s.low -= tl.valid[g] & (x < k.ratio_low) & (tl.adv[g] < k.zero);
  s.high -= tl.valid[g] & (x > k.ratio_high) & (tl.adv[g] > k.zero);
}

// Mirrors reference dual_clip: for A < 0, p = min(p, −A·c) (torch.minimum: a tie passes half
// the gradient, so coef, ∂p/∂x divided by −A, is scaled by 1, ½ or 0); CLIP_LOWER counts the
// valid A < 0 tokens it bounds. Shared by ppo_term and gspo_term (gspo_dual_clip).
template <int VB, typename T>
RLVR_INLINE void dual_clip(const VConst<T, VB>& k, const Tile<T, VB>& tl, int g, typename Lanes<T, VB>::V neg_adv,
                           typename Lanes<T, VB>::V& p, typename Lanes<T, VB>::V& coef, PgSums<T, VB>& s) {
  using V = typename Lanes<T, VB>::V;
  using M = typename Lanes<T, VB>::M;
  const V l3 = neg_adv * k.clip_c;
  const M neg = tl.adv[g] < k.zero;
  const V gm = sel(p < l3, k.one, sel(p == l3, k.half, k.zero));
  s.clip_lower -= tl.valid[g] & neg & (p > l3);
  coef = sel(neg, coef * gm, coef);
  p = sel(neg, vmin_nan(p, l3), p);
}

// Mirrors reference ppo_term: the clipped ratio objective, then dual_clip.
template <int VB, typename T>
RLVR_INLINE void ppo_term(const Options& o, const VConst<T, VB>& k, Tile<T, VB>& tl, int g, PgSums<T, VB>& s) {
  using V = typename Lanes<T, VB>::V;
  using M = typename Lanes<T, VB>::M;
  const V neg_adv = -tl.adv[g];
  M pass;
  const V delta = log_ratio(o.lrc_on, k, tl.lp[g], tl.old[g], pass);
  const V ratio = vexp(delta);
  V coef;
  M clipped;
  V p = clipped_objective(k, neg_adv, ratio, coef, clipped);
  if (o.dual_clip) dual_clip(k, tl, g, neg_adv, p, coef, s);
  tl.pg[g] = p;
  tl.dpg[g] = sel(pass, neg_adv * coef * ratio, k.zero);
  s.clip -= tl.valid[g] & clipped;
  clip_sides(k, tl, g, ratio, s);
  s.neg_delta += sel(tl.valid[g], -delta, k.zero);
}

// Mirrors reference gspo_term: log s_{i,t} = logp − sg(logp) + sg(log s_i), so the value is the
// sequence's s (from the pre-pass) and the derivative w.r.t. its own logp is s while log s_i is
// under the clamp; then dual_clip (gspo_dual_clip).
template <int VB, typename T>
RLVR_INLINE void gspo_term(const Options& o, const VConst<T, VB>& k, const SeqConst<T>& sc,
                           typename Lanes<T, VB>::V s_vec, Tile<T, VB>& tl, int g, PgSums<T, VB>& s) {
  using V = typename Lanes<T, VB>::V;
  using M = typename Lanes<T, VB>::M;
  const V neg_adv = -tl.adv[g];
  V coef;
  M clipped;
  V p = clipped_objective(k, neg_adv, s_vec, coef, clipped);
  if (o.dual_clip) dual_clip(k, tl, g, neg_adv, p, coef, s);
  tl.pg[g] = p;
  tl.dpg[g] = sc.gspo_pass ? neg_adv * coef * s_vec : k.zero;
  s.clip -= tl.valid[g] & clipped;
  clip_sides(k, tl, g, s_vec, s);
  s.neg_delta += sel(tl.valid[g], tl.old[g] - tl.lp[g], k.zero);
}

// Mirrors reference cispo_term: −sg(clamp(ratio, lo, hi))·A·logp (the clipped ratio is a constant).
template <int VB, typename T>
RLVR_INLINE void cispo_term(const Options& o, const VConst<T, VB>& k, Tile<T, VB>& tl, int g, PgSums<T, VB>& s) {
  using V = typename Lanes<T, VB>::V;
  using M = typename Lanes<T, VB>::M;
  M pass;  // (unused: the clipped ratio carries no gradient)
  const V delta = log_ratio(o.lrc_on, k, tl.lp[g], tl.old[g], pass);
  const V ratio = vexp(delta);
  const V clipped_ratio = vclamp(ratio, k.ratio_low, k.ratio_high);
  tl.dpg[g] = -clipped_ratio * tl.adv[g];
  tl.pg[g] = tl.dpg[g] * tl.lp[g];
  s.clip -= tl.valid[g] & (ratio != clipped_ratio);
  clip_sides(k, tl, g, ratio, s);
  s.neg_delta += sel(tl.valid[g], -delta, k.zero);
}

// Mirrors reference sapo_term: −σ(τ·(ratio − 1))·(4/τ)·A, τ = τ_pos for A > 0, else τ_neg.
template <int VB, typename T>
RLVR_INLINE void sapo_term(const Options& o, const VConst<T, VB>& k, Tile<T, VB>& tl, int g, PgSums<T, VB>& s) {
  using V = typename Lanes<T, VB>::V;
  using M = typename Lanes<T, VB>::M;
  M pass;
  const V delta = log_ratio(o.lrc_on, k, tl.lp[g], tl.old[g], pass);
  const V ratio = vexp(delta);
  const M pos = tl.adv[g] > k.zero;
  const V tau = sel(pos, k.tau_pos, k.tau_neg);
  const V four_tau = sel(pos, k.four_tau_pos, k.four_tau_neg);
  const V sig = k.one / (k.one + vexp(-(tau * (ratio - k.one))));
  tl.pg[g] = -(sig * four_tau) * tl.adv[g];
  tl.dpg[g] = sel(pass, -tl.adv[g] * four_tau * (sig * (k.one - sig)) * tau * ratio, k.zero);
  s.neg_delta += sel(tl.valid[g], -delta, k.zero);
}

// Mirrors reference reinforce_term: −A·logp.
template <int VB, typename T>
RLVR_INLINE void reinforce_term(const VConst<T, VB>& k, Tile<T, VB>& tl, int g, PgSums<T, VB>& s) {
  tl.pg[g] = -tl.adv[g] * tl.lp[g];
  tl.dpg[g] = -tl.adv[g];
  s.neg_delta += sel(tl.valid[g], tl.old[g] - tl.lp[g], k.zero);
}

// Mirrors reference dppo_keep: the trust-region mask, p = exp(logp), p_old = exp(old), the
// thresholds δ_low / δ_high arriving as ratio_low / ratio_high. TV: p − p_old <= δ_high for
// A > 0, >= −δ_low otherwise. KL: kl = p_old·(old − logp) + (1 − p_old)·log((1 − p_old + 1e-8) /
// (1 − p + 1e-8)) (the log lane by lane, libm), kl <= δ_high or p <= p_old for A > 0, kl <= δ_low
// or p >= p_old otherwise.
template <bool KL, int VB, typename T>
RLVR_INLINE typename Lanes<T, VB>::M dppo_keep(const VConst<T, VB>& k, const Tile<T, VB>& tl, int g) {
  using V = typename Lanes<T, VB>::V;
  using M = typename Lanes<T, VB>::M;
  const V p = vexp(tl.lp[g]), p_old = vexp(tl.old[g]);
  const M pos = tl.adv[g] > k.zero;
  if constexpr (!KL) {
    const V d = p - p_old;
    return (pos & (d <= k.ratio_high)) | (~pos & (d >= -k.ratio_low));
  } else {
    const V eps = splat<V>(T(1e-8));
    V q = ((k.one - p_old) + eps) / ((k.one - p) + eps);
    for (int l = 0; l < Lanes<T, VB>::W; ++l) q[l] = std::log(q[l]);
    const V kl = p_old * (tl.old[g] - tl.lp[g]) + (k.one - p_old) * q;
    return (pos & ((kl <= k.ratio_high) | (p <= p_old))) | (~pos & ((kl <= k.ratio_low) | (p >= p_old)));
  }
}

// Mirrors reference dppo_term (with dppo_ratio; dppo_tv with KL = false, dppo_kl with true):
// −A·sg(min(ρ, c))·logp·keep, the truncated ratio and keep = dppo_keep constants, so
// ∂pg/∂logp = −A·sg(min(ρ, c))·keep; CLIP counts the valid tokens outside the region,
// CLIP_LOWER the kept ones with ρ > c.
template <bool KL, int VB, typename T>
RLVR_INLINE void dppo_term(const Options& o, const VConst<T, VB>& k, Tile<T, VB>& tl, int g, PgSums<T, VB>& s) {
  using V = typename Lanes<T, VB>::V;
  using M = typename Lanes<T, VB>::M;
  M pass;  // (unused: the truncated ratio carries no gradient)
  const V delta = log_ratio(o.lrc_on, k, tl.lp[g], tl.old[g], pass);
  const V ratio = vexp(delta);
  const M capped = o.dppo_cap ? ratio > k.clip_c : k.none;  // torch.clamp(max=c): NaN stays NaN
  const V trunc = sel(capped, k.clip_c, ratio);
  const M keep = dppo_keep<KL>(k, tl, g);
  const V coef = -tl.adv[g] * trunc;
  tl.dpg[g] = sel(keep, coef, k.zero);
  tl.pg[g] = sel(keep, coef * tl.lp[g], k.zero);
  s.clip -= tl.valid[g] & ~keep;
  s.clip_lower -= tl.valid[g] & keep & capped;
  s.neg_delta += sel(tl.valid[g], -delta, k.zero);
}

// Mirrors reference geo_mean_log_ratio, scalar (the pre-pass): δ clipped above at ε_high for
// A > 0, below at −ε_low for A < 0, 0 for A = 0 (ε_low / ε_high arriving as ratio_low /
// ratio_high).
template <typename T>
RLVR_INLINE T geo_mean_log_ratio(T delta, T adv, T eps_low, T eps_high) {
  if (adv > T(0)) return delta > eps_high ? eps_high : delta;
  if (adv < T(0)) return delta < -eps_low ? -eps_low : delta;
  return T(0);
}

// Mirrors reference geo_mean_term: every valid token carries the sequence's share L_i / n_i
// (pre-pass) and the derivative of its own log-prob, share·∂δ_min/∂δ: the share, except 0
// where the clip binds (A > 0 and δ > ε_high, A < 0 and δ < −ε_low; the boundaries pass, as
// torch.minimum's halves of a tie add up to 1 there) and for A = 0. CLIP counts δ outside
// [−ε_low, ε_high] with A > 0, CLIP_LOWER with A < 0 (verl's metrics).
template <int VB, typename T>
RLVR_INLINE void geo_mean_term(const VConst<T, VB>& k, const SeqConst<T>& sc, Tile<T, VB>& tl, int g,
                               PgSums<T, VB>& s) {
  using V = typename Lanes<T, VB>::V;
  using M = typename Lanes<T, VB>::M;
  const V share = splat<V>(sc.geo_share);
  const V delta = tl.lp[g] - tl.old[g];
  const M pos = tl.adv[g] > k.zero, neg = tl.adv[g] < k.zero;
  const M above = delta > k.ratio_high, below = delta < -k.ratio_low;
  const M outside = above | below;
  tl.pg[g] = share;
  tl.dpg[g] = sel((pos & ~above) | (neg & ~below), share, k.zero);
  s.clip -= tl.valid[g] & outside & pos;
  s.clip_lower -= tl.valid[g] & outside & neg;
  s.neg_delta += sel(tl.valid[g], -delta, k.zero);
}

// Mirrors reference dro_term: −(logp·A − ½β·δ²), δ = logp − old unclamped, so
// ∂pg/∂logp = ½β·2δ − A.
template <int VB, typename T>
RLVR_INLINE void dro_term(const VConst<T, VB>& k, Tile<T, VB>& tl, int g, PgSums<T, VB>& s) {
  using V = typename Lanes<T, VB>::V;
  const V delta = tl.lp[g] - tl.old[g];
  tl.pg[g] = -(tl.lp[g] * tl.adv[g] - k.half_dro_beta * (delta * delta));
  tl.dpg[g] = k.half_dro_beta * (delta + delta) - tl.adv[g];
  s.neg_delta += sel(tl.valid[g], -delta, k.zero);
}

// Mirrors reference clip_cov_term: ppo's clipped_objective without the dual clip, the term (and
// its gradient) zeroed on the selected tokens; CLIP counts the selected valid tokens (verl's
// pg_clipfrac of clip_cov), the clip sides are ppo's.
template <int VB, typename T>
RLVR_INLINE void clip_cov_term(const Options& o, const VConst<T, VB>& k, Tile<T, VB>& tl, int g, PgSums<T, VB>& s) {
  using V = typename Lanes<T, VB>::V;
  using M = typename Lanes<T, VB>::M;
  const V neg_adv = -tl.adv[g];
  M pass;
  const V delta = log_ratio(o.lrc_on, k, tl.lp[g], tl.old[g], pass);
  const V ratio = vexp(delta);
  V coef;
  M clipped;
  const V p = clipped_objective(k, neg_adv, ratio, coef, clipped);
  const M keep = ~tl.cov[g];
  tl.pg[g] = sel(keep, p, k.zero);
  tl.dpg[g] = sel(keep & pass, neg_adv * coef * ratio, k.zero);
  s.clip -= tl.valid[g] & tl.cov[g];
  clip_sides(k, tl, g, ratio, s);
  s.neg_delta += sel(tl.valid[g], -delta, k.zero);
}

// Mirrors reference kl_cov_term: −A·ρ, plus kl_cov_coef·|δ| on the selected tokens
// (∂|δ|/∂δ = sign(δ), 0 at δ = 0 as torch.abs); CLIP counts the selected valid tokens and
// NEG_DELTA holds Σ m·|δ| (verl's ppo_kl of kl_cov).
template <int VB, typename T>
RLVR_INLINE void kl_cov_term(const Options& o, const VConst<T, VB>& k, Tile<T, VB>& tl, int g, PgSums<T, VB>& s) {
  using V = typename Lanes<T, VB>::V;
  using M = typename Lanes<T, VB>::M;
  const V neg_adv = -tl.adv[g];
  M pass;
  const V delta = log_ratio(o.lrc_on, k, tl.lp[g], tl.old[g], pass);
  const V ratio = vexp(delta);
  const V abs_delta = sel(delta < k.zero, -delta, delta);
  const V sign = sel(delta > k.zero, k.one, sel(delta < k.zero, -k.one, k.zero));
  const M on = tl.cov[g];
  tl.pg[g] = neg_adv * ratio + sel(on, k.kl_cov_coef * abs_delta, k.zero);
  tl.dpg[g] = sel(pass, neg_adv * ratio + sel(on, k.kl_cov_coef * sign, k.zero), k.zero);
  s.clip -= tl.valid[g] & on;
  s.neg_delta += sel(tl.valid[g], abs_delta, k.zero);
}

// Mirrors reference pg_term: the policy-gradient term pg, dpg = ∂pg/∂logp, the clip flags and
// −δ, one loop per loss type (the type is tested once per tile).
template <int VB, typename T>
RLVR_INLINE void pg_stage(const Options& o, const VConst<T, VB>& k, const SeqConst<T>& sc, Tile<T, VB>& tl,
                          Acc<T, VB>& acc) {
  using V = typename Lanes<T, VB>::V;
  PgSums<T, VB> s{k.zero, k.none, k.none, k.none, k.none};
  switch (o.loss) {
    case LossType::PPO:
      for (int g = 0; g < tl.ng; ++g) ppo_term(o, k, tl, g, s);
      break;
    case LossType::GSPO: {
      const V s_vec = splat<V>(sc.gspo_s);
      for (int g = 0; g < tl.ng; ++g) gspo_term(o, k, sc, s_vec, tl, g, s);
      break;
    }
    case LossType::CISPO:
      for (int g = 0; g < tl.ng; ++g) cispo_term(o, k, tl, g, s);
      break;
    case LossType::SAPO:
      for (int g = 0; g < tl.ng; ++g) sapo_term(o, k, tl, g, s);
      break;
    case LossType::DPPO_TV:
      for (int g = 0; g < tl.ng; ++g) dppo_term<false>(o, k, tl, g, s);
      break;
    case LossType::DPPO_KL:
      for (int g = 0; g < tl.ng; ++g) dppo_term<true>(o, k, tl, g, s);
      break;
    case LossType::GEO_MEAN:
      for (int g = 0; g < tl.ng; ++g) geo_mean_term(k, sc, tl, g, s);
      break;
    case LossType::DRO:
      for (int g = 0; g < tl.ng; ++g) dro_term(k, tl, g, s);
      break;
    case LossType::CLIP_COV:
      for (int g = 0; g < tl.ng; ++g) clip_cov_term(o, k, tl, g, s);
      break;
    case LossType::KL_COV:
      for (int g = 0; g < tl.ng; ++g) kl_cov_term(o, k, tl, g, s);
      break;
    default:  // REINFORCE
      for (int g = 0; g < tl.ng; ++g) reinforce_term(k, tl, g, s);
      break;
  }
  acc.add(Acc<T, VB>::kNegDelta, s.neg_delta);
  acc.clip += s.clip;
  acc.clip_lower += s.clip_lower;
  acc.clip_low += s.low;
  acc.clip_high += s.high;
}

// The factors of reference shaping_weights, per token in double.
// Mirrors reference polarity_weights.
RLVR_INLINE double polarity_weight(const Options& o, double adv) {
  return adv > 0 ? o.w_pos : adv < 0 ? o.w_neg : 1.0;
}

// Mirrors reference probability_weights: (1 − λ) + λ·w, w = 1 − p for A > 0, p for A < 0.
RLVR_INLINE double probability_weight(const Options& o, double adv, double old) {
  const double p = std::exp(old);
  const double wp = adv > 0 ? 1.0 - p : adv < 0 ? p : 0.0;
  return (1.0 - o.lambda) + o.lambda * wp;
}

// Mirrors reference a3po_scales: the scales of the knobs that selected the token (pre-pass bits).
RLVR_INLINE double a3po_scale(uint8_t selected, double scale_high, double scale_low) {
  double s = 1.0;
  if (selected & 1) s *= scale_high;
  if (selected & 2) s *= scale_low;
  return s;
}

// Mirrors reference shaping_weights: w = polarity × probability × A3PO scales × entropy keep,
// in double and rounded once (a constant: no gradient); Ã = A·w from the double weight.
template <int VB, typename in_t, typename T>
RLVR_INLINE void shaping_stage(const Ctx<in_t, T>& c, const VConst<T, VB>& k, const SeqConst<T>& sc,
                               Tile<T, VB>& tl, Acc<T, VB>& acc) {
  using M = typename Lanes<T, VB>::M;
  constexpr int W = Lanes<T, VB>::W;
  const Options& o = c.o;
  M shaped = k.none;
  for (int g = 0; g < tl.ng; ++g) {
    const int n = tl.lanes(g);
    for (int l = 0; l < W; ++l) {
      const double adv = double(tl.adv[g][l]);
      double w = polarity_weight(o, adv);
      if (o.lambda != 0.0) w *= probability_weight(o, adv, double(tl.old[g][l]));
      if (o.a3po) {
        const uint8_t selected = l < n ? c.seq->a3po_sel[tl.t0 + g * W + l] : 0;
        w *= a3po_scale(selected, sc.a3po_high, sc.a3po_low);
      }
      if (o.ent_quantile) w *= static_cast<float>(tl.ent[g][l]) >= c.threshold ? 1.0 : 0.0;  // entropy_keep
      tl.w[g][l] = static_cast<T>(w);
      tl.shaped_adv[g][l] = static_cast<T>(adv * w);
    }
    shaped -= tl.valid[g] & (tl.w[g] != k.one);
  }
  acc.shaped += shaped;
}

// The rollout-correction weight from the raw weight rw (reference is_weights' second half), for
// token lanes and for a sequence's scalar alike: TIS caps at C; decoupled drops tokens above C;
// MIS keeps 1 inside [low, C] and rejects outside.
template <typename V, typename M>
RLVR_INLINE V corrected_weight(RolloutCorrection rc, V rw, V low, V high, V zero, V one, M& rejected) {
  switch (rc) {
    case RolloutCorrection::TOKEN_TIS:
    case RolloutCorrection::SEQ_TIS:
      rejected = M{};
      return rw > high ? high : rw;
    case RolloutCorrection::DECOUPLED:
      rejected = rw > high;
      return sel(rejected, zero, rw);
    case RolloutCorrection::TOKEN_ICEPOP:
    case RolloutCorrection::SEQ_ICEPOP:
      rejected = (rw < low) | (rw > high);
      return sel(rejected, zero, rw);
    default:  // TOKEN_MIS, SEQ_MIS
      rejected = (rw < low) | (rw > high);
      return sel(rejected, zero, one);
  }
}

// Mirrors reference gate_statistic for one token: OpenRLHF's binary KL / TV of
// p = exp(rollout), q = exp(base), both clamped to [1e-6, 1 − 1e-6].
template <typename T>
RLVR_INLINE T gate_divergence(IsGate gate, T base, T roll) {
  const T lo = T(1e-6), hi = T(1 - 1e-6);
  T p = std::exp(roll), q = std::exp(base);
  p = p < lo ? lo : p > hi ? hi : p;
  q = q < lo ? lo : q > hi ? hi : q;
  if (gate == IsGate::TV) return std::abs(p - q);
  return p * std::log(p / q) + (T(1) - p) * std::log((T(1) - p) / (T(1) - q));
}

// Mirrors reference is_weights for rollout_correction GATE (OpenRLHF's is_correction): the token
// weight rw clamped into [low, C] (CLAMP), or kept where the gate's statistic (the token's, or the
// sequence's from the pre-pass) lies in [low, C], else 0; the token stays counted either way.
template <int VB, typename T>
RLVR_INLINE typename Lanes<T, VB>::V gate_weight(const Options& o, const VConst<T, VB>& k, const SeqConst<T>& sc,
                                                 typename Lanes<T, VB>::V base, typename Lanes<T, VB>::V roll,
                                                 typename Lanes<T, VB>::V rw, typename Lanes<T, VB>::M& rej) {
  using V = typename Lanes<T, VB>::V;
  if (o.gate == IsGate::CLAMP) {
    rej = (rw < k.rc_low) | (rw > k.rc_high);
    return vclamp(rw, k.rc_low, k.rc_high);
  }
  if (o.gate_seq) {
    rej = sc.seq_rej ? k.all : k.none;
  } else {
    V stat = rw;
    if (o.gate != IsGate::RATIO)
      for (int l = 0; l < Lanes<T, VB>::W; ++l) stat[l] = gate_divergence(o.gate, T(base[l]), T(roll[l]));
    rej = (stat < k.rc_low) | (stat > k.rc_high);
  }
  return sel(rej, k.zero, rw);
}

// Mirrors reference is_weights: a detached weight per token (token level: exp of the clamped
// base − rollout, base = old or, for rc_current, logprobs; sequence level: from the pre-pass),
// over the batch mean with is_norm (reference is_batch_norm).
template <int VB, typename T>
RLVR_INLINE void is_weight_stage(const Options& o, const VConst<T, VB>& k, const SeqConst<T>& sc, Tile<T, VB>& tl,
                                 Acc<T, VB>& acc) {
  using V = typename Lanes<T, VB>::V;
  using M = typename Lanes<T, VB>::M;
  V is_sum = k.zero, is_max = acc.is_max;
  M reject = k.none;
  for (int g = 0; g < tl.ng; ++g) {
    V iw;
    M rej = k.none;
    if (o.seq_rc) {
      iw = splat<V>(sc.seq_w);
      rej = sc.seq_rej ? k.all : k.none;
    } else {
      const V base = o.rc_current ? tl.lp[g] : tl.old[g];
      const V rw = vexp(vclamp(base - tl.roll[g], -k.lim20, k.lim20));
      if (o.rc == RolloutCorrection::GATE)
        iw = gate_weight<VB, T>(o, k, sc, base, tl.roll[g], rw, rej);
      else
        iw = corrected_weight(o.rc, rw, k.rc_low, k.rc_high, k.zero, k.one, rej);
    }
    if (o.is_norm) iw = iw / k.is_mu;
    tl.is_w[g] = iw;
    const V iv = sel(tl.valid[g], iw, k.zero);
    is_sum += iv;
    is_max = vmax_nan(is_max, iv);
    reject -= tl.valid[g] & rej;
  }
  acc.add(Acc<T, VB>::kIs, is_sum);
  acc.is_max = is_max;
  acc.reject += reject;
}

// Mirrors reference kl_estimate, the one home of the KL estimators: the per-token estimate to
// the reference policy, its ∂/∂logp and `live` (no clamp active: reference kl_clamped; k3+: the
// value of k3 with the gradient of k2, each clamped as on its own).
// k1 / k2 (reference kl_estimate's first branch), with the clamps of kl_clamp = ALL.
template <typename V, typename M, typename K>
RLVR_INLINE V kl_quadratic(const Options& o, const K& k, V x, bool k1, V& d, M& live) {
  live = k.all;
  if (o.kl_in2) {
    live = (x >= -k.kl_in) & (x <= k.kl_in);
    x = vclamp(x, -k.kl_in, k.kl_in);
  }
  V v = k1 ? x : k.half * (x * x);
  if (o.kl_out2) {
    live = live & (v >= -k.kl_out) & (v <= k.kl_out);
    v = vclamp(v, -k.kl_out, k.kl_out);
  }
  d = k1 ? k.one : x;
  if (o.kl_in2 || o.kl_out2) d = sel(live, d, k.zero);
  return v;
}

template <typename V, typename M, typename K>
RLVR_INLINE V kl_estimate(const Options& o, const K& k, V lp, V ref, V& d, M& live) {
  const V x = lp - ref;
  if (o.kl == KlEstimator::K1 || o.kl == KlEstimator::K2)
    return kl_quadratic<V, M>(o, k, x, o.kl == KlEstimator::K1, d, live);
  V y = ref - lp;
  M pass = k.all;
  if (o.kl_in3) {
    pass = (y >= -k.kl_in) & (y <= k.kl_in);
    y = vclamp(y, -k.kl_in, k.kl_in);
  }
  const V e = vexp(y);
  V v = e - y - k.one;
  if (o.kl_out3) {
    pass = pass & (v >= -k.kl_out) & (v <= k.kl_out);
    v = vclamp(v, -k.kl_out, k.kl_out);
  }
  if (o.kl == KlEstimator::K3) {
    d = sel(pass, k.one - e, k.zero);
    live = pass;
  } else {
    kl_quadratic<V, M>(o, k, x, false, d, live);
  }
  return v;
}

// Mirrors reference importance_ratio: the ratio r the loss type is built on and its own-token
// derivative dr: exp(δ) (δ through log_ratio), GSPO's s_{i,t} (value s_i from the pre-pass,
// derivative s_i while log s_i is under the clamp).
template <typename V, typename M, typename K, typename T>
RLVR_INLINE V importance_ratio(const Options& o, const K& k, const SeqConst<T>& sc, V lp, V old, V& dr) {
  if (o.loss == LossType::GSPO) {
    const V r = splat<V>(sc.gspo_s);
    dr = sc.gspo_pass ? r : k.zero;
    return r;
  }
  M pass;
  const V r = vexp(log_ratio(o.lrc_on, k, lp, old, pass));
  dr = sel(pass, r, k.zero);
  return r;
}

// Mirrors reference kl_term: kl_estimate, times importance_ratio with kl_ratio_correction
// (d(kl·r) = dkl·r + kl·dr); kl_score_grad adds kl to the derivative where the estimate is live.
template <typename V, typename M, typename K, typename T>
RLVR_INLINE V kl_term(const Options& o, const K& k, const SeqConst<T>& sc, V lp, V old, V ref, V& d) {
  M live;
  V kl = kl_estimate<V, M>(o, k, lp, ref, d, live);
  if (o.kl_ratio) {
    V dr;
    const V r = importance_ratio<V, M>(o, k, sc, lp, old, dr);
    d = d * r + kl * dr;
    kl = kl * r;
  }
  if (o.kl_score) d = d + sel(live, kl, k.zero);
  return kl;
}

template <int VB, typename T>
RLVR_INLINE void kl_stage(const Options& o, const VConst<T, VB>& k, const SeqConst<T>& sc, Tile<T, VB>& tl,
                          Acc<T, VB>& acc) {
  using V = typename Lanes<T, VB>::V;
  using M = typename Lanes<T, VB>::M;
  V kl_sum = k.zero;
  for (int g = 0; g < tl.ng; ++g) {
    tl.kl[g] = kl_term<V, M>(o, k, sc, tl.lp[g], tl.old[g], tl.ref[g], tl.dkl[g]);
    kl_sum += sel(tl.valid[g], tl.kl[g], k.zero);
  }
  acc.add(Acc<T, VB>::kKlRaw, kl_sum);
  acc.add(Acc<T, VB>::kKl, aggregate(o, sc, kl_sum));
}

// Mirrors reference token_loss and aggregate: ℓ = pg·w·is_w + β·kl − c_H·H, the token outputs
// (grad_logprobs = agg_w·∂ℓ/∂logp, grad_entropy, token_out) and the loss sums.
template <int VB, typename in_t, typename T>
RLVR_INLINE void output_stage(const Ctx<in_t, T>& c, const VConst<T, VB>& k, const SeqConst<T>& sc, Tile<T, VB>& tl,
                              Acc<T, VB>& acc) {
  using V = typename Lanes<T, VB>::V;
  constexpr int W = Lanes<T, VB>::W;
  const Options& o = c.o;
  V total = k.zero, pg_sum = k.zero;
  const V grad_ent = splat<V>(sc.grad_ent);
  for (int g = 0; g < tl.ng; ++g) {
    const int64_t t = tl.t0 + g * W;
    const int n = tl.lanes(g);
    const auto valid = tl.valid[g];
    V p = tl.pg[g], d = tl.dpg[g];
    if (o.shaping) {
      p = p * tl.w[g];
      d = d * tl.w[g];
    }
    if (o.rc != RolloutCorrection::NONE) {
      p = p * tl.is_w[g];
      d = d * tl.is_w[g];
    }
    V loss = p;
    if (o.kl != KlEstimator::NONE) {
      loss = loss + k.beta * tl.kl[g];
      d = d + k.beta * tl.dkl[g];
    }
    if (o.ent_term) loss = loss - k.ent_coef * tl.ent[g];
    d = aggregate(o, sc, d);
    store<T>(c.grad + t, sel(valid, d, k.zero), n);
    if (c.grad_ent != nullptr) store<T>(c.grad_ent + t, sel(valid, grad_ent, k.zero), n);
    if (o.token_out == TokenOut::LOSS) {
      store<T>(c.tok + t, sel(valid, loss, k.zero), n);
    } else if (o.token_out == TokenOut::SHAPED_ADVANTAGES) {
      store<T>(c.tok + t, sel(valid, o.shaping ? tl.shaped_adv[g] : tl.adv[g], k.zero), n);
    } else if (o.token_out == TokenOut::IS_WEIGHTS) {
      // On the valid tokens before rejection (verl weighs its unmodified response_mask).
      using M = typename Lanes<T, VB>::M;
      M valid0;
      if (c.mask != nullptr) {
        load_mask<T, VB>(c.mask + t, n, valid0);
      } else {
        valid0 = lanes_below<T, VB>(n);
      }
      store<T>(c.tok + t, sel(valid0, o.rc != RolloutCorrection::NONE ? tl.is_w[g] : k.one, k.zero), n);
    } else if (o.token_out == TokenOut::KEEP) {
      store<T>(c.tok + t, sel(valid, k.one, k.zero), n);
    }
    total += sel(valid, loss, k.zero);
    pg_sum += sel(valid, p, k.zero);
  }
  acc.add(Acc<T, VB>::kTotal, aggregate(o, sc, total));
  acc.add(Acc<T, VB>::kPg, aggregate(o, sc, pg_sum));
  if (o.has_entropy) {
    V ent_sum = k.zero;
    for (int g = 0; g < tl.ng; ++g) ent_sum += sel(tl.valid[g], tl.ent[g], k.zero);
    acc.add(Acc<T, VB>::kEnt, ent_sum);
  }
}

// One tile of token slots [t0, t0 + ns) of one sequence through every stage. Returns whether a
// slot was valid.
template <int VB, typename in_t, typename T>
RLVR_INLINE bool tile(const Ctx<in_t, T>& c, const VConst<T, VB>& k, const SeqConst<T>& sc, int64_t t0, int ns,
                      Acc<T, VB>& acc) {
  const Options& o = c.o;
  Tile<T, VB> tl;
  tl.t0 = t0;
  tl.ns = ns;
  tl.ng = (ns + Lanes<T, VB>::W - 1) / Lanes<T, VB>::W;
  if (!input_stage(c, k, sc, tl, acc)) {
    zero_slots(c, t0, t0 + ns);
    return false;
  }
  pg_stage(o, k, sc, tl, acc);
  if (o.shaping) shaping_stage(c, k, sc, tl, acc);
  if (o.rc != RolloutCorrection::NONE) is_weight_stage(o, k, sc, tl, acc);
  if (o.kl != KlEstimator::NONE) kl_stage(o, k, sc, tl, acc);
  output_stage(c, k, sc, tl, acc);
  return true;
}

// One block of kBlock token slots (the work item of the main pass): its sequences' segments
// tile by tile, the slots outside every sequence zeroed, the block's sums into `out`.
template <typename in_t, typename T>
struct BlockBody {
  struct Arg {
    const Ctx<in_t, T>* c;
    int64_t blk;
    double* out;  // NUM_SUMS
  };

  template <int VB>
  RLVR_INLINE static void run(const Arg& a) {
    constexpr int kTileSlots = kTileGroups * Lanes<T, VB>::W;
    // A private copy: the float stores to the outputs could otherwise alias the float fields of
    // the shared context, and the compiler would reload them for every group.
    const Ctx<in_t, T> c = *a.c;
    const VConst<T, VB> k(c);
    Acc<T, VB> acc;
    acc.zero();
    const int64_t t0 = a.blk * kBlock, t1 = std::min(t0 + kBlock, c.slots);
    auto segment = [&](int64_t i, int64_t s0, int64_t s1) __attribute__((always_inline)) {
      const SeqConst<T> sc = seq_const(c, i);
      bool any = false;
      const auto n0 = acc.ntok, low0 = acc.clip_low, high0 = acc.clip_high;
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
      if (any && c.seq_counts != nullptr) {  // integer sums: the same result in any order
        int64_t d[3] = {0, 0, 0};
        for (int l = 0; l < Lanes<T, VB>::W; ++l) {
          d[0] += int64_t(acc.ntok[l] - n0[l]);
          d[1] += int64_t(acc.clip_low[l] - low0[l]);
          d[2] += int64_t(acc.clip_high[l] - high0[l]);
        }
        for (int j = 0; j < 3; ++j) __atomic_fetch_add(c.seq_counts + 3 * i + j, d[j], __ATOMIC_RELAXED);
      }
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
      const int64_t* ends = c.offsets + 1;
      int64_t i = std::upper_bound(ends, ends + c.B, t0) - ends;
      for (; t < t1 && i < c.B; ++i) {
        const int64_t b = std::min(std::max(c.offsets[i], t), t1);
        zero_slots(c, t, b);
        t = b;
        const int64_t e = std::min(ends[i], t1);
        if (e > t) {
          segment(i, t, e);
          t = e;
        }
      }
      zero_slots(c, t, t1);
    }
    acc.reduce(a.out);
  }
};

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

// Mirrors reference a3po_scales for sequence i: the candidates are its valid tokens with a
// metric ≠ 0; each knob of the sequence's polarity (ratio > 0, scale ≠ 1) marks its
// k = max(1, ⌊n·ratio⌋) highest / lowest ones (bit 0 / bit 1 of a3po_sel).
template <typename in_t, typename T>
void a3po_select(const Ctx<in_t, T>& c, int64_t i, int64_t b, int64_t e, double polarity, SeqInfo<T>& s,
                 std::vector<std::pair<double, int64_t>>& cand) {
  const Options& o = c.o;
  s.a3po_high[i] = s.a3po_low[i] = 1.0;
  if (polarity == 0.0) return;
  cand.clear();
  for (int64_t t = b; t < e; ++t) {
    if (c.mask != nullptr && !c.mask[t]) continue;
    const double m = o.a3po_entropy ? double(static_cast<T>(c.ent[t])) : std::exp(double(static_cast<T>(c.old[t])));
    if (m != 0.0) cand.emplace_back(m, t);
  }
  const int64_t nc = int64_t(cand.size());
  if (nc == 0) return;
  const int base = polarity > 0 ? 0 : 2;  // knobs: pos-high, pos-low, neg-high, neg-low
  for (int k = 0; k < 2; ++k) {
    // (the ratio is in [0, 1] for any options object; clamped so that no parameter list can
    // make the count overflow)
    const double ratio = std::min(o.a3po_knobs[2 * (base + k)], 1.0), scale = o.a3po_knobs[2 * (base + k) + 1];
    if (!(ratio > 0 && scale != 1)) continue;
    const int64_t top = std::min(nc, std::max<int64_t>(1, int64_t(double(nc) * ratio)));
    std::nth_element(cand.begin(), cand.begin() + (top - 1), cand.end(), RankOrder{k == 0});
    for (int64_t j = 0; j < top; ++j) s.a3po_sel[cand[j].second] |= uint8_t(1 << k);
    (k == 0 ? s.a3po_high[i] : s.a3po_low[i]) = scale;
  }
}

// Mirrors reference rejection_keep for one token: the token options of the chain on the token's
// k1 = −x, k2 = x²/2, k3 = eˣ − 1 − x (x clamped to ±20, as rs_statistics).
template <typename T>
RLVR_INLINE bool token_keep(uint32_t rs, const T* b, T k1, T k2, T k3) {
  bool ok = true;
  if (rs & 1u) ok = ok && k1 >= b[0] && k1 <= b[1];
  if (rs & 2u) ok = ok && k2 <= b[2];
  if (rs & 4u) ok = ok && k3 <= b[3];
  return ok;
}

// Mirrors reference rejection_keep for one sequence: the sequence options on the sums, means
// (over the n > 0 valid tokens) and maxima of k1, k2, k3.
template <typename T>
RLVR_INLINE bool seq_keep(uint32_t rs, const T* b, const T* sum, const T* mean, const T* mx) {
  bool ok = true;
  if (rs & 8u) ok = ok && sum[0] >= b[4] && sum[0] <= b[5];
  if (rs & 16u) ok = ok && sum[1] <= b[6];
  if (rs & 32u) ok = ok && sum[2] <= b[7];
  if (rs & 64u) ok = ok && mean[0] >= b[8] && mean[0] <= b[9];
  if (rs & 128u) ok = ok && mean[1] <= b[10];
  if (rs & 256u) ok = ok && mean[2] <= b[11];
  if (rs & 512u) ok = ok && mx[1] <= b[12];
  if (rs & 1024u) ok = ok && mx[2] <= b[13];
  return ok;
}

// The sequence statistics: n_i; GSPO's log s_i = Σ δ·m / max(n, 1), clamped above (the clamp
// stops the gradient; reference gspo_term); geo_mean's share −Ā_i·r_i / n_i with
// r_i = exp(Σ δ_min·m / n_i), Ā_i = Σ A·m / n_i over the kept tokens (reference
// geo_mean_term); the sequence IS weight from the clamped Σ x·m
// (reference is_weights) and, for the token-level batch norm, Σ w·m; the A3PO selection; the
// rejection chain (reference rejection_keep): its statistics over the valid tokens, the per-slot
// keep flags, and n_i, GSPO's sums over the kept tokens only (verl's modified response_mask).
template <typename in_t, typename T>
void prepass(const Ctx<in_t, T>& c, SeqInfo<T>& s) {
  const Options& o = c.o;
  const bool gspo = o.loss == LossType::GSPO, geo = o.loss == LossType::GEO_MEAN;
  const bool tok_norm = o.is_norm && !o.seq_rc;
  const in_t* base = o.rc_current ? c.lp : c.old;
#pragma omp parallel if (c.B > 1)
  {
    std::vector<std::pair<double, int64_t>> cand;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < c.B; ++i) {
      int64_t b, e;
      c.span(i, b, e);
      int64_t n = 0, n_raw = 0;
      double sum_delta = 0.0, sum_logw = 0.0, polarity = 0.0, sum_w = 0.0, sum_dmin = 0.0, sum_adv = 0.0;
      double sum_gate = 0.0;  // rollout_correction GATE per sequence: Σ x (ratio) or Σ divergence
      double ksum[3] = {0.0, 0.0, 0.0};
      T kmax[3] = {T(0), -std::numeric_limits<T>::infinity(), -std::numeric_limits<T>::infinity()};
      for (int64_t t = b; t < e; ++t) {
        if (c.mask != nullptr && !c.mask[t]) continue;
        ++n_raw;
        const T x = static_cast<T>(base[t]) - static_cast<T>(c.roll != nullptr ? c.roll[t] : base[t]);
        if (o.seq_rc) sum_logw += double(x);
        if (o.gate_seq) {
          const T roll = static_cast<T>(c.roll[t]);
          sum_gate += double(o.gate == IsGate::RATIO ? x : gate_divergence(o.gate, static_cast<T>(base[t]), roll));
        }
        const T xc = x < T(-20) ? T(-20) : x > T(20) ? T(20) : x;
        if (tok_norm) {
          bool rej;
          sum_w += double(corrected_weight(o.rc, T(std::exp(xc)), c.rc_low, c.rc_high, T(0), T(1), rej));
        }
        if (o.rs != 0) {
          const T k1 = -xc, k2 = T(0.5) * (xc * xc), k3 = (T(std::exp(xc)) - T(1)) - xc;
          ksum[0] += double(k1);
          ksum[1] += double(k2);
          ksum[2] += double(k3);
          kmax[1] = std::max(kmax[1], k2);
          kmax[2] = std::max(kmax[2], k3);
          const bool kept = token_keep(o.rs, c.rs, k1, k2, k3);
          s.keep[t] = kept;
          if (!kept) continue;
        }
        ++n;
        if (gspo) sum_delta += double(static_cast<T>(c.lp[t]) - static_cast<T>(c.old[t]));
        if (geo) {
          const T a = o.seq_adv ? c.adv[i] : c.adv[t];
          const T delta = static_cast<T>(c.lp[t]) - static_cast<T>(c.old[t]);
          sum_dmin += double(geo_mean_log_ratio(delta, a, c.ratio_low, c.ratio_high));
          sum_adv += double(a);
        }
        if (o.a3po) polarity += double(o.seq_adv ? c.adv[i] : c.adv[t]);
      }
      if (c.stats != nullptr) {
        // The group's statistics of the whole sequence (cp_group) replace this slice's; the
        // sequence options of the rejection chain were applied to them (N = 0: rejected).
        const double* st = c.stats + i * kNumSeqStats;
        n = static_cast<int64_t>(st[idx(SeqStat::N)]);
        n_raw = static_cast<int64_t>(st[idx(SeqStat::N_RAW)]);
        sum_delta = st[idx(SeqStat::DELTA)];
        sum_dmin = st[idx(SeqStat::DMIN)];
        sum_adv = st[idx(SeqStat::ADV)];
        sum_logw = st[idx(SeqStat::LOGW)];
        sum_w = st[idx(SeqStat::IS_W)];
        sum_gate = st[idx(SeqStat::GATE)];
        if (o.rs != 0) {
          if (n == 0) std::fill(s.keep.begin() + b, s.keep.begin() + e, uint8_t(0));
          s.n_raw[i] = n_raw;
        }
      } else if (o.rs != 0) {
        const T sum[3] = {T(ksum[0]), T(ksum[1]), T(ksum[2])};
        const T nr = static_cast<T>(std::max<int64_t>(n_raw, 1));
        const T mean[3] = {n_raw > 0 ? sum[0] / nr : T(0), n_raw > 0 ? sum[1] / nr : T(0),
                           n_raw > 0 ? sum[2] / nr : T(0)};
        if (n_raw == 0) kmax[1] = kmax[2] = T(0);
        if (!seq_keep(o.rs, c.rs, sum, mean, kmax)) {
          n = 0;
          std::fill(s.keep.begin() + b, s.keep.begin() + e, uint8_t(0));
        }
        s.n_raw[i] = n_raw;
      }
      if (tok_norm) s.tok_w[i] = sum_w;
      s.n[i] = n;
      s.inv_n[i] = n > 0 ? T(1) / static_cast<T>(n) : T(0);
      if (gspo) {
        const T log_s = static_cast<T>(sum_delta / double(std::max<int64_t>(n, 1)));
        s.gspo_pass[i] = log_s <= c.gspo_clamp;
        s.gspo_s[i] = std::exp(log_s > c.gspo_clamp ? c.gspo_clamp : log_s);
      }
      if (geo) {
        const double nn = double(std::max<int64_t>(n, 1));
        const T r = std::exp(static_cast<T>(sum_dmin / nn));
        const T adv_mean = static_cast<T>(sum_adv / nn);
        s.geo_share[i] = -adv_mean * r / static_cast<T>(nn);
      }
      if (o.seq_rc) {
        T lw = static_cast<T>(sum_logw);
        lw = lw < T(-20) ? T(-20) : lw > T(20) ? T(20) : lw;
        bool rej;
        s.seq_w[i] = corrected_weight(o.rc, T(std::exp(lw)), c.rc_low, c.rc_high, T(0), T(1), rej);
        s.seq_rej[i] = rej;
      }
      if (o.gate_seq) {  // reference gate_statistic: the mean over the valid tokens before rejection
        T stat = n_raw > 0 ? static_cast<T>(static_cast<T>(sum_gate) / static_cast<T>(n_raw)) : T(0);
        if (o.gate == IsGate::RATIO) stat = std::exp(stat < T(-20) ? T(-20) : stat > T(20) ? T(20) : stat);
        s.seq_rej[i] = stat < c.rc_low || stat > c.rc_high;
      }
      if (o.a3po) a3po_select(c, i, b, e, polarity, s, cand);
    }
  }
}

// ------------------------------------------------------------------ driver
template <typename in_t, typename T>
void forward(Ctx<in_t, T>& c, double* sums) {
  const Options& o = c.o;
  SeqInfo<T> seq;
  std::vector<uint8_t> has_valid;
  if (o.prepass) {
    seq.n.assign(c.B, 0);
    seq.inv_n.assign(c.B, T(0));
    if (o.loss == LossType::GSPO) {
      seq.gspo_s.assign(c.B, T(0));
      seq.gspo_pass.assign(c.B, 0);
    }
    if (o.loss == LossType::GEO_MEAN) seq.geo_share.assign(c.B, T(0));
    if (o.seq_rc) seq.seq_w.assign(c.B, T(1));
    if (o.seq_rc || o.gate_seq) seq.seq_rej.assign(c.B, 0);
    if (o.a3po) {
      seq.a3po_high.assign(c.B, 1.0);
      seq.a3po_low.assign(c.B, 1.0);
      seq.a3po_sel.assign(c.slots, 0);
    }
    if (o.rs != 0) {
      seq.n_raw.assign(c.B, 0);
      seq.keep.assign(c.slots, 0);
    }
    if (o.is_norm && !o.seq_rc) seq.tok_w.assign(c.B, 0.0);
    c.seq = &seq;
    prepass(c, seq);
    if (o.rs != 0) c.keep = reinterpret_cast<const bool*>(seq.keep.data());
    if (o.is_norm) {  // reference is_batch_norm, in sequence order
      double num = 0.0, den = 0.0;
      for (int64_t i = 0; i < c.B; ++i) {
        const int64_t nr = o.rs != 0 ? seq.n_raw[i] : seq.n[i];
        if (o.seq_rc) {
          num += nr > 0 ? double(seq.seq_w[i]) : 0.0;
          den += nr > 0 ? 1.0 : 0.0;
        } else {
          num += seq.tok_w[i];
          den += double(nr);
        }
      }
      const T mu = den > 0 ? static_cast<T>(static_cast<T>(num) / static_cast<T>(den)) : T(0);
      c.is_mu = mu > T(1e-8) ? mu : T(1);
    }
  } else {
    has_valid.assign(c.B, 0);
    c.has_valid = has_valid.data();
  }

  std::vector<int64_t> seq_counts;
  if (o.clip_sides) {
    seq_counts.assign(3 * c.B, 0);
    c.seq_counts = seq_counts.data();
  }

  const int64_t nblocks = (c.slots + kBlock - 1) / kBlock;
  std::vector<double> partial(nblocks * NUM_SUMS);
  const Ctx<in_t, T>* cc = &c;
#pragma omp parallel for schedule(dynamic, 1) if (nblocks > 1)
  for (int64_t b = 0; b < nblocks; ++b) run_isa<BlockBody<in_t, T>>({cc, b, partial.data() + b * NUM_SUMS});

  for (int k = 0; k < NUM_SUMS; ++k) sums[k] = 0.0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const double* p = partial.data() + b * NUM_SUMS;
    for (int k = 0; k < NUM_SUMS; ++k) sums[k] = k == idx(Sum::IS_MAX) ? std::max(sums[k], p[k]) : sums[k] + p[k];
  }
  int64_t nseq = 0;
  for (int64_t i = 0; i < c.B; ++i) nseq += o.prepass ? seq.n[i] > 0 : has_valid[i] != 0;
  sums[idx(Sum::NSEQ)] = double(nseq);
  // The per-sequence clip fractions f_i = count / n_i (sequences with n_i > 0), in order.
  double low_sum = 0.0, high_sum = 0.0, low_min = 0.0, high_max = 0.0;
  bool first = true;
  for (int64_t i = 0; o.clip_sides && i < c.B; ++i) {
    const int64_t n = seq_counts[3 * i];
    if (n <= 0) continue;
    const double fl = double(seq_counts[3 * i + 1]) / double(n), fh = double(seq_counts[3 * i + 2]) / double(n);
    low_sum += fl;
    high_sum += fh;
    low_min = first ? fl : std::min(low_min, fl);
    high_max = first ? fh : std::max(high_max, fh);
    first = false;
  }
  sums[idx(Sum::SEQ_CLIP_LOW)] = low_sum;
  sums[idx(Sum::SEQ_CLIP_HIGH)] = high_sum;
  sums[idx(Sum::SEQ_CLIP_LOW_MIN)] = low_min;
  sums[idx(Sum::SEQ_CLIP_HIGH_MAX)] = high_max;
  // Rejection: the counts before it; the batch-normalisation mean.
  double ntok_raw = sums[idx(Sum::NTOK)], rs_reject = 0.0, rs_seq_reject = 0.0;
  if (o.rs != 0) {
    ntok_raw = 0.0;
    for (int64_t i = 0; i < c.B; ++i) {
      ntok_raw += double(seq.n_raw[i]);
      rs_reject += double(seq.n_raw[i] - seq.n[i]);
      rs_seq_reject += seq.n_raw[i] > seq.n[i] ? 1.0 : 0.0;
    }
  }
  sums[idx(Sum::NTOK_RAW)] = ntok_raw;
  sums[idx(Sum::RS_REJECT)] = rs_reject;
  sums[idx(Sum::RS_SEQ_REJECT)] = rs_seq_reject;
  sums[idx(Sum::IS_NORM)] = o.is_norm ? double(c.is_mu) : 0.0;
  if (o.rc == RolloutCorrection::NONE) {  // is_w = 1
    sums[idx(Sum::IS)] = sums[idx(Sum::NTOK)];
    sums[idx(Sum::IS_MAX)] = sums[idx(Sum::NTOK)] > 0 ? 1.0 : 0.0;
  }
}

// ------------------------------------------------------------------ entry point: checks
// The parameters decoded and checked (unknown branch codes are errors), and the switches
// derived from them.
Options decode_options(const PolicyLossParams& p, bool need_entropy_grad, bool has_entropy) {
  TORCH_CHECK(valid_LossType(p.loss_type), "policy_loss_fwd: unknown loss_type ", p.loss_type);
  TORCH_CHECK(valid_KlEstimator(p.kl), "policy_loss_fwd: unknown kl ", p.kl);
  TORCH_CHECK(valid_RolloutCorrection(p.rollout_correction), "policy_loss_fwd: unknown rollout_correction ",
              p.rollout_correction);
  TORCH_CHECK(valid_TokenOut(p.token_out), "policy_loss_fwd: unknown token_out ", p.token_out);
  TORCH_CHECK(valid_A3poMetric(p.a3po_metric), "policy_loss_fwd: unknown a3po_metric ", p.a3po_metric);
  Options o{};
  o.loss = LossType(p.loss_type);
  o.kl = KlEstimator(p.kl);
  o.rc = RolloutCorrection(p.rollout_correction);
  o.token_out = TokenOut(p.token_out);
  TORCH_CHECK(valid_KlClamp(p.kl_clamp), "policy_loss_fwd: unknown kl_clamp ", p.kl_clamp);
  const bool clamp3 = KlClamp(p.kl_clamp) != KlClamp::NONE, clamp2 = KlClamp(p.kl_clamp) == KlClamp::ALL;
  o.kl_in3 = clamp3 && p.kl_clamp_input > 0;
  o.kl_out3 = clamp3 && p.kl_clamp_output > 0;
  o.kl_in2 = clamp2 && p.kl_clamp_input > 0;
  o.kl_out2 = clamp2 && p.kl_clamp_output > 0;
  o.kl_score = p.kl_score_grad != 0;
  o.seq_mean = p.seq_mean != 0;
  o.seq_adv = p.seq_adv != 0;
  o.a3po = p.a3po != 0;
  o.a3po_entropy = A3poMetric(p.a3po_metric) == A3poMetric::ENTROPY;
  o.ent_quantile = p.entropy_quantile != 0;
  o.need_entropy_grad = need_entropy_grad;
  o.lrc_on = p.log_ratio_clamp > 0;
  // (the op layer passes c = 0 for GSPO unless PolicyLossOptions.gspo_dual_clip)
  o.dual_clip = (o.loss == LossType::PPO || o.loss == LossType::GSPO) && p.clip_ratio_c > 0;
  o.dppo_cap = (o.loss == LossType::DPPO_TV || o.loss == LossType::DPPO_KL) && p.clip_ratio_c > 0;
  o.has_entropy = has_entropy;
  o.ent_term = has_entropy && p.entropy_coef != 0;
  // The polarity weights enter the double shaping weight exactly (as the reference's).
  o.w_pos = p.w_pos;
  o.w_neg = p.w_neg;
  o.lambda = p.probability;
  const double knobs[8] = {p.a3po_pos_high_ratio, p.a3po_pos_high_scale, p.a3po_pos_low_ratio, p.a3po_pos_low_scale,
                           p.a3po_neg_high_ratio, p.a3po_neg_high_scale, p.a3po_neg_low_ratio, p.a3po_neg_low_scale};
  std::copy(knobs, knobs + 8, o.a3po_knobs);
  o.shaping = o.w_pos != 1.0 || o.w_neg != 1.0 || o.lambda != 0.0 || o.a3po || o.ent_quantile;
  o.seq_rc = o.rc == RolloutCorrection::SEQ_TIS || o.rc == RolloutCorrection::SEQ_MIS ||
             o.rc == RolloutCorrection::SEQ_ICEPOP;
  // (the bits above the 11 options are ignored: no parameter list reaches outside the bounds)
  o.rs = uint32_t(p.rs_options) & 0x7ffu;
  o.rc_current = p.rc_current != 0;
  o.is_norm = p.is_batch_normalize != 0 && o.rc != RolloutCorrection::NONE;
  TORCH_CHECK(valid_IsGate(p.is_gate), "policy_loss_fwd: unknown is_gate ", p.is_gate);
  o.gate = IsGate(p.is_gate);
  o.gate_seq = o.rc == RolloutCorrection::GATE && p.is_gate_seq != 0;
  TORCH_CHECK(!(o.gate_seq && o.gate == IsGate::CLAMP), "policy_loss_fwd: is_gate CLAMP is token level");
  TORCH_CHECK(!(o.is_norm && o.rc == RolloutCorrection::GATE),
              "policy_loss_fwd: is_batch_normalize is not supported with rollout_correction GATE");
  o.prepass = o.seq_mean || o.loss == LossType::GSPO || o.loss == LossType::GEO_MEAN || o.seq_rc || o.a3po || o.rs != 0 ||
              o.is_norm || o.gate_seq;
  o.kl_ratio = o.kl != KlEstimator::NONE && p.kl_ratio_correction != 0;
  o.clip_sides = o.loss == LossType::PPO || o.loss == LossType::GSPO || o.loss == LossType::CISPO ||
                 o.loss == LossType::CLIP_COV;
  o.cov = o.loss == LossType::CLIP_COV || o.loss == LossType::KL_COV;
  return o;
}

void check_cpu(const char* name, const torch::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "policy_loss_fwd: ", name, " must be a CPU tensor, got ", t.device());
}

// A token-shaped input: CPU, the shape of logprobs, and (when `dtype` is given) its dtype.
torch::Tensor token_input(const char* name, const torch::Tensor& t, const torch::Tensor& like,
                          c10::optional<at::ScalarType> dtype) {
  check_cpu(name, t);
  TORCH_CHECK(t.sizes() == like.sizes(), "policy_loss_fwd: ", name, " must have shape ", like.sizes(), ", got ",
              t.sizes());
  TORCH_CHECK(!dtype.has_value() || t.scalar_type() == *dtype, "policy_loss_fwd: ", name, " must have dtype ",
              *dtype, ", got ", t.scalar_type());
  return t.contiguous();
}

// An optional token-shaped input of the logprobs dtype: required when `needed`, and returned
// only when the kernel reads it (`used`), so that an unused input is neither read nor counted
// by the value check.
torch::Tensor optional_input(const char* name, const c10::optional<torch::Tensor>& t, const torch::Tensor& like,
                             bool needed, bool used) {
  TORCH_CHECK(t.has_value() || !needed, "policy_loss_fwd: these options need ", name);
  if (!t.has_value()) return torch::Tensor();
  torch::Tensor out = token_input(name, *t, like, like.scalar_type());
  return used ? out : torch::Tensor();
}

// The inputs of a call, checked against each other and made contiguous: every shape relation
// the kernel relies on holds when this returns.
struct Inputs {
  torch::Tensor lp, old, ref, roll, ent, mask, adv;  // ref / roll / ent undefined when not read
  torch::Tensor cov;                                 // bool, clip_cov / kl_cov only
  std::vector<int64_t> offsets;                      // packed: the B + 1 sanitised offsets
  bool packed;
  int64_t B, L, slots;
  float threshold;
};

Inputs check_inputs(const Options& o, const torch::Tensor& logprobs, const torch::Tensor& old_logprobs,
                    const torch::Tensor& advantages, const c10::optional<torch::Tensor>& mask,
                    const c10::optional<torch::Tensor>& ref_logprobs,
                    const c10::optional<torch::Tensor>& rollout_logprobs, const c10::optional<torch::Tensor>& entropy,
                    const c10::optional<torch::Tensor>& cu_seqlens,
                    const c10::optional<torch::Tensor>& entropy_threshold,
                    const c10::optional<torch::Tensor>& cov_selection) {
  const auto dtype = logprobs.scalar_type();
  TORCH_CHECK(
      dtype == torch::kFloat32 || dtype == torch::kFloat64 || dtype == torch::kFloat16 || dtype == torch::kBFloat16,
      "policy_loss_fwd: logprobs must be float16, bfloat16, float32 or float64, got ", dtype);
  check_cpu("logprobs", logprobs);
  Inputs in{};
  in.packed = cu_seqlens.has_value();
  TORCH_CHECK(logprobs.dim() == (in.packed ? 1 : 2), "policy_loss_fwd: logprobs must be ",
              in.packed ? "[T] with cu_seqlens" : "[B, L] without cu_seqlens", ", got shape ", logprobs.sizes());
  TORCH_CHECK(in.packed || mask.has_value(), "policy_loss_fwd: the padded layout needs a mask");
  in.lp = logprobs.contiguous();
  in.old = token_input("old_logprobs", old_logprobs, in.lp, dtype);
  const bool kl_on = o.kl != KlEstimator::NONE, rc_on = o.rc != RolloutCorrection::NONE || o.rs != 0;
  in.ref = optional_input("ref_logprobs", ref_logprobs, in.lp, kl_on, kl_on);
  in.roll = optional_input("rollout_logprobs", rollout_logprobs, in.lp, rc_on, rc_on);
  const bool needs_entropy = o.ent_term || o.ent_quantile || (o.a3po && o.a3po_entropy) || o.need_entropy_grad;
  in.ent = optional_input("entropy", entropy, in.lp, needs_entropy, true);
  if (mask.has_value()) {
    in.mask = token_input("mask", *mask, in.lp, c10::nullopt);
    if (in.mask.scalar_type() != torch::kBool) in.mask = (in.mask != 0).contiguous();
  }
  in.slots = in.lp.numel();
  if (in.packed) in.offsets = sanitized_offsets(*cu_seqlens, in.slots, "policy_loss_fwd");
  in.B = in.packed ? int64_t(in.offsets.size()) - 1 : in.lp.size(0);
  in.L = in.packed ? 0 : in.lp.size(1);
  check_cpu("advantages", advantages);
  in.adv = advantages.to(dtype == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32).contiguous();
  if (o.seq_adv) {
    TORCH_CHECK(in.adv.dim() == 1 && in.adv.numel() == in.B, "policy_loss_fwd: advantages must be [B = ", in.B,
                "], got ", in.adv.sizes());
  } else {
    token_input("advantages", in.adv, in.lp, c10::nullopt);
  }
  in.threshold = 0.0f;
  if (o.ent_quantile) {
    TORCH_CHECK(entropy_threshold.has_value() && entropy_threshold->numel() == 1,
                "policy_loss_fwd: the entropy quantile needs a 1-element entropy_threshold");
    in.threshold = entropy_threshold->to(torch::kCPU, torch::kFloat32).item<float>();
  }
  TORCH_CHECK(cov_selection.has_value() == o.cov, "policy_loss_fwd: cov_selection is ",
              o.cov ? "required by" : "only read by", " the clip_cov / kl_cov loss types");
  if (o.cov) in.cov = token_input("cov_selection", *cov_selection, in.lp, torch::kBool);
  return in;
}

// The kernel's context: pointers into the inputs and outputs, the hyper-parameters in the compute
// dtype T.
template <typename in_t, typename T>
Ctx<in_t, T> make_ctx(const Options& o, const PolicyLossParams& p, const Inputs& in, const torch::Tensor& grad,
                      const torch::Tensor& grad_ent, const torch::Tensor& tok) {
  auto ptr = [](const torch::Tensor& t) { return t.defined() ? t.data_ptr<in_t>() : nullptr; };
  Ctx<in_t, T> c{};
  c.lp = in.lp.data_ptr<in_t>();
  c.old = in.old.data_ptr<in_t>();
  c.ref = ptr(in.ref);
  c.roll = ptr(in.roll);
  c.ent = ptr(in.ent);
  c.adv = in.adv.data_ptr<T>();
  c.mask = in.mask.defined() ? in.mask.data_ptr<bool>() : nullptr;
  c.cov_sel = in.cov.defined() ? in.cov.data_ptr<bool>() : nullptr;
  c.B = in.B;
  c.L = in.L;
  c.slots = in.slots;
  c.offsets = in.packed ? in.offsets.data() : nullptr;
  c.grad = grad.data_ptr<T>();
  c.grad_ent = o.need_entropy_grad ? grad_ent.data_ptr<T>() : nullptr;
  c.tok = o.token_out != TokenOut::NONE ? tok.data_ptr<T>() : nullptr;
  c.o = o;
  c.ratio_low = static_cast<T>(p.ratio_low);
  c.ratio_high = static_cast<T>(p.ratio_high);
  c.clip_c = static_cast<T>(p.clip_ratio_c);
  c.lrc = static_cast<T>(p.log_ratio_clamp);
  c.gspo_clamp = static_cast<T>(p.gspo_log_clamp);
  c.beta = static_cast<T>(p.kl_coef);
  c.kl_in = static_cast<T>(p.kl_clamp_input);
  c.kl_out = static_cast<T>(p.kl_clamp_output);
  c.rc_low = static_cast<T>(p.rc_low);
  c.rc_high = static_cast<T>(p.rc_high);
  c.ent_coef = o.ent_term ? static_cast<T>(p.entropy_coef) : T(0);
  c.tau_pos = static_cast<T>(p.tau_pos);
  c.tau_neg = static_cast<T>(p.tau_neg);
  c.four_tau_pos = T(4) / c.tau_pos;
  c.four_tau_neg = T(4) / c.tau_neg;
  c.half_dro_beta = static_cast<T>(0.5 * p.dro_beta);  // (Python's 0.5·β, then the compute dtype)
  c.kl_cov_coef = static_cast<T>(p.kl_cov_coef);
  c.threshold = in.threshold;
  const double rs[14] = {p.rs_token_k1_low,    p.rs_token_k1_high,    p.rs_token_k2,      p.rs_token_k3,
                         p.rs_seq_sum_k1_low,  p.rs_seq_sum_k1_high,  p.rs_seq_sum_k2,    p.rs_seq_sum_k3,
                         p.rs_seq_mean_k1_low, p.rs_seq_mean_k1_high, p.rs_seq_mean_k2,   p.rs_seq_mean_k3,
                         p.rs_seq_max_k2,      p.rs_seq_max_k3};
  for (int j = 0; j < 14; ++j) c.rs[j] = static_cast<T>(rs[j]);
  c.is_mu = T(1);
  return c;
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> policy_loss_fwd_cpu(
    const torch::Tensor& logprobs, const torch::Tensor& old_logprobs, const torch::Tensor& advantages,
    const c10::optional<torch::Tensor>& mask, const c10::optional<torch::Tensor>& ref_logprobs,
    const c10::optional<torch::Tensor>& rollout_logprobs, const c10::optional<torch::Tensor>& entropy,
    const c10::optional<torch::Tensor>& cu_seqlens, const c10::optional<torch::Tensor>& entropy_threshold,
    c10::ArrayRef<double> fparams, c10::ArrayRef<int64_t> iparams, bool need_entropy_grad,
    const c10::optional<torch::Tensor>& cov_selection, const c10::optional<torch::Tensor>& seq_stats) {
  const PolicyLossParams p = PolicyLossParams::unpack(fparams, iparams);
  Options o = decode_options(p, need_entropy_grad, entropy.has_value());
  const Inputs in = check_inputs(o, logprobs, old_logprobs, advantages, mask, ref_logprobs, rollout_logprobs, entropy,
                                 cu_seqlens, entropy_threshold, cov_selection);
  torch::Tensor stats;
  if (seq_stats.has_value()) {
    check_cpu("seq_stats", *seq_stats);
    TORCH_CHECK(seq_stats->scalar_type() == torch::kFloat64 && seq_stats->dim() == 2 &&
                    seq_stats->size(0) == in.B && seq_stats->size(1) == kNumSeqStats,
                "policy_loss_fwd: seq_stats must be float64 [B = ", in.B, ", ", kNumSeqStats, "], got ",
                seq_stats->scalar_type(), " ", seq_stats->sizes());
    // (A3PO ranks the tokens of a sequence: not a statistic a group can sum; the op layer refuses it)
    TORCH_CHECK(!o.a3po, "policy_loss_fwd: seq_stats does not carry the A3PO selection");
    stats = seq_stats->contiguous();
    o.prepass = true;  // every sequence-level quantity comes from the given statistics
  }
  const auto dtype = in.lp.scalar_type();
  const auto cdt = dtype == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;

  // Outputs (token-shaped ones from the huge-page cache).
  const auto shape = in.lp.sizes();
  const torch::Tensor grad = empty_output(shape, cdt);
  const torch::Tensor grad_ent =
      need_entropy_grad ? empty_output(shape, cdt) : torch::empty({0}, torch::dtype(cdt));
  const torch::Tensor tok =
      o.token_out != TokenOut::NONE ? empty_output(shape, cdt) : torch::empty({0}, torch::dtype(cdt));
  double sums[NUM_SUMS];
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rlvr_policy_loss_fwd", [&] {
    using T = std::conditional_t<std::is_same<scalar_t, double>::value, double, float>;
    Ctx<scalar_t, T> c = make_ctx<scalar_t, T>(o, p, in, grad, grad_ent, tok);
    c.stats = stats.defined() ? stats.data_ptr<double>() : nullptr;
    forward(c, sums);
  });

  torch::Tensor sums_t = torch::empty({NUM_SUMS}, torch::dtype(cdt));
  AT_DISPATCH_FLOATING_TYPES(cdt, "rlvr_policy_loss_sums", [&] {
    scalar_t* out = sums_t.data_ptr<scalar_t>();
    for (int k = 0; k < NUM_SUMS; ++k) out[k] = static_cast<scalar_t>(sums[k]);
  });
  return {sums_t, grad, grad_ent, tok};
}

// ------------------------------------------------------------------ backward
// out = (coef · up).to(dtype), with torch's type promotion (at::result_type: a 0-d up does
// not promote coef). Fixed chunks over the threads; the chunk loop is compiled twice by run_isa
// (baseline and AVX2) and left to the auto-vectoriser, conversions included.
namespace {

constexpr int64_t kGradChunk = 1 << 15;

template <typename T, typename c_t, typename u_t, typename out_t, bool kScalar>
RLVR_INLINE void grad_chunk(const c_t* __restrict coef, const u_t* __restrict up, T u0, out_t* __restrict out,
                            int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T u = kScalar ? u0 : static_cast<T>(up[i]);
    out[i] = static_cast<out_t>(static_cast<T>(coef[i]) * u);
  }
}

template <typename T, typename c_t, typename u_t, typename out_t, bool kScalar>
struct GradBody {
  struct Arg {
    const c_t* coef;
    const u_t* up;  // nullptr when kScalar
    T u0;
    out_t* out;
    int64_t n;
  };

  template <int VB>
  RLVR_INLINE static void run(const Arg& a) {
    grad_chunk<T, c_t, u_t, out_t, kScalar>(a.coef, a.up, a.u0, a.out, a.n);
  }
};

template <typename T, typename c_t, typename u_t, typename out_t, bool kScalar>
void grad_run(const c_t* coef, const u_t* up, T u0, out_t* out, int64_t numel) {
  const int64_t nchunks = (numel + kGradChunk - 1) / kGradChunk;
#pragma omp parallel for schedule(static) if (nchunks > 1)
  for (int64_t b = 0; b < nchunks; ++b) {
    const int64_t i0 = b * kGradChunk, n = std::min(kGradChunk, numel - i0);
    run_isa<GradBody<T, c_t, u_t, out_t, kScalar>>({coef + i0, kScalar ? up : up + i0, u0, out + i0, n});
  }
}

bool is_float_dtype(at::ScalarType t) {
  return t == torch::kFloat32 || t == torch::kFloat64 || t == torch::kBFloat16 || t == torch::kFloat16;
}

}  // namespace

torch::Tensor policy_loss_grad_cpu(const torch::Tensor& coef, const torch::Tensor& up, at::ScalarType dtype) {
  TORCH_CHECK(coef.device().is_cpu() && up.device().is_cpu(), "policy_loss_grad: coef and up must be CPU tensors");
  TORCH_CHECK(coef.scalar_type() == torch::kFloat32 || coef.scalar_type() == torch::kFloat64,
              "policy_loss_grad: coef must be float32 or float64, got ", coef.scalar_type());
  TORCH_CHECK(is_float_dtype(up.scalar_type()),
              "policy_loss_grad: up must be float16, bfloat16, float32 or float64, got ", up.scalar_type());
  TORCH_CHECK(is_float_dtype(dtype), "policy_loss_grad: dtype must be float16, bfloat16, float32 or float64, got ",
              dtype);
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
