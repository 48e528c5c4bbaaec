// y = x @ W^T (+ b) for few rows of x (decode batches) on the CPU, from W packed into panels
// of 16 output features: panels[p][k][i] = W[16 p + i][k] (zeros past N). float32, or
// bfloat16 (weights, x, bias and y in bfloat16; products exact and sums in float32, y rounded
// once at the end). In bfloat16 on a CPU with AVX512_BF16 the panels hold pairs of k,
// panels[p][k / 2][i][k % 2], and each step is one VDPBF16PS (16 features x 2 k, the pair's
// two products summed into the float32 accumulator): twice the products per instruction of a
// float32 FMA, and no widening. Elsewhere the bfloat16 weights are widened (exactly) to
// float32 as they stream in.
//
// Why not MKL: with few rows the product is bound by streaming the weights from memory (the
// model's weights do not fit in the cache; every decode step reads all of them once), and
// MKL's packed sgemm leaves the memory idle while it computes. Here each thread walks its share
// of panel pairs (32 output features) in order; a tile of up to 8 rows keeps 8 x 2 vector
// accumulators in registers (per k: 2 weight loads, 8 broadcasts, 16 FMAs; so with AVX-512:
// with AVX2 a vector takes two registers, half of them spill, and the runner gives the panels
// few rows there, layers/linear.py), and while it
// computes, it prefetches its slice of the next panel pair, so the next weights arrive while
// these are multiplied. Measured on 2 cores (all 30 layers + the head of SmolLM2-135M, cold):
// 18-26 % faster than MKL's packed sgemm from 4 to 32 rows, 14 % at 64, equal at 1.
// In bfloat16 the same walk reads half the bytes, and few rows stay bound by memory.
#include "panel_linear.h"

#include "lanes.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

using namespace pagewire::lanes;  // a panel holds kLanes output features: one Vec
constexpr int kTileRows = 8;
constexpr int64_t kLineBytes = 64;
#if defined(__AVX512BF16__)
constexpr bool kBf16Pairs = true;
#else
constexpr bool kBf16Pairs = false;
#endif

// x as the tiles read it: float32 values (one k per step), or bfloat16 pairs (two k per step,
// one uint32 each) for the VDPBF16PS tiles.
using Pair = uint32_t;

// Panel values per step of k: 16 features, or 16 features x 2 k for pairs.
template <typename X>
constexpr int64_t values_per_step() {
  return std::is_same_v<X, Pair> ? 2 * kLanes : kLanes;
}

bool holds_pairs(at::ScalarType type) { return type == at::kBFloat16 && kBf16Pairs; }

// The steps of k a panel holds for K inputs of type `type`, and the values of each step.
int64_t panel_steps(int64_t K, at::ScalarType type) {
  return holds_pairs(type) ? (K + 1) / 2 : K;
}

int64_t step_width(at::ScalarType type) { return holds_pairs(type) ? 2 * kLanes : kLanes; }
// What a tile prefetches of the next panel pair while it computes: `lines` cache lines every
// `every` values of k, starting at `next` (null: nothing to prefetch).
struct Prefetch {
  const char* next;
  int64_t lines;  // 1 or 2
  int64_t every;  // >= 1

  // Called once per step of k: every `every` steps, the next `lines` lines.
  inline void step(int64_t& countdown) {
    if (next == nullptr || --countdown > 0) return;
    __builtin_prefetch(next, 0, 3);
    if (lines == 2) __builtin_prefetch(next + kLineBytes, 0, 3);
    next += kLineBytes * lines;
    countdown = every;
  }
};

// A tile's outputs: y[r][n0 + 16 c + i] = lanes[r][c][i] (+ bias) for the features that
// exist (< N), rounded once to T.
template <int R, int C, typename T>
inline void write_tile(const float (&lanes)[R][C][kLanes], const T* bias, T* y, int64_t N,
                       int64_t n0) {
  for (int c = 0; c < C; ++c) {
    const int64_t n = n0 + c * kLanes;
    const int64_t m = std::min(kLanes, N - n);
    for (int r = 0; r < R; ++r) {
      for (int64_t i = 0; i < m; ++i) {
        const float b = bias == nullptr ? 0.0f : static_cast<float>(bias[n + i]);
        y[r * N + n + i] = static_cast<T>(lanes[r][c][i] + b);
      }
    }
  }
}

