// Paged attention on the CPU: every sequence's new query tokens attend, causally, over the
// sequence's keys read in place from the paged KV cache (no gather into padded tensors, no
// padding). One kernel for every kind of sequence in a batch: a decode (one new token), a fresh
// prompt, or a chunk after a cached prefix; the new tokens' K/V are already in the cache.
//
// Work item = (sequence, KV head, tile of up to kTileTokens new tokens). The tile's query rows
// (its tokens x the q_per_kv query heads of that KV head, GQA) share every key/value row, so
// each row is loaded once per group of up to 8 query rows. Two passes over the keys the
// tile sees, block by block through the block table:
//   1. scores[r][t] = (q_r * scale) . k_t   (kept in a per-item buffer),
//   2. softmax per query row over its own causal range (max subtracted, float32), then
//      out_r = sum_t p_r[t] v_t / sum_r.
// Items are handed out dynamically (an atomic counter): prompts and decodes differ in cost by
// orders of magnitude, and a static split would leave a thread idle.
// Vectorisation without intrinsics or -ffast-math: the dot products and the weighted sums use
// the compiler's generic vector type (GCC/Clang), the softmax loops are plain elementwise loops
// over fixed-width lanes, and exp is a polynomial the compiler vectorises. The JIT build uses
// -O3 -march=native (see gpu_runner/cpu_kernels.py).
#include "paged_attention.h"

#include "exp_nonpositive.h"
#include "lanes.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace pagewire::lanes;  // kLanes floats per vector step: a multiple of every SIMD width

struct Geometry {
  int64_t num_tokens;
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t q_per_kv;
  int64_t head_dim;
  int64_t num_blocks;
  int64_t block_size;
  int64_t max_blocks;
};

// Strides (in elements) of the caches and the query; the last dimension is contiguous.
struct Strides {
  int64_t q_token, q_head;
  int64_t k_block, k_slot, k_head;
  int64_t v_block, v_slot, v_head;
};

// Sums 16 lanes as a tree of fixed-width steps (each one vector add once unrolled), where a
// left-to-right sum is 16 dependent scalar adds (the compiler may not reorder float adds).
inline float sum_lanes(float* lanes) {
  static_assert(kLanes == 16, "the tree below sums 16 lanes");
  for (int l = 0; l < 8; ++l) lanes[l] += lanes[l + 8];
  for (int l = 0; l < 4; ++l) lanes[l] += lanes[l + 4];
  for (int l = 0; l < 2; ++l) lanes[l] += lanes[l + 2];
  return lanes[0] + lanes[1];
}

inline float max_of(const float* x, int64_t n) {
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, -std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] = std::max(lanes[l], x[t + l]);
  }
  for (; t < n; ++t) lanes[0] = std::max(lanes[0], x[t]);
  return *std::max_element(lanes, lanes + kLanes);
}

// Replaces x by exp(x - shift) and returns the sum.
inline float exp_shifted_sum(float* x, float shift, int64_t n) {
  float lanes[kLanes] = {0.0f};
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      x[t + l] = exp_nonpositive(x[t + l] - shift);
      lanes[l] += x[t + l];
    }
  }
  for (; t < n; ++t) {
    x[t] = exp_nonpositive(x[t] - shift);
    lanes[0] += x[t];
  }
  return sum_lanes(lanes);
}

// Halves and quarters of a Vec, for the horizontal sum.
using Half = float __attribute__((vector_size(kLanes / 2 * sizeof(float))));
using Quarter = float __attribute__((vector_size(kLanes / 4 * sizeof(float))));

inline float hsum(Vec v) {
  Half lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  const Half h = lo + hi;
  Quarter a, b;
  std::memcpy(&a, &h, sizeof(a));
  std::memcpy(&b, reinterpret_cast<const char*>(&h) + sizeof(a), sizeof(b));
  const Quarter q = a + b;
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// Scores of R query rows against one key: one vector accumulator per row, in registers, and
// every key element loaded once for all rows.
template <int R, typename T>
inline void dot_rows(const float* q, int64_t dim, const T* k, float* out,
                     int64_t out_stride) {
  Vec acc[R] = {};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    const Vec key = load(k + d);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] += load(q + r * dim + d) * key;
  }
  float tail[R] = {};
  for (; d < dim; ++d) {
    for (int r = 0; r < R; ++r) tail[r] += q[r * dim + d] * static_cast<float>(k[d]);
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(acc[r]) + tail[r];
}

