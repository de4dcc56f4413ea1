"""Starting and stopping real Ray Serve instances for tests, leaving no process behind."""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import ray
import yaml
from ray import serve
from ray.serve.schema import ServeDeploySchema

from loadtest.client import serve_process

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 180
MODEL = "tiny"  # the served_model_name every test app uses
# The suite's in-process Serve instances start as `serve run configs/gpt2.yaml` does: the
# controller's environment (which its proxy and replicas inherit) is part of what ships.
CONTROLLER_OPTIONS = yaml.safe_load((ROOT / "configs" / "gpt2.yaml").read_text())["controller_options"]


# Below Linux's ephemeral range (32768+), where the kernel hands out ports to every process
# that binds port 0 (Ray's gRPC servers among them), and above Ray's worker ports
# (10002-19999): a port picked here is not taken between the check and the proxy's bind.
_PORT_RANGE = (20000, 32000)


def free_port() -> int:
    for port in random.Random().sample(range(*_PORT_RANGE), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORT_RANGE}")


def tiny_app_args(model_dir: Path, **overrides: Any) -> dict[str, Any]:
    """build_app's arguments for the tiny checkpoint in fp32, served as MODEL, its steps
    eager (compile_decode: false) so the app is up at once: test_serve_run serves the
    shipped config, graph and all."""
    engine = {"compile_decode": False, **overrides.pop("engine", {})}
    return {"model": str(model_dir), "served_model_name": MODEL, "dtype": "float32", "engine": engine, **overrides}


def is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def titled_processes(title: str) -> list[psutil.Process]:
    """This process's live descendants whose title (Ray sets it to the actor's class or
    replica) holds `title`: those of the clusters this test process started, not another's."""
    found = []
    for process in descendants():
        with contextlib.suppress(psutil.Error):
            cmdline = process.cmdline()
            if cmdline and title in cmdline[0] and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def one_titled_process(title: str) -> psutil.Process:
    processes = titled_processes(title)
    assert len(processes) == 1, processes
    return processes[0]


def replica_processes(deployment: str, app: str = "rayinfer") -> list[psutil.Process]:
    """The live replica processes of `deployment`."""
    return titled_processes(f"ServeReplica:{app}:{deployment}")


def replica_process(deployment: str, app: str = "rayinfer") -> psutil.Process:
    """The one live replica process of `deployment`."""
    return one_titled_process(f"ServeReplica:{app}:{deployment}")


def proxy_process() -> psutil.Process:
    """The one live process of Serve's HTTP proxy."""
    return one_titled_process("ray::ProxyActor")


def wait_for_exit(pids: list[int], timeout_s: float = 20) -> list[int]:
    """The pids still running after timeout_s."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if is_running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if is_running(p)]
    return alive


def ray_logs_dir() -> Path:
    """The logs of the Ray cluster this process is connected to."""
    return Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"


def descendants() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def reap(started: list[psutil.Process], timeout_s: float = 20) -> list[str]:
    """Waits for `started` to exit, kills by PID those that don't (psutil refuses a PID the
    kernel has since reused), and names them."""
    alive = set(wait_for_exit([p.pid for p in started], timeout_s))
    outlived = [p for p in started if p.pid in alive]
    names = []
    for process in outlived:
        with contextlib.suppress(psutil.NoSuchProcess):
            names.append(f"{process.pid} {' '.join(process.cmdline())[:120]}")
            process.kill()
    return names


@contextlib.contextmanager
def reaped(shutdown: Callable[[], None], what: str, timeout_s: float = 20) -> Iterator[None]:
    """Runs the block, then `shutdown`; afterwards every process started meanwhile (Ray's
    gcs_server, raylet, agents and workers: all this process's descendants, gathered before
    the shutdown orphans the workers) must exit. Those that don't are killed, so a leak or a
    half-done `ray.init` can't fail the modules after it as well (a CI run's did: the
    gcs_server of an init whose raylet never came up outlived every later module's check)."""
    before = {p.pid for p in descendants()}
    try:
        yield
    finally:
        started = [p for p in descendants() if p.pid not in before]
        try:
            shutdown()
        finally:
            outlived = reap(started, timeout_s)
    assert outlived == [], f"processes outlived {what}: {outlived}"


def shut_serve_and_ray() -> None:
    try:
        # Serve's graceful pass first, as every passing CI run before 2cd89c0 had it: the
        # one run with ray.shutdown() alone had a later module's raylet never start. Without
        # it, more of gRPC's threads stayed at work in this process, the one every later
        # ray.init forks from. Only with Ray up: without,
        # Serve would start a cluster to shut down.
        if ray.is_initialized():
            with contextlib.suppress(Exception):
                serve.shutdown()
    finally:
        ray.shutdown()


@dataclass
class ServeInstance:
    """The suite's one local Ray (2 CPUs) and Serve instance: HTTP on a free 127.0.0.1 port,
    Ray's Prometheus export on another, each replica's metrics reported every 0.5 s. Every
    in-process app module deploys into it under a name of its own, so the suite starts Ray
    once rather than once a module."""

    port: int
    metrics_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


_shared: ServeInstance | None = None
_shared_reaper: contextlib.ExitStack | None = None


