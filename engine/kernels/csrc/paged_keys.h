// What both attention kernels (decode_attention.cpp's per row, chunk_attention.h's per chunk)
// read a row's keys and values through: the paged pools via its block table, then the step's
// own rows not yet written to them.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>

// In an anonymous namespace: each ISA's build of these kernels keeps its own copy.
namespace rayinfer::attention {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kMaxHeadDim = 512;
constexpr int64_t kMaxChunks = kMaxHeadDim / Vec::size();

inline Vec load(const float* p) { return Vec::loadu(p); }

inline Vec load(const at::BFloat16* p) {
  Vec out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
}

inline int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// scores[t] = exp(scores[t] - max_score) for t < n, vectorised; returns their sum. The
// buffer holds whole vectors past n: its padding is set to -inf, whose exp is 0.
inline float exp_normalised(float* scores, int64_t n, float max_score) {
  const int64_t padded = round_up(n, Vec::size());
  std::fill(scores + n, scores + padded, -INFINITY);
  const Vec shift(max_score);
  Vec sum(0.f);
  for (int64_t t = 0; t < padded; t += Vec::size()) {
    const Vec e = (Vec::loadu(scores + t) - shift).exp_u20();
    e.store(scores + t);
    sum = sum + e;
  }
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum);
}

// A strided [*, *, D] or [*, *, *, D] tensor's base pointer and leading strides.
template <typename T>
struct View {
  const T* data;
  int64_t s0, s1, s2;
  explicit View(const at::Tensor& t)
      : data(t.data_ptr<T>()), s0(t.stride(0)), s1(t.stride(1)), s2(t.dim() > 3 ? t.stride(2) : 0) {}
};

// Pointers to one (row, head)'s data: its query, the first in-flight key and value of its
// chunk (rows `fresh` apart), and its cached keys and values through its block table.
template <typename T>
struct Task {
  const T* query;
  const T* fresh_keys;    // this step's key of the chunk's first row, for this head
  const T* fresh_values;  // and its value
  int64_t fresh, key_row, value_row;  // the chunk's rows up to this one; strides between rows
  const T* head_keys;    // the head's plane of the key pool
  const T* head_values;  // and of the value pool
  const int64_t* table;
  int64_t cached, block_size, key_block, key_slot, value_block, value_slot;

  const T* key(int64_t t) const { return head_keys + table[t / block_size] * key_block + (t % block_size) * key_slot; }
  const T* value(int64_t t) const {
    return head_values + table[t / block_size] * value_block + (t % block_size) * value_slot;
  }
  const T* fresh_key(int64_t j) const { return fresh_keys + j * key_row; }
  const T* fresh_value(int64_t j) const { return fresh_values + j * value_row; }
};

}  // namespace
}  // namespace rayinfer::attention