// acc[r][:] += sum_i p[r][i] * v_i[:] over n value rows: the outer loop is over lane chunks of
// the head dimension so that the R accumulators stay in registers while the rows stream by.
template <int R, typename T>
inline void weighted_rows(const float* p, int64_t p_stride, const T* v, int64_t v_stride,
                          int64_t n, int64_t dim, float* acc) {
  int64_t d0 = 0;
  for (; d0 + kLanes <= dim; d0 += kLanes) {
    Vec sums[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) sums[r] = load(acc + r * dim + d0);
    for (int64_t i = 0; i < n; ++i) {
      const Vec row = load(v + i * v_stride + d0);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) sums[r] += p[r * p_stride + i] * row;
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) store(acc + r * dim + d0, sums[r]);
  }
  for (; d0 < dim; ++d0) {  // a head_dim that is not a multiple of kLanes
    for (int64_t i = 0; i < n; ++i) {
      for (int r = 0; r < R; ++r) {
        acc[r * dim + d0] += p[r * p_stride + i] * static_cast<float>(v[i * v_stride + d0]);
      }
    }
  }
}

// Asks for the next block's rows while this one is computed: blocks are scattered in memory,
// so the hardware prefetcher cannot guess them (about 10-15 % faster here).
template <typename T>
inline void prefetch_rows(const T* first, int64_t stride, int64_t rows, int64_t dim) {
  constexpr int64_t kLineValues = 64 / sizeof(T);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t d = 0; d < dim; d += kLineValues) __builtin_prefetch(first + i * stride + d);
  }
}

// Calls fn(std::integral_constant<int, R>{}, first_row) for tiles of at most Max rows
// covering rows [first, rows). Max bounds the accumulators a tile keeps in registers.
template <int Max, typename Fn>
inline void for_row_tiles(int64_t first, int64_t rows, Fn&& fn) {
  static_assert(Max >= 1 && Max <= 8, "tiles hold 1 to 8 rows");
  for (int64_t r0 = first; r0 < rows; r0 += Max) {
    switch (std::min<int64_t>(Max, rows - r0)) {
      case 1: fn(std::integral_constant<int, 1>{}, r0); break;
      case 2: fn(std::integral_constant<int, std::min(2, Max)>{}, r0); break;
      case 3: fn(std::integral_constant<int, std::min(3, Max)>{}, r0); break;
      case 4: fn(std::integral_constant<int, std::min(4, Max)>{}, r0); break;
      case 5: fn(std::integral_constant<int, std::min(5, Max)>{}, r0); break;
      case 6: fn(std::integral_constant<int, std::min(6, Max)>{}, r0); break;
      case 7: fn(std::integral_constant<int, std::min(7, Max)>{}, r0); break;
      default: fn(std::integral_constant<int, Max>{}, r0); break;
    }
  }
}

// Scores of R query rows against up to K * kLanes transposed keys (K chunks side by side in
// kt): the accumulators hold each row's scores against every key at once, so no horizontal
// sums (dot_rows needs one per score), and each loaded key vector serves R rows. Pays off once
// the transpose is shared by enough rows (prompts), not for a decode's few.
template <int R, int K>
inline void dot_keys_transposed(const float* q, int64_t dim, const float* kt, int64_t keys,
                                float* out, int64_t out_stride) {
  Vec acc[R][K] = {};
  for (int64_t d = 0; d < dim; ++d) {
    Vec key[K];
#pragma GCC unroll 2
    for (int k = 0; k < K; ++k) key[k] = load(kt + k * dim * kLanes + d * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float x = q[r * dim + d];
#pragma GCC unroll 2
      for (int k = 0; k < K; ++k) acc[r][k] += x * key[k];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int k = 0; k < K; ++k) {
      const int64_t n = std::min(kLanes, keys - k * kLanes);
      float* dst = out + r * out_stride + k * kLanes;
      if (n == kLanes) {
        store(dst, acc[r][k]);
      } else if (n > 0) {
        std::memcpy(dst, &acc[r][k], static_cast<size_t>(n) * sizeof(float));
      }
    }
  }
}

