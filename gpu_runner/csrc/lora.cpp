// LoRA on the CPU: one call per fused projection and layer adds every adapter group's
// product to the projection's output, in float32.
//
// torch needs two small matmuls per group and projection (plus an index_add_ when a group's
// rows are not contiguous): with 8 adapters over a 32-row decode batch that was ~2,000 calls
// per forward, and the block-diagonal layout of q/k/v (gpu_runner/lora/slots.py) made the
// expansion multiply zeros for two parts in three. Here each group reads its slot's lora_A
// rows once for all of its rows (the shrink, xa = x @ A.T), then each part's lora_B rows once
// per 64-column tile, only in that part's columns (the expand, y += xa @ B.T).
// Plain loops over 16-lane vectors (-O3 -march=native); no -ffast-math.
#include "lora.h"

#include "lanes.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using namespace pagewire::lanes;
constexpr int64_t kTileVecs = 4;
constexpr int64_t kTile = kTileVecs * kLanes;  // output columns per expand work item
// Multiply-adds per parallel chunk, at least: a decode row's few thousand are not worth waking
// a thread for (a forward makes 4 calls per layer).
constexpr int64_t kMinChunkMacs = 32768;

int64_t grain(int64_t macs_per_item) {
  return std::max<int64_t>(1, kMinChunkMacs / std::max<int64_t>(1, macs_per_item));
}

float sum_lanes(Vec v) {
  float lanes[kLanes];
  store(lanes, v);
  float total = 0.0f;
  for (int64_t i = 0; i < kLanes; ++i) total += lanes[i];
  return total;
}

float dot(const float* a, const float* b, int64_t n) {
  Vec even{}, odd{};
  int64_t k = 0;
  for (; k + 2 * kLanes <= n; k += 2 * kLanes) {
    even += load(a + k) * load(b + k);
    odd += load(a + k + kLanes) * load(b + k + kLanes);
  }
  for (; k + kLanes <= n; k += kLanes) even += load(a + k) * load(b + k);
  float total = sum_lanes(even + odd);
  for (; k < n; ++k) total += a[k] * b[k];
  return total;
}

// Dot products of kRowBlock consecutive rows of `a` (row stride `n`) with one x row: x is
// read once for all of them.
constexpr int64_t kRowBlock = 4;

void dot_rows(const float* a, const float* x, int64_t n, int64_t rows, float* out) {
  if (rows < kRowBlock) {
    for (int64_t r = 0; r < rows; ++r) out[r] = dot(a + r * n, x, n);
    return;
  }
  Vec acc[kRowBlock] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    const Vec xv = load(x + k);
    for (int64_t r = 0; r < kRowBlock; ++r) acc[r] += load(a + r * n + k) * xv;
  }
  for (int64_t r = 0; r < kRowBlock; ++r) {
    float total = sum_lanes(acc[r]);
    for (int64_t j = k; j < n; ++j) total += a[r * n + j] * x[j];
    out[r] = total;
  }
}

struct Tile {
  int64_t group, part_row, rank, col, width;
};

void check_float(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == dims, name,
              " must be a ", dims, "-d float32 CPU tensor, got ", t.scalar_type(), " ",
              t.sizes());
  TORCH_CHECK(t.stride(dims - 1) == 1, name, " must have contiguous rows");
}

