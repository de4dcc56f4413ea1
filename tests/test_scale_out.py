"""Several engine replicas behind PrefixAffinityRouter, for real: Ray Serve on CPU, real
HTTP, the tiny checkpoint. Each prompt is a list of token ids, so its key is known here:
a prefix's requests all land on its rendezvous first choice, a burst on one prefix spills
to its second choice within the load bound (as the replicas' own load logs show), two
routers in two processes agree and stay within it together, replicas added or removed
mid-run take or hand over keys without a failed request, and the router's metrics reach
Prometheus."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from bench.scale.load_log import LOAD_LOG_DIR_ENV, read_load_logs
from deployments.routing.prefix_routing import prefix_key, rendezvous_order
from engine import SamplingParams
from bench.scale.load_balance import arrival_loads
from tests.http_helpers import wait_for
from tests.serve_helpers import deploy_config, running_config
from tests.test_observability import scrape_until

pytestmark = pytest.mark.serve

APP = "scale-out"
BLOCK = 16  # EngineConfig's default block_size
KEY_BLOCKS = 4
EPS = 0.5
ROUTER = {"request_router_class": "deployments.routing.router:PrefixAffinityRouter",
          "request_router_kwargs": {"load_bound_eps": EPS, "key_blocks": KEY_BLOCKS, "load_unit": "requests"},
          "request_routing_stats_period_s": 0.2}
# How long until every router's view of the replicas' reports is current: Serve's controller
# polls each replica once a stats period (within 10%) from its control loop, then broadcasts
# over long poll. Under the full suite on 2 cores that chain took more than two periods
# (a sequential request on idle replicas spilled on a report from the one before it).
REPORTS_SETTLE_S = 5 * ROUTER["request_routing_stats_period_s"]
# Requests routed within a burst reach their replicas in whatever order the replicas'
# processes get the CPU: on a loaded 2-core machine one replica took a burst's requests
# 0.3 s after the other (a CPU-bound process beside the suite), and 0.7 s after on an
# AVX2-only machine under the full suite. A breach counts only if it lasts once this
# window's arrivals are in; one the router made lasts until departures (BURST_MAX_TOKENS
# keeps them 5 s or more after the burst).
ARRIVAL_SETTLE_S = 1.0
# A burst's requests decode this many tokens: long enough that none ends before the whole
# burst has reached its replicas, so the load logs judge the burst's placement, not
# departures the router could not have known of when it chose (48 tokens ended within
# 0.15 s, before the other replica's share arrived, 0.25 s late under a CPU-bound process;
# on an AVX2-only machine beside a CPU-bound process, 160 tokens ended 1.2 s in, before the
# last of the burst arrived, 1.4 s in). 18 on one replica fit its KV blocks (app_args: 31
# blocks each, and the prefix's 5 they share).
BURST_MAX_TOKENS = 480
DECODE_TOKEN_COST = 1.0
WORK_ROUTER = {**ROUTER, "request_router_kwargs": {"load_bound_eps": EPS, "key_blocks": KEY_BLOCKS, "load_unit": "work",
                                                   "decode_token_cost": DECODE_TOKEN_COST}}


def app_args(tiny_gpt2_dir: Path) -> dict:
    """The app's arguments."""
    return {"model": str(tiny_gpt2_dir), "served_model_name": "tiny", "dtype": "float32",
            "engine_num_cpus": 0.4, "tokenizer_num_replicas": 1,
            "engine": {"num_kv_blocks": 640, "max_num_seqs": 32, "max_num_batched_tokens": 512, "compile_decode": False}}