// weighted_rows for a head_dim of exactly C * kLanes: all R x C accumulators stay in registers
// while the value rows stream by, so each row is loaded once for R query rows and each weight
// once for C vectors (weighted_rows reloads the weights for every lane chunk).
template <int R, int C, typename T>
inline void weighted_rows_blocked(const float* p, int64_t p_stride, const T* v,
                                  int64_t v_stride, int64_t n, float* acc) {
  Vec sums[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) sums[r][c] = load(acc + (r * C + c) * kLanes);
  }
  for (int64_t i = 0; i < n; ++i) {
    Vec row[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) row[c] = load(v + i * v_stride + c * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float w = p[r * p_stride + i];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) sums[r][c] += w * row[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) store(acc + (r * C + c) * kLanes, sums[r][c]);
  }
}

// New tokens per work item: enough query rows to reuse each loaded key/value row many times,
// few enough that a prompt splits into several items (both threads busy on one long prompt).
constexpr int64_t kTileTokens = 16;

// One work item: a tile of new tokens of one sequence, for one KV head.
struct Item {
  int64_t seq;
  int64_t first_token;  // packed index of the tile's first new token
  int64_t tokens;       // new tokens in the tile
  int64_t first_pos;    // position of the tile's first token (keys 0..first_pos are visible)
  int64_t kv_head;      // -1: every KV head (a decode, see attend_decode)
  const float* keys_t;  // the sequence's keys for this KV head, transposed; null: not used
};

// Reusable buffers of one thread (allocated once per call, not per item).
struct Scratch {
  std::vector<float> scores;    // [rows, keys]
  std::vector<float> query;     // [rows, head_dim], pre-scaled
  std::vector<float> acc;       // [rows, head_dim]
  std::vector<float> inv_sums;  // [rows]
};

// From this many query rows per sequence (new tokens x q_per_kv), pass 1 works on transposed
// keys (dot_keys_transposed) instead of a horizontal sum per score (dot_rows). The keys of
// such a sequence are transposed once per call, before any item runs, and shared by its tiles.
constexpr int64_t kTransposeRows = 8;
// Row tiles: 4 rows with a decode's horizontal sums (dot_rows keeps 4 accumulators per row
// group), 8 once keys are transposed (one accumulator per row).
constexpr int kDotRows = 4;
constexpr int kWideRows = 8;

// Query row r of an item is token r / q_per_kv, head r % q_per_kv: it sees this many keys.
inline int64_t visible_keys(const Item& item, int64_t q_per_kv, int64_t row) {
  return item.first_pos + row / q_per_kv + 1;
}

// Floats of one sequence's transposed keys for one KV head: chunks of kLanes keys, each
// [head_dim, kLanes], the last one padded with zeros.
inline int64_t transposed_size(int64_t context, int64_t dim) {
  return (context + kLanes - 1) / kLanes * dim * kLanes;
}

// The first `context` keys of one sequence and KV head, read through its block table, written
// as chunks kt[chunk][d][i] = key (chunk * kLanes + i)[d].
template <typename T>
void transpose_keys(const Geometry& g, const Strides& s, const T* keys,
                    const int64_t* table, int64_t context, int64_t kv_head, float* kt) {
  const int64_t dim = g.head_dim;
  for (int64_t key0 = 0; key0 < context; key0 += kLanes, kt += dim * kLanes) {
    const int64_t n = std::min(kLanes, context - key0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = key0 + i;
      const T* row = keys + table[t / g.block_size] * s.k_block +
                     (t % g.block_size) * s.k_slot + kv_head * s.k_head;
      for (int64_t d = 0; d < dim; ++d) kt[d * kLanes + i] = static_cast<float>(row[d]);
    }
    for (int64_t i = n; i < kLanes; ++i) {
      for (int64_t d = 0; d < dim; ++d) kt[d * kLanes + i] = 0.0f;
    }
  }
}

