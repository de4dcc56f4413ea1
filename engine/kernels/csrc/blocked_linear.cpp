// y = epilogue(x @ weight.T + bias) in bf16 for 1 to 64 rows, on AVX-512 BF16's dot product,
// from a weight laid out for it once at load (engine/model/packed_linear.py panels):
//
//     panels [P, K/2, 32, 2]: panel p holds output features 32p .. 32p+31 (zero past N),
//     k-pair by k-pair, so one 64-byte load is 16 features' products for two k.
//
// Why: at the rows a decode step runs (1 to 64 sequences) oneDNN's bf16 product streams its
// packed weight slower than it does on many rows; this one, a 12-row by 32-feature register
// tile over a panel, each thread streaming its own run of panels, is faster there and as
// fast as our one-dot-per-feature kernel on one to three rows. Accumulation is in fp32, as
// oneDNN's; rounding to bf16 is round-to-nearest-even.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include "gelu.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace rayinfer {

constexpr int64_t kPanel = 32;     // output features a panel: two 16-lane vectors
constexpr int64_t kTileRows = 12;  // 12 x 2 accumulators, 2 weight vectors, a broadcast: 27 registers

#if defined(CPU_CAPABILITY_AVX512)
#define RAYINFER_BF16 __attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f")))

bool has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

namespace {

struct Tail {
  const at::BFloat16* bias;  // [N] or null
  int kind;                  // 0 none, 1 gelu (tanh), 2 add `other`
  const at::BFloat16* other; // [M, N] for add
  int64_t n;                 // features
};

RAYINFER_BF16 inline __m512 load_bf16(const at::BFloat16* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

RAYINFER_BF16 inline __m512 gelu(__m512 y) { return gelu_tanh(at::vec::Vectorized<float>(y)); }

// Rows [0, MR) of x (row stride k2 pairs) against one panel: y's features [n0, n0 + 32).
template <int MR>
RAYINFER_BF16 void tile(const uint32_t* x, const __m512i* panel, int64_t k2, at::BFloat16* y, int64_t row0,
                        int64_t n0, const Tail& t) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k2; ++k) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + 2 * k), w1 = (__m512bh)_mm512_loadu_si512(panel + 2 * k + 1);
    for (int m = 0; m < MR; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * k2 + k]));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, w1);
    }
  }
  for (int z = 0; z < 2; ++z) {
    const int64_t n = n0 + 16 * z;
    if (n >= t.n) break;
    const __mmask16 mask = t.n - n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (t.n - n)) - 1);
    const __m512 bias = t.bias ? load_bf16(t.bias + n, mask) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      __m512 v = _mm512_add_ps(acc[m][z], bias);
      if (t.kind == 1) v = gelu(v);
      else if (t.kind == 2) v = _mm512_add_ps(v, load_bf16(t.other + (row0 + m) * t.n + n, mask));
      _mm256_mask_storeu_epi16(y + (row0 + m) * t.n + n, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

template <int MR>
RAYINFER_BF16 void tile_rows(const uint32_t* x, const __m512i* panel, int64_t k2, at::BFloat16* y, int64_t row0,
                             int64_t rows, int64_t n0, const Tail& t) {
  if constexpr (MR > 1) {
    if (rows < MR) return tile_rows<MR - 1>(x, panel, k2, y, row0, rows, n0, t);
  }
  tile<MR>(x, panel, k2, y, row0, n0, t);
}

}  // namespace

// x [M, K] contiguous bf16 with K even, panels as above; kind as Tail's.
at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, const at::BFloat16* bias,
                          int kind, const at::BFloat16* other) {
  TORCH_CHECK(has_bf16_dot(), "linear: weights in panels need AVX-512 BF16, which this CPU lacks");
  // Read below as raw 64-byte vectors: bf16, dense, in the shape the loops walk.
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  panels.is_contiguous(), "linear: bf16 panels need contiguous bf16 x and panels");
  const int64_t k = x.size(-1), k2 = k / 2, num_panels = panels.size(0);
  TORCH_CHECK(k > 0 && k % 2 == 0, "linear: bf16 panels take an even number of inputs, got ", k);
  const int64_t rows = x.numel() / k;
  TORCH_CHECK(panels.dim() == 4 && panels.size(1) == k2 && panels.size(2) == kPanel && panels.size(3) == 2 &&
                  num_panels * kPanel >= n, "linear: panels ", panels.sizes(), " for another shape than [", n, ", ", k, "]");
  auto shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  const auto* xp = static_cast<const uint32_t*>(x.const_data_ptr());
  const auto* wp = static_cast<const __m512i*>(panels.const_data_ptr());
  auto* yp = y.data_ptr<at::BFloat16>();
  const Tail t{bias, kind, other, n};
  at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t row0 = 0; row0 < rows; row0 += kTileRows) {
        tile_rows<kTileRows>(xp + row0 * k2, wp + p * k2 * 2, k2, yp, row0, std::min(kTileRows, rows - row0), p * kPanel, t);
      }
    }
  });
  return y;
}
#else
at::Tensor blocked_linear(const at::Tensor&, const at::Tensor&, int64_t, const at::BFloat16*, int, const at::BFloat16*) {
  TORCH_CHECK(false, "linear: weights in panels need kernels built for AVX-512 BF16");
}
#endif

}  // namespace rayinfer
