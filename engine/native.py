"""Our C++ kernels (engine/csrc/*.cpp), built for this CPU's vector ISA the first time an
engine asks for them and loaded as ops under `torch.ops.rayinfer`: `decode_attention`
(engine/native_attention.py), the decode graph's KV write `write_kv` (engine/decode_graph.py),
the sampler's `draw` and `argmax` (engine/sampler.py) and the small-batch `linear`
(engine/packed_linear.py).

The build needs a C++ compiler and ninja (torch.utils.cpp_extension), as inductor needs the
compiler; it is cached under ~/.cache/torch_extensions, keyed by the sources and flags, so
only a process that finds no build compiles (~20-45 s). The ISA comes from the CPU probe, so
RAYINFER_CPU_ISA=avx2 builds (and runs) the AVX2 kernels on an AVX-512 machine too.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.cpu import cpu_features

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))

# The macro selects ATen's vector types (at::vec) for the ISA; the flags let the compiler emit it.
_ISA_FLAGS = {
    "avx512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"],
    "avx2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "baseline": [],
}


def isa_build() -> str:
    """Which of _ISA_FLAGS this CPU's kernels are built for: the probe's vector width, the one
    inductor's kernels are tiled for too (engine/inductor.py)."""
    return {512: "avx512", 256: "avx2"}.get(cpu_features().vector_bits, "baseline")


@functools.cache
def load():
    """torch.ops.rayinfer with every kernel in it, built or loaded once per process; raises
    where the kernels cannot be built (no compiler, no ninja)."""
    from torch.utils import cpp_extension

    isa = isa_build()
    name, build_dir = _name(isa), build_directory(isa)
    with _build_lock(build_dir):
        cpp_extension.load(name=name, sources=_sources_in(build_dir),
                           extra_cflags=["-O3", "-fopenmp", *_ISA_FLAGS[isa]], is_python_module=False)
    logger.info("our C++ kernels: built for %s", isa)
    return torch.ops.rayinfer


def _name(isa: str) -> str:
    return f"rayinfer_kernels_{isa}"


def build_directory(isa: str) -> Path:
    """Where the kernels for `isa` are built and cached (made if missing)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(_name(isa), verbose=False))


def _sources_in(build_dir: Path) -> list[str]:
    """The sources (and the headers they include) copied into the build directory, each
    rewritten only where its bytes changed. Ninja keys each object on its compile command,
    which names the source's path: built from the checkout, the same kernels loaded from
    another clone (CI's clean clone, a second worktree) were all compiled again, and again
    on the way back (~30-45 s an ISA on 2 cores)."""
    copies = build_dir / "src"
    copies.mkdir(exist_ok=True)
    for source in CSRC.iterdir():
        if source.suffix in (".cpp", ".h"):
            copy, text = copies / source.name, source.read_bytes()
            if not copy.exists() or copy.read_bytes() != text:
                copy.write_bytes(text)
    return [str(copies / source.name) for source in SOURCES]


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Serialise our processes' builds on a lock the kernel drops with its holder, and clear
    the one torch leaves behind a build that was killed: torch's lock is a bare file, so a
    build killed mid-compile (a stopped replica, a timed-out test) left every later engine on
    this machine waiting for it forever. Under our lock no live process of ours is building."""
    with open(build_dir / "rayinfer.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a kernel build that was killed", stale)
            stale.unlink()
        yield