// Pass 1 for many query rows: every row that sees any key of a chunk gets its scores against
// the whole chunk. Entries past a row's own causal limit are computed or left as they are;
// the softmax zeroes them.
void scores_transposed(const Geometry& g, const Item& item, const float* q, int64_t rows,
                       int64_t context, float* scores) {
  const int64_t qn = g.q_per_kv, dim = g.head_dim;
  const float* kt = item.keys_t;
  // Two chunks of keys at a time: two accumulators per row, each loaded query value used twice.
  for (int64_t key0 = 0; key0 < context; key0 += 2 * kLanes, kt += 2 * dim * kLanes) {
    const int64_t m = std::min(2 * kLanes, context - key0);
    // Row r sees keys below first_pos + r / qn + 1: rows before this one see none of these.
    const int64_t first_row = std::max<int64_t>(0, (key0 - item.first_pos) * qn);
    for_row_tiles<kWideRows>(first_row, rows, [&](auto tile, int64_t r0) {
      constexpr int R = decltype(tile)::value;
      float* out = scores + r0 * context + key0;
      if (m > kLanes) {
        dot_keys_transposed<R, 2>(q + r0 * dim, dim, kt, m, out, context);
      } else {
        dot_keys_transposed<R, 1>(q + r0 * dim, dim, kt, m, out, context);
      }
    });
  }
}

// Pass 2: acc[r] += sum_t p_r[t] v_t over the keys each tile of rows sees. C = head_dim /
// kLanes selects weighted_rows_blocked (with tiles of MaxRows rows); C = 0 any head_dim.
template <int MaxRows, int C, typename T>
void weigh_values(const Geometry& g, const Strides& s, const T* values,
                  const int64_t* table, const Item& item, int64_t rows, int64_t context,
                  Scratch& scratch) {
  const int64_t dim = g.head_dim;
  const float* scores = scratch.scores.data();
  float* acc = scratch.acc.data();
  for_row_tiles<MaxRows>(0, rows, [&](auto tile, int64_t r0) {
    constexpr int R = decltype(tile)::value;
    const int64_t seen = visible_keys(item, g.q_per_kv, std::min(rows, r0 + R) - 1);
    for (int64_t t0 = 0, b = 0; t0 < seen; t0 += g.block_size, ++b) {
      const T* block = values + table[b] * s.v_block + item.kv_head * s.v_head;
      const int64_t n = std::min(g.block_size, seen - t0);
      if (t0 + g.block_size < seen) {
        prefetch_rows(values + table[b + 1] * s.v_block + item.kv_head * s.v_head, s.v_slot,
                      std::min(g.block_size, seen - t0 - g.block_size), dim);
      }
      const float* p = scores + r0 * context + t0;
      if constexpr (C > 0) {
        weighted_rows_blocked<R, C>(p, context, block, s.v_slot, n, acc + r0 * dim);
      } else {
        weighted_rows<R>(p, context, block, s.v_slot, n, dim, acc + r0 * dim);
      }
    }
  });
}

// Pass 2 for one tile of R query rows over n value rows: acc[r] += sum_i p[r][i] v_i.
template <int R, typename T>
inline void weigh_rows(const float* p, int64_t p_stride, const T* v, int64_t v_stride,
                       int64_t n, int64_t dim, float* acc) {
  if (dim == 4 * kLanes) {
    weighted_rows_blocked<R, 4>(p, p_stride, v, v_stride, n, acc);
  } else {
    weighted_rows<R>(p, p_stride, v, v_stride, n, dim, acc);
  }
}

