"""Whether the engine deployment has a replica to send to, as the Ingress's handle sees it:
while it has none (the replica died or is being replaced), a request gets a 503 at once
instead of waiting in Serve's router until a new replica is up.

Serve's router keeps that set current: the controller's long poll adds and removes
replicas, and the router drops a replica as soon as a call or a queue-length probe to it
fails with ActorDiedError. No public API gives the set, nor any other signal as quick
(serve.status() waits for the controller's health checks; a liveness call waits in the same
router), so `num_replicas` reads the router's own attributes, which Ray 2.60 has
(pyproject.toml pins the range). Where they are missing it fails loudly, never silently:
`check_serve_internals` raises at the Ingress's start (the app does not deploy), and
tests/test_serve_internals.py fails on a Ray that moved them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import ray
from ray.serve.handle import DeploymentHandle

from deployments.api.errors import unavailable

T = TypeVar("T")

# How often the watch looks at the set: the router can lose its last replica while requests
# wait in it (a probe of the dead replica fails), and they are answered within this.
_POLL_S = 0.2


class ServeInternalsMoved(RuntimeError):
    """This Ray's Serve lacks a private attribute rayinfer reads."""

    def __init__(self, what: str) -> None:
        super().__init__(f"Ray {ray.__version__}'s Serve has no {what}: rayinfer supports the Ray versions "
                         "pyproject.toml pins (deployments/api/engine_replicas.py)")


class EngineReplicas:
    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle
        self._watch: asyncio.Task | None = None  # done once the set is empty; shared by every waiting call

    def check_serve_internals(self) -> None:
        """Raises ServeInternalsMoved unless the handle's router has what num_replicas reads;
        call it once the handle has made a call (its router is built then)."""
        _router_parts(self._handle)

    def num_replicas(self) -> int | None:
        """The replicas the handle's router can send to; None when unknown: a router not
        built yet, or an engine that autoscales from zero (a request waiting in the router is
        what wakes it)."""
        parts = _router_parts(self._handle)
        if parts is None:
            return None
        request_router, metrics_manager = parts
        config = metrics_manager.autoscaling_config
        if request_router is None or (config is not None and config.min_replicas == 0):
            return None
        return len(request_router.curr_replicas)

    async def while_up(self, waiting: Awaitable[T]) -> T:
        """`waiting`'s result, or a 503 as soon as the handle has no replica; leaving early
        (the 503, or the caller cancelled) cancels `waiting`."""
        task = asyncio.ensure_future(waiting)
        try:
            if self.num_replicas() != 0:
                done, _ = await asyncio.wait({task, self._none_left()}, return_when=asyncio.FIRST_COMPLETED)
                if task in done:
                    return task.result()
            raise unavailable("no engine replica is up (one is being replaced); retry shortly")
        finally:
            task.cancel()  # a no-op once it is done

    def _none_left(self) -> asyncio.Task:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._until_none_left())
        return self._watch

    async def _until_none_left(self) -> None:
        while self.num_replicas() != 0:
            await asyncio.sleep(_POLL_S)


def _router_parts(handle: DeploymentHandle) -> tuple[Any, Any] | None:
    """The handle's request router (None until it routes a first request) and its metrics
    manager (which holds the deployment's autoscaling config); None before the handle's
    first call."""
    if not handle.is_initialized:
        return None
    router = getattr(handle, "_router", None)
    asyncio_router = getattr(router, "_asyncio_router", None)
    for name in ("_request_router", "_metrics_manager"):
        if not hasattr(asyncio_router, name):
            raise ServeInternalsMoved(f"DeploymentHandle._router._asyncio_router.{name}")
    request_router = asyncio_router._request_router
    if request_router is not None and not hasattr(request_router, "curr_replicas"):
        raise ServeInternalsMoved("RequestRouter.curr_replicas")
    if not hasattr(asyncio_router._metrics_manager, "autoscaling_config"):
        raise ServeInternalsMoved("RouterMetricsManager.autoscaling_config")
    return request_router, asyncio_router._metrics_manager
