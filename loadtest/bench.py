"""Fixed-workload benchmark of OpenAI-compatible streaming servers.

Sends `--num-requests` streaming completions of `--prompt-tokens` prompt tokens and
`--max-tokens` output tokens, closed loop (`--concurrency`) or open loop (`--request-rate`,
fixed or Poisson arrivals), and reports TTFT (with the server's own tokenize / queue wait /
prefill breakdown where it sends `server_timing`), TPOT, ITL, end-to-end latency and
throughput. `--compare-url` runs the same workload against a second server in the same run;
`--sweep 1,8,32,64` repeats it over concurrency levels and plots the result; `--repeats 5`
runs the whole comparison five times, alternating servers, and reports each round and the
median (throughput on a shared or virtual machine moves between runs minutes apart).
`--offline-model gpt2` adds the in-process engine on the same workload, and `--handle-app
rayinfer` the app's engine deployment over a Serve handle (no HTTP): between them they
show where the HTTP path's time goes. Against vLLM's CPU server: start it (outside the
package: `python -m bench.peers.vllm_peer DIR 8100`, bench/README.md) and pass its URL as
`--compare-url`.

    python -m loadtest.bench --num-requests 64 --concurrency 8 --prompt-tokens 128 --max-tokens 64
    python -m loadtest.bench --compare-url http://127.0.0.1:8001 --sweep 1,8,32,64 --out bench_out
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as `python loadtest/bench.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.client.http_target import BenchConfig, Target, run_benchmark, run_sweep
from loadtest.client.report_files import plot_sweep, write_outputs
from loadtest.client.results import BenchResult
from loadtest.client.tables import repeats_table, side_by_side_table, sweep_table
from loadtest.client.workload import Workload


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(parser)
    add_peer_args(parser)
    add_workload_args(parser)
    return parser.parse_args(argv)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The HTTP servers under test."""
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the server under test")
    parser.add_argument("--label", default="rayinfer")
    parser.add_argument("--model", default=None, help="model field to send (omitted when not given)")
    parser.add_argument("--api", choices=["completions", "chat"], default="completions")
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (a vLLM/rayinfer extension)")
    parser.add_argument("--compare-url", default=None, help="a second OpenAI-compatible server, same workload")
    parser.add_argument("--compare-label", default="baseline")
    parser.add_argument("--compare-model", default=None)
    parser.add_argument("--compare-api", choices=["completions", "chat"], default="completions")
    parser.add_argument("--compare-ignore-eos", action="store_true")


def add_peer_args(parser: argparse.ArgumentParser) -> None:
    """The targets beside them: the offline engine, the engine over a Serve handle."""
    parser.add_argument("--offline-model", default=None,
                        help="also run the workload on an in-process engine (random weights), e.g. gpt2")
    parser.add_argument("--offline-dtype", default="bfloat16")
    parser.add_argument("--offline-weights", choices=["random", "pretrained", "auto"], default="random",
                        help="weights of --offline-model (pretrained: the checkpoint directory the servers load)")
    parser.add_argument("--handle-app", default=None,
                        help="also send the workload to this app's engine deployment over a Serve handle (this "
                             "process joins its Ray cluster): Ray and the engine replica, without HTTP")


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """What is sent, how often it is run, and where the results go."""
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=None, help="requests in flight (default 8 without a rate)")
    parser.add_argument("--request-rate", type=float, default=None, help="open loop: requests per second")
    parser.add_argument("--arrival", choices=["fixed", "poisson"], default="poisson")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sent with every request, and used by --offline-model too (0: greedy)")
    parser.add_argument("--warmup", type=int, default=1, help="requests sent and discarded before measuring")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every server (and --offline-model) this many times, alternating; report the medians")
    parser.add_argument("--sweep", default=None, help="comma-separated concurrency levels, e.g. 1,8,32,64")
    parser.add_argument("--out", type=Path, default=None, help="directory for bench.json, bench.md (and sweep.png)")
    parser.add_argument("--no-progress", action="store_true")


def targets_from_args(args: argparse.Namespace) -> list[Target]:
    targets = [Target(args.url, args.label, args.model, args.api, args.ignore_eos)]
    if args.compare_url:
        targets.append(
            Target(args.compare_url, args.compare_label, args.compare_model, args.compare_api, args.compare_ignore_eos)
        )
    if len({t.label for t in targets}) != len(targets):
        raise SystemExit("--label and --compare-label must differ")
    return targets


def workload_from_args(args: argparse.Namespace) -> Workload:
    concurrency = args.concurrency if args.concurrency is not None or args.request_rate is not None else 8
    return Workload(
        num_requests=args.num_requests,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        concurrency=concurrency,
        request_rate=args.request_rate,
        arrival=args.arrival,
        warmup=args.warmup,
        seed=args.seed,
        timeout_s=args.timeout,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.repeats < 1 or (args.repeats > 1 and args.sweep):
        raise SystemExit("--repeats must be at least 1, and applies to a single run, not to --sweep")
    return run_main(args)


def run_main(args: argparse.Namespace) -> int:
    targets, workload = targets_from_args(args), workload_from_args(args)
    if args.sweep:
        levels = [int(level) for level in args.sweep.split(",")]
        results = run_sweep(targets, workload, levels, not args.no_progress)
        table, out = sweep_table(results), args.out or Path("bench_out")
        write_outputs(out, workload, results, table)
        plot_sweep(results, out / "sweep.png")
        print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'sweep.png'}", file=sys.stderr)
    else:
        results = [r for n in range(1, args.repeats + 1) for r in run_round(n, targets, workload, args)]
        table = side_by_side_table(results) if args.repeats == 1 else repeats_table(results)
        if args.out:
            write_outputs(args.out, workload, results, table)
    print(table)
    _print_errors(results)
    return 1 if any(r.failures for r in results) else 0


def run_round(number: int, targets: Sequence[Target], workload: Workload, args: argparse.Namespace) -> list[BenchResult]:
    """Every server in turn, then the engine over a handle and the offline engine where asked:
    one round of --repeats."""
    results = [run_benchmark(BenchConfig(t, workload, not args.no_progress)) for t in targets]
    if args.handle_app:
        from loadtest.client.handle_target import HandleTarget, run_over_handle  # needs Ray: only when asked

        results.append(run_over_handle(HandleTarget(args.handle_app), workload))
    if args.offline_model:
        from loadtest.client.offline_target import OfflineTarget, run_offline  # needs torch: only when asked

        target = OfflineTarget(args.offline_model, weights=args.offline_weights, dtype=args.offline_dtype)
        results.append(run_offline(target, workload))
    return [replace(r, round=number) for r in results]


def _print_errors(results: Sequence[BenchResult]) -> None:
    for result in results:
        for error in result.errors:
            print(f"{result.label} error: {error}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
