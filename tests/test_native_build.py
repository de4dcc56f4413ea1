"""Building our C++ kernels (engine/native.py) survives a build that was killed: torch's
build lock is a bare file, which a killed build leaves behind, and a later process must
clear it rather than wait on it forever (it did: CI hung an hour on one). And a build is
found again from another checkout of the same sources, not compiled again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from engine import native

_LOAD = ("import logging; logging.basicConfig(level=logging.INFO); "
         "from engine import native; native.load(); print('loaded')")


def built(directory: Path) -> dict[str, int]:
    """The build's objects and library, each with its mtime: a compile rewrites them."""
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir() if p.suffix in (".o", ".so")}


def test_a_lock_left_by_a_killed_build_does_not_stop_the_next_load():
    native.load()  # so the next process only loads the build
    stale = native.build_directory(native.isa_build()) / "lock"
    stale.touch()
    try:
        done = subprocess.run([sys.executable, "-c", _LOAD], capture_output=True, text=True,
                              timeout=300, cwd=Path(__file__).parent.parent)
    finally:
        stale.unlink(missing_ok=True)  # never leave the suite's later builds waiting on it
    assert done.returncode == 0, done.stderr
    assert "loaded" in done.stdout
    assert "left by a kernel build that was killed" in done.stderr


def test_another_checkout_of_the_same_sources_loads_the_build_without_compiling(tmp_path: Path):
    """CI's clean clone, or a second worktree, finds the kernels this checkout built."""
    native.load()
    before = built(native.build_directory(native.isa_build()))
    checkout = tmp_path / "clone"
    shutil.copytree(Path(native.__file__).parent, checkout / "engine",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = _LOAD + "; print(native.__file__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == str(checkout / "engine" / "native.py")  # the clone's code ran
    assert len(before) == len(native.SOURCES) + 1  # an object a source, and the library
    assert built(native.build_directory(native.isa_build())) == before