// Rows [0, R) of x (float32) times C panels (C = 1 or 2) -> y[:, n0 : n0 + 16 C] (clipped at
// N), in T.
template <int R, int C, typename T>
void tile(const float* x, int64_t K, const T* panels, int64_t panel_stride, const T* bias,
          T* y, int64_t N, int64_t n0, Prefetch prefetch) {
  Vec acc[R][C] = {};
  int64_t countdown = 0;
  for (int64_t k = 0; k < K; ++k) {
    prefetch.step(countdown);
    Vec w[C];
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) w[c] = load(panels + c * panel_stride + k * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * K + k];
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) acc[r][c] += xv * w[c];
    }
  }
  float lanes[R][C][kLanes];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) store(lanes[r][c], acc[r][c]);
  }
  write_tile(lanes, bias, y, N, n0);
}

#if defined(__AVX512BF16__)
// The pairs' tile: rows [0, R) of x (bfloat16 pairs) times C panels of pairs, K2 steps.
template <int R, int C>
void tile(const Pair* x, int64_t K2, const c10::BFloat16* panels, int64_t panel_stride,
          const c10::BFloat16* bias, c10::BFloat16* y, int64_t N, int64_t n0,
          Prefetch prefetch) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  int64_t countdown = 0;
  for (int64_t k = 0; k < K2; ++k) {
    prefetch.step(countdown);
    __m512bh w[C];
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) {
      w[c] = (__m512bh)_mm512_loadu_si512(panels + c * panel_stride + k * 2 * kLanes);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * K2 + k]));
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w[c], xv);
    }
  }
  float lanes[R][C][kLanes];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(lanes[r][c], acc[r][c]);
  }
  write_tile(lanes, bias, y, N, n0);
}
#endif

template <int C, int R, typename X, typename T>
void tail_tile(const X* x, int64_t K, const T* panels, int64_t panel_stride,
               const T* bias, T* y, int64_t N, int64_t n0, Prefetch prefetch, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) {
      tile<R, C>(x, K, panels, panel_stride, bias, y, N, n0, prefetch);
      return;
    }
    tail_tile<C, R - 1>(x, K, panels, panel_stride, bias, y, N, n0, prefetch, rows);
  }
}

// Every row of x (K steps each) times C panels, in tiles of kTileRows rows; the tiles share
// the prefetching of the next panel pair evenly.
template <int C, typename X, typename T>
void all_rows(const X* x, int64_t M, int64_t K, const T* panels, const T* bias, T* y,
              int64_t N, int64_t n0, const T* next) {
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  const int64_t pair_lines =
      2 * K * values_per_step<X>() * static_cast<int64_t>(sizeof(T)) / kLineBytes;
  const int64_t share = pair_lines / tiles;  // lines each tile prefetches
  const int64_t lines = tiles == 1 ? 2 : 1;
  // A tile walks K values of k: spread its share of lines over them.
  const int64_t every = std::max<int64_t>(1, K * lines / std::max<int64_t>(1, share));
  const int64_t panel_stride = K * values_per_step<X>();
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t r0 = t * kTileRows;
    const char* first =
        next == nullptr ? nullptr : reinterpret_cast<const char*>(next) + t * share * kLineBytes;
    const Prefetch prefetch{first, lines, every};
    const int64_t rows = std::min<int64_t>(kTileRows, M - r0);
    if (rows == kTileRows) {
      tile<kTileRows, C>(x + r0 * K, K, panels, panel_stride, bias, y + r0 * N, N, n0,
                         prefetch);
    } else {
      tail_tile<C, kTileRows - 1>(x + r0 * K, K, panels, panel_stride, bias, y + r0 * N, N,
                                  n0, prefetch, rows);
    }
  }
}

// panels[p][k2][i][j] = W[16 p + i][2 k2 + j] (zeros past N and K).
void pack_pairs(const c10::BFloat16* src, c10::BFloat16* dst, int64_t N, int64_t K, int64_t P) {
  const int64_t K2 = (K + 1) / 2;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t i = 0; i < kLanes && p * kLanes + i < N; ++i) {
        const c10::BFloat16* row = src + (p * kLanes + i) * K;
        for (int64_t k = 0; k < K; ++k) dst[((p * K2 + k / 2) * kLanes + i) * 2 + k % 2] = row[k];
      }
    }
  });
}

template <typename T>
void pack(const T* src, T* dst, int64_t N, int64_t K, int64_t P) {
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t i = 0; i < kLanes && p * kLanes + i < N; ++i) {
        const T* row = src + (p * kLanes + i) * K;
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kLanes + i] = row[k];
      }
    }
  });
}

