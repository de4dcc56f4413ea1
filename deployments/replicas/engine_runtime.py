"""The engine replica's process environment, through its Ray `runtime_env`: Ray starts the
replica's worker process with these variables.

Serve runs the engine deployment's code on the replica's own event loop rather than on a
loop in a thread of its own, one thread hop less for every chunk a stream sends. Past its
constructor (which waits for the engine to build, before the replica serves anything) the
deployment's code never blocks its loop: the model steps on the step loop thread. A
blocking loop is what the separate thread guards against.
"""

from __future__ import annotations

REPLICA_DEFAULTS = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def engine_runtime_env() -> dict:
    """The engine replica's runtime_env: environment variables only, so Serve merges them
    into the application's runtime_env (working_dir, pip, env_vars, ...) rather than replacing it."""
    return {"env_vars": dict(REPLICA_DEFAULTS)}
