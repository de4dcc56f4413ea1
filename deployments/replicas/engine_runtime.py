"""The engine replica's process environment: an allocator and OpenMP runtime preloaded, and
OpenMP settings, through its Ray `runtime_env` (a config file's `engine_preload` and
`engine_env` args). Ray starts the replica's worker process with these variables, so
`LD_PRELOAD` takes effect before torch loads.

One variable is set by default (`engine_env` may override it): Serve runs the engine
deployment's code on the replica's own event loop rather than on a loop in a thread of its
own, one thread hop less for every chunk a stream sends. Past its constructor (which waits
for the engine to build, before the replica serves anything) the deployment's code never
blocks its loop: the model steps on the step loop thread. A blocking loop is what the
separate thread guards against. Measured: BENCHMARKS.md, "Designs shipped": event loops and handles.

Libraries are optional: a name that resolves to no file on this machine is skipped with a
warning, so one config file runs where tcmalloc or Intel OpenMP is installed and where it
isn't. Names:
  tcmalloc   gperftools' tcmalloc_minimal (Debian/Ubuntu: libtcmalloc-minimal4)
  iomp5      Intel OpenMP (`pip install intel-openmp` puts it in <prefix>/lib); it takes
             over torch's GNU OpenMP calls, and reads KMP_* settings (e.g. KMP_AFFINITY)
  a path     any other shared library
"""

from __future__ import annotations

import ctypes.util
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

_LIB_DIRS = (Path(sys.prefix) / "lib", Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib"))
_KNOWN = {"tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"), "iomp5": ("libiomp5.so",)}


def resolve_library(name: str) -> Path | None:
    """The file a preload name stands for, or None where this machine has none."""
    if "/" in name:
        return Path(name) if Path(name).is_file() else None
    for file_name in _KNOWN.get(name, (f"lib{name}.so",)):
        for directory in _LIB_DIRS:
            if (directory / file_name).is_file():
                return directory / file_name
    found = ctypes.util.find_library(name.removeprefix("lib"))
    return Path(found) if found and Path(found).is_absolute() else None


REPLICA_DEFAULTS = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def engine_env_vars(preload: list[str], env: dict[str, str]) -> dict[str, str]:
    """REPLICA_DEFAULTS and `env` over them, plus LD_PRELOAD of every library in `preload`
    that this machine has."""
    found = []
    for name in preload:
        path = resolve_library(name)
        if path is None:
            logger.warning("engine_preload: %r not found on this machine; the engine runs without it", name)
        else:
            found.append(str(path))
    variables = {**REPLICA_DEFAULTS, **env}
    if found:
        variables["LD_PRELOAD"] = ":".join([*found, *filter(None, [env.get("LD_PRELOAD")])])
    return variables


def engine_runtime_env(preload: list[str], env: dict[str, str]) -> dict:
    """The engine replica's runtime_env: environment variables only, so Serve merges them
    into the application's runtime_env (working_dir, pip, ...) rather than replacing it."""
    return {"env_vars": engine_env_vars(preload, env)}
