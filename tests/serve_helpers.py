"""Starting and stopping real Ray Serve instances for tests, leaving no process behind."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import psutil
import ray
from ray import serve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for_exit(pids: list[int], timeout_s: float = 20) -> list[int]:
    """The pids still running after timeout_s."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if is_running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if is_running(p)]
    return alive


@contextlib.contextmanager
def running_app(app: serve.Application, name: str = "rayinfer", **ray_init_kwargs) -> Iterator[str]:
    """A fresh local Ray (2 CPUs) serving `app` at / on a free 127.0.0.1 port; yields its
    base URL, then shuts Serve and Ray down and checks that every Ray process exited."""
    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, **ray_init_kwargs)
    # gcs_server and raylet are our children; every worker is the raylet's.
    ray_pids = [p.pid for p in psutil.Process().children(recursive=True)]
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app, name=name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
    assert wait_for_exit(ray_pids) == [], "Ray processes outlived ray.shutdown()"
