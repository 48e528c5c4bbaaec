// Fused elementwise kernels for the CPU decoder layer (float32 or bfloat16), each one pass
// over memory where torch takes several: on 2 cores a prefill chunk's [2048, 576]
// activations pass through RMSNorm's pow, mean, rsqrt and two muls plus the residual add,
// the rotary embedding's four multiplies and two adds, and the MLP's
// [2048, 1536] gate through silu and a mul, each a full read and write.
// Plain loops over fixed-width lanes that the compiler vectorises (-O3 -march=native); no
// -ffast-math, so the arithmetic is IEEE float32 in a fixed order. In bfloat16 every value is
// widened to float32, and rounded back to bfloat16 where Hugging Face's bfloat16 model rounds
// (each op of its own returns bfloat16): the residual sum, the normalised row before the
// weight, silu(gate) before the product, and each result.
#include "elementwise.h"

#include "exp_nonpositive.h"
#include "lanes.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

using namespace pagewire::lanes;
// Rows per parallel chunk: ~64 KB of activations, enough to pay for waking a thread.
constexpr int64_t kMinFloatsPerChunk = 16384;

// silu(x) = x / (1 + e^-x), written with e = exp(-|x|) <= 1 so that exp never overflows.
inline float silu(float x) {
  const float e = exp_nonpositive(x < 0.0f ? x : -x);
  return (x < 0.0f ? x * e : x) / (1.0f + e);
}

int64_t grain_rows(int64_t width) {
  return std::max<int64_t>(1, kMinFloatsPerChunk / std::max<int64_t>(1, width));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              name, " must be a float32 or bfloat16 CPU tensor, got ", t.scalar_type(), " on ",
              t.device());
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name,
              " must be [rows, width] with contiguous rows, got ", t.sizes(), " strides ",
              t.strides());
}

// Conversions written without branches, so that the loops around them vectorise (c10's own
// float -> bfloat16 conversion has a branch for NaN, and the loops stayed scalar).
inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// x rounded to the nearest bfloat16, ties to even (as c10::BFloat16 rounds; NaN stays NaN).
inline float round_to_bf16(float x) {
  const uint32_t u = bits_of(x);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return x != x ? float_of(0x7FC00000u) : float_of(r);
}

// The value `x` as a T would hold it, in float32 (identity for float: no rounding).
template <typename T>
inline float rounded(float x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return round_to_bf16(x);
  } else {
    return x;
  }
}

// x stored as a T (rounded as `rounded` rounds it).
template <typename T>
inline T narrow(float x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return c10::BFloat16(static_cast<uint16_t>(bits_of(round_to_bf16(x)) >> 16),
                         c10::BFloat16::from_bits());
  } else {
    return x;
  }
}

template <typename T>
void add_rms_norm_rows(const T* xs, int64_t x_stride, T* rs, int64_t r_stride, const T* w,
                       T* os, int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      T* r = rs + row * r_stride;
      const T* xr = xs + row * x_stride;
      float lanes[kLanes] = {0.0f};
      int64_t i = 0;
      for (; i + kLanes <= width; i += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) {
          const float sum =
              rounded<T>(static_cast<float>(r[i + l]) + static_cast<float>(xr[i + l]));
          r[i + l] = narrow<T>(sum);
          lanes[l] += sum * sum;
        }
      }
      for (; i < width; ++i) {
        const float sum = rounded<T>(static_cast<float>(r[i]) + static_cast<float>(xr[i]));
        r[i] = narrow<T>(sum);
        lanes[0] += sum * sum;
      }
      float total = 0.0f;
      for (int64_t l = 0; l < kLanes; ++l) total += lanes[l];
      const float inverse_rms = 1.0f / std::sqrt(total / static_cast<float>(width) + eps);
      T* o = os + row * width;
      for (int64_t j = 0; j < width; ++j) {
        o[j] = narrow<T>(rounded<T>(static_cast<float>(r[j]) * inverse_rms) *
                         static_cast<float>(w[j]));
      }
    }
  });
}

