// A prefill chunk's rows against their cached tokens and, causally, each other, one head at a
// time: the path decode_attention.cpp takes for chunks of kMinChunkRows rows or more.
//
// Why: the per-row kernel reduces each key's dot product across a vector's lanes, n * L
// reductions for a chunk of n rows over L keys, a large share of a long prompt's prefill.
// A chunk's rows share their keys, so here the chunk's keys are laid out once per head dimension by dimension,
// kGroup to a group, and a tile of rows takes a group's scores as broadcast multiply-adds
// with no reduction; each value is then read once for the tile's rows.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "paged_keys.h"

namespace rayinfer::attention {
namespace {

constexpr int64_t kMinChunkRows = 16;
// A group's keys are two vectors' lanes (32 on AVX-512, 16 on AVX2), so that each broadcast
// of a query's element feeds two multiply-adds; a tile's rows fill 16 of AVX-512's 32
// registers with accumulators, 8 of AVX2's 16.
constexpr int kGroupVecs = 2;
constexpr int64_t kGroup = kGroupVecs * Vec::size();
constexpr int kTileRows = Vec::size() >= 16 ? 8 : 4;

// One (chunk, head)'s working set in float32: keys [groups][D][kGroup], dimension by
// dimension and zero past the last key; values [keys][D]; a tile's scaled queries [rows][D]
// and its scores, then probabilities, [rows][keys rounded up to kGroup].
struct ChunkScratch {
  std::vector<float> keys, values, queries, scores;

