// The checks every op makes of its inputs before it touches their memory: a caller's wrong
// tensor is a RuntimeError naming the op and the problem, never a read or write outside it.
// Index checks are one pass per call over the indices, a min/max reduction the compiler
// vectorises, before any parallel loop; the slow search for the index to name runs only
// where the check fails.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace rayinfer {

inline void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got ", t.device());
}

inline void check_dtype(const at::Tensor& t, at::ScalarType dtype, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
}

// Every ids[i] for i < n in [0, bound); `what` names the indices and `pool` what they index.
inline void check_indices(const int64_t* ids, int64_t n, int64_t bound, const char* op, const char* what,
                          const char* pool) {
  int64_t lowest = std::numeric_limits<int64_t>::max(), highest = std::numeric_limits<int64_t>::min();
  for (int64_t i = 0; i < n; ++i) {
    lowest = std::min(lowest, ids[i]);
    highest = std::max(highest, ids[i]);
  }
  if (n == 0 || (lowest >= 0 && highest < bound)) return;
  const int64_t* bad = std::find_if(ids, ids + n, [bound](int64_t id) { return id < 0 || id >= bound; });
  TORCH_CHECK(false, op, ": ", what, " ", *bad, " at index ", bad - ids, " is outside ", pool, " of ", bound);
}

}  // namespace rayinfer
