"""torch.compile with inductor's CPU kernels tiled for the vector width the CPU probe allows.

Why the width is passed explicitly: inductor's on-disk FX graph cache, shared by every
process of a user, keys a CPU graph's generated C++ by the graph and the inductor config,
not by the vector ISA the C++ was tiled for; that ISA (picked from ATEN_CPU_CAPABILITY or
the CPU) only enters the compiler flags. A process running at another ISA on the same
machine (CI's AVX2-emulated step after its AVX-512 one) then reuses C++ tiled for 16-lane
AVX-512 vectors and builds it with 8-lane AVX2 types: out-of-bounds loads and stores,
NaNs, heap corruption. `cpp.simdlen` from the probe puts the width into the config, so
into the cache key, and caps inductor at what RAYINFER_CPU_ISA allows.

Why our kernels' fingerprint is in the cache key too (`cache_key_tag`): a graph calls our
ops by a boxed call whose argument list the generated C++ spells out, and the traced graph
leaves out arguments at their defaults. A new argument with a default (a changed kernel)
leaves the graph, so the key, unchanged, and a cached wrapper would call the new op with the
old argument list: a crash. With the fingerprint, changed kernels compile anew.

One compiled graph for every thread count: inductor's C++ takes the OpenMP thread count
at each call (`cpp.dynamic_threads`) rather than baking in the compiling thread's, and
dynamo keeps no guard on torch's thread count (nor on the rest of the global state it
guards as one: grad mode keeps its own guard). So a step on one thread (engine/core/step_threads.py)
runs the graph a step on two compiled, and the graph is compiled once, not once per count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from engine.kernels.cpu import cpu_features
from engine.kernels.kernel_sources import sources_digest

_KERNELS_TAG = f"rayinfer-kernels-{sources_digest()}"  # in the compile cache's key: the module docstring says why


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
    before applying those, and a recompile (a new shape) happens inside a later call. A frozen
    graph is compiled anew in each process (inductor's FX graph cache skips frozen graphs);
    one that takes its weights as inputs is loaded from that cache (and AOTAutograd's) by
    any later process on this machine, keyed by the graph, its input shapes and dtypes, the
    inductor config (the vector width: inductor_options) and torch's version.

    Floats stay constants around each call too (specialize_float): with dynamic=True dynamo
    first traces a module's float attributes (LayerNorm's eps) as symbols, then restarts the
    whole trace when inductor cannot keep them, a second trace of the model every compile.
    The patches are process-wide: a compile on another thread meanwhile may restart once.

    torch.compile itself runs at the first call, not here: it imports dynamo and inductor,
    which the thread that compiles should pay (the engine's background compile), not the
    engine's start, which builds the graph's wrapper with the model.
    """
    make_compiled = functools.cache(lambda: _torch_compile(device, fn, dynamic, cpp_wrapper))

    def with_settings(*args):
        compiled = make_compiled()
        with (torch._inductor.config.patch(freezing=freezing), torch._dynamo.config.patch(specialize_float=True),
              torch.compiler.config.patch(cache_key_tag=_KERNELS_TAG)):
            return compiled(*args)

    return with_settings


def _torch_compile(device: torch.device, fn: Callable, dynamic: bool | None, cpp_wrapper: bool) -> Callable:
    if cpp_wrapper:
        _cache_cpp_wrappers_across_processes()
    options = {**inductor_options(device), **({"cpp_wrapper": True} if cpp_wrapper else {})}
    if device.type == "cpu":
        options |= {"cpp.dynamic_threads": True, "guard_filter_fn": _without_global_state}
    return torch.compile(fn, dynamic=dynamic, options=options)


def _without_global_state(guards: Sequence) -> list[bool]:
    """Every guard dynamo builds but the global state's, which holds torch's thread count.

    Safe for our graphs: each is called from one place, under the same modes (inference
    mode, default dtype) every time, and their C++ reads the thread count at each call."""
    return [guard.guard_type != "GLOBAL_STATE" for guard in guards]


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
