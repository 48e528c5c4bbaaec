// exp(x) for x <= 0 in plain float arithmetic that the compiler vectorises (no intrinsics, no
// -ffast-math): softmax numerators (scores minus their max) and silu's e^-|x|.
#pragma once

#include <cstdint>
#include <cstring>

// Cody-Waite range reduction and a degree-6 polynomial: about 1 ulp in float32. Below -87,
// where expf underflows to a denormal, the result is 0 (silu multiplies it by x, which may be
// huge, so a clamped e^-87 would not do).
inline float exp_nonpositive(float x) {
  const bool underflows = x < -87.0f;
  x = underflows ? -87.0f : x;
  // Round to nearest by adding and removing 1.5 * 2^23 (plain arithmetic: vectorises).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;  // ln2 split into hi + lo for an exact reduction
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n as a float
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflows ? 0.0f : p * scale;
}
