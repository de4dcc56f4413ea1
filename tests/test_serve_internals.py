# The private parts of Ray Serve that rayinfer reads, pinned: each test fails on a Ray that
# moved one, so an upgrade past pyproject.toml's range is caught here, never in service as
# a feature that silently stopped working. (tests/test_serve_api.py reads them live.)
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import ray
from packaging.specifiers import SpecifierSet
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, RequestRouter

from deployments.api.engine_replicas import EngineReplicas, ServeInternalsMoved
from tests.serve_helpers import ROOT


def pinned_ray() -> SpecifierSet:
    import tomllib

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [ray_serve] = [d for d in dependencies if d.startswith("ray[serve]")]
    return SpecifierSet(ray_serve.removeprefix("ray[serve]"))


def test_the_installed_ray_is_in_the_pinned_range() -> None:
    assert ray.__version__ in pinned_ray()


def test_a_handle_still_takes_the_grpc_transport_option() -> None:
    """deployments/api/handles.py: `_by_reference=False` (TypeError on a Ray without it)."""
    assert "_by_reference" in inspect.signature(DeploymentHandle.options).parameters


def test_the_router_still_reads_serves_queue_length_cache_and_the_calls_keywords() -> None:
    """deployments/routing/router.py: RequestRouter.replica_queue_len_cache.get(replica_id),
    PendingRequest.kwargs."""
    cache_type = inspect.signature(RequestRouter.replica_queue_len_cache.fget).return_annotation
    cache_type = getattr(inspect.getmodule(RequestRouter), cache_type) if isinstance(cache_type, str) else cache_type
    assert callable(cache_type.get)
    assert "kwargs" in {field.name for field in PendingRequest.__dataclass_fields__.values()}


def test_the_handles_router_still_holds_the_replica_set_and_autoscaling_config() -> None:
    """deployments/api/engine_replicas.py reads these off an AsyncioRouter instance."""
    from ray.serve._private.router import AsyncioRouter, RouterMetricsManager

    init = inspect.getsource(AsyncioRouter.__init__)
    assert "self._request_router" in init and "self._metrics_manager = RouterMetricsManager(" in init
    assert isinstance(RouterMetricsManager.autoscaling_config, property)
    assert isinstance(RequestRouter.curr_replicas, property)


def test_a_ray_without_them_fails_the_ingress_loudly() -> None:
    handle = SimpleNamespace(is_initialized=True, _router=SimpleNamespace(_asyncio_router=object()))
    with pytest.raises(ServeInternalsMoved, match="_asyncio_router._request_router"):
        EngineReplicas(handle).check_serve_internals()
    with pytest.raises(ServeInternalsMoved):
        EngineReplicas(handle).num_replicas()
