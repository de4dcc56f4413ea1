// Attention over the paged KV pools for the step graph's rows: the kernel engine/kernels/native.py
// builds for this CPU's vector ISA and the compiled step (engine/model/decode_graph.py) calls.
//
// Each (row, head) reads its cached keys and values in place, block by block through its
// block table (no gathered copy), in float32 with the ISA's widest vectors, plus the k, v of
// this step's rows from its chunk's first row up to itself, which the caller writes to the
// pools after the step. A decode row's chunk is itself; a prefill chunk's rows share a
// block table and each attends causally to the chunk's rows before it. Chunks of
// kMinChunkRows rows or more go to chunk_attention.h's tiles, split over (chunk, head) pairs
// across torch's intra-op threads; the other rows here, split over (row, head) pairs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "chunk_attention.h"
#include "input_checks.h"
#include "paged_keys.h"

namespace rayinfer::attention {
namespace {

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

// The step's tensors as pointers, and one (row, head)'s Task from them.
template <typename T>
struct Operands {
  View<T> queries, keys, values, key_pool, value_pool;
  const int64_t* tables;
  const int64_t* lens;
  int64_t width, block_size;

  Task<T> task(int64_t b, int64_t h, int64_t first) const {
    return Task<T>{queries.data + b * queries.s0 + h * queries.s1, keys.data + first * keys.s0 + h * keys.s1,
                   values.data + first * values.s0 + h * values.s1, b - first + 1, keys.s0, values.s0,
                   key_pool.data + h * key_pool.s0, value_pool.data + h * value_pool.s0, tables + b * width,
                   lens[b], block_size, key_pool.s1, key_pool.s2, value_pool.s1, value_pool.s2};
  }
};

struct Chunk {
  int64_t first, rows;
};

// The prefill chunks of kMinChunkRows rows or more whose rows share their cached length and
// block table, as the engine's always do: chunk_attention.h takes these, the per-row kernel
// the rest (`single`).
std::vector<Chunk> long_chunks(const int64_t* first_rows, const int64_t* lens, const int64_t* tables, int64_t batch,
                               int64_t width, std::vector<int64_t>& single) {
  std::vector<Chunk> chunks;
  for (int64_t b = 0; b < batch;) {
    int64_t end = b + 1;
    while (first_rows != nullptr && end < batch && first_rows[end] == b) ++end;
    bool shared = first_rows != nullptr && first_rows[b] == b && end - b >= kMinChunkRows;
    for (int64_t r = b + 1; shared && r < end; ++r) {
      shared = lens[r] == lens[b] && std::equal(tables + r * width, tables + (r + 1) * width, tables + b * width);
    }
    if (shared) chunks.push_back({b, end - b});
    for (int64_t r = b; !shared && r < end; ++r) single.push_back(r);
    b = end;
  }
  return chunks;
}

template <typename T>
void attend_rows(const Operands<T>& ops, const std::vector<int64_t>& rows, const int64_t* first_rows,
                 int64_t longest_chunk, int64_t heads, int64_t head_dim, T* output) {
  const int64_t chunks = head_dim / Vec::size();
  const Vec scale(1.f / std::sqrt(static_cast<float>(head_dim)));
  at::parallel_for(0, static_cast<int64_t>(rows.size()) * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(round_up(ops.width * ops.block_size + longest_chunk, Vec::size()));
    Vec query[kMaxChunks], acc[kMaxChunks];
    float row[kMaxHeadDim];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = rows[i / heads], h = i % heads, first = first_rows == nullptr ? b : first_rows[b];
      const Task<T> task = ops.task(b, h, first);
      for (int64_t c = 0; c < chunks; ++c) query[c] = load(task.query + c * Vec::size()) * scale;
      const float max_score = score(task, query, chunks, head_dim, scores.data());
      const float total = exp_normalised(scores.data(), task.cached + task.fresh, max_score);
      weigh_values(task, scores.data(), total, chunks, acc, row, output + (b * heads + h) * head_dim, head_dim);
    }
  });
}

// Head-major, so that each thread's share of the tasks holds its share of every chunk.
template <typename T>
void attend_chunks(const Operands<T>& ops, const std::vector<Chunk>& chunks, int64_t heads, int64_t head_dim,
                   T* output) {
  const int64_t count = static_cast<int64_t>(chunks.size());
  const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
  at::parallel_for(0, count * heads, 1, [&](int64_t begin, int64_t end) {
    ChunkScratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      const Chunk& chunk = chunks[i % count];
      const int64_t h = i / count;
      attend_chunk(ops.task(chunk.first, h, chunk.first), chunk.rows, ops.queries.s0, scale, head_dim,
                   output + (chunk.first * heads + h) * head_dim, heads * head_dim, scratch);
    }
  });
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& context_lens,
            const int64_t* first_rows, int64_t longest_chunk, at::Tensor& out) {
  const Operands<T> ops{View<T>(q), View<T>(k), View<T>(v), View<T>(k_cache), View<T>(v_cache),
                        block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), block_tables.size(1),
                        k_cache.size(2)};
  const int64_t heads = q.size(1), head_dim = q.size(2);
  std::vector<int64_t> single;
  const std::vector<Chunk> chunks = long_chunks(first_rows, ops.lens, ops.tables, q.size(0), ops.width, single);
  if (!chunks.empty()) attend_chunks(ops, chunks, heads, head_dim, out.data_ptr<T>());
  if (!single.empty()) attend_rows(ops, single, first_rows, longest_chunk, heads, head_dim, out.data_ptr<T>());
}

