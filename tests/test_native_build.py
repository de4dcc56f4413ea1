"""Where an engine's C++ kernels (engine/kernels/native.py) come from. `pip install` builds them
(setup.py), and an engine loads the library for its CPU's ISA without compiling anything;
where the install built none for these sources, the engine builds them itself, and where it
cannot, it runs torch's ops and says so once. A build of its own survives a build that was
killed (torch's build lock is a bare file a killed build leaves behind: CI hung an hour on
one), and is found again from another checkout of the same sources, not compiled again.

Each case runs in a process of its own: a process loads one build of the kernels, once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.kernels import kernel_sources, native

ROOT = Path(__file__).resolve().parents[1]

_LOAD = ("import logging; logging.basicConfig(level=logging.INFO); "
         "from engine.kernels import native; native.load(); print('loaded')")
# The kernel libraries this process has mapped, the installed ones' or a build's of its own.
_MAPPED = "; print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'kernels_' in l}))"
# The fault: what building the kernels raises on a machine without a compiler.
_NO_COMPILER = ("import engine.kernels.native as native\n"
                "def no_compiler(isa): raise RuntimeError(\"Error building extension: c++: not found\")\n"
                "native.build_just_in_time = no_compiler\n")


def run_in(checkout: Path, code: str, **env: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout), **env})
    assert done.returncode == 0, done.stderr
    return done


def clone(tmp_path: Path, with_libraries: bool) -> Path:
    """This checkout's engine in another directory, with or without the libraries its install built."""
    ignored = ["__pycache__"] if with_libraries else ["__pycache__", "_kernels_*.so"]
    shutil.copytree(ROOT / "engine", tmp_path / "clone" / "engine", ignore=shutil.ignore_patterns(*ignored))
    return tmp_path / "clone"


def built(directory: Path) -> dict[str, int]:
    """A build's objects and library, each with its mtime: a compile rewrites them."""
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir() if p.suffix in (".o", ".so")}


@pytest.mark.parametrize("capped", ["", "avx2"], ids=["this-cpu", "avx2"])
def test_an_engine_loads_the_library_the_install_built_for_its_isa_without_compiling(tmp_path, capped):
    isa = "avx2" if capped else native.isa_build()
    library = kernel_sources.library(isa, torch.__version__)
    assert library.exists(), f"no {library.name}: `pip install -e .` builds it"
    done = run_in(ROOT, _LOAD + _MAPPED, RAYINFER_CPU_ISA=capped, TORCH_EXTENSIONS_DIR=str(tmp_path / "builds"))
    assert done.stdout.splitlines()[-1] == str([str(library)])
    assert "built for %s when the package was installed" % isa in done.stderr
    assert not (tmp_path / "builds").exists()  # nothing compiled, nothing cached


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump reads the libraries' code")
def test_each_library_the_install_built_holds_its_own_isas_code():
    """The install builds its ISAs' libraries side by side from one source: each must hold its
    own code, the AVX2 one none of AVX-512's registers (an AVX2-only CPU cannot run them)."""
    installed = {isa: kernel_sources.library(isa, torch.__version__) for isa in ("avx512", "avx2")}
    installed = {isa: library for isa, library in installed.items() if library.exists()}
    assert installed, "`pip install -e .` built no library"
    for isa, library in installed.items():
        code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)],
                              capture_output=True, text=True, check=True).stdout
        assert ("%zmm" in code) == (isa == "avx512"), f"{library.name} holds another ISA's code"


def test_an_install_older_than_the_sources_is_not_loaded(tmp_path):
    """An edited kernel in an editable install builds again rather than run the old library."""
    checkout = clone(tmp_path, with_libraries=True)
    with (checkout / "engine" / "kernels" / "csrc" / "kv_write.cpp").open("a") as source:
        source.write("// edited\n")
    code = _NO_COMPILER + "try: native.load()\nexcept RuntimeError: print('not built')" + _MAPPED
    done = run_in(checkout, "import logging; logging.basicConfig(level=logging.INFO)\n" + code)
    assert done.stdout.splitlines() == ["not built", "[]"]
    assert f"the install built none for {native.isa_build()} from these sources; building them" in done.stderr


def test_without_libraries_or_a_compiler_an_engine_serves_on_torch_ops_and_says_so_once(tmp_path, tiny_gpt2_dir):
    checkout = clone(tmp_path, with_libraries=False)
    code = _NO_COMPILER + f"""
import logging; logging.basicConfig(level=logging.INFO)
from engine import LLM, SamplingParams
llm = LLM({str(tiny_gpt2_dir)!r}, weights="pretrained", dtype="float32", device="cpu", compile_decode=False)
assert llm.engine.runner.sampler.native is None
print(len(llm.generate(["Hi"], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids))
"""
    done = run_in(checkout, code)
    assert done.stdout.splitlines()[-1] == "4"
    assert done.stderr.count("our C++ kernels are not available here") == 1
    # Both ops that asked for the kernels went on without them.
    assert "sampler: our C++ kernel is not available; the draw runs on torch ops" in done.stderr
    assert "small_batch_linear: our C++ kernel is not available" in done.stderr


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A build root of this module's own (TORCH_EXTENSIONS_DIR, here and in the processes it
    starts): another checkout's engines, building from other sources in the shared one,
    would rewrite the build under these tests."""
    root = tmp_path_factory.mktemp("builds")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_EXTENSIONS_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def uninstalled(tmp_path_factory: pytest.TempPathFactory, builds: Path) -> Path:
    """A checkout without the installed libraries, whose kernels were built by an engine
    before (so the next process only loads that build)."""
    checkout = clone(tmp_path_factory.mktemp("uninstalled"), with_libraries=False)
    run_in(checkout, _LOAD)
    return checkout


def test_a_lock_left_by_a_killed_build_does_not_stop_the_next_load(uninstalled):
    stale = native.build_directory(native.isa_build()) / "lock"
    stale.touch()
    try:
        done = run_in(uninstalled, _LOAD)
    finally:
        stale.unlink(missing_ok=True)  # never leave the suite's later builds waiting on it
    assert "loaded" in done.stdout
    assert "left by a kernel build that was killed" in done.stderr


def test_another_checkout_of_the_same_sources_loads_the_build_without_compiling(uninstalled, tmp_path):
    """CI's clean clone, or a second worktree, finds the kernels another checkout built."""
    before = built(native.build_directory(native.isa_build()))
    other = clone(tmp_path / "other", with_libraries=False)
    done = run_in(other, _LOAD + "; print(native.__file__)")
    assert done.stdout.split()[-1] == str(other / "engine" / "kernels" / "native.py")  # the other clone's code ran
    assert len(before) == len(native.SOURCES) + 1  # an object a source, and the library
    assert built(native.build_directory(native.isa_build())) == before
