// Each row's argmax, and a token drawn from softmax(logits / temperature) at the row's
// uniform: the sampler's `draw` (engine/sampling/sampler.py) in two passes over a row, the op
// engine/kernels/native.py builds for this CPU's vector ISA.
//
// Pass one finds the row's max and its first position. Pass two sums exp((x - max) / T)
// per chunk of kChunk tokens; the row's total is its chunk sums added in order. The token
// drawn is the first whose running sum passes u * total (the inverse CDF): the first chunk
// whose running sum passes it, then, within that chunk alone, the first token. torch's
// version keeps a cumulative sum over the whole vocabulary for one lookup per row.
//
// Logits may be float32 or the model's bf16 / fp16 (the decode graph's): each pass converts
// as it loads, so a reduced-precision batch is never copied out to float32 first. `argmax`
// alone is pass one, for greedy batches.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "input_checks.h"

namespace rayinfer::sampling {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunk = 256;  // a multiple of every ISA's vector width
constexpr int64_t kMaxExactIndex = int64_t{1} << 24;  // positions stay exact in float lanes below this

inline Vec load(const float* p) { return Vec::loadu(p); }
inline Vec load(const c10::BFloat16* p) {
  Vec out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
}
inline Vec load(const c10::Half* p) {
  Vec out;
  at::vec::load_fp32_from_fp16(p, out);
  return out;
}

// The first n (< Vec::size()) elements, the other lanes zero.
template <typename T>
inline Vec load(const T* p, int64_t n) {
  float buffer[Vec::size()] = {};
  for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(p[i]);
  return Vec::loadu(buffer);
}

inline float reduce_add(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

struct Max {
  float value;
  int64_t index;  // its first position, as torch.argmax
};

// Each lane keeps its own max and where it first saw it; then the max of the lanes and, among
// the lanes holding it, the earliest position.
template <typename T>
Max row_max(const T* row, int64_t n) {
  const int64_t vectors_end = n - n % Vec::size();
  Max best{-std::numeric_limits<float>::infinity(), 0};
  if (vectors_end > 0) {
    Vec values = load(row), positions = Vec::arange(0.f, 1.f);
    const Vec step(static_cast<float>(Vec::size()));
    Vec here = positions;
    for (int64_t i = Vec::size(); i < vectors_end; i += Vec::size()) {
      here = here + step;
      const Vec x = load(row + i);
      const Vec greater = x > values;
      values = Vec::blendv(values, x, greater);
      positions = Vec::blendv(positions, here, greater);
    }
    float lane_values[Vec::size()], lane_positions[Vec::size()];
    values.store(lane_values);
    positions.store(lane_positions);
    best = {lane_values[0], static_cast<int64_t>(lane_positions[0])};
    for (int64_t lane = 1; lane < Vec::size(); ++lane) {
      const int64_t position = static_cast<int64_t>(lane_positions[lane]);
      if (lane_values[lane] > best.value || (lane_values[lane] == best.value && position < best.index)) {
        best = {lane_values[lane], position};
      }
    }
  }
  for (int64_t i = vectors_end; i < n; ++i) {
    const float x = static_cast<float>(row[i]);
    if (x > best.value) best = {x, i};
  }
  return best;
}

// exp((x - max) * inverse_temperature) of row[begin, end) into out[0, end - begin), zero
// past it up to whole vectors; returns their sum. Both passes compute a chunk's terms here,
// so the scan within a chunk sees the same terms its sum was made of.
template <typename T>
float chunk_terms(const T* row, int64_t begin, int64_t end, float max, float inverse_temperature, float* out) {
  const int64_t n = end - begin;
  const Vec shift(max), scale(inverse_temperature);
  Vec sum(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec term = ((load(row + begin + i) - shift) * scale).exp_u20();
    term.store(out + i);
    sum = sum + term;
  }
  if (i < n) {  // the row's last, partial vector: the lanes past its end count nothing
    const Vec x = load(row + begin + i, n - i);
    const Vec term = Vec::set(Vec(0.f), ((x - shift) * scale).exp_u20(), n - i);
    term.store(out + i);
    sum = sum + term;
  }
  return reduce_add(sum);
}

// The first token whose running sum passes target, given the chunk sums; the last token with
// any mass where float rounding leaves target just past the running sums within its chunk.
template <typename T>
int64_t inverse_cdf(const T* row, int64_t n, float max, float inverse_temperature, const std::vector<float>& sums,
                    float target) {
  float running = 0.f;
  int64_t chunk = 0;
  const int64_t last_chunk = static_cast<int64_t>(sums.size()) - 1;
  while (chunk < last_chunk && running + sums[chunk] <= target) running += sums[chunk++];
  float terms[kChunk];
  const int64_t begin = chunk * kChunk, end = std::min(n, begin + kChunk);
  chunk_terms(row, begin, end, max, inverse_temperature, terms);
  int64_t last_with_mass = begin;
  for (int64_t i = 0; i < end - begin; ++i) {
    if (terms[i] <= 0.f) continue;
    running += terms[i];
    last_with_mass = begin + i;
    if (running > target) return last_with_mass;
  }
  return last_with_mass;
}

template <typename T>
int64_t draw_row(const T* row, int64_t n, float max, float temperature, float uniform, std::vector<float>& sums) {
  const float inverse_temperature = 1.f / temperature;
  float terms[kChunk];
  const int64_t num_chunks = (n + kChunk - 1) / kChunk;
  sums.resize(num_chunks);
  float total = 0.f;
  for (int64_t c = 0; c < num_chunks; ++c) {
    sums[c] = chunk_terms(row, c * kChunk, std::min(n, (c + 1) * kChunk), max, inverse_temperature, terms);
    total += sums[c];
  }
  // u * total may round up to total itself, past every token: keep it strictly below.
  const float target = std::min(uniform * total, std::nextafter(total, 0.f));
  return inverse_cdf(row, n, max, inverse_temperature, sums, target);
}

void check_logits(const at::Tensor& logits, const char* op) {
  check_cpu(logits, op, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, op, ": logits [S, V] with contiguous rows, got ",
              logits.sizes(), " strides ", logits.strides());
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < kMaxExactIndex, op, ": a vocabulary of 1 to ",
              kMaxExactIndex - 1, " tokens");
}

// Calls body(const T* first_row) with T the logits' element type: float, bf16 or fp16.
template <typename Body>
void with_rows(const at::Tensor& logits, const char* op, const Body& body) {
  switch (logits.scalar_type()) {
    case at::kFloat: return body(logits.const_data_ptr<float>());
    case at::kBFloat16: return body(logits.const_data_ptr<c10::BFloat16>());
    case at::kHalf: return body(logits.const_data_ptr<c10::Half>());
    default: TORCH_CHECK(false, op, ": logits in float32, bf16 or fp16, not ", logits.scalar_type());
  }
}

// logits [S, V] (float32, bf16 or fp16), rows contiguous -> each row's argmax [S], int64.
at::Tensor argmax(const at::Tensor& logits) {
  check_logits(logits, "argmax");
  const int64_t rows = logits.size(0), vocab = logits.size(1), row_stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* out_data = out.data_ptr<int64_t>();
  with_rows(logits, "argmax", [&](const auto* data) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) out_data[r] = row_max(data + r * row_stride, vocab).index;
    });
  });
  return out;
}

