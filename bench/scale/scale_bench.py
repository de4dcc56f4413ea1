"""The scale-out benchmark: one prefix workload (loadtest/scale/prefix_workloads.py) against the
app of a Serve config file under several engine setups, one after the other, each on a
fresh local Ray (so every setup starts with empty prefix caches):

    prefix-router   the config as it is (configs/scale-out.yaml: 2 replicas, PrefixAffinityRouter);
                    prefix-router:load_unit=requests:load_bound_eps=0.5 the same with those
                    request_router_kwargs changed (request_routing_stats_period_s=N too),
                    so that router designs run side by side
    serve-default   the same with Serve's default router (no request_router_config)
    one-replica     1 engine replica with all the engine CPUs of the two (2x the threads)
    single-replica  1 engine replica with one replica's CPUs: what a second replica adds to,
                    on a machine with the cores for both (`--num-cpus`, `--app-arg engine_num_cpus=4`)

    python -m bench.scale.scale_bench --config configs/scale-out.yaml --workload shared \\
        --setups prefix-router,serve-default --weights random --engine num_kv_blocks=160
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import ray
import yaml
from ray import serve

from loadtest.client.http_target import Target
from deployments.routing.router import PrefixAffinityRouter
from bench.scale.load_balance import ArrivalLoads, arrival_loads
from loadtest.client.machine import machine_line, utc_now
from bench.scale.load_log import LOAD_LOG_DIR_ENV, ReplicaCounts, engine_replica_counts, make_logged_app, read_load_logs
from loadtest.scale.prefix_workloads import PrefixWorkload, run_http
from loadtest.client.results import BenchResult

SETUPS = ("prefix-router", "serve-default", "one-replica", "single-replica")
BLOCK_SIZE = 16
_STATS_PERIOD = "request_routing_stats_period_s"
# The router's own defaults, for a config that leaves a kwarg out.
_ROUTER_DEFAULTS = {name: parameter.default for name, parameter
                    in inspect.signature(PrefixAffinityRouter.initialize_state).parameters.items()
                    if parameter.default is not inspect.Parameter.empty}


@dataclass(frozen=True)
class SetupResult:
    setup: str
    bench: BenchResult
    replicas: dict[str, ReplicaCounts]
    loads: ArrivalLoads  # requests in each replica when one arrived
    work_loads: ArrivalLoads  # the same in work (bench/scale/load_balance.py)
    ideal_hit_tokens: int

    @property
    def hit_rate(self) -> float:
        queried = sum(c.num_prefix_queried_tokens for c in self.replicas.values())
        return sum(c.num_prefix_hit_tokens for c in self.replicas.values()) / max(queried, 1)

    @property
    def share_of_ideal(self) -> float | None:
        hits = sum(c.num_prefix_hit_tokens for c in self.replicas.values())
        return hits / self.ideal_hit_tokens if self.ideal_hit_tokens else None

    @property
    def max_over_mean_requests(self) -> float:
        counts = [c.num_requests for c in self.replicas.values()]
        return max(counts) / statistics.mean(counts)


def parse_setup(setup: str) -> tuple[str, dict]:
    """"prefix-router:load_unit=requests" -> ("prefix-router", {"load_unit": "requests"})."""
    name, *pairs = setup.split(":")
    if name not in SETUPS:
        raise SystemExit(f"unknown setup {name!r}; choose from {', '.join(SETUPS)}")
    if pairs and name != "prefix-router":
        raise SystemExit(f"only prefix-router takes router kwargs, got {setup!r}")
    return name, parse_pairs(pairs)


def parse_pairs(pairs: Sequence[str]) -> dict:
    """["load_bound_eps=0.5", "x=true"] -> {"load_bound_eps": 0.5, "x": True}: each value as YAML."""
    return {key: yaml.safe_load(value) for key, value in (pair.split("=", 1) for pair in pairs)}


def app_from_config(config_path: Path, setup: str, overrides: dict) -> serve.Application:
    """The config file's first application, as `serve run` would build it, for one setup."""
    setup, router_kwargs = parse_setup(setup)
    application = yaml.safe_load(config_path.read_text())["applications"][0]
    args = copy.deepcopy(application["args"])
    args.update({k: v for k, v in overrides.items() if k != "engine"})
    args["engine"] = {**args.get("engine", {}), **overrides.get("engine", {})}
    options = {d["name"]: {k: v for k, v in d.items() if k != "name"} for d in application.get("deployments", [])}
    engine = options.setdefault("EngineDeployment", {})
    if router_kwargs:
        router = engine.setdefault("request_router_config", {})
        if _STATS_PERIOD in router_kwargs:  # a request_router_config field, not a kwarg
            router[_STATS_PERIOD] = router_kwargs.pop(_STATS_PERIOD)
        router["request_router_kwargs"] = {**router.get("request_router_kwargs", {}), **router_kwargs}
    if setup != "prefix-router":  # Serve's default router: no request_router_config
        engine.pop("request_router_config", None)
    if setup in ("one-replica", "single-replica"):
        replicas = engine.pop("num_replicas", 2)
        if setup == "one-replica":
            args["engine_num_cpus"] = args.get("engine_num_cpus", 0.5) * replicas
        engine["num_replicas"] = 1
    return make_logged_app(args, options)


def run_setup(config_path: Path, setup: str, overrides: dict, workload: PrefixWorkload, port: int,
              num_cpus: int = 2) -> SetupResult:
    with tempfile.TemporaryDirectory() as load_log_dir:
        os.environ[LOAD_LOG_DIR_ENV] = load_log_dir  # the local Ray's workers inherit it
        try:
            return _run_setup(config_path, setup, overrides, workload, port, Path(load_log_dir), num_cpus)
        finally:
            del os.environ[LOAD_LOG_DIR_ENV]