// A decode (one new token) over every KV head at once: block by block, slot by slot, the
// heads' key (then value) rows are read in memory order, the whole of each block's rows, and
// while a block is computed the same slots of the next block are prefetched. Per-head items
// would read each block three times at a stride (one 256-byte row per slot and head), which
// the hardware prefetcher follows poorly: decode attention is bound by reading the cache.
template <typename T>
void attend_decode(const Geometry& g, const Strides& s, const T* query, const T* keys,
                   const T* values, const int64_t* table, const Item& item, float scale,
                   T* out, Scratch& scratch) {
  const int64_t qn = g.q_per_kv, dim = g.head_dim, heads = g.num_heads;
  const int64_t context = item.first_pos + 1;
  scratch.scores.resize(static_cast<size_t>(heads * context));
  scratch.query.resize(static_cast<size_t>(heads * dim));
  scratch.acc.assign(static_cast<size_t>(heads * dim), 0.0f);
  scratch.inv_sums.resize(static_cast<size_t>(heads));
  float* scores = scratch.scores.data();
  float* q = scratch.query.data();
  float* acc = scratch.acc.data();
  for (int64_t h = 0; h < heads; ++h) {
    const T* src = query + item.first_token * s.q_token + h * s.q_head;
    for (int64_t d = 0; d < dim; ++d) q[h * dim + d] = static_cast<float>(src[d]) * scale;
  }
  // Pass 1: scores.
  for (int64_t t0 = 0, b = 0; t0 < context; t0 += g.block_size, ++b) {
    const T* block = keys + table[b] * s.k_block;
    const int64_t n = std::min(g.block_size, context - t0);
    const int64_t n_next = std::min(g.block_size, context - t0 - g.block_size);
    for (int64_t i = 0; i < n; ++i) {
      if (i < n_next) {
        prefetch_rows(keys + table[b + 1] * s.k_block + i * s.k_slot, s.k_head, g.num_kv_heads,
                      dim);
      }
      for (int64_t kv = 0; kv < g.num_kv_heads; ++kv) {
        const T* key = block + i * s.k_slot + kv * s.k_head;
        for_row_tiles<kDotRows>(0, qn, [&](auto tile, int64_t r0) {
          const int64_t row = kv * qn + r0;
          dot_rows<decltype(tile)::value>(q + row * dim, dim, key, scores + row * context + t0 + i,
                                          context);
        });
      }
    }
  }
  float* inv_sums = scratch.inv_sums.data();
  for (int64_t h = 0; h < heads; ++h) {
    float* row = scores + h * context;
    inv_sums[h] = 1.0f / exp_shifted_sum(row, max_of(row, context), context);
  }
  // Pass 2: weighted sums of the values.
  for (int64_t t0 = 0, b = 0; t0 < context; t0 += g.block_size, ++b) {
    const T* block = values + table[b] * s.v_block;
    const int64_t n = std::min(g.block_size, context - t0);
    if (t0 + g.block_size < context) {
      const T* next = values + table[b + 1] * s.v_block;
      const int64_t n_next = std::min(g.block_size, context - t0 - g.block_size);
      for (int64_t i = 0; i < n_next; ++i) {
        prefetch_rows(next + i * s.v_slot, s.v_head, g.num_kv_heads, dim);
      }
    }
    for (int64_t kv = 0; kv < g.num_kv_heads; ++kv) {
      for_row_tiles<kDotRows>(0, qn, [&](auto tile, int64_t r0) {
        const int64_t row = kv * qn + r0;
        weigh_rows<decltype(tile)::value>(scores + row * context + t0, context,
                                          block + kv * s.v_head, s.v_slot, n, dim,
                                          acc + row * dim);
      });
    }
  }
  T* dst = out + item.first_token * heads * dim;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t d = 0; d < dim; ++d) dst[h * dim + d] = static_cast<T>(acc[h * dim + d] * inv_sums[h]);
  }
}