// logits [S, V] (float32, bf16 or fp16), rows contiguous; temperatures [S] (> 0; the caller
// sets greedy rows' to 1); uniforms [S] or [S, 1] in [0, 1). Returns (argmax [S], drawn [S]), int64.
std::tuple<at::Tensor, at::Tensor> draw(const at::Tensor& logits, const at::Tensor& temperatures,
                                        const at::Tensor& uniforms) {
  check_logits(logits, "draw");
  check_cpu(temperatures, "draw", "temperatures");
  check_cpu(uniforms, "draw", "uniforms");
  const int64_t rows = logits.size(0), vocab = logits.size(1), row_stride = logits.stride(0);
  const at::Tensor temps = temperatures.to(at::kFloat).contiguous(), draws = uniforms.to(at::kFloat).contiguous();
  TORCH_CHECK(temps.numel() == rows && draws.numel() == rows, "draw: one temperature and one uniform per row: ",
              rows, " rows, ", temps.numel(), " temperatures, ", draws.numel(), " uniforms");
  at::Tensor argmax = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor drawn = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* temperature = temps.data_ptr<float>();
  const float* uniform = draws.data_ptr<float>();
  int64_t* argmax_out = argmax.data_ptr<int64_t>();
  int64_t* drawn_out = drawn.data_ptr<int64_t>();
  with_rows(logits, "draw", [&](const auto* data) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> sums;
      for (int64_t r = begin; r < end; ++r) {
        const auto* row = data + r * row_stride;
        const Max max = row_max(row, vocab);
        argmax_out[r] = max.index;
        drawn_out[r] = temperature[r] > 0.f ? draw_row(row, vocab, max.value, temperature[r], uniform[r], sums)
                                            : max.index;
      }
    });
  });
  return {argmax, drawn};
}

}  // namespace
}  // namespace rayinfer::sampling

TORCH_LIBRARY_FRAGMENT(rayinfer, m) {
  m.def("draw(Tensor logits, Tensor temperatures, Tensor uniforms) -> (Tensor, Tensor)");
  m.def("argmax(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(rayinfer, CPU, m) {
  m.impl("draw", &rayinfer::sampling::draw);
  m.impl("argmax", &rayinfer::sampling::argmax);
}
