"""Whether the engine deployment has a replica to send to, as the Ingress's handle sees it
(`ingress: deployment`): while it has none (the replica died or is being replaced), a
request gets a 503 at once instead of waiting in Serve's router until a new replica is up.

Serve's router keeps that set current: the controller's long poll adds and removes
replicas, and the router drops a replica as soon as a call or a queue-length probe to it
fails with ActorDiedError. Serve has no public API for the set, so `num_replicas` reads the
router's own attributes (Ray 2.60); where they are missing (another Ray) it knows nothing,
and requests wait in the router as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from ray.serve.handle import DeploymentHandle

from deployments.api.errors import unavailable

T = TypeVar("T")

# How often the watch looks at the set: the router can lose its last replica while requests
# wait in it (a probe of the dead replica fails), and they are answered within this.
_POLL_S = 0.2


class EngineReplicas:
    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle
        self._watch: asyncio.Task | None = None  # done once the set is empty; shared by every waiting call

    def num_replicas(self) -> int | None:
        """The replicas the handle's router can send to; None when unknown: a router not
        built yet, a Ray without these attributes, or an engine that autoscales from zero
        (a request waiting in the router is what wakes it)."""
        router = getattr(getattr(self._handle, "_router", None), "_asyncio_router", None)
        request_router = getattr(router, "_request_router", None)
        replicas = getattr(request_router, "curr_replicas", None)
        if replicas is None or _scales_from_zero(router):
            return None
        return len(replicas)

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


def _scales_from_zero(router: object) -> bool:
    config = getattr(getattr(router, "_metrics_manager", None), "autoscaling_config", None)
    return config is not None and config.min_replicas == 0