// x (K steps per row) times every panel, the panels shared out over the threads in pairs.
template <typename X, typename T>
void multiply(const X* xs, int64_t M, int64_t K, const T* ps, int64_t P, const T* b, T* ys,
              int64_t N) {
  const int64_t pairs = (P + 1) / 2;
  const int64_t panel_size = K * values_per_step<X>();
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = 2 * i;
      const T* pair = ps + p * panel_size;
      // The next pair of this thread's range, when it is a whole pair.
      const T* next = (i + 1 < end && p + 3 < P) ? pair + 2 * panel_size : nullptr;
      if (p + 1 < P) {
        all_rows<2>(xs, M, K, pair, b, ys, N, p * kLanes, next);
      } else {
        all_rows<1>(xs, M, K, pair, b, ys, N, p * kLanes, static_cast<const T*>(nullptr));
      }
    }
  });
}

bool supported_type(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16;
}

}  // namespace

at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && supported_type(weight.scalar_type()) &&
                  weight.dim() == 2,
              "pack_panels: weight must be a float32 or bfloat16 CPU matrix [N, K], got ",
              weight.scalar_type(), " ", weight.sizes());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + kLanes - 1) / kLanes;
  const int64_t steps = panel_steps(K, w.scalar_type());
  at::Tensor panels = at::zeros({P, steps, step_width(w.scalar_type())}, w.options());
  if (holds_pairs(w.scalar_type())) {
    pack_pairs(w.data_ptr<c10::BFloat16>(), panels.data_ptr<c10::BFloat16>(), N, K, P);
  } else if (w.scalar_type() == at::kBFloat16) {
    pack(w.data_ptr<c10::BFloat16>(), panels.data_ptr<c10::BFloat16>(), N, K, P);
  } else {
    pack(w.data_ptr<float>(), panels.data_ptr<float>(), N, K, P);
  }
  return panels;
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels,
                        const c10::optional<at::Tensor>& bias, int64_t out_features) {
  const at::ScalarType type = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && supported_type(type) && x.dim() == 2 && x.is_contiguous(),
              "panel_linear: x must be a contiguous float32 or bfloat16 CPU matrix [M, K], got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1), steps = panel_steps(K, type);
  TORCH_CHECK(panels.scalar_type() == type && panels.dim() == 3 &&
                  panels.size(2) == step_width(type) && panels.is_contiguous() &&
                  panels.size(1) == steps,
              "panel_linear: panels must be [P, ", steps, ", ", step_width(type),
              "] from pack_panels in x's dtype, got ", panels.scalar_type(), " ",
              panels.sizes());
  const int64_t P = panels.size(0), N = out_features;
  TORCH_CHECK(N > (P - 1) * kLanes && N <= P * kLanes, "panel_linear: ", N,
              " output features do not match ", P, " panels");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == type && bias->dim() == 1 && bias->size(0) == N &&
                    bias->is_contiguous(),
                "panel_linear: bias must be a contiguous vector of ", N, " values in x's dtype");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
#if defined(__AVX512BF16__)
  // Only built where the pairs' tiles exist (they need VDPBF16PS): elsewhere holds_pairs is
  // always false, and an instantiation of multiply for pairs would find no tile to call.
  if (holds_pairs(type)) {
    // x as pairs of k (one uint32 each), zero-padded to an even K: a few rows, copied once.
    at::Tensor padded = at::zeros({M, 2 * steps}, x.options());
    padded.narrow(1, 0, K).copy_(x);
    multiply(reinterpret_cast<const Pair*>(padded.data_ptr<c10::BFloat16>()), M, steps,
             panels.data_ptr<c10::BFloat16>(), P,
             has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr,
             y.data_ptr<c10::BFloat16>(), N);
    return y;
  }
#endif
  if (type == at::kBFloat16) {
    // x widened once (a few rows): the tiles then read float32 like the float32 path.
    const at::Tensor x32 = x.to(at::kFloat);
    multiply(x32.data_ptr<float>(), M, K, panels.data_ptr<c10::BFloat16>(), P,
             has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr,
             y.data_ptr<c10::BFloat16>(), N);
  } else {
    multiply(x.data_ptr<float>(), M, K, panels.data_ptr<float>(), P,
             has_bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), N);
  }
  return y;
}
