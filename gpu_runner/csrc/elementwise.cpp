// Fused elementwise kernels for the CPU decoder layer (float32), each one pass over memory
// where torch takes several: on 2 cores a prefill chunk's [2048, 576] activations pass
// through RMSNorm's pow, mean, rsqrt and two muls plus the residual add, and the MLP's
// [2048, 1536] gate through silu and a mul, each a full read and write.
// Plain loops over fixed-width lanes that the compiler vectorises (-O3 -march=native); no
// -ffast-math, so the arithmetic is IEEE float32 in a fixed order.
#include "elementwise.h"

#include "exp_nonpositive.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kLanes = 16;
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
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name,
              " must be [rows, width] with contiguous rows, got ", t.sizes(), " strides ",
              t.strides());
}

}  // namespace

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape: ", x.sizes(),
              " vs ", residual.sizes());
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat &&
                  weight.dim() == 1 && weight.size(0) == width && weight.is_contiguous(),
              "weight must be a contiguous float32 CPU vector of ", width, " values, got ",
              weight.sizes());
  at::Tensor out = at::empty({rows, width}, x.options());
  const float* xs = x.data_ptr<float>();
  float* rs = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0), r_stride = residual.stride(0);
  const float eps_f = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float* r = rs + row * r_stride;
      const float* xr = xs + row * x_stride;
      float lanes[kLanes] = {0.0f};
      int64_t i = 0;
      for (; i + kLanes <= width; i += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) {
          r[i + l] += xr[i + l];
          lanes[l] += r[i + l] * r[i + l];
        }
      }
      for (; i < width; ++i) {
        r[i] += xr[i];
        lanes[0] += r[i] * r[i];
      }
      float sum = 0.0f;
      for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
      const float inverse_rms = 1.0f / std::sqrt(sum / static_cast<float>(width) + eps_f);
      float* o = os + row * width;
      for (int64_t j = 0; j < width; ++j) o[j] = r[j] * inverse_rms * w[j];
    }
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width, got ",
              gate_up.size(1));
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t stride = gate_up.stride(0);
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* gate = in + row * stride;
      const float* up = gate + width;
      float* o = os + row * width;
      for (int64_t j = 0; j < width; ++j) o[j] = silu(gate[j]) * up[j];
    }
  });
  return out;
}
