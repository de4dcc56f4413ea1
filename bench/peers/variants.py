"""Designs of the app measured against each other in one Ray cluster: each variant is the
config's application at its own route prefix (`/<name>`), with its own app args and replica
environment, and the variants take turns, round after round, under the same workload.

    python -m bench.peers.variants --checkpoint /tmp/gpt2-random \
        --variant base '{}' --variant chunks50 '{"args": {"max_chunks_per_s": 50}}' --rounds 3

Why one cluster: on a small shared machine throughput moves by ±25% between runs minutes
apart, so two designs measured in two `serve run`s compare the machine's moods as much as
the designs. Here they share the proxy, controller and client, idle variants only keep
their background loops, and alternating rounds spread the drift over all of them.

A variant is JSON: `args` merged into the app's args (one level deep, as bench.peers.peer_table
does), `env` set as the application's runtime_env env_vars (read by every replica it
starts). Every deployment asks Ray for a token CPU so that all variants fit the node; the
engine keeps the torch threads its args give it (`num_threads` is made explicit).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from loadtest.client.http_target import BenchConfig, Target, run_benchmark
from bench.peers.peer_table import RAYINFER_URL, TableWorkload, serve_config, serve_run
from loadtest.client.results import BenchResult

_TOKEN_CPU = 0.01  # what each replica asks Ray for: scheduling only, not a limit
_STARTUP_S = 240.0  # per variant: each engine may compile its decode graph first


@dataclass(frozen=True)
class Variant:
    name: str
    args: dict
    env: dict[str, str]

    @classmethod
    def parse(cls, name: str, spec: str) -> Variant:
        value = json.loads(spec)
        unknown = set(value) - {"args", "env"}
        if unknown:
            raise SystemExit(f"variant {name}: unknown keys {sorted(unknown)} (expected args, env)")
        return cls(name, value.get("args", {}), value.get("env", {}))


def variants_config(base: Path, checkpoint: Path, dtype: str, variants: list[Variant]) -> dict:
    """One Serve config with an application per variant, at /<name>."""
    config, apps = None, []
    for variant in variants:
        config = serve_config(base, checkpoint, dtype, variant.args, {})
        app = config["applications"][0]
        app.update(name=variant.name, route_prefix=f"/{variant.name}")
        if variant.env:
            app["runtime_env"] = {"env_vars": dict(variant.env)}
        _token_cpus(app)
        apps.append(app)
    assert config is not None
    config["applications"] = apps
    return config


def _token_cpus(app: dict) -> None:
    args = app["args"]
    threads = args.get("engine", {}).get("num_threads", math.ceil(args.get("engine_num_cpus", 0.5)))
    args["engine"] = {**args.get("engine", {}), "num_threads": threads}
    args["engine_num_cpus"] = _TOKEN_CPU
    for deployment in app.get("deployments", []):
        if deployment["name"] != "EngineDeployment":  # build_app sets the engine's
            deployment.setdefault("ray_actor_options", {})["num_cpus"] = _TOKEN_CPU


@dataclass(frozen=True)
class Round:
    variant: str
    concurrent: BenchResult
    single: BenchResult | None


def measure(variants: list[Variant], workload: TableWorkload, rounds: int) -> list[Round]:
    results = []
    for number in range(rounds):
        order = variants if number % 2 == 0 else variants[::-1]  # neither always goes first
        for variant in order:
            target = Target(f"{RAYINFER_URL}/{variant.name}", variant.name, ignore_eos=True)
            concurrent = run_benchmark(BenchConfig(target, workload.concurrent(), False))
            single = run_benchmark(BenchConfig(target, workload.single(), False)) if workload.num_single else None
            results.append(Round(variant.name, concurrent, single))
            print(_row(results[-1], number + 1), flush=True)
    return results


def _row(r: Round, number: int | str) -> str:
    c, s = r.concurrent, r.single
    single = "-" if s is None else f"{_f(s.tpot_ms.p50)}, {_f(s.ttft_ms.p50)}"
    return (f"| {number} | {r.variant} | {c.output_throughput:.1f}, {_f(c.ttft_ms.p50)} | "
            f"{_f(c.itl_ms.p50)} / {_f(c.itl_ms.p95)} | {single} | {c.failures} |")


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(variants: list[Variant], results: list[Round], workload: TableWorkload) -> str:
    header = [f"| round | variant | {workload.streams} streams: tok/s, TTFT p50 (ms) | ITL p50 / p95 (ms) | "
              "1 stream: TPOT p50, TTFT p50 (ms) | failed |", "|---|---|---|---|---|---|"]
    rows = [_row(r, i // len(variants) + 1) for i, r in enumerate(results)]
    return "\n".join(header + rows + [_median_row(v.name, results) for v in variants])


def _median_row(name: str, results: list[Round]) -> str:
    mine = [r for r in results if r.variant == name]

    def med(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    c = replace(mine[0].concurrent, output_throughput=med([r.concurrent.output_throughput for r in mine]),
                ttft_ms=replace(mine[0].concurrent.ttft_ms, p50=med([r.concurrent.ttft_ms.p50 for r in mine])),
                itl_ms=replace(mine[0].concurrent.itl_ms, p50=med([r.concurrent.itl_ms.p50 for r in mine]),
                               p95=med([r.concurrent.itl_ms.p95 for r in mine])),
                failures=sum(r.concurrent.failures for r in mine))
    single = None
    if mine[0].single is not None:
        s = mine[0].single
        single = replace(s, tpot_ms=replace(s.tpot_ms, p50=med([r.single.tpot_ms.p50 for r in mine])),
                         ttft_ms=replace(s.ttft_ms, p50=med([r.single.ttft_ms.p50 for r in mine])))
    return _row(Round(name, c, single), "**median**")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True, help="a model directory every variant loads")
    parser.add_argument("--config", type=Path, default=Path("configs/gpt2.yaml"))
    parser.add_argument("--variant", nargs=2, action="append", required=True, metavar=("NAME", "JSON"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--requests", type=int, default=None, help="per concurrent run (default 4 x streams)")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--single", type=int, default=8, help="requests sent one at a time per round (0: none)")
    parser.add_argument("--out", type=Path, default=None, help="a file for the table")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    variants = [Variant.parse(name, spec) for name, spec in args.variant]
    workload = TableWorkload(args.streams, args.prompt_tokens, args.max_tokens, args.single, warmup=4,
                             num_concurrent=args.requests or 4 * args.streams)
    config = variants_config(args.config, args.checkpoint, args.dtype, variants)
    urls = [f"{RAYINFER_URL}/{v.name}" for v in variants]
    with serve_run(config, timeout_s=_STARTUP_S * len(variants), app_urls=urls):
        for variant in variants:  # a first request of each compiles nothing later than this
            run_benchmark(BenchConfig(Target(f"{RAYINFER_URL}/{variant.name}", variant.name, ignore_eos=True),
                                      replace(workload.concurrent(), num_requests=8, warmup=0), False))
        results = measure(variants, workload, args.rounds)
    report = table(variants, results, workload)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
