// Paged decode attention on the CPU: one query token per sequence attends over the sequence's
// keys read in place from the paged KV cache (no gather into padded tensors, no padding).
//
// Work item = (sequence, KV head), spread over threads with at::parallel_for: its q_per_kv
// query heads (GQA) share every key/value row, so each row is loaded once per tile of up to
// kMaxRows query rows. Two passes over the context, block by block through the block table:
//   1. scores[r][t] = (q_r * scale) . k_t   (kept in a per-chunk buffer),
//   2. softmax per query row (max subtracted, float32), then out_r = sum_t p_r[t] v_t / sum_r.
// Vectorisation without intrinsics or -ffast-math: the dot products and the weighted sums use
// the compiler's generic vector type (GCC/Clang), the softmax loops are plain elementwise loops
// over fixed-width lanes, and exp is a polynomial the compiler vectorises. The JIT build uses
// -O3 -march=native (see cpu_decode.py).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Floats per vector step: a multiple of every SIMD width (4, 8, 16 floats).
constexpr int64_t kLanes = 16;

struct Geometry {
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
  int64_t q_seq, q_head;
  int64_t k_block, k_slot, k_head;
  int64_t v_block, v_slot, v_head;
};

// exp(x) for x <= 0 (scores minus their max) by Cody-Waite range reduction and a degree-6
// polynomial: about 1 ulp in float32, and plain arithmetic the compiler vectorises.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this expf underflows to a denormal; 0 is close enough
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
  return p * scale;
}

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

// kLanes floats as one value of the compiler's generic vector type (GCC and Clang): it lowers
// to whatever SIMD the target has (one AVX-512 register, two AVX2 ones, four SSE ones).
// Used where the auto-vectoriser does not keep several accumulators in registers.
using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
using Half = float __attribute__((vector_size(kLanes / 2 * sizeof(float))));
using Quarter = float __attribute__((vector_size(kLanes / 4 * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

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
template <int R>
inline void dot_rows(const float* q, int64_t dim, const float* k, float* out,
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
    for (int r = 0; r < R; ++r) tail[r] += q[r * dim + d] * k[d];
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(acc[r]) + tail[r];
}

// acc[r][:] += sum_i p[r][i] * v_i[:] over n value rows: the outer loop is over lane chunks of
// the head dimension so that the R accumulators stay in registers while the rows stream by.
template <int R>
inline void weighted_rows(const float* p, int64_t p_stride, const float* v, int64_t v_stride,
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
        acc[r * dim + d0] += p[r * p_stride + i] * v[i * v_stride + d0];
      }
    }
  }
}

constexpr int kMaxRows = 4;

// Asks for the next block's rows while this one is computed: blocks are scattered in memory,
// so the hardware prefetcher cannot guess them (about 10-15 % faster here).
inline void prefetch_rows(const float* first, int64_t stride, int64_t rows, int64_t dim) {
  constexpr int64_t kLineFloats = 64 / sizeof(float);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t d = 0; d < dim; d += kLineFloats) __builtin_prefetch(first + i * stride + d);
  }
}

// Calls fn(std::integral_constant<int, R>{}, first_row) for tiles of at most kMaxRows rows.
template <typename Fn>
inline void for_row_tiles(int64_t rows, Fn&& fn) {
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, rows - r0)) {
      case 1: fn(std::integral_constant<int, 1>{}, r0); break;
      case 2: fn(std::integral_constant<int, 2>{}, r0); break;
      case 3: fn(std::integral_constant<int, 3>{}, r0); break;
      default: fn(std::integral_constant<int, 4>{}, r0); break;
    }
  }
}

// Reusable buffers of one parallel chunk (allocated once per chunk, not per item).
struct Scratch {
  std::vector<float> scores;    // [q_per_kv, context]
  std::vector<float> query;     // [q_per_kv, head_dim], pre-scaled
  std::vector<float> acc;       // [q_per_kv, head_dim]
  std::vector<float> inv_sums;  // [q_per_kv]
};

void attend_one(const Geometry& g, const Strides& s, const float* query, const float* keys,
                const float* values, const int64_t* table, int64_t context, float scale,
                int64_t seq, int64_t kv_head, float* out, Scratch& scratch) {
  const int64_t qn = g.q_per_kv, dim = g.head_dim;
  scratch.scores.resize(static_cast<size_t>(qn * context));
  float* scores = scratch.scores.data();
  float* q = scratch.query.data();
  float* acc = scratch.acc.data();
  for (int64_t r = 0; r < qn; ++r) {
    const float* src = query + seq * s.q_seq + (kv_head * qn + r) * s.q_head;
    for (int64_t d = 0; d < dim; ++d) q[r * dim + d] = src[d] * scale;
  }
  // Pass 1: scores, block by block in place.
  for_row_tiles(qn, [&](auto rows, int64_t r0) {
    for (int64_t t0 = 0, b = 0; t0 < context; t0 += g.block_size, ++b) {
      const float* block = keys + table[b] * s.k_block + kv_head * s.k_head;
      const int64_t n = std::min(g.block_size, context - t0);
      if (t0 + g.block_size < context) {
        prefetch_rows(keys + table[b + 1] * s.k_block + kv_head * s.k_head, s.k_slot,
                      std::min(g.block_size, context - t0 - g.block_size), dim);
      }
      for (int64_t i = 0; i < n; ++i) {
        dot_rows<decltype(rows)::value>(q + r0 * dim, dim, block + i * s.k_slot,
                                        scores + r0 * context + t0 + i, context);
      }
    }
  });
  // Softmax numerators and their sums, per query row.
  float* inv_sums = scratch.inv_sums.data();
  for (int64_t r = 0; r < qn; ++r) {
    float* row = scores + r * context;
    inv_sums[r] = 1.0f / exp_shifted_sum(row, max_of(row, context), context);
  }
  // Pass 2: weighted sum of the values, block by block in place.
  std::fill(acc, acc + qn * dim, 0.0f);
  for_row_tiles(qn, [&](auto rows, int64_t r0) {
    for (int64_t t0 = 0, b = 0; t0 < context; t0 += g.block_size, ++b) {
      const float* block = values + table[b] * s.v_block + kv_head * s.v_head;
      const int64_t n = std::min(g.block_size, context - t0);
      if (t0 + g.block_size < context) {
        prefetch_rows(values + table[b + 1] * s.v_block + kv_head * s.v_head, s.v_slot,
                      std::min(g.block_size, context - t0 - g.block_size), dim);
      }
      weighted_rows<decltype(rows)::value>(scores + r0 * context + t0, context, block,
                                           s.v_slot, n, dim, acc + r0 * dim);
    }
  });
  for (int64_t r = 0; r < qn; ++r) {
    float* dst = out + (seq * g.num_heads + kv_head * qn + r) * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = acc[r * dim + d] * inv_sums[r];
  }
}