// Every read stays in the pools: block ids within both, lengths within each row's table.
void check_in_pools(const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& k_cache,
                    const at::Tensor& v_cache) {
  const int64_t num_blocks = std::min(k_cache.size(1), v_cache.size(1)), block_size = k_cache.size(2);
  const char* pools = k_cache.size(1) <= v_cache.size(1) ? "k_cache's blocks" : "v_cache's blocks";
  check_indices(tables.data_ptr<int64_t>(), tables.numel(), num_blocks, "decode_attention", "block id", pools);
  const int64_t* cached = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < lens.numel(); ++b) {
    TORCH_CHECK(cached[b] >= 0 && cached[b] <= tables.size(1) * block_size, "decode_attention: length ", cached[b],
                " of row ", b, " beyond its block table of ", tables.size(1), " blocks of ", block_size);
  }
}

// Shapes, dtypes, devices and layouts: q, k, v [B, H, D], pools [H, blocks, block_size, D],
// each with a contiguous last dimension, in one dtype; tables [B, W] and lengths [B] int64.
void check_operands(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& context_lens) {
  const char* op = "decode_attention";
  const char* names[] = {"q", "k", "v", "k_cache", "v_cache", "block_tables", "context_lens"};
  const at::Tensor* all[] = {&q, &k, &v, &k_cache, &v_cache, &block_tables, &context_lens};
  for (int i = 0; i < 7; ++i) check_cpu(*all[i], op, names[i]);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "decode_attention: q, k, v [B, H, D] and pools [H, blocks, block_size, D]");
  const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2);
  TORCH_CHECK(head_dim > 0 && head_dim % Vec::size() == 0 && head_dim <= kMaxHeadDim, "decode_attention: head_dim ", head_dim,
              " is not a positive multiple of ", Vec::size(), " up to ", kMaxHeadDim);
  TORCH_CHECK(k.size(0) == rows && v.size(0) == rows, "decode_attention: one k and v row per query: q ", q.sizes(),
              ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(k.size(1) == heads && v.size(1) == heads && k_cache.size(0) == heads && v_cache.size(0) == heads,
              "decode_attention: k, v, k_cache and v_cache must have q's head count ", heads, ": k ", k.sizes(),
              ", v ", v.sizes(), ", k_cache ", k_cache.sizes(), ", v_cache ", v_cache.sizes());
  for (int i = 0; i < 5; ++i) {
    TORCH_CHECK(all[i]->scalar_type() == q.scalar_type(), "decode_attention: ", names[i], " is ",
                all[i]->scalar_type(), ", q is ", q.scalar_type());
    TORCH_CHECK(all[i]->size(-1) == head_dim && all[i]->stride(-1) == 1, "decode_attention: ", names[i],
                "'s last dimension must be head_dim ", head_dim, " and contiguous");
  }
  TORCH_CHECK(v_cache.size(2) == k_cache.size(2), "decode_attention: k_cache's blocks hold ", k_cache.size(2),
              " tokens, v_cache's ", v_cache.size(2));
  TORCH_CHECK(block_tables.dim() == 2 && context_lens.dim() == 1 && block_tables.size(0) == rows &&
                  context_lens.size(0) == rows,
              "decode_attention: block_tables [B, W] and context_lens [B], one table and length per row");
  check_dtype(block_tables, at::kLong, op, "block_tables");
  check_dtype(context_lens, at::kLong, op, "context_lens");
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
  check_operands(q, k, v, k_cache, v_cache, block_tables, context_lens);
  const int64_t head_dim = q.size(2);
  const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
  check_in_pools(tables, lens, k_cache, v_cache);
  at::Tensor firsts;
  if (first_rows.has_value()) {
    check_cpu(*first_rows, "decode_attention", "first_rows");
    check_dtype(*first_rows, at::kLong, "decode_attention", "first_rows");
    TORCH_CHECK(first_rows->dim() == 1 && first_rows->size(0) == q.size(0), "decode_attention: first_rows [B]");
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
}  // namespace rayinfer::attention

TORCH_LIBRARY_FRAGMENT(rayinfer, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, Tensor? first_rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(rayinfer, CPU, m) { m.impl("decode_attention", &rayinfer::attention::decode_attention); }