  void fit(int64_t padded_keys, int64_t head_dim) {
    keys.resize(padded_keys * head_dim);
    values.resize(padded_keys * head_dim);
    queries.resize(kTileRows * head_dim);
    scores.resize(kTileRows * padded_keys);
  }
};

template <typename T>
void stage(const Task<T>& task, int64_t num_keys, int64_t head_dim, ChunkScratch& scratch) {
  const int64_t last_group = (num_keys - 1) / kGroup;
  std::fill(scratch.keys.begin() + last_group * head_dim * kGroup, scratch.keys.begin() + (last_group + 1) * head_dim * kGroup, 0.f);
  for (int64_t t = 0; t < num_keys; ++t) {
    const bool cached = t < task.cached;
    const T* key = cached ? task.key(t) : task.fresh_key(t - task.cached);
    const T* value = cached ? task.value(t) : task.fresh_value(t - task.cached);
    float* column = scratch.keys.data() + (t / kGroup) * head_dim * kGroup + t % kGroup;
    for (int64_t d = 0; d < head_dim; ++d) column[d * kGroup] = static_cast<float>(key[d]);
    for (int64_t d = 0; d < head_dim; d += Vec::size()) load(value + d).store(scratch.values.data() + t * head_dim + d);
  }
}

// scores[r][g * kGroup ..) = queries[r] . each key of groups g < num_groups, for the tile's rows.
template <int R>
void tile_scores(const float* queries, const float* keys, int64_t num_groups, int64_t head_dim, float* scores,
                 int64_t stride) {
  for (int64_t g = 0; g < num_groups; ++g) {
    const float* group = keys + g * head_dim * kGroup;
    Vec acc[R][kGroupVecs];
    for (auto& row : acc) std::fill(row, row + kGroupVecs, Vec(0.f));
    for (int64_t d = 0; d < head_dim; ++d) {
      Vec key[kGroupVecs];
      for (int v = 0; v < kGroupVecs; ++v) key[v] = Vec::loadu(group + d * kGroup + v * Vec::size());
      for (int r = 0; r < R; ++r) {
        const Vec query(queries[r * head_dim + d]);
        for (int v = 0; v < kGroupVecs; ++v) acc[r][v] = at::vec::fmadd(query, key[v], acc[r][v]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < kGroupVecs; ++v) acc[r][v].store(scores + r * stride + g * kGroup + v * Vec::size());
    }
  }
}

// out[r][slice ..) = sum over keys t < num_keys of probs[r][t] * values[t][slice ..) / totals[r],
// for rows r < rows, V vectors of head dims a slice.
template <int R, int V, typename T>
void weigh_slices(const float* values, const float* probs, int64_t stride, int64_t num_keys, int64_t head_dim,
                  const float* totals, int64_t rows, T* out, int64_t out_row) {
  for (int64_t slice = 0; slice < head_dim; slice += V * Vec::size()) {
    Vec acc[R][V];
    for (auto& row : acc) std::fill(row, row + V, Vec(0.f));
    for (int64_t t = 0; t < num_keys; ++t) {
      Vec value[V];
      for (int v = 0; v < V; ++v) value[v] = Vec::loadu(values + t * head_dim + slice + v * Vec::size());
      for (int r = 0; r < R; ++r) {
        const Vec p(probs[r * stride + t]);
        for (int v = 0; v < V; ++v) acc[r][v] = at::vec::fmadd(p, value[v], acc[r][v]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float row[V * Vec::size()];
      for (int v = 0; v < V; ++v) (acc[r][v] * Vec(1.f / totals[r])).store(row + v * Vec::size());
      std::copy(row, row + V * Vec::size(), out + r * out_row + slice);
    }
  }
}

// Head dims two vectors a slice where they divide (GPT-2's 64 on either ISA), else one.
template <int R, typename T>
void weigh_tile(const float* values, const float* probs, int64_t stride, int64_t num_keys, int64_t head_dim,
                const float* totals, int64_t rows, T* out, int64_t out_row) {
  if (head_dim % (2 * Vec::size()) == 0) {
    weigh_slices<R, 2>(values, probs, stride, num_keys, head_dim, totals, rows, out, out_row);
  } else {
    weigh_slices<R, 1>(values, probs, stride, num_keys, head_dim, totals, rows, out, out_row);
  }
}

inline float max_of(const float* x, int64_t n) {
  Vec lanes(-INFINITY);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) lanes = at::vec::maximum(lanes, Vec::loadu(x + i));
  float best = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, lanes);
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}

// Rows [i0, i0 + kTileRows) of the chunk (those below `rows`), given the staged keys and values.
template <typename T>
void attend_tile(const Task<T>& task, int64_t i0, int64_t rows, int64_t query_row, float scale, int64_t head_dim,
                 ChunkScratch& scratch, int64_t stride, T* out, int64_t out_row) {
  float* queries = scratch.queries.data();
  for (int64_t r = 0; r < kTileRows; ++r) {
    for (int64_t d = 0; d < head_dim; ++d) {
      queries[r * head_dim + d] = r < rows ? static_cast<float>(task.query[(i0 + r) * query_row + d]) * scale : 0.f;
    }
  }
  const int64_t seen = task.cached + i0 + rows;  // the keys the tile's last row attends to
  float* scores = scratch.scores.data();
  tile_scores<kTileRows>(queries, scratch.keys.data(), (seen + kGroup - 1) / kGroup, head_dim, scores, stride);
  float totals[kTileRows];
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * stride;
    const int64_t own = task.cached + i0 + r + 1;  // causal: up to the row's own key
    std::fill(row + own, row + seen, -INFINITY);
    totals[r] = exp_normalised(row, seen, max_of(row, own));
  }
  weigh_tile<kTileRows>(scratch.values.data(), scores, stride, seen, head_dim, totals, rows, out + i0 * out_row, out_row);
}

// A chunk of `rows` rows for one head: task is its first row's, whose query is row 0 and whose
// fresh keys are the chunk's; the rows' queries and outputs are query_row and out_row apart.
template <typename T>
void attend_chunk(const Task<T>& task, int64_t rows, int64_t query_row, float scale, int64_t head_dim, T* out,
                  int64_t out_row, ChunkScratch& scratch) {
  const int64_t num_keys = task.cached + rows, stride = round_up(num_keys, kGroup);
  scratch.fit(stride, head_dim);
  stage(task, num_keys, head_dim, scratch);
  for (int64_t i0 = 0; i0 < rows; i0 += kTileRows) {
    attend_tile(task, i0, std::min<int64_t>(kTileRows, rows - i0), query_row, scale, head_dim, scratch, stride, out, out_row);
  }
}

}  // namespace
}  // namespace rayinfer::attention