template <typename T>
void silu_and_mul_rows(const T* in, int64_t stride, T* os, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* gate = in + row * stride;
      const T* up = gate + width;
      T* o = os + row * width;
      for (int64_t j = 0; j < width; ++j) {
        o[j] = narrow<T>(rounded<T>(silu(static_cast<float>(gate[j]))) *
                         static_cast<float>(up[j]));
      }
    }
  });
}

}  // namespace

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape: ", x.sizes(),
              " vs ", residual.sizes());
  const at::ScalarType type = x.scalar_type();
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(residual.scalar_type() == type && weight.device().is_cpu() &&
                  weight.scalar_type() == type && weight.dim() == 1 &&
                  weight.size(0) == width && weight.is_contiguous(),
              "residual and weight must have x's dtype, and weight be a contiguous CPU vector "
              "of ", width, " values, got ", residual.scalar_type(), " and ",
              weight.scalar_type(), " ", weight.sizes());
  at::Tensor out = at::empty({rows, width}, x.options());
  const float eps_f = static_cast<float>(eps);
  if (type == at::kBFloat16) {
    add_rms_norm_rows(x.data_ptr<c10::BFloat16>(), x.stride(0),
                      residual.data_ptr<c10::BFloat16>(), residual.stride(0),
                      weight.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows,
                      width, eps_f);
  } else {
    add_rms_norm_rows(x.data_ptr<float>(), x.stride(0), residual.data_ptr<float>(),
                      residual.stride(0), weight.data_ptr<float>(), out.data_ptr<float>(),
                      rows, width, eps_f);
  }
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width, got ",
              gate_up.size(1));
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16) {
    silu_and_mul_rows(gate_up.data_ptr<c10::BFloat16>(), gate_up.stride(0),
                      out.data_ptr<c10::BFloat16>(), rows, width);
  } else {
    silu_and_mul_rows(gate_up.data_ptr<float>(), gate_up.stride(0), out.data_ptr<float>(), rows,
                      width);
  }
  return out;
}

namespace {

// Each product rounded on its own, as torch's separate multiplies and add round them: no
// fused multiply-add (which -O3 -march=native may otherwise contract a*b - c*d into).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// The rotation in kLanes-wide vectors, read from and written to T: in bfloat16 a loop over
// scalars did not vectorise (6x slower than torch).
template <typename T>
inline Vec rounded_lanes(Vec v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return round_bf16(v);
  } else {
    return v;
  }
}

template <typename T>
void rotate_half_rows(const T* xs, int64_t token_stride, int64_t head_stride, const T* cos,
                      const T* sin, T* os, int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, grain_rows(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * half;
      const T* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* x = xs + t * token_stride + h * head_stride;
        T* o = os + (t * heads + h) * dim;
        int64_t i = 0;
        for (; i + kLanes <= half; i += kLanes) {
          const Vec first = load(x + i), second = load(x + i + half);
          const Vec ci = load(c + i), si = load(s + i);
          store(o + i, rounded_lanes<T>(rounded_lanes<T>(first * ci) -
                                              rounded_lanes<T>(second * si)));
          store(o + i + half, rounded_lanes<T>(rounded_lanes<T>(second * ci) +
                                                     rounded_lanes<T>(first * si)));
        }
        for (; i < half; ++i) {  // a head_dim / 2 that is not a multiple of kLanes
          const float first = static_cast<float>(x[i]), second = static_cast<float>(x[i + half]);
          const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
          o[i] = narrow<T>(rounded<T>(first * ci) - rounded<T>(second * si));
          o[i + half] = narrow<T>(rounded<T>(second * ci) + rounded<T>(first * si));
        }
      }
    }
  });
}
#pragma GCC pop_options

}  // namespace

at::Tensor rotate_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const at::ScalarType type = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && (type == at::kFloat || type == at::kBFloat16) &&
                  x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotate_half: x must be a float32 or bfloat16 CPU tensor [tokens, heads, dim] "
              "with an even, contiguous dim, got ", x.scalar_type(), " ", x.sizes());
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == type && t->is_contiguous() &&
                    t->numel() == tokens * (dim / 2),
                "rotate_half: cos and sin must be contiguous [tokens, dim / 2] in x's dtype");
  }
  at::Tensor out = at::empty({tokens, heads, dim}, x.options());
  if (type == at::kBFloat16) {
    rotate_half_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), x.stride(1),
                     cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>(),
                     out.data_ptr<c10::BFloat16>(), tokens, heads, dim);
  } else {
    rotate_half_rows(x.data_ptr<float>(), x.stride(0), x.stride(1), cos.data_ptr<float>(),
                     sin.data_ptr<float>(), out.data_ptr<float>(), tokens, heads, dim);
  }
  return out;
}
