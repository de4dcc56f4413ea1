"""What this CPU can do, as torch and oneDNN report it: the one probe every ISA-dependent
choice reads (`dtype: auto`, which linears are prepacked for oneDNN, the vector width of
inductor's compiled kernels).

/proc/cpuinfo is not the truth to probe: under ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY
(or a hypervisor that hides state) it still lists AVX-512 BF16 while oneDNN refuses bf16
packing. So each feature is what the kernel libraries will actually run, and the hardware
flags only refine it (oneDNN also runs bf16 on AVX-512 cores without native bf16, slowly).

RAYINFER_CPU_ISA=avx2|avx512|avx512_bf16|amx|baseline caps the probe at that level, so an
AVX-512 machine can run as an AVX2-only CPU would (together with ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2). It can only lower what the CPU reports, never raise it.

torch is imported where the probe runs, not with the module: usable_cpus and the engine's
config read this file in processes that never load torch (the Serve app's build, the
tokenizer and Ingress replicas).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ISA_ENV = "RAYINFER_CPU_ISA"
ISA_LEVELS = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")


@dataclass(frozen=True)
class CpuFeatures:
    machine: str  # platform.machine(): x86_64, aarch64, ...
    aten_capability: str  # ATen's kernel dispatch level: DEFAULT, AVX2, AVX512, ...
    avx2: bool
    avx512: bool
    avx512_bf16: bool  # native bf16 dot products (AVX512_BF16): bf16 matmuls beat fp32
    amx: bool
    onednn_linear: bool  # oneDNN's prepacked-weight linear ops exist (fp32 on any x86-64)
    onednn_bf16: bool  # oneDNN runs bf16 (AVX-512 BW/VL/DQ or newer); bf16 packing needs it

    @property
    def isa(self) -> str:
        """The highest level of ISA_LEVELS this CPU reaches."""
        flags = (True, self.avx2, self.avx512, self.avx512_bf16, self.amx)
        return ISA_LEVELS[max(i for i, ok in enumerate(flags) if ok)]

    @property
    def has_fast_bf16(self) -> bool:
        """bf16 matmuls run natively (AVX512_BF16 or AMX) through oneDNN."""
        return self.onednn_bf16 and (self.avx512_bf16 or self.amx)

    def can_pack(self, dtype: torch.dtype) -> bool:
        import torch

        if not self.onednn_linear or self.machine not in ("x86_64", "AMD64"):
            return False
        if dtype == torch.bfloat16:
            return self.onednn_bf16
        return dtype == torch.float32

    @property
    def vector_bits(self) -> int | None:
        """The widest x86 vector registers compiled kernels may use (inductor's cpp.simdlen)."""
        if self.avx512:
            return 512
        return 256 if self.avx2 else None

    def summary(self) -> str:
        return (f"{self.machine} {self.isa} (ATen {self.aten_capability}, oneDNN bf16 "
                f"{'yes' if self.onednn_bf16 else 'no'}, native bf16 {'yes' if self.has_fast_bf16 else 'no'})")


def usable_cpus() -> int:
    """The CPUs this process may run on: the cpuset a container or taskset gave it, where the
    OS says (os.cpu_count() elsewhere)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@functools.cache
def cpu_features() -> CpuFeatures:
    """Probed once per process; RAYINFER_CPU_ISA caps it (read at the first call)."""
    return _cap(_probe(), os.environ.get(ISA_ENV, "").strip().lower())


def _probe() -> CpuFeatures:
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    x86 = platform.machine() in ("x86_64", "AMD64")
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    onednn_bf16 = onednn and x86 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    avx512 = capability.startswith("AVX512")
    return CpuFeatures(
        machine=platform.machine(),
        aten_capability=capability,
        avx2=x86 and (capability == "AVX2" or avx512),
        avx512=avx512,
        avx512_bf16=avx512 and onednn_bf16 and _cpu_flag("_is_avx512_bf16_supported"),
        amx=avx512 and onednn_bf16 and _cpu_flag("_is_amx_tile_supported"),
        onednn_linear=onednn,
        onednn_bf16=onednn_bf16,
    )


def _cpu_flag(name: str) -> bool:
    import torch

    check = getattr(torch.cpu, name, None)
    return bool(check()) if check is not None else False


def _cap(features: CpuFeatures, level: str) -> CpuFeatures:
    if not level:
        return features
    if level not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV}={level!r}: expected one of {', '.join(ISA_LEVELS)}")
    rank = ISA_LEVELS.index(level)
    return replace(
        features,
        avx2=features.avx2 and rank >= 1,
        avx512=features.avx512 and rank >= 2,
        avx512_bf16=features.avx512_bf16 and rank >= 3,
        amx=features.amx and rank >= 4,
        onednn_bf16=features.onednn_bf16 and rank >= 2,
    )
