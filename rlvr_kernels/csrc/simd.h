// The one home of the kernels' vector helpers: GCC vector types (Lanes<T, VB>), masked loads and
// stores, NaN-propagating max/min, a float exp, and the run-time choice between the baseline
// build (16-byte vectors) and the AVX2+FMA clone (32-byte vectors).
//
// The build is portable (no -march), so a kernel's hot loop is written once on these helpers,
// always inlined into two noinline entry points (one with target("avx2,fma")) and picked at run
// time with use_avx2().
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

// 32-byte vector arguments of always-inlined helpers never cross a call boundary.
#pragma GCC diagnostic ignored "-Wpsabi"

#define RLVR_INLINE inline __attribute__((always_inline))

#if defined(__x86_64__) && defined(__GNUC__)
#define RLVR_AVX2_CLONE 1
#else
#define RLVR_AVX2_CLONE 0
#endif

namespace rlvr {

template <typename V, typename S>
RLVR_INLINE V splat(S s) {
  V v;
  for (int l = 0; l < int(sizeof(V) / sizeof(v[0])); ++l) v[l] = s;
  return v;
}

// torch.clamp: NaN stays NaN.
template <typename V>
RLVR_INLINE V vclamp(V x, V lo, V hi) {
  x = x < lo ? lo : x;
  return x > hi ? hi : x;
}

typedef float F32x8 __attribute__((vector_size(32)));
typedef float F32x4 __attribute__((vector_size(16)));
typedef double F64x4 __attribute__((vector_size(32)));
typedef double F64x2 __attribute__((vector_size(16)));

// The integer vectors exp needs beside float vectors of VB bytes (vector_size cannot depend on a
// template parameter, hence the specialisations).
template <int VB>
struct F32Bits;
template <>
struct F32Bits<32> {
  typedef int32_t M __attribute__((vector_size(32)));
  typedef uint32_t U __attribute__((vector_size(32)));
};
template <>
struct F32Bits<16> {
  typedef int32_t M __attribute__((vector_size(16)));
  typedef uint32_t U __attribute__((vector_size(16)));
};

// exp on float lanes. Cephes expf: x = n·ln2 + r with |r| ≤ ln2/2 (n found with the 1.5·2^23
// rounding trick, so no float→int conversion), e^r by a degree-7 polynomial, 2^n applied in two
// halves so that results down to the denormal range and overflow to +inf come out right.
template <typename V>
RLVR_INLINE V vexp_float(V x) {
  using M = typename F32Bits<int(sizeof(V))>::M;
  using U = typename F32Bits<int(sizeof(V))>::U;
  x = vclamp(x, splat<V>(-104.0f), splat<V>(89.0f));
  const V magic = splat<V>(12582912.0f);
  const V t = x * 1.44269504088896341f + magic;
  const V nf = t - magic;
  const U n = (U)t - (U)magic;
  V r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  V p = splat<V>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const V y = p * (r * r) + r + 1.0f;
  const U n1 = (U)((M)n >> 1);
  const U n2 = n - n1;
  const V s1 = (V)((n1 + 127u) << 23);
  const V s2 = (V)((n2 + 127u) << 23);
  return y * s1 * s2;
}

RLVR_INLINE F32x8 vexp(F32x8 x) { return vexp_float(x); }
RLVR_INLINE F32x4 vexp(F32x4 x) { return vexp_float(x); }

// Double lanes (the fp64 paths, for checks rather than speed): libm.
template <typename V>
RLVR_INLINE V vexp_double(V x) {
  for (int l = 0; l < int(sizeof(V) / sizeof(double)); ++l) x[l] = std::exp(x[l]);
  return x;
}
RLVR_INLINE F64x4 vexp(F64x4 x) { return vexp_double(x); }
RLVR_INLINE F64x2 vexp(F64x2 x) { return vexp_double(x); }

// ------------------------------------------------------------------ lanes of a compute type
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

// m ? a : b, for vector lanes and for scalars alike.
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

// The scalar max with torch.max semantics (NaN wins), for reducing the lanes of vmax_nan.
template <typename T>
RLVR_INLINE T max_nan(T a, T b) {
  return a != a ? a : (b != b ? b : (a > b ? a : b));
}

#if RLVR_AVX2_CLONE
// Whether to run the AVX2+FMA clones; RLVR_KERNELS_CPU_NO_AVX2=1 forces the baseline build
// (how the tests reach it on an AVX2 machine).
inline bool use_avx2() {
  static const bool ok = [] {
    const char* env = std::getenv("RLVR_KERNELS_CPU_NO_AVX2");
    if (env != nullptr && env[0] != '\0' && env[0] != '0') return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return ok;
}
#else
inline bool use_avx2() { return false; }
#endif

// Body::run<VB>(arg), always inlined into a baseline entry point (16-byte vectors) and an
// AVX2+FMA one (32-byte vectors); run_isa picks one at run time. The one ISA dispatch of the
// kernels: a hot loop is written once as a Body with `using Arg = ...` and
// `template <int VB> static void run(const Arg&)`.
template <typename Body>
__attribute__((noinline)) void run_baseline(const typename Body::Arg& a) {
  Body::template run<16>(a);
}

#if RLVR_AVX2_CLONE
template <typename Body>
__attribute__((noinline, target("avx2,fma"))) void run_avx2(const typename Body::Arg& a) {
  Body::template run<32>(a);
}
#endif

template <typename Body>
void run_isa(const typename Body::Arg& a) {
#if RLVR_AVX2_CLONE
  if (use_avx2()) return run_avx2<Body>(a);
#endif
  run_baseline<Body>(a);
}

}  // namespace rlvr
