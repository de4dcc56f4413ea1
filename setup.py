"""Builds our C++ kernels when the package is installed (`pip install -e .` or `pip install .`),
as vLLM builds its CPU kernels: one library for each ISA this machine runs (avx512, avx2,
baseline) from the same sources, each with its flags, installed inside the package as engine/kernels/_kernels_<isa>_<fingerprint>.so
(engine/kernels/kernel_sources.py). engine/kernels/native.py loads the one for the CPU it runs on.

A library that does not build (no compiler, a compiler without AVX-512) is skipped with a
warning, never failing the install: the engine then builds it at its first start, or runs
torch's ops where it cannot. Everything else about the package is in pyproject.toml.
"""

import copy
import importlib.util
import os
import shutil
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).parent


def kernel_sources():
    """engine/kernels/kernel_sources.py, loaded by its path: importing the engine package would need
    its dependencies, which pip's build environment does not have."""
    spec = importlib.util.spec_from_file_location("kernel_sources", ROOT / "engine" / "kernels" / "kernel_sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The CPU flags each ISA's kernels need; the flags ISA_FLAGS compiles them with.
_NEEDS = {"avx512": {"avx512f", "avx512dq", "avx512vl", "avx512bw", "fma"}, "avx2": {"avx2", "fma", "f16c"}}


def isas_to_build(kernels) -> list[str]:
    """Each ISA this machine runs (AVX2 beside AVX-512, as RAYINFER_CPU_ISA=avx2 runs it
    there; baseline only where neither runs): the install is for the machine it runs on,
    and the engine builds any other where it is asked for. RAYINFER_KERNEL_ISAS=a,b chooses."""
    chosen = os.environ.get("RAYINFER_KERNEL_ISAS")
    if chosen:
        return [isa for isa in chosen.split(",") if isa in kernels.ISA_FLAGS]
    flags = _cpu_flags()
    runs = [isa for isa, needs in _NEEDS.items() if needs <= flags]
    return runs or ["baseline"]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def extensions(kernels) -> list[CppExtension]:
    # optional: setuptools copies an editable install's libraries into the source tree and
    # must not fail on one whose build was skipped. Sources relative: setuptools wants them so.
    # -g0: Python's own CFLAGS, which setuptools compiles with, carry -g (debug information,
    # 25 times the library's size, and a slower build); the engine's own builds have none.
    return [CppExtension(f"engine.kernels.{kernels.library_stem(isa, torch.__version__)}",
                         [str(path.relative_to(ROOT)) for path in kernels.sources()],
                         extra_compile_args=[*kernels.cflags(isa), "-g0"], optional=True)
            for isa in isas_to_build(kernels)]


class BuildKernels(BuildExtension):
    """BuildExtension that skips, with a warning, a library that does not build."""

    command_name = "build_ext"  # the warnings' prefix, not with_options' class's name

    def finalize_options(self) -> None:
        super().finalize_options()
        # Each ISA's library is one translation unit (csrc/kernels.cpp): built side by side,
        # each its own compiler process, rather than one after another.
        if not self.parallel:
            self.parallel = True

    def run(self) -> None:
        if self.inplace:  # an editable install's: set before run() builds elsewhere and copies back
            self._clear_stale_libraries()
        super().run()

    def build_extensions(self) -> None:
        try:
            super().build_extensions()
        except Exception as exc:  # noqa: BLE001 - torch's compiler check found no compiler
            self.warn(f"our C++ kernels were not built ({exc}); the engine builds them at its first start")

    def build_extension(self, ext) -> None:
        built = ROOT / "engine" / "kernels" / Path(self.get_ext_filename(ext.name)).name
        if built.exists():  # the same fingerprint: the same sources, flags and torch (an editable reinstall)
            target = Path(self.get_ext_fullpath(ext.name))
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.resolve() != built.resolve():
                shutil.copy2(built, target)
            return
        # Every ISA's library compiles the same source, and setuptools names an object by its
        # source's path alone: built side by side in one build_temp, one library's kernels.o
        # was overwritten while the other linked it (CI lost the AVX-512 library so). Each
        # library builds in a directory of its own, on a copy of this command: the builds are
        # threads, and build_temp is this command's.
        own = copy.copy(self)
        own.build_temp = os.path.join(self.build_temp, ext.name)
        try:
            super(BuildKernels, own).build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - a failed compile raises distutils' CompileError
            self.warn(f"{ext.name} was not built ({exc}); the engine builds it at its first start "
                      "where it is this CPU's, or runs torch's ops where it cannot")

    def _clear_stale_libraries(self) -> None:
        """An editable install's libraries land in the source tree; one built from older
        sources would never be loaded again."""
        current = {Path(self.get_ext_filename(ext.name)).name for ext in self.extensions}
        for stale in (ROOT / "engine" / "kernels").glob("_kernels_*.so"):
            if stale.name not in current:
                stale.unlink()


# No ninja: a library is one translation unit, and side-by-side builds would share its build file.
setup(ext_modules=extensions(kernel_sources()),
      cmdclass={"build_ext": BuildKernels.with_options(no_python_abi_suffix=True, use_ninja=False)})
