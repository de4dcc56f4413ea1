// One decode step's new keys and values into the paged KV pool, every layer at once: the
// decode graph's write (engine/model/decode_graph.py write_new_kv). index_copy_ does the same
// copies on one thread; here the pool's rows (layer, k/v, head) are split over torch's
// threads, so a long prefill's write is not one thread's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "input_checks.h"

namespace rayinfer::kv_write {
namespace {

// rows [R, slots, D] (the pool viewed as its rows), new_kv [R, B, D], slot_mapping [B] int64:
// rows[r, slot_mapping[b]] = new_kv[r, b] for every r, b. Slots must be distinct and in range.
void write_kv(at::Tensor rows, const at::Tensor& new_kv, const at::Tensor& slot_mapping) {
  check_cpu(rows, "write_kv", "rows");
  check_cpu(new_kv, "write_kv", "new_kv");
  check_cpu(slot_mapping, "write_kv", "slot_mapping");
  TORCH_CHECK(rows.dim() == 3 && new_kv.dim() == 3 && rows.size(0) == new_kv.size(0) && rows.size(2) == new_kv.size(2),
              "write_kv: rows [R, slots, D] and new_kv [R, B, D], got ", rows.sizes(), " and ", new_kv.sizes());
  TORCH_CHECK(rows.scalar_type() == new_kv.scalar_type(), "write_kv: new_kv is ", new_kv.scalar_type(),
              ", the pool ", rows.scalar_type());
  TORCH_CHECK(rows.is_contiguous(), "write_kv: a contiguous pool");
  check_dtype(slot_mapping, at::kLong, "write_kv", "slot_mapping");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == new_kv.size(1),
              "write_kv: slot_mapping [B], one slot per new row, got ", slot_mapping.sizes(), " for ", new_kv.size(1));
  const at::Tensor source = new_kv.contiguous(), slots = slot_mapping.contiguous();
  const int64_t num_rows = rows.size(0), num_slots = rows.size(1), batch = source.size(1);
  const int64_t row_bytes = rows.size(2) * rows.element_size();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  check_indices(slot, batch, num_slots, "write_kv", "slot", "the pool's slots");
  char* pool = static_cast<char*>(rows.data_ptr());
  const char* data = static_cast<const char*>(source.const_data_ptr());
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      char* row = pool + r * num_slots * row_bytes;
      const char* from = data + r * batch * row_bytes;
      for (int64_t b = 0; b < batch; ++b) std::memcpy(row + slot[b] * row_bytes, from + b * row_bytes, row_bytes);
    }
  });
}

}  // namespace
}  // namespace rayinfer::kv_write

TORCH_LIBRARY_FRAGMENT(rayinfer, m) { m.def("write_kv(Tensor(a!) rows, Tensor new_kv, Tensor slot_mapping) -> ()"); }

TORCH_LIBRARY_IMPL(rayinfer, CPU, m) { m.impl("write_kv", &rayinfer::kv_write::write_kv); }
