// Attention over the paged KV pools for the step graph's rows: the kernel engine/native.py
// builds for this CPU's vector ISA and the compiled step (engine/decode_graph.py) calls.
//
// Each (row, head) reads its cached keys and values in place, block by block through its
// block table (no gathered copy), in float32 with the ISA's widest vectors, plus the k, v of
// this step's rows from its chunk's first row up to itself, which the caller writes to the
// pools after the step. A decode row's chunk is itself; a prefill chunk's rows share a
// block table and each attends causally to the chunk's rows before it. Work is split over
// (row, head) pairs across torch's intra-op threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

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

template <typename T>
inline float dot(const Vec* query, const T* key, int64_t chunks) {
  Vec acc = query[0] * load(key);
  for (int64_t c = 1; c < chunks; ++c) acc = at::vec::fmadd(query[c], load(key + c * Vec::size()), acc);
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
}

template <typename T>
inline void add_scaled(float weight, const T* value, Vec* acc, int64_t chunks) {
  const Vec w(weight);
  for (int64_t c = 0; c < chunks; ++c) acc[c] = at::vec::fmadd(w, load(value + c * Vec::size()), acc[c]);
}

template <typename T>
inline void prefetch_row(const T* row, int64_t head_dim) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < head_dim * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(bytes + i);
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

// The scaled scores of the cached keys, then of the chunk's in-flight keys up to this row's
// own, into scores[0..cached + fresh), their maximum returned.
template <typename T>
float score(const Task<T>& task, const Vec* query, int64_t chunks, int64_t head_dim, float* scores) {
  float max_score = -INFINITY;
  for (int64_t t = 0; t < task.cached; ++t) {
    prefetch_row(task.value(t), head_dim);  // read after every key: fetched now, it arrives meanwhile
    scores[t] = dot(query, task.key(t), chunks);
    max_score = std::max(max_score, scores[t]);
  }
  for (int64_t j = 0; j < task.fresh; ++j) {
    scores[task.cached + j] = dot(query, task.fresh_key(j), chunks);
    max_score = std::max(max_score, scores[task.cached + j]);
  }
  return max_score;
}

// out_row = the values weighted by probabilities scores[0..cached + fresh) / total.
template <typename T>
void weigh_values(const Task<T>& task, const float* scores, float total, int64_t chunks, Vec* acc, float* row,
                  T* out_row, int64_t head_dim) {
  for (int64_t c = 0; c < chunks; ++c) acc[c] = Vec(0.f);
  for (int64_t t = 0; t < task.cached; ++t) add_scaled(scores[t], task.value(t), acc, chunks);
  for (int64_t j = 0; j < task.fresh; ++j) add_scaled(scores[task.cached + j], task.fresh_value(j), acc, chunks);
  const Vec inverse(1.f / total);
  for (int64_t c = 0; c < chunks; ++c) (acc[c] * inverse).store(row + c * Vec::size());
  for (int64_t i = 0; i < head_dim; ++i) out_row[i] = static_cast<T>(row[i]);
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& context_lens,
            const int64_t* first_rows, int64_t longest_chunk, at::Tensor& out) {
  const int64_t heads = q.size(1), head_dim = q.size(2), chunks = head_dim / Vec::size();
  const int64_t block_size = k_cache.size(2), width = block_tables.size(1);
  const Vec scale(1.f / std::sqrt(static_cast<float>(head_dim)));
  const View<T> queries(q), keys(k), values(v), key_pool(k_cache), value_pool(v_cache);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* output = out.data_ptr<T>();
  at::parallel_for(0, q.size(0) * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(round_up(width * block_size + longest_chunk, Vec::size()));
    Vec query[kMaxChunks], acc[kMaxChunks];
    float row[kMaxHeadDim];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / heads, h = i % heads, first = first_rows == nullptr ? b : first_rows[b];
      const Task<T> task{queries.data + b * queries.s0 + h * queries.s1, keys.data + first * keys.s0 + h * keys.s1,
                         values.data + first * values.s0 + h * values.s1, b - first + 1, keys.s0, values.s0,
                         key_pool.data + h * key_pool.s0, value_pool.data + h * value_pool.s0, tables + b * width,
                         lens[b], block_size, key_pool.s1, key_pool.s2, value_pool.s1, value_pool.s2};
      for (int64_t c = 0; c < chunks; ++c) query[c] = load(task.query + c * Vec::size()) * scale;
      const float max_score = score(task, query, chunks, head_dim, scores.data());
      const float total = exp_normalised(scores.data(), task.cached + task.fresh, max_score);
      weigh_values(task, scores.data(), total, chunks, acc, row, output + i * head_dim, head_dim);
    }
  });
}

