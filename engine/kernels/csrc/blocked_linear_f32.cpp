// y = epilogue(x @ weight.T + bias) in fp32 for 1 to 64 rows, from a weight laid out for it once
// at load (engine/model/packed_linear.py panels):
//
//     panels [P, K, 2L]: panel p holds output features 2Lp .. 2Lp+2L-1 (zero past N), L the
//     build's fp32 lanes (8 on AVX2), input by input, so two vector loads are one input's
//     weights for the panel's features.
//
// Why: on AVX2 oneDNN's fp32 product runs well below its many-row rate at these rows: the
// rows of a short prompt's prefill, of a few streams' decodes and of the compiled graph's
// mixed steps. A 6-row by 2L-feature register
// tile over a panel (12 accumulators, 2 weight vectors and a broadcast: 15 of AVX2's 16
// registers), each thread streaming its own run of panels, re-reads a panel from cache for
// each tile of rows and the weights from memory once; each tile prefetches the next panel as
// it reads its own, so that the panel's first tile of rows does not wait on memory alone.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include "gelu.h"

namespace rayinfer {

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr int kF32TileRows = 6;

struct F32Tail {
  const float* bias;   // [N] or null
  int kind;            // 0 none, 1 gelu (tanh), 2 add `other`
  const float* other;  // [M, N] for add
  int64_t n;           // features
};

// y[m, n .. n + L) from its accumulator, where n is a feature.
inline void finish(Vec v, float* y, int64_t m, int64_t n, const F32Tail& t) {
  if (n >= t.n) return;
  const int count = static_cast<int>(std::min<int64_t>(kLanes, t.n - n));
  if (t.bias) v = v + Vec::loadu(t.bias + n, count);
  if (t.kind == 1) v = gelu_tanh(v);
  else if (t.kind == 2) v = v + Vec::loadu(t.other + m * t.n + n, count);
  v.store(y + m * t.n + n, count);
}

// Rows [row0, row0 + MR) of x against one panel: y's features [n0, n0 + 2L). Every loop over
// the tile is unrolled, so that the accumulators stay in registers (indexed by a variable
// anywhere, the compiler keeps them in memory, and stores each at every input).
template <int MR>
void tile(const float* x, const float* panel, const float* next, int64_t k_dim, float* y, int64_t row0, int64_t n0,
          const F32Tail& t) {
  Vec acc[MR][2];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = Vec(0.f);
  const float* xr = x + row0 * k_dim;
  for (int64_t k = 0; k < k_dim; ++k) {
    const Vec w0 = Vec::loadu(panel + 2 * kLanes * k), w1 = Vec::loadu(panel + 2 * kLanes * k + kLanes);
    __builtin_prefetch(next + 2 * kLanes * k);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const Vec a(xr[m * k_dim + k]);
      acc[m][0] = at::vec::fmadd(a, w0, acc[m][0]);
      acc[m][1] = at::vec::fmadd(a, w1, acc[m][1]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    finish(acc[m][0], y, row0 + m, n0, t);
    finish(acc[m][1], y, row0 + m, n0 + kLanes, t);
  }
}

template <int MR>
void tile_rows(const float* x, const float* panel, const float* next, int64_t k_dim, float* y, int64_t row0,
               int64_t rows, int64_t n0, const F32Tail& t) {
  if constexpr (MR > 1) {
    if (rows < MR) return tile_rows<MR - 1>(x, panel, next, k_dim, y, row0, rows, n0, t);
  }
  tile<MR>(x, panel, next, k_dim, y, row0, n0, t);
}

}  // namespace

// x [M, K] contiguous fp32, panels as above; kind as F32Tail's.
at::Tensor blocked_linear_f32(const at::Tensor& x, const at::Tensor& panels, int64_t n, const float* bias, int kind,
                              const float* other) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat && x.is_contiguous() &&
                  panels.is_contiguous(), "linear: fp32 panels need contiguous fp32 x and panels");
  const int64_t k_dim = x.size(-1), num_panels = panels.size(0);
  TORCH_CHECK(k_dim > 0, "linear: x has no inputs");
  const int64_t rows = x.numel() / k_dim;
  TORCH_CHECK(panels.dim() == 3 && panels.size(1) == k_dim && panels.size(2) == 2 * kLanes &&
                  num_panels * 2 * kLanes >= n,
              "linear: fp32 panels ", panels.sizes(), " for another shape or vector width than [", n, ", ", k_dim, "]");
  auto shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* wp = panels.const_data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const F32Tail t{bias, kind, other, n};
  // The rows in as few tiles as fit, as even as can be (16: 6, 5, 5, not 6, 6, 4): a tile's
  // pass over a panel costs its FMAs, and a short tile's too few to hide their latency.
  const int64_t num_tiles = (rows + kF32TileRows - 1) / kF32TileRows, base = rows / num_tiles, extra = rows % num_tiles;
  at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float* panel = wp + p * k_dim * 2 * kLanes;
      const float* next = p + 1 < num_panels ? panel + k_dim * 2 * kLanes : panel;
      for (int64_t i = 0, row0 = 0; i < num_tiles; ++i) {
        const int64_t tile_rows_i = base + (i < extra);
        tile_rows<kF32TileRows>(xp, panel, next, k_dim, yp, row0, tile_rows_i, p * 2 * kLanes, t);
        row0 += tile_rows_i;
      }
    }
  });
  return y;
}

}  // namespace rayinfer
