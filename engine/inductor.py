"""torch.compile with inductor's CPU kernels tiled for the vector width the CPU probe allows.

Why the width is passed explicitly: inductor's on-disk FX graph cache, shared by every
process of a user, keys a CPU graph's generated C++ by the graph and the inductor config,
not by the vector ISA the C++ was tiled for; that ISA (picked from ATEN_CPU_CAPABILITY or
the CPU) only enters the compiler flags. A process running at another ISA on the same
machine (CI's AVX2-emulated step after its AVX-512 one) then reuses C++ tiled for 16-lane
AVX-512 vectors and builds it with 8-lane AVX2 types: out-of-bounds loads and stores,
NaNs, heap corruption. `cpp.simdlen` from the probe puts the width into the config, so
into the cache key, and caps inductor at what RAYINFER_CPU_ISA allows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.cpu import cpu_features


def inductor_options(device: torch.device) -> dict[str, object]:
    """Inductor config for a compile on `device`: the CPU's vector width where it has one."""
    bits = cpu_features().vector_bits if device.type == "cpu" else None
    return {} if bits is None else {"cpp.simdlen": bits}


def compile_for(device: torch.device, fn: Callable, dynamic: bool | None = None, freezing: bool = False,
                cpp_wrapper: bool = False) -> Callable:
    """torch.compile(fn) with inductor_options(device); freezing folds the parameters fn reads
    into the graph as constants (so inductor prepacks linear weights), which needs grad off.
    cpp_wrapper: the graph's kernels called from generated C++ rather than Python, a few
    microseconds less per kernel (the decode graph calls ~150 a step).

    freezing is set around each call, not passed in torch.compile's options: inductor reads it
    before applying those, and a recompile (a new shape) happens inside a later call.
    """
    if cpp_wrapper:
        _cache_cpp_wrappers_across_processes()
    options = {**inductor_options(device), **({"cpp_wrapper": True} if cpp_wrapper else {})}
    compiled = torch.compile(fn, dynamic=dynamic, options=options)
    if not freezing:
        return compiled

    def frozen(*args):
        with torch._inductor.config.patch(freezing=True):
            return compiled(*args)

    return frozen


def _cache_cpp_wrappers_across_processes() -> None:
    """Keep the ids of a graph's constants out of its C++ wrapper's source.

    Inductor heads the wrapper with one comment per constant, ending in hash(tensor) (an
    address), "so our code cache gives different constants different files". A C++ wrapper
    takes its constants as inputs, not in its code, but the address makes every process's
    source new: its ~200 KB of C++ is built again at each start (and again for the one-thread
    variant: step_threads), where the rest of the compile's C++ comes from the disk cache.
    Without the address, a second start reuses the .so. Idempotent; a torch without this
    hook keeps its own behaviour.
    """
    try:
        from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    except ImportError:
        return
    hook = getattr(CppWrapperCpu, "write_constant", None)
    if hook is None or getattr(hook, "_rayinfer", False):
        return  # no such hook, or patched already

    def write_constant(self, name: str, hashed: str) -> None:
        self.header.writeline(f"// {name} {hashed.rsplit(' ', 1)[0]}")  # device, dtype, size, stride

    write_constant._rayinfer = True
    CppWrapperCpu.write_constant = write_constant