def _run_setup(config_path: Path, setup: str, overrides: dict, workload: PrefixWorkload, port: int,
               load_log_dir: Path, num_cpus: int) -> SetupResult:
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        controller_options = yaml.safe_load(config_path.read_text()).get("controller_options")
        serve.start(http_options={"host": "127.0.0.1", "port": port}, controller_options=controller_options)
        serve.run(app_from_config(config_path, setup, overrides), name="rayinfer", route_prefix="/")
        target = Target(f"http://127.0.0.1:{port}", setup, model=None, ignore_eos=True)
        _warm_up(target.url)
        before, started = engine_replica_counts(), time.time()
        bench = run_http(target, workload)
        after = engine_replica_counts()
        counts = {r: after[r].minus(before.get(r, ReplicaCounts(0, 0, 0))) for r in after}
        logs, bound = read_load_logs(load_log_dir, started, list(after)), router_kwargs(config_path, setup)
        loads = arrival_loads(logs, bound["load_bound_eps"])
        work_loads = arrival_loads(logs, bound["load_bound_eps"], decode_token_cost=bound["decode_token_cost"])
        return SetupResult(setup, bench, counts, loads, work_loads, workload.ideal_hit_tokens(BLOCK_SIZE))
    finally:
        serve.shutdown()
        ray.shutdown()


def router_kwargs(config_path: Path, setup: str) -> dict:
    """The bound a setup's loads are judged against: the config's PrefixAffinityRouter
    kwargs with the setup's own (Serve's default router is judged against the config's)."""
    application = yaml.safe_load(config_path.read_text())["applications"][0]
    engine = next(d for d in application.get("deployments", []) if d["name"] == "EngineDeployment")
    kwargs = engine.get("request_router_config", {}).get("request_router_kwargs", {})
    return {**_ROUTER_DEFAULTS, **kwargs, **parse_setup(setup)[1]}


def _warm_up(url: str) -> None:
    """One short request per replica's worth, so no setup pays for first-call costs."""
    for _ in range(4):
        body = {"prompt": "warm up", "max_tokens": 2}
        httpx.post(f"{url}/v1/completions", json=body, timeout=120, trust_env=False).raise_for_status()


def table(results: Sequence[SetupResult]) -> str:
    header = ("| setup | req/s | output tok/s | TTFT p50 ms | TTFT p95 ms | prefix hit rate | hits / ideal "
              "| requests per replica | max/mean requests | busiest/mean at arrivals: requests, work "
              "| over bound in requests: at arrival / lasting | in work | failed |")
    rows = [header, "|" + "---|" * 13]
    for r in results:
        ideal = "-" if r.share_of_ideal is None else f"{r.share_of_ideal:.0%}"
        per_replica = " / ".join(str(c.num_requests) for c in sorted(r.replicas.values(), key=lambda c: -c.num_requests))
        rows.append(f"| {r.setup} | {r.bench.request_throughput:.2f} | {r.bench.output_throughput:.1f} "
                    f"| {r.bench.ttft_ms.p50:.0f} | {r.bench.ttft_ms.p95:.0f} | {r.hit_rate:.0%} | {ideal} "
                    f"| {per_replica} | {r.max_over_mean_requests:.2f} "
                    f"| {r.loads.busiest_over_mean:.2f}, {r.work_loads.busiest_over_mean:.2f} "
                    f"| {_over_bound(r.loads)} | {_over_bound(r.work_loads)} | {r.bench.failures} |")
    return "\n".join(rows)


def _over_bound(loads: ArrivalLoads) -> str:
    return f"{loads.num_over_bound} / {loads.num_over_bound_lasting} of {loads.num_arrivals}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/scale-out.yaml"))
    parser.add_argument("--workload", choices=("shared", "hot", "free"), default="shared")
    parser.add_argument("--setups", default="prefix-router,serve-default")
    parser.add_argument("--model", default=None, help="override the config's model")
    parser.add_argument("--weights", default=None, help="override the config's weights (auto|pretrained|random)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=YAML",
                        help="an EngineConfig override, e.g. num_kv_blocks=288 or enable_prefix_caching=false")
    parser.add_argument("--app-arg", action="append", default=[], metavar="KEY=YAML",
                        help="an app arg override, e.g. engine_num_cpus=4 or device=cpu")
    parser.add_argument("--num-cpus", type=int, default=2, help="the local Ray's CPUs")
    parser.add_argument("--port", type=int, default=8000)
    for name, default in (("num-requests", 96), ("num-prefixes", 12), ("prefix-tokens", 256),
                          ("suffix-tokens", 16), ("max-tokens", 16), ("concurrency", 8), ("seed", 0)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--hot-share", type=float, default=0.8)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workload = PrefixWorkload(args.workload, args.num_requests, args.num_prefixes, args.prefix_tokens,
                              args.suffix_tokens, args.max_tokens, args.concurrency, args.hot_share, args.seed)
    overrides = {k: v for k, v in (("model", args.model), ("weights", args.weights), ("dtype", args.dtype)) if v}
    overrides.update(parse_pairs(args.app_arg))
    overrides["engine"] = parse_pairs(args.engine)
    setups = args.setups.split(",")
    for setup in setups:
        parse_setup(setup)  # a misspelt setup fails before the first one runs
    results, started = [], utc_now()
    for setup in setups:
        results.append(run_setup(args.config, setup, overrides, workload, args.port, args.num_cpus))
    print(machine_line(started, utc_now()))
    print(f"workload: {workload}")
    print(table(results))
    return 1 if any(r.bench.failures for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
