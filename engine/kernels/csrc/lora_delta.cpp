// One linear's LoRA updates for a step's rows, each row under its own adapter's slot
// (engine/lora/lora_linear.py): y[t] = (x[t] @ A[slot t]) @ B[slot t], Punica's SGMV on the CPU.
//
// Why a kernel: the rows of a step share few adapters, and each adapter's A and B are small
// (K x R and R x N). Rows sorted by slot and taken a few at a time read each slot's weights
// once for all its rows, from cache; torch's gather-and-bmm reads them once per row, and the
// one-GEMM-over-every-slot form multiplies by every slot's zeros. Slot 0 is the base model's,
// all zeros: its rows get zeros without reading it.
//
// a [K, S, R] (slot s's A in a[:, s, :], engine/lora/slots.py's layout), b [S, R, N] with the
// adapter's scaling folded in; x [T, K] and b in one dtype (bf16 or fp32), accumulated in fp32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "input_checks.h"

namespace rayinfer::lora_delta {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kGroupRows = 4;  // rows of one slot that share each load of its weights
constexpr int64_t kColumnGrain = 64;  // output columns per expand task

struct Group {
  int64_t slot;
  const int64_t* rows;  // into the slot-sorted row order
  int64_t count;
};

template <typename T>
inline Vec load(const T* p, int64_t count) {
  if constexpr (std::is_same_v<T, float>) return Vec::loadu(p, count);
  else return at::vec::convert<float>(at::vec::Vectorized<T>::loadu(p, count));
}

// Rows with a slot other than 0, sorted by slot, cut into groups of at most kGroupRows.
std::vector<Group> groups_of(const int64_t* slot, int64_t rows, std::vector<int64_t>& order) {
  order.clear();
  for (int64_t t = 0; t < rows; ++t)
    if (slot[t] != 0) order.push_back(t);
  std::stable_sort(order.begin(), order.end(), [slot](int64_t i, int64_t j) { return slot[i] < slot[j]; });
  std::vector<Group> groups;
  for (size_t begin = 0; begin < order.size();) {
    size_t end = begin + 1;
    while (end < order.size() && end - begin < kGroupRows && slot[order[end]] == slot[order[begin]]) ++end;
    groups.push_back({slot[order[begin]], order.data() + begin, int64_t(end - begin)});
    begin = end;
  }
  return groups;
}

template <typename T>
inline void store(T* p, const Vec& v, int64_t count) {
  if constexpr (std::is_same_v<T, float>) v.store(p, count);
  else at::vec::convert_from_float<T>(v, v).store(p, count);
}

// shrunk[row] = x[row] @ a[:, slot, :] for each row of the group, R outputs in fp32.
template <typename T, int64_t M>
void shrink(const Group& g, const T* x, const T* a, float* shrunk, int64_t K, int64_t S, int64_t R) {
  const int64_t width = Vec::size();
  std::vector<float> xs(M * K);  // the group's rows in fp32: one conversion, not one per rank block
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) xs[i * K + k] = float(x[g.rows[i] * K + k]);
  for (int64_t r0 = 0; r0 < R; r0 += width) {
    const int64_t count = std::min(width, R - r0);
    Vec acc[M];
    for (int64_t i = 0; i < M; ++i) acc[i] = Vec(0.f);
    const T* column = a + g.slot * R + r0;
    for (int64_t k = 0; k < K; ++k) {
      const Vec av = load(column + k * S * R, count);
      for (int64_t i = 0; i < M; ++i) acc[i] = at::vec::fmadd(Vec(xs[i * K + k]), av, acc[i]);
    }
    for (int64_t i = 0; i < M; ++i) acc[i].store(shrunk + g.rows[i] * R + r0, count);
  }
}

// y[row, n0:n1] = shrunk[row] @ b[slot, :, n0:n1] for each row of the group, two vectors of
// columns at a time (eight sums in flight: enough to hide the FMAs' latency).
template <typename T, int64_t M>
void expand(const Group& g, const float* shrunk, const T* b, T* y, int64_t R, int64_t N, int64_t n0, int64_t n1) {
  const int64_t width = Vec::size();
  const T* slot_b = b + g.slot * R * N;
  for (int64_t n = n0; n < n1; n += 2 * width) {
    const int64_t count0 = std::min(width, n1 - n), count1 = std::max<int64_t>(0, std::min(width, n1 - n - width));
    Vec acc0[M], acc1[M];
    for (int64_t i = 0; i < M; ++i) acc0[i] = acc1[i] = Vec(0.f);
    for (int64_t r = 0; r < R; ++r) {
      const Vec b0 = load(slot_b + r * N + n, count0);
      const Vec b1 = count1 ? load(slot_b + r * N + n + width, count1) : Vec(0.f);
      for (int64_t i = 0; i < M; ++i) {
        const Vec s(shrunk[g.rows[i] * R + r]);
        acc0[i] = at::vec::fmadd(s, b0, acc0[i]);
        acc1[i] = at::vec::fmadd(s, b1, acc1[i]);
      }
    }
    for (int64_t i = 0; i < M; ++i) {
      T* row = y + g.rows[i] * N + n;
      store(row, acc0[i], count0);
      if (count1) store(row + width, acc1[i], count1);
    }
  }
}

