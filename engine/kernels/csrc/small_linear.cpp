// y = epilogue(x @ weight.T + bias) for a prepacked linear (engine/model/packed_linear.py): where
// its weight is in bf16 panels, 1 to 64 rows on blocked_linear.cpp's kernel (or, past
// max_rows and up to brgemm_rows, oneDNN's brgemm ukernel: brgemm_linear.cpp); in fp32 panels,
// 1 to 64 rows on blocked_linear_f32.cpp's; where it is plain,
// up to three rows on a pass over it of our own; for more, oneDNN's product on the packed one.
// The epilogues are those inductor fuses into oneDNN's linears in the decode graph, which it
// cannot see through this op: "none", "gelu" (tanh-approximated, GPT-2's) and "add" (y +
// other, the residual).
//
// Why: a decode step of one sequence (padded to two rows by the decode graph) reads every
// weight once, and its time is that read. oneDNN's kernels for so few rows stream the weights
// well below the memory bandwidth; one dot product per output, its rows split across torch's
// threads, streams them near it.
//
// The plain pass (fp32, and bf16 on CPUs without AVX-512 BF16) runs on ATen's vector types
// for the build's ISA, accumulating in fp32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <cmath>
#include <torch/library.h>

#include "input_checks.h"

namespace rayinfer {
at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, const at::BFloat16* bias,
                          int kind, const at::BFloat16* other);
at::Tensor blocked_linear_f32(const at::Tensor& x, const at::Tensor& panels, int64_t n, const float* bias, int kind,
                              const float* other);
at::Tensor brgemm_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, const at::BFloat16* bias, int kind,
                         const at::BFloat16* other);
// Past it oneDNN's product is as fast.
constexpr int64_t kMaxBlockedRows = 64;
}  // namespace rayinfer

namespace rayinfer::small_linear {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kGrain = 16;  // output features per task: each task streams kGrain weight rows

struct Epilogue {
  enum Kind { kNone, kGelu, kAdd } kind;
  const void* other;  // kAdd: [rows, N], the linear's output dtype
};

template <typename T>
inline T finish(float acc, const T* bias, const Epilogue& e, int64_t m, int64_t n, int64_t N) {
  float y = acc + (bias ? float(bias[n]) : 0.f);
  if (e.kind == Epilogue::kGelu) {
    constexpr float kAlpha = 0.7978845608028654f;  // sqrt(2 / pi)
    y = 0.5f * y * (1.f + std::tanh(kAlpha * (y + 0.044715f * y * y * y)));
  } else if (e.kind == Epilogue::kAdd) {
    y += float(static_cast<const T*>(e.other)[m * N + n]);
  }
  return T(y);
}

inline float reduce_add(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// Output features [n0, n1) of every row, for any dtype ATen's vectors convert to float.
template <typename T, int64_t M>
void rows_vec(const T* x, const T* w, const T* bias, const Epilogue& e, T* y, int64_t K, int64_t N, int64_t n0,
              int64_t n1) {
  const int64_t step = Vec::size();
  for (int64_t n = n0; n < n1; ++n) {
    const T* wr = w + n * K;
    Vec acc[M];
    for (int64_t m = 0; m < M; ++m) acc[m] = Vec(0.f);
    int64_t k = 0;
    for (; k + step <= K; k += step) {
      Vec wv = at::vec::convert<float>(at::vec::Vectorized<T>::loadu(wr + k, step));
      for (int64_t m = 0; m < M; ++m)
        acc[m] = at::vec::fmadd(wv, at::vec::convert<float>(at::vec::Vectorized<T>::loadu(x + m * K + k, step)), acc[m]);
    }
    for (int64_t m = 0; m < M; ++m) {
      float sum = reduce_add(acc[m]);
      for (int64_t kk = k; kk < K; ++kk) sum += float(wr[kk]) * float(x[m * K + kk]);
      y[m * N + n] = finish(sum, bias, e, m, n, N);
    }
  }
}

template <typename T>
at::Tensor few_rows(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                    Epilogue e) {
  const int64_t K = weight.size(1), N = weight.size(0), M = x.numel() / K;
  auto shape = x.sizes().vec();
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  const T* bp = bias && bias->defined() ? bias->const_data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    if (M == 1) rows_vec<T, 1>(xp, wp, bp, e, yp, K, N, n0, n1);
    else if (M == 2) rows_vec<T, 2>(xp, wp, bp, e, yp, K, N, n0, n1);
    else rows_vec<T, 3>(xp, wp, bp, e, yp, K, N, n0, n1);
  });
  return y;
}