template <typename T>
void attend_item(const Geometry& g, const Strides& s, const T* query, const T* keys,
                 const T* values, const int64_t* table, const Item& item, float scale,
                 T* out, Scratch& scratch) {
  const int64_t qn = g.q_per_kv, dim = g.head_dim;
  const int64_t rows = item.tokens * qn;
  const int64_t context = item.first_pos + item.tokens;  // keys the item's last token sees
  scratch.scores.resize(static_cast<size_t>(rows * context));
  scratch.query.resize(static_cast<size_t>(rows * dim));
  scratch.acc.assign(static_cast<size_t>(rows * dim), 0.0f);
  scratch.inv_sums.resize(static_cast<size_t>(rows));
  float* scores = scratch.scores.data();
  float* q = scratch.query.data();
  float* acc = scratch.acc.data();
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = query + (item.first_token + r / qn) * s.q_token +
                   (item.kv_head * qn + r % qn) * s.q_head;
    for (int64_t d = 0; d < dim; ++d) q[r * dim + d] = static_cast<float>(src[d]) * scale;
  }
  // Pass 1: scores, block by block in place.
  if (item.keys_t != nullptr) {
    scores_transposed(g, item, q, rows, context, scores);
  } else {
    for_row_tiles<kDotRows>(0, rows, [&](auto tile, int64_t r0) {
      constexpr int R = decltype(tile)::value;
      // Up to the last key any row of the tile sees.
      const int64_t seen = visible_keys(item, qn, std::min(rows, r0 + R) - 1);
      for (int64_t t0 = 0, b = 0; t0 < seen; t0 += g.block_size, ++b) {
        const T* block = keys + table[b] * s.k_block + item.kv_head * s.k_head;
        const int64_t n = std::min(g.block_size, seen - t0);
        if (t0 + g.block_size < seen) {
          prefetch_rows(keys + table[b + 1] * s.k_block + item.kv_head * s.k_head, s.k_slot,
                        std::min(g.block_size, seen - t0 - g.block_size), dim);
        }
        for (int64_t i = 0; i < n; ++i) {
          dot_rows<R>(q + r0 * dim, dim, block + i * s.k_slot, scores + r0 * context + t0 + i,
                      context);
        }
      }
    });
  }
  // Softmax numerators and their sums per query row; keys a row must not see get weight 0.
  float* inv_sums = scratch.inv_sums.data();
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * context;
    const int64_t seen = visible_keys(item, qn, r);
    inv_sums[r] = 1.0f / exp_shifted_sum(row, max_of(row, seen), seen);
    std::fill(row + seen, row + context, 0.0f);
  }
  // Pass 2: weighted sum of the values, block by block in place.
  switch (dim) {
    case 2 * kLanes: weigh_values<8, 2>(g, s, values, table, item, rows, context, scratch); break;
    case 4 * kLanes: weigh_values<4, 4>(g, s, values, table, item, rows, context, scratch); break;
    case 8 * kLanes: weigh_values<2, 8>(g, s, values, table, item, rows, context, scratch); break;
    default: weigh_values<8, 0>(g, s, values, table, item, rows, context, scratch); break;
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + ((item.first_token + r / qn) * g.num_heads + item.kv_head * qn + r % qn) *
                       dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[r * dim + d] * inv_sums[r]);
  }
}

void check_inputs(const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& context_lens, const at::Tensor& query_start_locs) {
  for (const at::Tensor* t :
       {&query, &key_cache, &value_cache, &block_tables, &context_lens, &query_start_locs}) {
    TORCH_CHECK(t->device().is_cpu(), "paged_attention: every tensor must be on the CPU");
  }
  const at::ScalarType type = query.scalar_type();
  TORCH_CHECK((type == at::kFloat || type == at::kBFloat16) &&
                  key_cache.scalar_type() == type && value_cache.scalar_type() == type,
              "paged_attention: query and caches must all be float32 or all bfloat16, got ",
              query.scalar_type(), ", ", key_cache.scalar_type(), ", ",
              value_cache.scalar_type());
  TORCH_CHECK(query.dim() == 3, "query must be [tokens, heads, head_dim], got ", query.sizes());
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache must both be [blocks, block_size, kv_heads, head_dim], "
              "got ", key_cache.sizes(), " and ", value_cache.sizes());
  TORCH_CHECK(key_cache.size(3) == query.size(2), "head_dim differs: query ", query.size(2),
              ", cache ", key_cache.size(3));
  TORCH_CHECK(key_cache.size(2) > 0 && query.size(1) % key_cache.size(2) == 0,
              "heads (", query.size(1), ") must be a multiple of kv_heads (", key_cache.size(2),
              ")");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "the head_dim dimension must be contiguous");
  const int64_t seqs = context_lens.dim() == 1 ? context_lens.size(0) : -1;
  TORCH_CHECK(seqs >= 0, "context_lens must be [seqs], got ", context_lens.sizes());
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == seqs,
              "block_tables must be [seqs, max_blocks] with seqs = ", seqs, ", got ",
              block_tables.sizes());
  TORCH_CHECK(query_start_locs.dim() == 1 && query_start_locs.size(0) == seqs + 1,
              "query_start_locs must be [seqs + 1] with seqs = ", seqs, ", got ",
              query_start_locs.sizes());
  for (const at::Tensor* t : {&block_tables, &context_lens, &query_start_locs}) {
    TORCH_CHECK(!at::isFloatingType(t->scalar_type()),
                "block_tables, context_lens and query_start_locs must be integer tensors");
  }
}