def app_config(tiny_gpt2_dir: Path, load_log_dir: Path, num_replicas: int, router: dict = ROUTER) -> dict:
    """The app as a config file declares it (configs/scale-out.yaml's shape): applied as
    `serve run` or `serve deploy` applies one, a later config that changes only num_replicas
    adds or removes replicas while the others keep running."""
    engine = {"name": "EngineDeployment", "num_replicas": num_replicas, "request_router_config": router,
              "graceful_shutdown_timeout_s": 5}
    return {"name": APP, "route_prefix": "/", "import_path": "bench.scale.load_log:build_app",
            "runtime_env": {"env_vars": {LOAD_LOG_DIR_ENV: str(load_log_dir)}},  # its engine replicas log there
            "args": app_args(tiny_gpt2_dir), "deployments": [engine]}


@pytest.fixture(scope="module")
def load_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Engine replicas log their load here (bench/scale/load_log.py), told by their
    environment (the application's runtime_env)."""
    return tmp_path_factory.mktemp("load-logs")


@pytest.fixture(scope="module")
def server(tiny_gpt2_dir: Path, load_log_dir: Path) -> Iterator[tuple[str, str]]:
    with running_config(app_config(tiny_gpt2_dir, load_log_dir, 2)) as instance:
        yield instance.url, instance.metrics_url


def engine_replicas() -> dict[str, ray.actor.ActorHandle]:
    """Each running engine replica's actor, by its replica id (what the router ranks)."""
    prefix = f"SERVE_REPLICA::{APP}#EngineDeployment#"
    names = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
             if actor["namespace"] == "serve" and actor["name"].startswith(prefix)]
    return {name.removeprefix(prefix): ray.get_actor(name, namespace="serve") for name in names}


def served() -> dict[str, int]:
    """Requests each engine replica has served since it started."""
    return {replica_id: ray.get(actor.record_routing_stats.remote())["num_requests"]
            for replica_id, actor in engine_replicas().items()}


def new_requests(before: dict[str, int]) -> dict[str, int]:
    return {replica_id: count - before.get(replica_id, 0) for replica_id, count in served().items()}


def random_prompt(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(256, 50000) for _ in range(num_tokens)]


def complete(client: httpx.Client, prompt: list[int], max_tokens: int = 2) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text


def test_each_prefix_goes_to_its_first_choice_and_hits_its_cache(server):
    base_url, _ = server
    rng = random.Random(0)
    replica_ids = list(engine_replicas())
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for _ in range(6):
            prefix = random_prompt(rng, 5 * BLOCK)
            first_choice = rendezvous_order(prefix_key(prefix, BLOCK, KEY_BLOCKS), replica_ids)[0]
            before = served()
            for _ in range(3):
                complete(client, prefix + random_prompt(rng, 8))
            assert new_requests(before) == {r: 3 if r == first_choice else 0 for r in replica_ids}
    stats = [ray.get(actor.record_routing_stats.remote()) for actor in engine_replicas().values()]
    # The 2nd and 3rd request of each prefix found its 5 blocks cached.
    assert sum(s["num_prefix_hit_tokens"] for s in stats) >= 6 * 2 * 5 * BLOCK