void check_ints(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(), name,
              " must be a contiguous int64 CPU tensor");
}

}  // namespace

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              const at::Tensor& rows, const at::Tensor& group_starts,
              const at::Tensor& group_slots, const at::Tensor& part_rows,
              const at::Tensor& ranks, const at::Tensor& part_offsets) {
  check_float(y, "y", 2);
  check_float(x, "x", 2);
  check_float(a, "a", 3);
  check_float(bt, "bt", 3);
  TORCH_CHECK(a.is_contiguous() && bt.is_contiguous(), "a and bt must be contiguous");
  for (const auto* t : {&rows, &group_starts, &group_slots, &part_rows, &ranks, &part_offsets})
    check_ints(*t, "an index tensor");
  const int64_t in = x.size(1), out = y.size(1), slot_rows = a.size(1);
  const int64_t groups = group_slots.size(0), parts = part_rows.size(1);
  TORCH_CHECK(a.size(2) == in && bt.size(2) == out && bt.size(1) == slot_rows &&
                  bt.size(0) == a.size(0) && x.size(0) == y.size(0),
              "shapes do not agree: x ", x.sizes(), " y ", y.sizes(), " a ", a.sizes(), " bt ",
              bt.sizes());
  TORCH_CHECK(group_starts.size(0) == groups + 1 && part_offsets.size(0) == parts + 1 &&
                  part_rows.size(0) == a.size(0) && ranks.size(0) == a.size(0),
              "index tensors do not agree");
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* start = group_starts.data_ptr<int64_t>();
  const int64_t* slot_of = group_slots.data_ptr<int64_t>();
  const int64_t* first_row = part_rows.data_ptr<int64_t>();
  const int64_t* rank_of = ranks.data_ptr<int64_t>();
  const int64_t* offset = part_offsets.data_ptr<int64_t>();
  const int64_t members = start[groups];
  TORCH_CHECK(rows.size(0) == members, "rows has ", rows.size(0), " entries, expected ",
              members);
  for (int64_t i = 0; i < members; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < y.size(0), "row ", row[i], " out of range");

  // Shrink work: (group, block of kRowBlock lora_A rows), over the used rows of each
  // group's slot.
  std::vector<int64_t> shrink_start(groups + 1, 0), used_rows(groups, 0);
  std::vector<Tile> tiles;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t slot = slot_of[g], rank = rank_of[slot];
    TORCH_CHECK(slot >= 0 && slot < a.size(0), "slot ", slot, " out of range");
    int64_t used = 0;
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t part_row = first_row[slot * parts + p];
      if (part_row < 0) continue;
      TORCH_CHECK(part_row + rank <= slot_rows, "part rows out of range");
      used = std::max(used, part_row + rank);
      for (int64_t col = offset[p]; col < offset[p + 1]; col += kTile)
        tiles.push_back({g, part_row, rank, col, std::min(kTile, offset[p + 1] - col)});
    }
    used_rows[g] = used;
    shrink_start[g + 1] = shrink_start[g] + (used + kRowBlock - 1) / kRowBlock;
  }
  TORCH_CHECK(offset[parts] == out, "part offsets end at ", offset[parts], ", not ", out);
  std::vector<float> xa(members * slot_rows);  // [member row, slot row]

  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = bt.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);
  const int64_t members_per_group = std::max<int64_t>(1, members / std::max<int64_t>(1, groups));
  const int64_t max_rank = *std::max_element(rank_of, rank_of + a.size(0));
  at::parallel_for(0, shrink_start[groups], grain(members_per_group * in * kRowBlock),
                   [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = std::upper_bound(shrink_start.begin(), shrink_start.end(), item) -
                        shrink_start.begin() - 1;
      const int64_t i = (item - shrink_start[g]) * kRowBlock;
      const int64_t count = std::min(kRowBlock, used_rows[g] - i);
      const float* a_rows = ap + (slot_of[g] * slot_rows + i) * in;
      for (int64_t m = start[g]; m < start[g + 1]; ++m)
        dot_rows(a_rows, xp + row[m] * x_stride, in, count, xa.data() + m * slot_rows + i);
    }
  });
  at::parallel_for(0, static_cast<int64_t>(tiles.size()),
                   grain(members_per_group * std::max<int64_t>(1, max_rank) * kTile),
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const Tile& tile = tiles[t];
      const float* b_rows = bp + (slot_of[tile.group] * slot_rows + tile.part_row) * out;
      const int64_t vecs = tile.width / kLanes;
      for (int64_t m = start[tile.group]; m < start[tile.group + 1]; ++m) {
        float* y_row = yp + row[m] * y_stride + tile.col;
        const float* xa_row = xa.data() + m * slot_rows + tile.part_row;
        Vec acc[kTileVecs];
        for (int64_t v = 0; v < vecs; ++v) acc[v] = load(y_row + v * kLanes);
        for (int64_t j = 0; j < tile.rank; ++j) {
          const float s = xa_row[j];
          const float* b = b_rows + j * out + tile.col;
          for (int64_t v = 0; v < vecs; ++v) acc[v] += s * load(b + v * kLanes);
        }
        for (int64_t v = 0; v < vecs; ++v) store(y_row + v * kLanes, acc[v]);
        for (int64_t c = vecs * kLanes; c < tile.width; ++c) {
          float total = y_row[c];
          for (int64_t j = 0; j < tile.rank; ++j) total += xa_row[j] * b_rows[j * out + tile.col + c];
          y_row[c] = total;
        }
      }
    }
  });
}
