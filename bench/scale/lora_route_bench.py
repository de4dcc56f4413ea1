"""Routing LoRA adapters over engine replicas: the share of requests that reach a replica
holding their adapter in an engine slot, and the load bound, on a fresh local Ray.

    python -m bench.scale.lora_route_bench --design prefix-router   # what ships (configs/scale-out.yaml's router)
    python -m bench.scale.lora_route_bench --design multiplex       # Serve's model multiplexing, bench-only

prefix-router   the engine deployment as it ships, behind PrefixAffinityRouter: an
                adapter's requests go to its home (deployments/routing/adapter_homes.py)
                within (1 + eps) x the mean load; past it, to a replica reporting it
                resident (or sent it lately), then to a free slot
multiplex       Serve's default router with model multiplexing: each request's handle
                call carries multiplexed_model_id = its adapter, the replica registers it
                through a @serve.multiplexed loader of max_loras models (MultiplexedEngine);
                Serve's LRU eviction unloads nothing (the engine's slots keep their own LRU,
                pinned while in use), so it never touches an adapter a request runs under

Requests: --num-requests, --concurrency at a time, each under an adapter drawn uniformly
from --num-adapters (rank 16 on c_attn, c_proj, c_fc, PEFT's save_pretrained), a random
prompt. "Resident" is where the replica found the request's adapter when the request
arrived (rayinfer_lora_requests{holding}, deployments/replicas/engine_adapters.py): the
cold reads of each adapter's first request count as misses. The load bound: arrivals that
left a replica past (1 + eps) x the mean open requests and stayed past it (bench/scale/load_balance.py).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from transformers import GPT2LMHeadModel

from bench.peers.peft_peer import save_adapters
from bench.scale.load_balance import arrival_loads
from bench.scale.load_log import LOAD_LOG_DIR_ENV, LoggedEngine, read_load_logs
from deployments.replicas.engine_deployment import EngineDeployment
from engine import EngineConfig, SamplingParams
from engine.request.lora_request import LoraRequest
from engine.request.scheduling import Scheduling
from loadtest.client.machine import machine_line, utc_now

APP = "lora-route"
MULTIPLEX_MODELS = 8  # Serve's multiplexed LRU per replica, fixed where the class is defined: --max-loras must match


class _Registered:
    """What Serve's multiplexed loader holds for an adapter: nothing to free on eviction."""

    def __init__(self, name: str) -> None:
        self.name = name


class MultiplexedEngine(LoggedEngine):
    """The engine deployment with Serve's model multiplexing in front of its adapters."""

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       scheduling: Scheduling = Scheduling(), lora: LoraRequest | None = None):
        if lora is not None:
            await self._register(serve.get_multiplexed_model_id())
        async for chunk in super().generate(request_id, prompt_token_ids, params, scheduling, lora):
            yield chunk

    @serve.multiplexed(max_num_models_per_replica=MULTIPLEX_MODELS)
    async def _register(self, model_id: str) -> _Registered:
        return _Registered(model_id)


def deploy(args: argparse.Namespace, log_dir: Path) -> None:
    config = EngineConfig(model=args.model, weights="pretrained", max_loras=args.max_loras, num_threads=1,
                          max_num_seqs=64)
    # max_ongoing_requests as the engine deployment's own: serve.deployment() on the subclass
    # would give Serve's default (5), past which Serve sends a request wherever there is room.
    options = dict(name="EngineDeployment", num_replicas=2, graceful_shutdown_timeout_s=5,
                   max_ongoing_requests=EngineDeployment.max_ongoing_requests,
                   ray_actor_options={"num_cpus": 0.75, "runtime_env": {"env_vars": {LOAD_LOG_DIR_ENV: str(log_dir)}}})
    if args.design == "prefix-router":
        engine = serve.deployment(LoggedEngine).options(**options, request_router_config=RequestRouterConfig(
            request_router_class="deployments.routing.router:PrefixAffinityRouter",
            request_router_kwargs={"load_bound_eps": args.eps, "key_blocks": 4}, request_routing_stats_period_s=1))
    else:
        engine = serve.deployment(MultiplexedEngine).options(**options)
    serve.run(engine.bind(config), name=APP, route_prefix=None)


