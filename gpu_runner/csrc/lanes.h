// 16 float32 lanes as one value, and its loads and stores from float32 and bfloat16 memory:
// shared by the CPU kernels.
//
// With AVX-512 a Vec is one register: the compiler's generic vector type of 16 floats. Below
// AVX-512 it is a pair (AVX2) or a quartet (SSE) of the target's own registers: GCC gives a
// generic vector wider than any register of the target no machine mode, keeps it in memory
// and goes through the stack for every operation (a broadcast was 16 scalar stores and a
// reload): on an AVX2-only EPYC every kernel ran 3-15x slower than torch's.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace pagewire::lanes {

constexpr int64_t kLanes = 16;

#if defined(__AVX512F__)
constexpr int kParts = 1;  // registers per Vec
#elif defined(__AVX__)
constexpr int kParts = 2;
#else
constexpr int kParts = 4;
#endif
constexpr int64_t kPartLanes = kLanes / kParts;

using Part = float __attribute__((vector_size(kPartLanes * sizeof(float))));
using PartBits = uint32_t __attribute__((vector_size(kPartLanes * sizeof(uint32_t))));
using PartHalfBits = uint16_t __attribute__((vector_size(kPartLanes * sizeof(uint16_t))));

#if defined(__AVX512F__)
using Vec = Part;
#else
struct Vec {
  Part part[kParts];
};

#define PAGEWIRE_VEC_OP(op)                                      \
  inline Vec operator op(Vec a, const Vec& b) {                  \
    _Pragma("GCC unroll 4") for (int i = 0; i < kParts; ++i) {   \
      a.part[i] = a.part[i] op b.part[i];                        \
    }                                                            \
    return a;                                                    \
  }                                                              \
  inline Vec& operator op##=(Vec& a, const Vec& b) { return a = a op b; }
PAGEWIRE_VEC_OP(+)
PAGEWIRE_VEC_OP(-)
PAGEWIRE_VEC_OP(*)
#undef PAGEWIRE_VEC_OP

inline Vec operator*(float s, Vec v) {
#pragma GCC unroll 4
  for (int i = 0; i < kParts; ++i) v.part[i] *= s;
  return v;
}
#endif

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

// kLanes bfloat16 values widened to float32: a bfloat16 is the upper half of a float32, so
// the widening is exact (zero-extend, shift by 16).
inline Vec load(const c10::BFloat16* p) {
  Vec v;
  auto* parts = reinterpret_cast<Part*>(&v);
#pragma GCC unroll 4
  for (int i = 0; i < kParts; ++i) {
    PartHalfBits half;
    std::memcpy(&half, p + i * kPartLanes, sizeof(half));
    const PartBits bits = __builtin_convertvector(half, PartBits) << 16;
    std::memcpy(&parts[i], &bits, sizeof(bits));
  }
  return v;
}

// v's upper halves as bfloat16: v must hold values already rounded to bfloat16.
inline void store(c10::BFloat16* p, Vec v) {
  const auto* parts = reinterpret_cast<const Part*>(&v);
#pragma GCC unroll 4
  for (int i = 0; i < kParts; ++i) {
    PartBits bits;
    std::memcpy(&bits, &parts[i], sizeof(bits));
    const PartHalfBits half = __builtin_convertvector(bits >> 16, PartHalfBits);
    std::memcpy(p + i * kPartLanes, &half, sizeof(half));
  }
}

// v rounded to bfloat16 values (kept in float32), ties to even (no NaN can arise from finite
// inputs of the kernels that round; a NaN input stays a NaN, possibly with another payload).
inline Vec round_bf16(Vec v) {
  auto* parts = reinterpret_cast<Part*>(&v);
#pragma GCC unroll 4
  for (int i = 0; i < kParts; ++i) {
    PartBits u;
    std::memcpy(&u, &parts[i], sizeof(u));
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    std::memcpy(&parts[i], &u, sizeof(u));
  }
  return v;
}

}  // namespace pagewire::lanes
