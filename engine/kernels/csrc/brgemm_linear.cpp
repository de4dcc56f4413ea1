// y = epilogue(x @ weight.T + bias) in bf16 for 1 to 64 rows on oneDNN's batch-reduce GEMM
// ukernel (ATen's at::native::cpublas::brgemm), from the same weight panels blocked_linear.cpp
// reads (engine/model/packed_linear.py panels):
//
//     panels [P, K/2, 32, 2]: panel p holds output features 32p .. 32p+31 (zero past N),
//     k-pair by k-pair: oneDNN's VNNI layout for bf16, a block of 32 columns with ld_b 32.
//
// Why: oneDNN's ukernel runs on AMX tiles where the CPU has them, and on avx512_core(_bf16)
// kernels elsewhere: a small step's product on AMX without a second copy of the weights.
// Whether it is faster than ours or oneDNN's full product is measured (engine/core/tuner.py).
//
// ATen packs for brgemm (cpublas::pack) only on AMX CPUs, and raises elsewhere; our panels
// are already VNNI, so no pack is needed. cpublas::brgemm raises where oneDNN's ISA is below
// avx512_core (an AVX2 CPU, or ONEDNN_MAX_CPU_ISA=AVX2): brgemm_runs() probes that once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "gelu.h"

namespace rayinfer {
namespace brgemm_linear_impl {
namespace {

constexpr int64_t kBlock = 32;    // output features a panel, blocked_linear.cpp's kPanel
constexpr int64_t kMaxRows = 64;  // small_linear.cpp's kMaxBlockedRows

struct Tail {
  const at::BFloat16* bias;   // [N] or null
  int kind;                   // 0 none, 1 gelu (tanh), 2 add `other`
  const at::BFloat16* other;  // [M, N] for add
  int64_t n;                  // features
};

using Vec = at::vec::Vectorized<float>;
using BVec = at::vec::Vectorized<at::BFloat16>;

// Features [n0, n0 + width) of row m from its fp32 accumulators c (width <= kBlock).
void finish_row(const float* c, int64_t m, int64_t n0, int64_t width, const Tail& t, at::BFloat16* y) {
  const int64_t lanes = Vec::size();
  for (int64_t j = 0; j < width; j += lanes) {
    const int64_t count = std::min(lanes, width - j), n = n0 + j;
    Vec v = Vec::loadu(c + j, count);
    if (t.bias) v = v + at::vec::convert<float>(BVec::loadu(t.bias + n, count));
    if (t.kind == 1) v = gelu_tanh(v);
    else if (t.kind == 2) v = v + at::vec::convert<float>(BVec::loadu(t.other + m * t.n + n, count));
    at::vec::convert_float_bfloat16(v, v).store(y + m * t.n + n, count);
  }
}

// Panels [p0, p1) for every row: one brgemm a panel into c, then the epilogue.
void panels_run(const at::BFloat16* x, const at::BFloat16* w, int64_t rows, int64_t k, int64_t p0, int64_t p1,
                const Tail& t, at::BFloat16* y) {
  alignas(64) float c[kMaxRows * kBlock];
  for (int64_t p = p0; p < p1; ++p) {
    at::native::cpublas::brgemm(rows, kBlock, k, k, kBlock, kBlock, false, x, w + p * k * kBlock, c, true);
    const int64_t n0 = p * kBlock, width = std::min(kBlock, t.n - n0);
    for (int64_t m = 0; m < rows; ++m) finish_row(c + m * kBlock, m, n0, width, t, y);
  }
  at::native::cpublas::brgemm_release(true);  // the AMX tile state this thread configured
}

bool probe() {
  try {
    // One row, two inputs, one panel: raises where oneDNN's ukernel does not run bf16 here.
    at::BFloat16 a[2] = {1.f, 1.f}, b[2 * kBlock] = {};
    float c[kBlock];
    at::native::cpublas::brgemm(1, kBlock, 2, 2, kBlock, kBlock, false, a, b, c, true);
    at::native::cpublas::brgemm_release(true);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace
}  // namespace brgemm_linear_impl

bool brgemm_runs() {
  static const bool runs = brgemm_linear_impl::probe();
  return runs;
}

// x [M, K] contiguous bf16 with K even and M <= 64, panels as above; kind as Tail's.
at::Tensor brgemm_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, const at::BFloat16* bias, int kind,
                         const at::BFloat16* other) {
  namespace impl = brgemm_linear_impl;
  TORCH_CHECK(brgemm_runs(), "linear: oneDNN's brgemm does not run bf16 on this CPU (it needs avx512_core)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  panels.is_contiguous(), "linear: brgemm needs contiguous bf16 x and panels");
  const int64_t k = x.size(-1), num_panels = panels.size(0);
  TORCH_CHECK(k > 0 && k % 2 == 0, "linear: bf16 panels take an even number of inputs, got ", k);
  const int64_t rows = x.numel() / k;
  TORCH_CHECK(rows >= 1 && rows <= impl::kMaxRows, "linear: brgemm takes 1 to ", impl::kMaxRows, " rows, got ", rows);
  TORCH_CHECK(panels.dim() == 4 && panels.size(1) == k / 2 && panels.size(2) == impl::kBlock && panels.size(3) == 2 &&
                  num_panels * impl::kBlock >= n, "linear: panels ", panels.sizes(), " for another shape than [", n, ", ", k, "]");
  auto shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  const impl::Tail t{bias, kind, other, n};
  const auto* xp = x.const_data_ptr<at::BFloat16>();
  const auto* wp = panels.const_data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) { impl::panels_run(xp, wp, rows, k, p0, p1, t, yp); });
  return y;
}

}  // namespace rayinfer

// No tensor to dispatch on: registered with its implementation, for every backend.
TORCH_LIBRARY_FRAGMENT(rayinfer, m) { m.def("brgemm_available() -> bool", &rayinfer::brgemm_runs); }