async def drive(args: argparse.Namespace, adapters: dict[str, Path]) -> float:
    """Every request, --concurrency at a time; the seconds they took."""
    rng, handle = random.Random(0), serve.get_app_handle(APP)
    names, gate = list(adapters), asyncio.Semaphore(args.concurrency)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    async def one(name: str, prompt: list[int]) -> None:
        async with gate:
            options = {"stream": True} | ({"multiplexed_model_id": name} if args.design == "multiplex" else {})
            stream = handle.options(**options).generate.remote(
                request_id=uuid.uuid4().hex, prompt_token_ids=prompt, params=params,
                lora=LoraRequest(name, str(adapters[name])))
            async for _ in stream:
                pass

    requests = [(rng.choice(names), [rng.randrange(50257) for _ in range(args.prompt_len)])
                for _ in range(args.num_requests)]
    start = time.perf_counter()
    await asyncio.gather(*(one(name, prompt) for name, prompt in requests))
    return time.perf_counter() - start


def holdings(metrics_url: str, num_requests: int, timeout_s: float = 30) -> Counter:
    """rayinfer_lora_requests of the app by holding, once every request is counted."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts: Counter = Counter()
        for line in httpx.get(metrics_url, timeout=5).text.splitlines():
            if line.startswith("ray_rayinfer_lora_requests_total{") and f'application="{APP}"' in line:
                counts[re.search(r'holding="(\w+)"', line).group(1)] += float(line.rsplit(" ", 1)[1])
        if sum(counts.values()) >= num_requests or time.monotonic() > deadline:
            return counts
        time.sleep(0.5)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--design", choices=["prefix-router", "multiplex"], default="prefix-router")
    parser.add_argument("--model", default="/tmp/gpt2-random", help="a checkpoint (python -m loadtest.make_checkpoint DIR --arch gpt2)")
    parser.add_argument("--num-adapters", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=480)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--eps", type=float, default=0.75, help="the router's load_bound_eps, and the bound checked")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.design == "multiplex" and args.max_loras != MULTIPLEX_MODELS:
        raise SystemExit(f"--design multiplex registers {MULTIPLEX_MODELS} adapters a replica: --max-loras {MULTIPLEX_MODELS}")
    metrics_port = 18080 + random.randrange(1000)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 500})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run(args, Path(tmp), f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        serve.shutdown()
        ray.shutdown()


def run(args: argparse.Namespace, tmp: Path, metrics_url: str) -> None:
    adapters = save_adapters(GPT2LMHeadModel.from_pretrained(args.model), tmp, args.num_adapters)
    (tmp / "logs").mkdir()
    deploy(args, tmp / "logs")
    time.sleep(3)  # every replica reported once
    started = utc_now()
    seconds = asyncio.run(drive(args, adapters))
    counts = holdings(metrics_url, args.num_requests)
    loads = arrival_loads(read_load_logs(tmp / "logs"), args.eps)
    total = sum(counts.values())
    print(machine_line(started, utc_now()))
    print(f"design={args.design} replicas=2 adapters={args.num_adapters} max_loras={args.max_loras} "
          f"requests={args.num_requests} concurrency={args.concurrency} prompt_len={args.prompt_len} "
          f"max_tokens={args.max_tokens} eps={args.eps}: {seconds:.1f} s")
    print(f"resident on arrival: {counts['resident'] / total:.1%} ({int(counts['resident'])} of {int(total)}; "
          f"read, not in a slot: {int(counts['read'])}; read from disk: {int(counts['none'])})")
    print(f"load bound: {loads.num_over_bound_lasting} of {loads.num_arrivals} arrivals past (1 + {args.eps}) x the "
          f"mean and lasting ({loads.num_over_bound} at arrival); busiest / mean {loads.busiest_over_mean:.2f}")
    print("| design | resident on arrival | read from disk | past the bound, lasting | busiest / mean | seconds |\n"
          "|---|---|---|---|---|---|")
    print(f"| {args.design} | {counts['resident'] / total:.1%} | {int(counts['none'])} | "
          f"{loads.num_over_bound_lasting} of {loads.num_arrivals} | {loads.busiest_over_mean:.2f} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
