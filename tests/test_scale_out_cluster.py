"""Scale-out beyond one fixed replica set: autoscaling on engine load (a burst takes the
engine from 1 replica to 2, quiet brings it back, no request fails) and a two-node Ray
cluster on this machine with an engine replica on each node, serving over HTTP."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from bench.scale.load_log import make_logged_app
from deployments.routing.prefix_routing import prefix_key, rendezvous_order
from tests.serve_helpers import CONTROLLER_OPTIONS, free_port, reaped, running_app, shut_serve_and_ray
from tests.test_scale_out import (APP, BLOCK, KEY_BLOCKS, ROUTER, app_args, complete, engine_replicas,
                                  new_requests, random_prompt, served)

pytestmark = pytest.mark.serve

AUTOSCALING = {
    "min_replicas": 1, "initial_replicas": 1, "max_replicas": 2,
    "metrics_interval_s": 0.2, "look_back_period_s": 1.0,
    "upscale_delay_s": 0.5, "downscale_delay_s": 3.0,
    "policy": {"policy_function": "deployments.routing.autoscaling:EngineLoadPolicy",
               "policy_kwargs": {"target_requests": 4, "target_waiting_prompt_tokens": 100000,
                                 "target_kv_cache_usage": 0.99}},
}


def num_running_engine_replicas() -> int:
    deployment = serve.status().applications[APP].deployments["EngineDeployment"]
    return deployment.replica_states.get("RUNNING", 0)


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not {what} after {timeout_s}s"
        time.sleep(0.25)


def test_a_burst_scales_the_engine_up_and_quiet_scales_it_down_without_a_failed_request(tiny_gpt2_dir):
    options = {"EngineDeployment": {"autoscaling_config": AUTOSCALING, "request_router_config": ROUTER,
                                    "graceful_shutdown_timeout_s": 5}}
    with running_app(make_logged_app(app_args(tiny_gpt2_dir), options), APP) as instance:
        url = instance.url
        assert num_running_engine_replicas() == 1
        statuses: list[int] = []
        stop = threading.Event()

        def user(seed: int) -> None:
            rng = random.Random(seed)
            with httpx.Client(base_url=url, timeout=120) as client:
                while not stop.is_set():
                    body = {"model": "tiny", "prompt": random_prompt(rng, 40), "max_tokens": 64, "ignore_eos": True}
                    statuses.append(client.post("/v1/completions", json=body).status_code)

        with ThreadPoolExecutor(12) as pool:
            users = [pool.submit(user, seed) for seed in range(12)]
            try:
                wait_until(lambda: num_running_engine_replicas() == 2, 90, "scaled up to 2")
            finally:
                stop.set()
            for future in users:
                future.result()
        wait_until(lambda: num_running_engine_replicas() == 1, 60, "scaled back down to 1")
        assert statuses and set(statuses) == {200}


@contextlib.contextmanager
def two_node_cluster() -> Iterator[Cluster]:
    """A head and a worker node of 2 CPUs each, as `ray start --head` and `ray start
    --address` make them; every process they started has exited afterwards."""
    clusters: list[Cluster] = []

    def shutdown() -> None:
        shut_serve_and_ray()
        for cluster in clusters:
            cluster.shutdown()

    with reaped(shutdown, "the cluster"):
        clusters.append(Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}))
        clusters[0].add_node(num_cpus=2)
        ray.init(address=clusters[0].address, log_to_driver=False)
        yield clusters[0]


@pytest.mark.own_cluster
def test_two_nodes_serve_over_http_with_an_engine_replica_on_each(tiny_gpt2_dir: Path):
    port = free_port()
    # One engine replica per node, as a user spreading engines over machines asks Serve for:
    # by CPUs alone both could land on the head once the ingress took the worker's spare CPU.
    app = make_logged_app({**app_args(tiny_gpt2_dir), "engine_num_cpus": 1},
                   {"EngineDeployment": {"num_replicas": 2, "max_replicas_per_node": 1,
                                         "request_router_config": ROUTER}})
    with two_node_cluster():
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port},
                    controller_options=CONTROLLER_OPTIONS)
        serve.run(app, name=APP, route_prefix="/")
        replicas = engine_replicas()
        nodes = {replica_id: ray._private.state.actors(actor._actor_id.hex())["Address"]["NodeID"]
                 for replica_id, actor in replicas.items()}
        assert len(set(nodes.values())) == 2, nodes
        rng = random.Random(4)
        homes = {}
        while len(homes) < 2:  # a prefix whose first choice is each replica
            prefix = random_prompt(rng, 5 * BLOCK)
            homes.setdefault(rendezvous_order(prefix_key(prefix, BLOCK, KEY_BLOCKS), list(replicas))[0], prefix)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            for replica_id, prefix in homes.items():
                before = served()
                complete(client, prefix + [400, 401], max_tokens=4)
                assert new_requests(before) == {r: int(r == replica_id) for r in replicas}