def test_a_burst_on_one_prefix_spills_to_its_second_choice_within_the_bound(server, load_log_dir):
    base_url, metrics_url = server
    rng = random.Random(1)
    prefix = random_prompt(rng, 5 * BLOCK)
    replica_ids = list(engine_replicas())
    order = rendezvous_order(prefix_key(prefix, BLOCK, KEY_BLOCKS), replica_ids)
    before, started = served(), time.time()
    with httpx.Client(base_url=base_url, timeout=120) as client, ThreadPoolExecutor(24) as pool:
        list(pool.map(lambda _: complete(client, prefix + random_prompt(rng, 8), BURST_MAX_TOKENS), range(24)))
    counts = new_requests(before)
    assert sum(counts.values()) == 24
    assert counts[order[1]] >= 1, counts  # the load bound sent some to the second choice
    assert counts[order[0]] >= counts[order[1]], counts  # and affinity kept the most at home
    # As the replicas saw it: no arrival left its replica past (1 + EPS) x the mean load
    # (beyond the ARRIVAL_SETTLE_S in which requests routed at once arrive in any order),
    # each request counted until the router can have heard of its end: on a loaded 2-core
    # machine Serve's completion report reaches the router tens of milliseconds after the
    # replica counted it (BURST_MAX_TOKENS keeps the burst's own ends after its arrivals).
    # An end after a choice does not make that choice a breach (arrival_loads' settle window).
    loads = arrival_loads(read_load_logs(load_log_dir, started, replica_ids), EPS, ARRIVAL_SETTLE_S,
                          completion_lag_s=0.1)
    assert (loads.num_arrivals, loads.num_over_bound_lasting) == (24, 0), loads
    at_least = lambda n: lambda v: v >= n  # noqa: E731
    scrape_until(metrics_url, APP, {
        ("ray_rayinfer_router_routed_requests_total", ("decision", "spill")): at_least(1),
        ("ray_rayinfer_router_routed_requests_total", ("decision", "affinity")): at_least(18 + counts[order[0]] // 2),
        ("ray_rayinfer_router_engine_replicas",): lambda v: v == 2,
        ("ray_rayinfer_engine_replica_prefix_cache_hit_rate", ("engine_replica", order[0])): lambda v: v > 0,
    })


@ray.remote(num_cpus=0.05)
class Caller:
    """A process with its own handle, so its own PrefixAffinityRouter: what each ingress
    replica is to the engine deployment."""

    def __init__(self) -> None:
        self._handle = serve.get_deployment_handle("EngineDeployment", APP).options(stream=True)

    async def complete(self, prompts: list[list[int]], max_tokens: int) -> list[str | None]:
        """Every prompt at once; each one's finish reason."""
        return list(await asyncio.gather(*(self._one(prompt, max_tokens) for prompt in prompts)))

    async def _one(self, prompt: list[int], max_tokens: int) -> str | None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        call = self._handle.generate.remote(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, params=params)
        chunks = [chunk async for chunk in call]
        return chunks[-1].finish_reason


def test_two_routers_in_two_processes_agree_on_affinity_and_together_stay_within_the_bound(server, load_log_dir):
    """Each router sees only its own requests at once and the replicas' last counts: each
    prefix still lands on one replica whichever process routes it, and a burst from both
    at once stays within the bound, since each bounds its own share."""
    check_two_routers(random.Random(4), list(engine_replicas()), load_log_dir, decode_token_cost=None)


def check_two_routers(rng: random.Random, replica_ids: list[str], load_log_dir: Path,
                      decode_token_cost: float | None) -> None:
    """Two Callers: sequential requests on a prefix homed on each replica, on idle replicas,
    all go to its first choice; then a burst of 12 from each on one prefix: most at home, some
    spilled, and (by the replicas' load logs, in requests or in work) no arrival lastingly
    past the bound."""
    callers = [Caller.remote(), Caller.remote()]
    for first_choice in replica_ids:
        prefix = prompt_homed_on(rng, replica_ids, first_choice, 5 * BLOCK)
        for caller in callers + callers:
            # Idle replicas as every router sees them: a report Serve polled while the last
            # request was still queued counts it until a later report reaches the router.
            time.sleep(REPORTS_SETTLE_S)
            before = served()
            assert ray.get(caller.complete.remote([prefix + random_prompt(rng, 8)], 2)) == ["length"]
            assert new_requests(before) == {r: 1 if r == first_choice else 0 for r in replica_ids}
    prefix = random_prompt(rng, 5 * BLOCK)
    order = rendezvous_order(prefix_key(prefix, BLOCK, KEY_BLOCKS), replica_ids)
    before, started = served(), time.time()
    bursts = [caller.complete.remote([prefix + random_prompt(rng, 8) for _ in range(12)], BURST_MAX_TOKENS)
              for caller in callers]
    assert ray.get(bursts) == [["length"] * 12] * 2
    for caller in callers:
        ray.kill(caller)
    counts = new_requests(before)
    assert counts[order[0]] > counts[order[1]] >= 1, counts
    # Each request counted until its router can have heard of its end, as in the one-router
    # burst above: each Caller hears of its own streams' ends on its loop, late on a busy VM.
    loads = arrival_loads(read_load_logs(load_log_dir, started, replica_ids), EPS, ARRIVAL_SETTLE_S,
                          decode_token_cost=decode_token_cost, completion_lag_s=0.1)
    assert (loads.num_arrivals, loads.num_over_bound_lasting) == (24, 0), loads


def test_replicas_added_and_removed_mid_run_keep_cached_keys_and_take_new_ones_without_a_failed_request(
        server, tiny_gpt2_dir, load_log_dir):
    """Traffic on 8 prefixes runs through each change. After it, on an idle app, each of
    those prefixes goes to one replica every time (where it is cached: an added replica
    does not take a key another one holds, it would only compute it again; a removed
    replica's keys find a new home), and fresh prefixes go to their first choice among the
    replicas now running, the added one included."""
    base_url, _ = server
    rng = random.Random(2)
    prefixes = [random_prompt(rng, 5 * BLOCK) for _ in range(8)]
    traffic = Traffic(base_url, prefixes)
    replica_ids = list(engine_replicas())
    for num_replicas in (3, 2):  # one added, then one removed
        with traffic.running():
            redeploy(tiny_gpt2_dir, load_log_dir, num_replicas)
            before, replica_ids = replica_ids, wait_for_replicas(num_replicas)
        assert len(set(before) & set(replica_ids)) == 2  # the others kept running, their caches too
        check_keys_stay(base_url, prefixes, replica_ids)
        fresh = [random_prompt(rng, 5 * BLOCK) for _ in range(24)]
        homes = {rendezvous_order(prefix_key(prefix, BLOCK, KEY_BLOCKS), replica_ids)[0] for prefix in fresh}
        assert homes == set(replica_ids)  # 24 keys: every replica is some key's first choice
        check_keys_on_first_choice(base_url, fresh, replica_ids)
    assert traffic.num_ok > 0 and traffic.failures == []


def check_keys_stay(base_url: str, prefixes: list[list[int]], replica_ids: list[str]) -> None:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for prefix in prefixes:
            served_by = []
            for _ in range(2):
                before = served()
                complete(client, prefix + [301, 302])
                served_by += [r for r, n in new_requests(before).items() if n]
            assert len(served_by) == 2 and served_by[0] == served_by[1] in replica_ids, served_by


class Traffic:
    """A client sending requests on the given prefixes, one after another, while running."""

    def __init__(self, base_url: str, prefixes: list[list[int]]) -> None:
        self.base_url, self.prefixes = base_url, prefixes
        self.num_ok, self.failures = 0, []

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        stop = threading.Event()
        thread = threading.Thread(target=self._send_until, args=(stop,))
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def _send_until(self, stop: threading.Event) -> None:
        rng = random.Random(3)
        with httpx.Client(base_url=self.base_url, timeout=60) as client:
            while not stop.is_set():
                body = {"model": "tiny", "prompt": rng.choice(self.prefixes) + [300], "max_tokens": 2}
                response = client.post("/v1/completions", json=body)
                if response.status_code == 200:
                    self.num_ok += 1
                else:
                    self.failures.append(f"{response.status_code} {response.text}")


def redeploy(tiny_gpt2_dir: Path, load_log_dir: Path, num_replicas: int, router: dict = ROUTER) -> None:
    deploy_config(app_config(tiny_gpt2_dir, load_log_dir, num_replicas, router))


def wait_for_replicas(num_replicas: int, timeout_s: float = 60) -> list[str]:
    """The engine replicas once exactly num_replicas answer (stopping ones drain first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            replica_ids = list(served())
        except ray.exceptions.RayActorError:  # one stopped between listing and asking
            replica_ids = []
        if len(replica_ids) == num_replicas:
            return replica_ids
        assert time.monotonic() < deadline, f"{replica_ids} after {timeout_s}s"
        time.sleep(0.5)


def check_keys_on_first_choice(base_url: str, prefixes: list[list[int]], replica_ids: list[str]) -> None:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for prefix in prefixes:
            first_choice = rendezvous_order(prefix_key(prefix, BLOCK, KEY_BLOCKS), replica_ids)[0]
            before = served()
            complete(client, prefix + [301, 302])
            assert new_requests(before) == {r: 1 if r == first_choice else 0 for r in replica_ids}


@pytest.fixture(scope="module")
def work_router(server, tiny_gpt2_dir: Path, load_log_dir: Path) -> list[str]:
    """The engine deployment routed with load_unit: work, for handles made from now on
    (Callers: the ingress's handle keeps the router it made); its replica ids. Once for the
    module's tests in work, the last in the file: pytest would put the request router back
    only at the module's end, where no test is left to use it. Serve counts a new request
    router as new code: both engine replicas restart."""
    redeploy(tiny_gpt2_dir, load_log_dir, 2, WORK_ROUTER)
    return wait_for_replicas(2)


def prompt_homed_on(rng: random.Random, replica_ids: list[str], home: str, num_tokens: int) -> list[int]:
    """A random prompt whose key's rendezvous first choice is home."""
    while True:
        prompt = random_prompt(rng, num_tokens)
        if rendezvous_order(prefix_key(prompt, BLOCK, KEY_BLOCKS), replica_ids)[0] == home:
            return prompt


def test_in_work_a_home_of_cached_requests_keeps_a_burst_the_request_bound_would_spill(work_router, load_log_dir):
    """A long request on each replica (100 prompt tokens, 900 to decode), then 12 requests
    on a prefix cached at its home, each 8 prompt tokens to compute and 32 to decode: 13 of
    14 in flight is past 1.5 x the mean in requests (10 is the most), yet in work all 12
    stay home and, as the replicas' own logs show, within the bound."""
    rng, replica_ids, caller = random.Random(5), work_router, Caller.remote()
    prefix = random_prompt(rng, 5 * BLOCK)
    home, other = rendezvous_order(prefix_key(prefix, BLOCK, KEY_BLOCKS), replica_ids)
    assert ray.get(caller.complete.remote([prefix + random_prompt(rng, 8)], 2)) == ["length"]  # now cached at home
    before, started = served(), time.time()
    long_ones = [caller.complete.remote([prompt_homed_on(rng, replica_ids, replica_id, 100)], 900)
                 for replica_id in (home, other)]
    # Both long requests in their engines, and in reports the router has read, before the
    # burst (a slow machine, as under the AVX2 emulation, takes longer than any fixed wait).
    wait_for(lambda: all(read_load_logs(load_log_dir, started, replica_ids).get(r) for r in replica_ids))
    time.sleep(2 * ROUTER["request_routing_stats_period_s"])
    burst = caller.complete.remote([prefix + random_prompt(rng, 8) for _ in range(12)], 32)
    assert ray.get([*long_ones, burst]) == [["length"], ["length"], ["length"] * 12]
    ray.kill(caller)
    assert new_requests(before) == {home: 13, other: 1}
    logs = read_load_logs(load_log_dir, started, replica_ids)
    assert arrival_loads(logs, EPS, ARRIVAL_SETTLE_S).num_over_bound_lasting >= 1  # in requests, it did pass the bound
    in_work = arrival_loads(logs, EPS, ARRIVAL_SETTLE_S, decode_token_cost=DECODE_TOKEN_COST)
    assert (in_work.num_arrivals, in_work.num_over_bound_lasting) == (14, 0), in_work


def test_in_work_two_routers_agree_on_affinity_and_together_stay_within_the_bound(work_router, load_log_dir):
    """As test_two_routers_..._within_the_bound, with the bound in work: each router reads
    the replicas' reported pending work (every router's) plus its own requests since."""
    check_two_routers(random.Random(6), work_router, load_log_dir, decode_token_cost=DECODE_TOKEN_COST)