// Every sequence's new tokens must be a non-empty run of the packed query that fits in its
// context, and every block it reads must exist: checked up front, serially (O(blocks read)),
// so bad metadata is an error and never an out-of-bounds read.
void check_sequences(const Geometry& g, const int64_t* tables, const int64_t* lens,
                     const int64_t* starts) {
  TORCH_CHECK(starts[0] == 0 && starts[g.num_seqs] == g.num_tokens,
              "query_start_locs must run from 0 to the number of query tokens (", g.num_tokens,
              "), got ", starts[0], " .. ", starts[g.num_seqs]);
  for (int64_t seq = 0; seq < g.num_seqs; ++seq) {
    const int64_t context = lens[seq];
    const int64_t new_tokens = starts[seq + 1] - starts[seq];
    TORCH_CHECK(new_tokens >= 1 && new_tokens <= context, "sequence ", seq, " has ",
                new_tokens, " new tokens for a context of ", context,
                " (needs 1 <= new tokens <= context)");
    TORCH_CHECK(context <= g.max_blocks * g.block_size, "context_lens[", seq, "] = ", context,
                " is beyond max_blocks * block_size = ", g.max_blocks * g.block_size);
    const int64_t used = (context + g.block_size - 1) / g.block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int64_t block = tables[seq * g.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < g.num_blocks, "block_tables[", seq, "][", b, "] = ",
                  block, " is outside [0, ", g.num_blocks, ")");
    }
  }
}

// The work items, and the sequences (with their keys' offset in `keys_t`) whose keys are
// transposed first. `keys_t` is sized here; items point into it.
struct Plan {
  std::vector<Item> items;
  std::vector<std::pair<int64_t, int64_t>> transposed;  // (seq, offset of its KV head 0)
  std::vector<float> keys_t;
  int64_t total_pairs = 0;  // query-row x key pairs: the amount of work
};

Plan plan_work(const Geometry& g, const int64_t* lens, const int64_t* starts) {
  Plan plan;
  // One item per decode (every KV head) once there are enough of them to share out; a few
  // decodes keep an item per KV head, so that a long context still splits over threads.
  int64_t decodes = 0;
  for (int64_t seq = 0; seq < g.num_seqs; ++seq) decodes += starts[seq + 1] - starts[seq] == 1;
  const bool decode_items = decodes >= 4 * at::get_num_threads();
  int64_t floats = 0;
  for (int64_t seq = 0; seq < g.num_seqs; ++seq) {
    if ((starts[seq + 1] - starts[seq]) * g.q_per_kv >= kTransposeRows) {
      plan.transposed.emplace_back(seq, floats);
      floats += g.num_kv_heads * transposed_size(lens[seq], g.head_dim);
    }
  }
  plan.keys_t.resize(static_cast<size_t>(floats));
  size_t next_transposed = 0;
  for (int64_t seq = 0; seq < g.num_seqs; ++seq) {
    const int64_t new_tokens = starts[seq + 1] - starts[seq];
    const int64_t first_pos = lens[seq] - new_tokens;
    const float* keys_t = nullptr;
    if (next_transposed < plan.transposed.size() && plan.transposed[next_transposed].first == seq) {
      keys_t = plan.keys_t.data() + plan.transposed[next_transposed++].second;
    }
    const int64_t per_head = transposed_size(lens[seq], g.head_dim);
    if (new_tokens == 1 && decode_items) {
      plan.items.push_back({seq, starts[seq], 1, first_pos, -1, nullptr});
      plan.total_pairs += lens[seq] * g.num_heads;
      continue;
    }
    for (int64_t t0 = 0; t0 < new_tokens; t0 += kTileTokens) {
      const int64_t tokens = std::min(kTileTokens, new_tokens - t0);
      for (int64_t kv_head = 0; kv_head < g.num_kv_heads; ++kv_head) {
        plan.items.push_back({seq, starts[seq] + t0, tokens, first_pos + t0, kv_head,
                              keys_t == nullptr ? nullptr : keys_t + kv_head * per_head});
      }
      plan.total_pairs += tokens * (first_pos + t0 + tokens) * g.num_kv_heads * g.q_per_kv;
    }
  }
  return plan;
}

