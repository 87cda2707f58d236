// Kernel contracts on the C++ side: the mirror of rlvr_kernels/contracts/.
//
// A kernel's scalar parameters arrive as `float[] fparams, int[] iparams`. Each op's header lists
// their names, in order, as X-macros:
//   #define RLVR_POLICY_LOSS_FPARAMS(X) X(clip_low) X(clip_high) ...
//   #define RLVR_POLICY_LOSS_IPARAMS(X) X(loss_type) X(kl) ...
// and RLVR_DEFINE_PARAMS(PolicyLossParams, RLVR_POLICY_LOSS_FPARAMS, RLVR_POLICY_LOSS_IPARAMS)
// makes a struct with one named field per entry and an `unpack(fparams, iparams)` that checks the
// list lengths. The Python dataclass (contracts/<op>.py) declares the same names in the same
// order; tests/common/test_contracts.py parses these lists and compares.
//
// Branch codes are `enum class` with explicit values, listed the same way
// (RLVR_<NAME>_CODES(X) with X(name, value)) and compared with the Python IntEnum.
#pragma once

#include <torch/types.h>

#include <cstdint>

#define RLVR_PARAM_FIELD_F(name) double name;
#define RLVR_PARAM_FIELD_I(name) int64_t name;
#define RLVR_PARAM_COUNT(name) +1
#define RLVR_PARAM_READ_F(name) p.name = fparams[i++];
#define RLVR_PARAM_READ_I(name) p.name = iparams[j++];

#define RLVR_DEFINE_PARAMS(Struct, FLIST, ILIST)                                                           \
  struct Struct {                                                                                        \
    FLIST(RLVR_PARAM_FIELD_F)                                                                            \
    ILIST(RLVR_PARAM_FIELD_I)                                                                            \
    static constexpr int64_t kNumF = 0 FLIST(RLVR_PARAM_COUNT);                                          \
    static constexpr int64_t kNumI = 0 ILIST(RLVR_PARAM_COUNT);                                          \
    static Struct unpack(c10::ArrayRef<double> fparams, c10::ArrayRef<int64_t> iparams) {                \
      TORCH_CHECK(int64_t(fparams.size()) == kNumF && int64_t(iparams.size()) == kNumI, #Struct,         \
                  ": expected ", kNumF, " fparams and ", kNumI, " iparams, got ", fparams.size(), " and ", \
                  iparams.size());                                                                       \
      Struct p{};                                                                                        \
      [[maybe_unused]] size_t i = 0, j = 0;                                                              \
      FLIST(RLVR_PARAM_READ_F)                                                                           \
      ILIST(RLVR_PARAM_READ_I)                                                                           \
      return p;                                                                                          \
    }                                                                                                    \
  };

#define RLVR_ENUM_ENTRY(name, value) name = value,
#define RLVR_ENUM_CHECK(name, value) (v == value) ||

// enum class Name : int64_t { ... } and `bool valid_Name(int64_t)`, from a CODES list.
#define RLVR_DEFINE_ENUM(Name, CODES)                                         \
  enum class Name : int64_t { CODES(RLVR_ENUM_ENTRY) };                     \
  inline bool valid_##Name(int64_t v) { return CODES(RLVR_ENUM_CHECK) false; }