def shared_serve() -> ServeInstance:
    """The shared instance, started at its first use."""
    global _shared, _shared_reaper
    if _shared is None:
        port, metrics_port = free_port(), free_port()
        with contextlib.ExitStack() as reaper:
            reaper.enter_context(reaped(shut_serve_and_ray, "the shared serve.shutdown() and ray.shutdown()"))
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                     _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 500})
            serve.start(http_options={"host": "127.0.0.1", "port": port}, controller_options=CONTROLLER_OPTIONS)
            _shared_reaper = reaper.pop_all()  # kept until release; a failed start is shut down here
        _shared = ServeInstance(port, metrics_port)
    return _shared


def release_shared_serve() -> None:
    """Shut the shared instance down, if it is up (at the session's end, or before a module
    starts a Ray cluster of its own), and check every process it started has exited."""
    global _shared, _shared_reaper
    reaper, _shared, _shared_reaper = _shared_reaper, None, None
    if reaper is not None:
        reaper.close()


@contextlib.contextmanager
def running_app(app: serve.Application, name: str) -> Iterator[ServeInstance]:
    """`app` served at / of the shared instance under `name`; afterwards the app is deleted
    and each of its replica processes must have exited."""
    instance = shared_serve()
    serve.run(app, name=name, route_prefix="/")
    with deleted_at_exit(name):
        yield instance


@contextlib.contextmanager
def deleted_at_exit(name: str) -> Iterator[None]:
    """Runs the block; then the app `name` is deleted and each of its replica processes must have exited."""
    try:
        yield
    finally:
        replicas = titled_processes(f"ServeReplica:{name}:")
        serve.delete(name)
        outlived = reap(replicas, timeout_s=30)
        assert outlived == [], f"replicas of {name} outlived serve.delete: {outlived}"


def deploy_config(app_config: dict, timeout_s: float = READY_TIMEOUT_S) -> None:
    """One application's config (a config file's `applications:` entry) applied to the shared
    instance as `serve run` and `serve deploy` apply a config file (the Serve client's
    deploy_apps), once it runs. Unlike serve.run(app), which makes every call a new code
    version, a config that changes only num_replicas or a reconfigurable option keeps the
    running replicas."""
    shared_serve()
    name = app_config["name"]
    before = serve.status().applications.get(name)
    serve.context._get_global_client().deploy_apps(ServeDeploySchema(applications=[app_config]))
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(name)
        deployed = status is not None and (before is None or status.last_deployed_time_s > before.last_deployed_time_s)
        if deployed and status.status == "RUNNING":
            return
        assert status is None or status.status in ("NOT_STARTED", "DEPLOYING", "RUNNING"), status
        assert time.monotonic() < deadline, f"{name} not running after {timeout_s}s: {status}"
        time.sleep(0.5)


@contextlib.contextmanager
def running_config(app_config: dict) -> Iterator[ServeInstance]:
    """As running_app, for an app deployed from its config (deploy_config)."""
    instance = shared_serve()
    deploy_config(app_config)
    with deleted_at_exit(app_config["name"]):
        yield instance


def serve_executable() -> str:
    beside_python = Path(sys.executable).with_name("serve")
    return str(beside_python) if beside_python.exists() else shutil.which("serve")


class ServeRun:
    """`serve run --address local CONFIG` in a subprocess, as a user starts it; --address
    local: our own cluster, never one another process on this machine started."""

    def __init__(self, config: Path, log: Path, env: dict[str, str]):
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen([serve_executable(), "run", "--address", "local", str(config)],
                                         cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         preexec_fn=serve_process.restore_sigint)  # also under `.ci/run &`
        self._descendants: list[psutil.Process] = []

    def wait_until_ready(self, url: str) -> None:
        """Until GET url answers 200, failing at once if serve run exits."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"serve run exited early (rc {self.proc.returncode}):\n{self.log_tail()}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            time.sleep(1)
        pytest.fail(f"not ready after {READY_TIMEOUT_S}s:\n{self.log_tail()}")

    def wait_for_log(self, text: str, timeout_s: float) -> None:
        """Until serve run's output (which carries its replicas' logs) holds `text`."""
        deadline = time.monotonic() + timeout_s
        while text not in self.log.read_text():
            assert self.proc.poll() is None, f"serve run exited early (rc {self.proc.returncode}):\n{self.log_tail()}"
            if time.monotonic() > deadline:
                pytest.fail(f"no {text!r} in serve run's log after {timeout_s}s:\n{self.log_tail()}")
            time.sleep(1)

    def stop(self, timeout_s: float) -> None:
        """Ctrl-C, as a user stops it: serve run exits 0 and takes every process it started."""
        self._descendants = self._children()
        self.proc.send_signal(signal.SIGINT)
        assert self.proc.wait(timeout=timeout_s) == 0, self.log_tail()
        assert wait_for_exit([p.pid for p in self._descendants]) == [], "Ray processes outlived serve run"

    def kill_leftovers(self) -> None:
        """After a failure: kill what this serve run started, by PID, and nothing else."""
        if self.proc.poll() is None:
            self._descendants = self._children()
            self.proc.kill()
        reap(self._descendants, timeout_s=0)

    def log_tail(self) -> str:
        return self.log.read_text()[-4000:]

    def _children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)


@contextlib.contextmanager
def serve_run(config: Path, log: Path, env: dict[str, str]) -> Iterator[ServeRun]:
    """A ServeRun whose leftovers are killed on the way out, however the test ended."""
    run = ServeRun(config, log, env)
    try:
        yield run
    finally:
        run.kill_leftovers()
