"""Two real engine replicas behind the PrefixAffinityRouter, four LoRA adapters, two slots
each: every adapter's requests land on its home replica, which holds it after the first, and the
replicas' LoRA metrics reach Ray's Prometheus export."""

from __future__ import annotations

import re
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ray import serve
from ray.serve.config import RequestRouterConfig

from deployments.replicas.engine_deployment import EngineDeployment
from deployments.routing.prefix_routing import adapter_key
from engine import EngineConfig, SamplingParams
from engine.request.lora_request import LoraRequest
from tests.serve_helpers import running_app
from tests.test_lora import save_adapter
from tests.test_observability import scrape_until

pytestmark = pytest.mark.serve

APP = "lora-routing"
NAMES = ("a", "b", "c", "d")
STATS_PERIOD_S = 0.2
ROUTER = RequestRouterConfig(request_router_class="deployments.routing.router:PrefixAffinityRouter",
                             request_router_kwargs={"load_bound_eps": 0.75, "key_blocks": 4},
                             request_routing_stats_period_s=STATS_PERIOD_S)


@pytest.fixture(scope="module")
def adapters(tiny_gpt2_dir, tmp_path_factory) -> dict[str, LoraRequest]:
    root = tmp_path_factory.mktemp("routed-loras")
    return {name: LoraRequest(name, str(save_adapter(tiny_gpt2_dir, root / name, seed, r=4, lora_alpha=8,
                                                           target_modules=["c_attn", "c_fc"])))
            for seed, name in enumerate(NAMES)}


@pytest.fixture(scope="module")
def server(tiny_gpt2_dir: Path) -> Iterator[str]:
    """The metrics export URL of an app of two engine replicas, LoRA on, two slots each."""
    config = EngineConfig(model=str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu",
                          compile_decode=False, num_kv_blocks=64, max_loras=2)
    engine = EngineDeployment.options(num_replicas=2, request_router_config=ROUTER,
                                      ray_actor_options={"num_cpus": 0.4}, graceful_shutdown_timeout_s=5)
    with running_app(engine.bind(config), APP) as instance:
        time.sleep(5 * STATS_PERIOD_S)  # every replica reported once: the router knows their free slots
        yield instance.metrics_url


def generate(lora: LoraRequest, prompt: list[int]) -> list[int]:
    handle = serve.get_app_handle(APP).options(stream=True)
    chunks = handle.generate.remote(request_id=uuid.uuid4().hex, prompt_token_ids=prompt,
                                    params=SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), lora=lora)
    return [t for chunk in chunks for t in chunk.token_ids]


def requests_by_replica(metrics_url: str) -> dict[str, dict[str, float]]:
    """rayinfer_lora_requests of this app: adapter -> replica -> requests."""
    counts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in httpx.get(metrics_url, timeout=5).text.splitlines():
        if line.startswith("ray_rayinfer_lora_requests_total{") and f'application="{APP}"' in line:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            counts[labels["adapter"]][labels["replica"]] += float(line.rsplit(" ", 1)[1])
    return counts


def test_each_adapters_requests_land_on_one_replica_which_holds_it_after_the_first(server, adapters):
    # First seen in adapter_key order, each new adapter is placed after the others, so no home
    # moves as the set grows (adapter_homes.py); in another order an early home may move once.
    in_key_order = sorted(NAMES, key=adapter_key)
    for round_ in range(3):
        for name in in_key_order:
            index = NAMES.index(name)
            assert len(generate(adapters[name], list(range(10 + index, 50 + index)))) == 3
    at_least = lambda n: lambda v: v >= n  # noqa: E731
    scrape_until(server, APP, {
        ("ray_rayinfer_lora_requests_total", ("holding", "none")): lambda v: v == len(NAMES),  # each read once
        ("ray_rayinfer_lora_requests_total", ("holding", "resident")): lambda v: v == 2 * len(NAMES),
        ("ray_rayinfer_lora_generation_tokens_total", ("adapter", "a")): at_least(9),
        ("ray_rayinfer_lora_prompt_tokens_total", ("adapter", "d")): at_least(3 * 40),
        ("ray_rayinfer_lora_adapters_resident",): lambda v: v == len(NAMES),  # two a replica
        ("ray_rayinfer_lora_adapters_loaded",): lambda v: v == len(NAMES),
        ("ray_rayinfer_lora_slot_loads_total",): lambda v: v == len(NAMES),
        ("ray_rayinfer_lora_load_seconds_total",): lambda v: 0 < v < 30,
    })
    replicas = requests_by_replica(server)
    assert {name: len(by_replica) for name, by_replica in replicas.items()} == dict.fromkeys(NAMES, 1)
    assert len({replica for by_replica in replicas.values() for replica in by_replica}) == 2