// The group's rows as a compile-time count, so each row's sums stay in registers.
template <typename T, typename F>
void by_count(const Group& g, F&& f) {
  switch (g.count) {
    case 1: return f(std::integral_constant<int64_t, 1>{});
    case 2: return f(std::integral_constant<int64_t, 2>{});
    case 3: return f(std::integral_constant<int64_t, 3>{});
    default: return f(std::integral_constant<int64_t, kGroupRows>{});
  }
}

template <typename T>
at::Tensor run(const at::Tensor& x, const int64_t* slot, const at::Tensor& a, const at::Tensor& b) {
  const int64_t rows = x.size(0), K = x.size(1), S = a.size(1), R = a.size(2), N = b.size(2);
  std::vector<int64_t> order;
  const std::vector<Group> groups = groups_of(slot, rows, order);
  at::Tensor y = at::zeros({rows, N}, x.options());
  if (groups.empty()) return y;
  std::vector<float> shrunk(rows * R);
  const T* xp = x.const_data_ptr<T>();
  const T* ap = a.const_data_ptr<T>();
  const T* bp = b.const_data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, int64_t(groups.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      by_count<T>(groups[i], [&](auto m) { shrink<T, m()>(groups[i], xp, ap, shrunk.data(), K, S, R); });
  });
  at::parallel_for(0, N, kColumnGrain, [&](int64_t n0, int64_t n1) {
    for (const Group& g : groups)
      by_count<T>(g, [&](auto m) { expand<T, m()>(g, shrunk.data(), bp, yp, R, N, n0, n1); });
  });
  return y;
}

at::Tensor lora_delta(const at::Tensor& x, const at::Tensor& slots, const at::Tensor& a, const at::Tensor& b) {
  for (const at::Tensor* t : {&x, &slots, &a, &b}) check_cpu(*t, "lora_delta", "every tensor");
  TORCH_CHECK(x.dim() == 2 && a.dim() == 3 && b.dim() == 3, "lora_delta: x [T, K], a [K, S, R], b [S, R, N], got ",
              x.sizes(), ", ", a.sizes(), ", ", b.sizes());
  TORCH_CHECK(a.size(0) == x.size(1) && b.size(0) == a.size(1) && b.size(1) == a.size(2), "lora_delta: a ", a.sizes(),
              " and b ", b.sizes(), " are not the slots of x's ", x.size(1), " inputs");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "lora_delta: x must be bfloat16 or float32, got ", x.scalar_type());
  check_dtype(a, x.scalar_type(), "lora_delta", "a (x's dtype)");
  check_dtype(b, x.scalar_type(), "lora_delta", "b (x's dtype)");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "lora_delta: contiguous a and b");
  check_dtype(slots, at::kLong, "lora_delta", "slots");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == x.size(0), "lora_delta: slots [T], one per row of x, got ",
              slots.sizes(), " for ", x.size(0), " rows");
  const at::Tensor dense_slots = slots.contiguous();
  const int64_t* slot = dense_slots.const_data_ptr<int64_t>();
  check_indices(slot, dense_slots.numel(), a.size(1), "lora_delta", "slot", "the adapters' slots");
  const at::Tensor dense_x = x.contiguous();
  if (x.scalar_type() == at::kBFloat16) return run<at::BFloat16>(dense_x, slot, a, b);
  return run<float>(dense_x, slot, a, b);
}

}  // namespace
}  // namespace rayinfer::lora_delta

TORCH_LIBRARY_FRAGMENT(rayinfer, m) { m.def("lora_delta(Tensor x, Tensor slots, Tensor a, Tensor b) -> Tensor"); }

TORCH_LIBRARY_IMPL(rayinfer, CPU, m) { m.impl("lora_delta", &rayinfer::lora_delta::lora_delta); }
