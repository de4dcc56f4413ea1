"""Our C++ kernels (engine/kernels/csrc/*.cpp) for this CPU's vector ISA, loaded as ops under
`torch.ops.rayinfer`: `decode_attention` (engine/kernels/native_attention.py), the decode graph's KV
write `write_kv` (engine/model/decode_graph.py), the sampler's `draw` and `argmax`
(engine/sampling/sampler.py), the small-batch `linear` (engine/model/packed_linear.py) and the
rows' LoRA updates `lora_delta` (engine/lora/lora_linear.py).

`pip install` builds them (setup.py, one library an ISA in the package), so an engine only
loads the one for its ISA. Where the install built none for these sources (a machine without
a compiler then, an install older than these sources), the engine builds them itself with
ninja (torch.utils.cpp_extension), as inductor needs the compiler too, cached under
~/.cache/torch_extensions and keyed by the sources and flags, so only a process that finds no
build compiles. Where neither works, the engine runs torch's ops in
their place, said once in the log. The ISA comes from the CPU probe, so RAYINFER_CPU_ISA=avx2
loads (or builds) the AVX2 kernels on an AVX-512 machine too.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

import engine.kernels.kernel_sources as kernel_sources
from engine.kernels.cpu import cpu_features

logger = logging.getLogger(__name__)

PACKAGE = Path(__file__).parent
SOURCES = kernel_sources.sources(PACKAGE)


def isa_build() -> str:
    """Which of kernel_sources.ISA_FLAGS this CPU's kernels are built for: the probe's vector
    width, the one inductor's kernels are tiled for too (engine/kernels/inductor.py)."""
    return {512: "avx512", 256: "avx2"}.get(cpu_features().vector_bits, "baseline")


def load():
    """torch.ops.rayinfer with every kernel in it, loaded once per process; raises where the
    kernels can be neither loaded nor built (no compiler, no ninja), the same error each call."""
    error = _load_once()
    if error is not None:
        raise error
    return torch.ops.rayinfer


@functools.cache
def _load_once() -> Exception | None:
    try:
        _load_or_build(isa_build())
    except Exception as exc:  # noqa: BLE001 - every caller falls back to torch's ops (engine/core/kernel_choice.py)
        logger.warning("our C++ kernels are not available here (%r): the engine runs torch's ops in their place", exc)
        return exc
    return None


def _load_or_build(isa: str) -> None:
    if not _load_prebuilt(isa):
        build_just_in_time(isa)
        logger.info("our C++ kernels: built for %s", isa)


def _load_prebuilt(isa: str) -> bool:
    installed = prebuilt(isa)
    if installed is None:
        logger.info("our C++ kernels: the install built none for %s from these sources; building them", isa)
        return False
    try:
        torch.ops.load_library(installed)
    except OSError as exc:  # a failed dlopen registers nothing: building ours instead is safe
        logger.warning("our C++ kernels: %s does not load (%s); building them", installed.name, exc)
        return False
    logger.info("our C++ kernels: %s, built for %s when the package was installed", installed.name, isa)
    return True


def prebuilt(isa: str) -> Path | None:
    """The library setup.py built for `isa` from this package's sources and this torch, where it is."""
    path = kernel_sources.library(isa, torch.__version__, PACKAGE)
    return path if path.exists() else None


def build_just_in_time(isa: str) -> None:
    """Builds the kernels for `isa` (or finds them built, under ~/.cache/torch_extensions)
    and loads them into this process."""
    from torch.utils import cpp_extension

    name, build_dir = _name(isa), build_directory(isa)
    with _build_lock(build_dir):
        cpp_extension.load(name=name, sources=_sources_in(build_dir), extra_cflags=kernel_sources.cflags(isa),
                           build_directory=str(build_dir), is_python_module=False)


def _name(isa: str) -> str:
    return f"rayinfer_kernels_{isa}"


def build_directory(isa: str) -> Path:
    """Where the kernels for `isa` are built and cached (made if missing): where torch builds
    a CPU extension by default (TORCH_EXTENSIONS_DIR, else its cache root and a folder for this
    Python), named here through public API rather than torch's private helper."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(cpp_extension.get_default_build_root(), f"{python}_cpu")
    directory = Path(root) / _name(isa)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _sources_in(build_dir: Path) -> list[str]:
    """The sources (and the headers they include) copied into the build directory, each
    rewritten only where its bytes changed. Ninja keys each object on its compile command,
    which names the source's path: built from the checkout, the same kernels loaded from
    another clone (CI's clean clone, a second worktree) were all compiled again, and again
    on the way back: a full build per ISA each time."""
    copies = build_dir / "src"
    copies.mkdir(exist_ok=True)
    for source in kernel_sources.csrc(PACKAGE).iterdir():
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
