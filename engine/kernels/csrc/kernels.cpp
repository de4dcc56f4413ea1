// The one translation unit our kernels are compiled as: each kernel's file is included here,
// so ATen's headers, most of each file's compile time, are parsed once per ISA rather than
// once per file (engine/kernels/kernel_sources.py). Anonymous namespaces merge
// here, so the attention, sampling, kv_write, lora_delta and small_linear kernels keep their internals in
// a namespace of their own, and the two blocked linears' names differ; each file registers
// its own ops with TORCH_LIBRARY_FRAGMENT.

#include "blocked_linear.cpp"
#include "blocked_linear_f32.cpp"
#include "brgemm_linear.cpp"
#include "decode_attention.cpp"
#include "kv_write.cpp"
#include "lora_delta.cpp"
#include "sampling.cpp"
#include "small_linear.cpp"
