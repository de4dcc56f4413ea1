"""GET /metrics on the API port: Ray's own Prometheus export, the one the dashboard's
Prometheus scrapes, read from every alive node's metrics agent and served as one page.

Ray exports each node's metrics (ours as `ray_rayinfer_*`, Serve's as `ray_serve_*`) on
that node's metrics export port, which `serve run` picks at random; clients such as aiperf
look for /metrics on the API's own URL instead. With several nodes, one metric family's
samples come from each node (told apart by their labels) and are merged under one
HELP/TYPE header, as the text format requires.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import httpx
import ray
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the text format Ray's agents serve
_SCRAPE_TIMEOUT_S = 5.0


def node_export_urls() -> list[str]:
    """Every alive node's metrics export URL (ray.nodes() is a GCS call: run it off the loop)."""
    return [f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            for node in ray.nodes() if node.get("Alive") and node.get("MetricsExportPort")]


async def scrape(http: httpx.AsyncClient) -> str:
    urls = await asyncio.to_thread(node_export_urls)
    pages = await asyncio.gather(*(_get(http, url) for url in urls))
    texts = [page for page in pages if page is not None]
    if len(texts) == 1:
        return texts[0]
    return merge(texts)


async def _get(http: httpx.AsyncClient, url: str) -> str | None:
    """A node that does not answer (it is leaving, its agent restarts) is left out, not fatal."""
    try:
        response = await http.get(url, timeout=_SCRAPE_TIMEOUT_S)
        response.raise_for_status()
        return response.text
    except httpx.HTTPError:
        return None


def merge(texts: Iterable[str]) -> str:
    families: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, family)
            if merged is not family:
                merged.samples.extend(family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry).decode()


class _Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families
