"""On vLLM's PYTHONPATH where this run caps the CPU at AVX2 (bench/peers/vllm_peer.py): the
emulated AVX2-only CPU of BENCHMARKS.md.

ONEDNN_MAX_CPU_ISA and ATEN_CPU_CAPABILITY cap oneDNN, ATen and inductor in vLLM's processes
as they do in ours, but vLLM picks its own compiled kernels (`_C`, `_C_AVX512`, `_C_AVX2`)
and its attention's ISA from torch.cpu's hardware probes, which neither variable caps. Here
those probes answer as an AVX2-only CPU would.
"""

import torch.cpu

for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
              "_is_avx512_fp16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)