using Pointwise = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                             c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>);
using Binary = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                          c10::string_view);

// The most rows our kernel takes: past them oneDNN's product is as fast or faster; for fp32
// on AVX-512 that is from three rows on.
int64_t plain_rows(at::ScalarType dtype) {
#if defined(CPU_CAPABILITY_AVX512)
  if (dtype == at::kFloat) return 2;
#endif
  return 3;
}

at::Tensor onednn(const at::Tensor& x, const at::Tensor& packed_weight, const std::optional<at::Tensor>& bias,
                  c10::string_view epilogue, const std::optional<at::Tensor>& other) {
  auto& dispatcher = c10::Dispatcher::singleton();
  if (epilogue == "add") {
    static const auto op = dispatcher.findSchemaOrThrow("mkldnn::_linear_pointwise", "binary").typed<Binary>();
    return op.call(x, *other, packed_weight, bias, "add");
  }
  static const auto op = dispatcher.findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<Pointwise>();
  const bool gelu = epilogue == "gelu";
  return op.call(x, packed_weight, bias, gelu ? "gelu" : "none", c10::List<std::optional<at::Scalar>>(),
                 c10::string_view(gelu ? "tanh" : ""));
}

int epilogue_kind(c10::string_view epilogue) {
  return epilogue == "gelu" ? Epilogue::kGelu : epilogue == "add" ? Epilogue::kAdd : Epilogue::kNone;
}

// The rows our kernel takes: its own limit, lowered by the caller's max_rows (-1: not lowered).
int64_t rows_limit(int64_t own, int64_t asked) { return asked < 0 ? own : std::min(own, asked); }

template <typename T>
using PanelKernel = at::Tensor (*)(const at::Tensor&, const at::Tensor&, int64_t, const T*, int, const T*);

// The kernels a weight in panels may run: ours up to max_rows rows, then (bf16 only, where
// brgemm_rows asks) oneDNN's brgemm ukernel on the same panels up to brgemm_rows.
template <typename T>
struct PanelKernels {
  PanelKernel<T> ours;
  PanelKernel<T> brgemm;  // null: none for this dtype
  int64_t max_rows, brgemm_rows;
};

// Weights in panels of K inputs: bf16 [P, K/2, 32, 2] (blocked_linear.cpp, brgemm_linear.cpp)
// or fp32 [P, K, 16] (blocked_linear_f32.cpp), 1 to 64 rows of the panels' dtype there;
// anything else, oneDNN's.
template <typename T>
at::Tensor on_panels(const at::Tensor& x, const at::Tensor& packed_weight, const at::Tensor& panels, int64_t K,
                     const std::optional<at::Tensor>& bias, c10::string_view epilogue,
                     const std::optional<at::Tensor>& other, const PanelKernels<T>& kernels) {
  const int64_t N = packed_weight.size(0), rows = K > 0 ? x.numel() / K : 0;
  const auto dtype = c10::CppTypeToScalarType<T>::value;
  check_dtype(panels, dtype, "linear", "weight in panels");
  TORCH_CHECK(panels.is_contiguous(), "linear: the weight's panels must be contiguous");
  PanelKernel<T> kernel = nullptr;
  if (rows > 0 && rows <= rows_limit(rayinfer::kMaxBlockedRows, kernels.max_rows)) kernel = kernels.ours;
  else if (kernels.brgemm && rows > 0 && rows <= std::min(rayinfer::kMaxBlockedRows, kernels.brgemm_rows))
    kernel = kernels.brgemm;
  if (!kernel) return onednn(x, packed_weight, bias, epilogue, other);
  return kernel(x.contiguous(), panels, N, bias ? bias->const_data_ptr<T>() : nullptr, epilogue_kind(epilogue),
                other ? other->const_data_ptr<T>() : nullptr);
}