void check_inputs(const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& context_lens) {
  for (const at::Tensor* t : {&query, &key_cache, &value_cache, &block_tables, &context_lens}) {
    TORCH_CHECK(t->device().is_cpu(), "paged_decode_attention: every tensor must be on the CPU");
  }
  TORCH_CHECK(query.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kFloat &&
                  value_cache.scalar_type() == at::kFloat,
              "paged_decode_attention: only float32 query and caches are supported, got ",
              query.scalar_type(), ", ", key_cache.scalar_type(), ", ",
              value_cache.scalar_type());
  TORCH_CHECK(query.dim() == 3, "query must be [seqs, heads, head_dim], got ", query.sizes());
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
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == query.size(0),
              "block_tables must be [seqs, max_blocks] with seqs = ", query.size(0), ", got ",
              block_tables.sizes());
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == query.size(0),
              "context_lens must be [seqs] with seqs = ", query.size(0), ", got ",
              context_lens.sizes());
  TORCH_CHECK(!at::isFloatingType(block_tables.scalar_type()) &&
                  !at::isFloatingType(context_lens.scalar_type()),
              "block_tables and context_lens must be integer tensors");
}

// Every block a sequence reads must exist: checked up front, serially (O(blocks read)), so a
// bad table is an error and never an out-of-bounds read.
void check_tables(const Geometry& g, const int64_t* tables, const int64_t* lens) {
  for (int64_t seq = 0; seq < g.num_seqs; ++seq) {
    const int64_t context = lens[seq];
    TORCH_CHECK(context >= 1 && context <= g.max_blocks * g.block_size, "context_lens[", seq,
                "] = ", context, " is outside [1, max_blocks * block_size = ",
                g.max_blocks * g.block_size, "]");
    const int64_t used = (context + g.block_size - 1) / g.block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int64_t block = tables[seq * g.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < g.num_blocks, "block_tables[", seq, "][", b, "] = ",
                  block, " is outside [0, ", g.num_blocks, ")");
    }
  }
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale) {
  check_inputs(query, key_cache, value_cache, block_tables, context_lens);
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = context_lens.to(at::kLong).contiguous();
  Geometry g{};
  g.num_seqs = query.size(0);
  g.num_heads = query.size(1);
  g.num_kv_heads = key_cache.size(2);
  g.q_per_kv = g.num_heads / g.num_kv_heads;
  g.head_dim = query.size(2);
  g.num_blocks = key_cache.size(0);
  g.block_size = key_cache.size(1);
  g.max_blocks = tables.size(1);
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const int64_t* len_data = lens.data_ptr<int64_t>();
  check_tables(g, table_data, len_data);
  const Strides s{query.stride(0),     query.stride(1),     key_cache.stride(0),
                  key_cache.stride(1), key_cache.stride(2), value_cache.stride(0),
                  value_cache.stride(1), value_cache.stride(2)};
  at::Tensor out = at::empty({g.num_seqs, g.num_heads, g.head_dim}, query.options());
  const float* q = query.data_ptr<float>();
  const float* k = key_cache.data_ptr<float>();
  const float* v = value_cache.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t items = g.num_seqs * g.num_kv_heads;
  // A chunk should hold enough work (~8k query-key pairs, tens of microseconds) to pay for
  // waking another thread; smaller calls run on the calling thread alone.
  int64_t total_keys = 0;
  for (int64_t seq = 0; seq < g.num_seqs; ++seq) total_keys += len_data[seq];
  const int64_t pairs_per_item = std::max<int64_t>(1, total_keys * g.q_per_kv / g.num_seqs);
  const int64_t grain = std::max<int64_t>(1, 8192 / pairs_per_item);
  const float scale_f = static_cast<float>(scale);
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    scratch.query.resize(static_cast<size_t>(g.q_per_kv * g.head_dim));
    scratch.acc.resize(static_cast<size_t>(g.q_per_kv * g.head_dim));
    scratch.inv_sums.resize(static_cast<size_t>(g.q_per_kv));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / g.num_kv_heads, kv_head = item % g.num_kv_heads;
      attend_one(g, s, q, k, v, table_data + seq * g.max_blocks, len_data[seq], scale_f, seq,
                 kv_head, o, scratch);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache read in place (float32, CPU)",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"));
}