// Every read stays in the pools: block ids within them, lengths within each row's table.
void check_in_pools(const at::Tensor& tables, const at::Tensor& lens, int64_t num_blocks, int64_t block_size) {
  const int64_t* ids = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < tables.numel(); ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_blocks, "decode_attention: block id ", ids[i], " outside the pools");
  }
  const int64_t* cached = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < lens.numel(); ++b) {
    TORCH_CHECK(cached[b] >= 0 && cached[b] <= tables.size(1) * block_size, "decode_attention: length ", cached[b],
                " beyond its block table");
  }
}

// Each row's chunk starts at a row before it or at itself; the longest chunk's length.
int64_t longest_chunk(const at::Tensor& first_rows) {
  const int64_t* first = first_rows.data_ptr<int64_t>();
  int64_t longest = 1;
  for (int64_t b = 0; b < first_rows.numel(); ++b) {
    TORCH_CHECK(first[b] >= 0 && first[b] <= b, "decode_attention: row ", b, "'s chunk starts at row ", first[b]);
    longest = std::max(longest, b - first[b] + 1);
  }
  return longest;
}

// q, k, v [B, H, D]: this step's query, key and value per row (k, v not in the pools yet);
// k_cache, v_cache [H, num_blocks, block_size, D]; block_tables [B, W]; context_lens [B], the
// cached tokens each row attends to besides this step's; first_rows [B] (None: each row's
// own), the row its chunk starts at: row b also attends to the k, v of rows first_rows[b]..b.
// Returns [B, H, D], contiguous.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& context_lens,
                            const std::optional<at::Tensor>& first_rows) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "decode_attention: q, k, v [B, H, D] and pools [H, blocks, block_size, D]");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim % Vec::size() == 0 && head_dim <= kMaxHeadDim, "decode_attention: head_dim ", head_dim,
              " is not a multiple of ", Vec::size(), " up to ", kMaxHeadDim);
  for (const at::Tensor* t : {&q, &k, &v, &k_cache, &v_cache}) {
    TORCH_CHECK(t->stride(-1) == 1 && t->size(-1) == head_dim && t->scalar_type() == q.scalar_type(),
                "decode_attention: every tensor's last dimension is head_dim, contiguous, in q's dtype");
  }
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0), "decode_attention: one k, v per query");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "decode_attention: int64 block tables and lengths");
  const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
  TORCH_CHECK(lens.numel() == q.size(0) && tables.size(0) == q.size(0), "decode_attention: one table and length per row");
  check_in_pools(tables, lens, k_cache.size(1), k_cache.size(2));
  at::Tensor firsts;
  if (first_rows.has_value()) {
    TORCH_CHECK(first_rows->scalar_type() == at::kLong && first_rows->numel() == q.size(0),
                "decode_attention: one int64 first row per row");
    firsts = first_rows->contiguous();
  }
  const int64_t* first = firsts.defined() ? firsts.data_ptr<int64_t>() : nullptr;
  const int64_t longest = firsts.defined() ? longest_chunk(firsts) : 1;
  at::Tensor out = at::empty({q.size(0), q.size(1), head_dim}, q.options());
  if (q.scalar_type() == at::kBFloat16) {
    attend<at::BFloat16>(q, k, v, k_cache, v_cache, tables, lens, first, longest, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_attention: bfloat16 or float32, got ", q.scalar_type());
    attend<float>(q, k, v, k_cache, v_cache, tables, lens, first, longest, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rayinfer, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, Tensor? first_rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(rayinfer, CPU, m) { m.impl("decode_attention", &decode_attention); }