// What every path reads x, the weight, bias and other as: x [..., K] and a weight of K inputs
// and N outputs (plain [N, K], fp32 panels [P, K, 2L] or bf16 [P, K/2, 32, 2], N then the
// packed weight's), all in x's dtype; bias [N]; other as many elements as y. Returns N.
int64_t check_linear(const at::Tensor& x, const at::Tensor& packed_weight, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& other) {
  for (const at::Tensor* t : {&x, &packed_weight, &weight}) check_cpu(*t, "linear", "every tensor");
  TORCH_CHECK(weight.dim() >= 2 && weight.dim() <= 4, "linear: weight [N, K] or in panels, got ", weight.sizes());
  TORCH_CHECK(packed_weight.dim() == 2, "linear: packed_weight [N, K], got ", packed_weight.sizes());
  const int64_t K = weight.dim() == 4 ? 2 * weight.size(1) : weight.size(1);
  const int64_t N = weight.dim() == 2 ? weight.size(0) : packed_weight.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "linear: x ", x.sizes(), " does not end in the weight's ", K,
              " inputs");
  TORCH_CHECK(packed_weight.size(0) == N && packed_weight.size(1) == K, "linear: packed_weight ",
              packed_weight.sizes(), " is not the weight's [", N, ", ", K, "]");
  check_dtype(weight, x.scalar_type(), "linear", "the weight (x's dtype)");
  if (bias && bias->defined()) {
    check_cpu(*bias, "linear", "bias");
    check_dtype(*bias, x.scalar_type(), "linear", "bias (x's dtype)");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "linear: bias [", N, "], got ", bias->sizes());
  }
  if (other && other->defined()) {
    check_cpu(*other, "linear", "other");
    check_dtype(*other, x.scalar_type(), "linear", "other (x's dtype)");
    TORCH_CHECK(other->numel() == x.numel() / std::max<int64_t>(K, 1) * N, "linear: other ", other->sizes(),
                " does not hold y's ", x.numel() / std::max<int64_t>(K, 1) * N, " elements");
  }
  return N;
}

std::optional<at::Tensor> dense(const std::optional<at::Tensor>& t) {
  return t && t->defined() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

// Every path takes bias and other dense: oneDNN's linear reads them so whatever their strides.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed_weight, const at::Tensor& weight,
                  const std::optional<at::Tensor>& strided_bias, c10::string_view epilogue,
                  const std::optional<at::Tensor>& strided_other, int64_t max_rows, int64_t brgemm_rows) {
  TORCH_CHECK(epilogue == "none" || epilogue == "gelu" || epilogue == "add", "linear: unknown epilogue ", epilogue);
  TORCH_CHECK((epilogue == "add") == (strided_other.has_value() && strided_other->defined()),
              "linear: `other` goes with \"add\" alone");
  check_linear(x, packed_weight, weight, strided_bias, strided_other);
  const std::optional<at::Tensor> bias = dense(strided_bias), other = dense(strided_other);
  if (weight.dim() == 4)
    return on_panels<at::BFloat16>(x, packed_weight, weight, 2 * weight.size(1), bias, epilogue, other,
                                   {rayinfer::blocked_linear, rayinfer::brgemm_linear, max_rows, brgemm_rows});
  if (weight.dim() == 3)
    return on_panels<float>(x, packed_weight, weight, weight.size(1), bias, epilogue, other,
                            {rayinfer::blocked_linear_f32, nullptr, max_rows, 0});
  const int64_t K = weight.size(1);
  const bool few = x.numel() <= rows_limit(plain_rows(x.scalar_type()), max_rows) * K && x.numel() > 0;
  const bool ours = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat;
  if (!few || !ours || !x.is_contiguous() || !weight.is_contiguous()) return onednn(x, packed_weight, bias, epilogue, other);
  Epilogue e{Epilogue::Kind(epilogue_kind(epilogue)), other ? other->data_ptr() : nullptr};
  if (x.scalar_type() == at::kBFloat16) return few_rows<at::BFloat16>(x, weight, bias, e);
  return few_rows<float>(x, weight, bias, e);
}

}  // namespace
}  // namespace rayinfer::small_linear

TORCH_LIBRARY_FRAGMENT(rayinfer, m) {
  m.def("linear(Tensor x, Tensor packed_weight, Tensor weight, Tensor? bias, str epilogue=\"none\", "
        "Tensor? other=None, int max_rows=-1, int brgemm_rows=0) -> Tensor");
}

// fp32 weights pack into an MKLDNN-layout tensor, which dispatches on its own key.
TORCH_LIBRARY_IMPL(rayinfer, CPU, m) { m.impl("linear", &rayinfer::small_linear::linear); }
TORCH_LIBRARY_IMPL(rayinfer, MkldnnCPU, m) { m.impl("linear", &rayinfer::small_linear::linear); }
