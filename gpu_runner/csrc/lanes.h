// 16 float32 lanes as one value of the compiler's generic vector type (GCC and Clang), and its
// loads and stores from float32 and bfloat16 memory: shared by the CPU kernels. The vector
// lowers to whatever SIMD the target has (one AVX-512 register, two AVX2 ones, four SSE ones).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace pagewire::lanes {

constexpr int64_t kLanes = 16;
using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
using Bits = uint32_t __attribute__((vector_size(kLanes * sizeof(uint32_t))));
using HalfBits = uint16_t __attribute__((vector_size(kLanes * sizeof(uint16_t))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}

// kLanes bfloat16 values widened to float32: a bfloat16 is the upper half of a float32, so
// the widening is exact (zero-extend, shift by 16).
inline Vec load(const c10::BFloat16* p) {
  HalfBits half;
  std::memcpy(&half, p, sizeof(half));
  const Bits bits = __builtin_convertvector(half, Bits) << 16;
  Vec v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

// v's upper halves as bfloat16: v must hold values already rounded to bfloat16.
inline void store(c10::BFloat16* p, Vec v) {
  Bits bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const HalfBits half = __builtin_convertvector(bits >> 16, HalfBits);
  std::memcpy(p, &half, sizeof(half));
}

}  // namespace pagewire::lanes
