"""What our C++ kernels are built from: the sources (engine/kernels/csrc), each vector ISA's
compiler flags, and the file a build for an ISA makes. setup.py builds one library an ISA
from them when the package is installed; engine/kernels/native.py loads the one for this CPU, or
builds it where the install did not.

The library's name carries a fingerprint of everything that changes its code (the sources
and headers, the flags, torch's version), so a library is only ever loaded with the sources
it was built from: an edited kernel in an editable install, or another torch, finds no
library of its own and is built again rather than run stale.

Standard library only: setup.py loads this file by its path in pip's build environment,
where torch is installed but none of the engine's other dependencies.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

PACKAGE = Path(__file__).parent

# The macro selects ATen's vector types (at::vec) for the ISA; the flags let the compiler emit it.
ISA_FLAGS = {
    "avx512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"],
    "avx2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "baseline": [],
}


def csrc(package: Path = PACKAGE) -> Path:
    return package / "csrc"


def sources(package: Path = PACKAGE) -> list[Path]:
    """The translation units: one, which includes every kernel's file (csrc/kernels.cpp says why)."""
    return [csrc(package) / "kernels.cpp"]


def cflags(isa: str) -> list[str]:
    return ["-O3", "-fopenmp", *ISA_FLAGS[isa]]


def library_stem(isa: str, torch_version: str, package: Path = PACKAGE) -> str:
    """`_kernels_<isa>_<fingerprint>`: the name, without its suffix, of the library built for
    `isa` from the package's sources by this torch."""
    digest = hashlib.sha256("\0".join([torch_version, *cflags(isa)]).encode())
    _add_sources(digest, package)
    return f"_kernels_{isa}_{digest.hexdigest()[:16]}"


def sources_digest(package: Path = PACKAGE) -> str:
    """The sources' and headers' fingerprint alone: what changes our ops' schemas and code."""
    digest = hashlib.sha256()
    _add_sources(digest, package)
    return digest.hexdigest()[:16]


def _add_sources(digest, package: Path) -> None:
    for path in sorted(csrc(package).iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())


def library(isa: str, torch_version: str, package: Path = PACKAGE) -> Path:
    """Where the library setup.py builds for `isa` lies once the package is installed."""
    return package / f"{library_stem(isa, torch_version, package)}.so"