// Runs fn(i) for i in [0, count) on up to `threads` threads, handing out indices one by one.
template <typename Fn>
void parallel_dynamic(int64_t count, int64_t threads, Fn&& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::max<int64_t>(1, std::min(threads, count)), 1,
                   [&](int64_t, int64_t) {
                     for (int64_t i = next++; i < count; i = next++) fn(i);
                   });
}

// The kernel for one element type T of the query, the caches and the output (float, or
// c10::BFloat16: read and written as bfloat16, computed in float32).
template <typename T>
void attend_all(const Geometry& g, const Strides& s, const T* q, const T* k, const T* v, T* o,
                const int64_t* table_data, const int64_t* len_data, const int64_t* start_data,
                float scale) {
  Plan plan = plan_work(g, len_data, start_data);
  // A thread should get enough work (~2k query-key pairs, a few microseconds) to pay for
  // waking it; small calls run on the calling thread alone.
  constexpr int64_t kPairsPerThread = 2048;
  const int64_t threads = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), plan.total_pairs / kPairsPerThread));
  const int64_t heads = g.num_kv_heads;
  parallel_dynamic(static_cast<int64_t>(plan.transposed.size()) * heads, threads,
                   [&](int64_t i) {
                     const auto [seq, offset] = plan.transposed[static_cast<size_t>(i / heads)];
                     const int64_t kv_head = i % heads;
                     transpose_keys(g, s, k, table_data + seq * g.max_blocks, len_data[seq],
                                    kv_head,
                                    plan.keys_t.data() + offset +
                                        kv_head * transposed_size(len_data[seq], g.head_dim));
                   });
  std::vector<Scratch> scratches(static_cast<size_t>(at::get_num_threads()));
  parallel_dynamic(static_cast<int64_t>(plan.items.size()), threads, [&](int64_t i) {
    const Item& item = plan.items[static_cast<size_t>(i)];
    Scratch& scratch = scratches[static_cast<size_t>(at::get_thread_num())];
    const int64_t* table = table_data + item.seq * g.max_blocks;
    if (item.kv_head < 0) {
      attend_decode(g, s, q, k, v, table, item, scale, o, scratch);
    } else {
      attend_item(g, s, q, k, v, table, item, scale, o, scratch);
    }
  });
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, const at::Tensor& query_start_locs,
                           double scale) {
  check_inputs(query, key_cache, value_cache, block_tables, context_lens, query_start_locs);
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = context_lens.to(at::kLong).contiguous();
  const at::Tensor starts = query_start_locs.to(at::kLong).contiguous();
  Geometry g{};
  g.num_tokens = query.size(0);
  g.num_seqs = lens.size(0);
  g.num_heads = query.size(1);
  g.num_kv_heads = key_cache.size(2);
  g.q_per_kv = g.num_heads / g.num_kv_heads;
  g.head_dim = query.size(2);
  g.num_blocks = key_cache.size(0);
  g.block_size = key_cache.size(1);
  g.max_blocks = tables.size(1);
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const int64_t* len_data = lens.data_ptr<int64_t>();
  const int64_t* start_data = starts.data_ptr<int64_t>();
  check_sequences(g, table_data, len_data, start_data);
  const Strides s{query.stride(0),     query.stride(1),     key_cache.stride(0),
                  key_cache.stride(1), key_cache.stride(2), value_cache.stride(0),
                  value_cache.stride(1), value_cache.stride(2)};
  at::Tensor out = at::empty({g.num_tokens, g.num_heads, g.head_dim}, query.options());
  const float scale_f = static_cast<float>(scale);
  if (query.scalar_type() == at::kBFloat16) {
    attend_all(g, s, query.data_ptr<c10::BFloat16>(), key_cache.data_ptr<c10::BFloat16>(),
               value_cache.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(),
               table_data, len_data, start_data, scale_f);
  } else {
    attend_all(g, s, query.data_ptr<float>(), key_cache.data_ptr<float>(),
               value_cache.data_ptr<float>(), out.data_ptr<float>(), table_data, len_data,
               start_data, scale_f);
  }
  return out;
}
