"""rayinfer against vLLM's CPU server in one run, same client, same dtype, same checkpoint:
offline throughput, HTTP at `--streams` concurrent streams (throughput, TTFT p50), HTTP one
stream at a time (TPOT p50, TTFT p50), the HTTP share of each server's own offline figure,
and the CPU time each process took during every HTTP run (loadtest/client/cpu_usage.py).

    python -m loadtest.make_checkpoint /tmp/gpt2-random --arch gpt2
    python -m bench.peers.peer_table --checkpoint /tmp/gpt2-random --out bench_out/peers

It runs the offline engine in this process, starts `serve run` on a copy of `--config`
whose model is the checkpoint, measures it and stops it; then starts vLLM's server from its
venv (bench/peers/vllm_peer.py), measures it, stops it, and runs vLLM's offline
`LLM.generate`. One server is up at a time, and each step waits for an idle machine.
Without vLLM installed, only rayinfer's rows are filled. `--app-args` and `--engine-env`
change the rayinfer app's config, to measure one design against another. `--rounds N`
measures both servers N times, vLLM first in every other round, and opens the report with
rayinfer's figures over vLLM's round by round and their medians (bench/peers/ratios.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml

from loadtest.client.http_target import BenchConfig, Target, run_benchmark
from loadtest.client.results import BenchResult, percentile
from loadtest.client import serve_process
from bench.peers.ratios import ratios_table
from loadtest.client.workload import Workload
from loadtest.client.cpu_usage import ProcessCpu, cpu_since, cpu_snapshot, cpu_table, settle
from loadtest.client.machine import machine_line, utc_now
from bench.peers.startup_time import FULL_SPEED_LINE, wait_for_line
from bench.peers.vllm_peer import VllmServer, VllmServerConfig, is_healthy, find_vllm, run_vllm_offline_target

RAYINFER_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class TableWorkload:
    streams: int = 32
    prompt_tokens: int = 16
    max_tokens: int = 64
    num_single: int = 16  # requests sent one at a time
    warmup: int = 2
    num_concurrent: int | None = None  # requests of the concurrent run; None: 2 x streams

    def concurrent(self) -> Workload:
        return Workload(num_requests=self.num_concurrent or 2 * self.streams, prompt_tokens=self.prompt_tokens, max_tokens=self.max_tokens,
                        concurrency=self.streams, warmup=self.warmup)

    def single(self) -> Workload:
        return replace(self.concurrent(), num_requests=self.num_single, concurrency=1)

    def offline(self) -> Workload:
        """Every prompt submitted at once, as LLM.generate does."""
        return replace(self.concurrent(), num_requests=self.streams)


@dataclass
class ServerRows:
    offline: BenchResult | None = None
    offline_single: BenchResult | None = None  # one request at a time: the TTFT the HTTP path adds to
    concurrent: BenchResult | None = None
    single: BenchResult | None = None

    @property
    def http_share(self) -> float | None:
        if self.offline is None or self.concurrent is None or not self.offline.output_throughput:
            return None
        return self.concurrent.output_throughput / self.offline.output_throughput

    @property
    def ttft_added_ms(self) -> float | None:
        if self.offline_single is None or self.single is None:
            return None
        return self.single.ttft_ms.p50 - self.offline_single.ttft_ms.p50


@dataclass
class TableRun:
    workload: TableWorkload
    rayinfer: ServerRows
    vllm: ServerRows
    cpu: dict[str, tuple[float, list[ProcessCpu]]]
    dtype: str
    machine: str  # loadtest/client/machine.py: the CPU kind and the run's times


def measure_http(label: str, target: Target, workload: TableWorkload, cpu: dict) -> ServerRows:
    rows = ServerRows()
    rows.concurrent = _with_cpu(f"{label} HTTP {workload.streams} streams", cpu,
                                lambda: run_benchmark(BenchConfig(target, workload.concurrent(), False)))
    rows.single = _with_cpu(f"{label} HTTP 1 stream", cpu,
                            lambda: run_benchmark(BenchConfig(target, workload.single(), False)))
    return rows


def _with_cpu(label: str, cpu: dict, run: Callable[[], BenchResult]) -> BenchResult:
    before, started = cpu_snapshot(), time.perf_counter()
    result = run()
    cpu[label] = (time.perf_counter() - started, cpu_since(before))
    return result


# ---- rayinfer ----


def serve_config(base: Path, checkpoint: Path, dtype: str, app_args: dict, engine_env: dict[str, str]) -> dict:
    """`base` with its first application serving `checkpoint`'s weights in `dtype`, and
    `engine_env` in the application's runtime_env."""
    config = yaml.safe_load(base.read_text(encoding="utf-8"))
    app = config["applications"][0]
    args = app["args"]
    args.update(model=str(checkpoint.resolve()), weights="pretrained", dtype=dtype)
    for key, value in app_args.items():  # one level deep: {"engine": {...}} keeps the file's other engine keys
        args[key] = args.get(key, {}) | value if isinstance(value, dict) else value
    if engine_env:  # Serve merges them with the engine replica's own variables
        runtime_env = app.setdefault("runtime_env", {})
        runtime_env["env_vars"] = runtime_env.get("env_vars", {}) | engine_env
    return config


@contextlib.contextmanager
def serve_run(config: dict, timeout_s: float = 300.0, app_urls: Sequence[str] = (RAYINFER_URL,)) -> Iterator[int]:
    """`serve run` on `config` in its own session; yields its pid once every app's /health answers 200."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as file:
        yaml.safe_dump(config, file)
    log = open(Path(file.name).with_suffix(".log"), "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(["serve", "run", file.name], stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, preexec_fn=serve_process.restore_sigint)
    try:
        deadline = time.monotonic() + timeout_s
        while not all(is_healthy(url) for url in app_urls):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve run did not become healthy; see {log.name}")
            time.sleep(1.0)
        # Measured at full speed: the engine answers on eager steps while its graph compiles.
        wait_for_line(process, Path(log.name), FULL_SPEED_LINE, time.monotonic(), timeout_s)
        yield process.pid
    finally:
        serve_process.stop(process)
        log.close()
        os.unlink(file.name)


def run_rayinfer(args: argparse.Namespace, workload: TableWorkload, cpu: dict) -> ServerRows:
    from loadtest.client.offline_target import OfflineTarget, run_offline_all

    config = serve_config(args.config, args.checkpoint, args.dtype, json.loads(args.app_args),
                          json.loads(args.engine_env))
    engine_args = config["applications"][0]["args"].get("engine", {})  # offline runs the engine the server runs
    target = OfflineTarget(str(args.checkpoint.resolve()), weights="pretrained", dtype=args.dtype,
                           label="rayinfer offline", engine=engine_args)
    offline = [None, None] if args.skip_offline else run_offline_all(target, [workload.offline(), workload.single()])
    with serve_run(config):
        rows = measure_http("rayinfer", Target(RAYINFER_URL, "rayinfer", ignore_eos=True), workload, cpu)
    settle()
    return replace(rows, offline=offline[0], offline_single=offline[1])


# ---- vLLM ----


def run_vllm(args: argparse.Namespace, workload: TableWorkload, cpu: dict) -> ServerRows:
    setup = find_vllm(args.vllm_venv)
    if setup is None:
        print("vLLM's CPU build is not installed: its rows stay empty", file=sys.stderr)
        return ServerRows()
    config = VllmServerConfig(args.checkpoint.resolve(), dtype=args.dtype, port=args.vllm_port,
                              extra_args=tuple(shlex.split(args.vllm_args)))
    with VllmServer(config, setup):
        rows = measure_http("vLLM", Target(config.url, "vLLM CPU", config.served_model_name, ignore_eos=True),
                            workload, cpu)
    settle()
    if not args.skip_offline:
        rows.offline = run_vllm_offline_target(args.checkpoint, workload.offline(), args.dtype, args.vllm_venv)
    return rows


# ---- report ----


def table(run: TableRun) -> str:
    ours, theirs, w = run.rayinfer, run.vllm, run.workload
    lines = [f"{run.machine}; dtype {run.dtype}", "",
             "| | rayinfer | vLLM CPU | rayinfer / vLLM |", "|---|---|---|---|"]
    lines.append(_line(f"offline, {w.streams} prompts (tok/s)", ours.offline, theirs.offline,
                       lambda r: r.output_throughput, "{:.1f}"))
    lines.append(_line(f"HTTP, {w.streams} concurrent streams (tok/s)", ours.concurrent, theirs.concurrent,
                       lambda r: r.output_throughput, "{:.1f}"))
    lines.append(_line(f"HTTP, {w.streams} streams: TTFT p50 (ms)", ours.concurrent, theirs.concurrent,
                       lambda r: r.ttft_ms.p50, "{:.1f}"))
    for later, which in ((False, f"the first {w.streams} requests"), (True, "those sent as a stream ended")):
        lines.append(_line(f"HTTP, {w.streams} streams: TTFT p50 of {which} (ms)", ours.concurrent,
                           theirs.concurrent, lambda r, later=later: wave_ttft_p50(r, w.streams, later), "{:.1f}"))
    share = lambda rows: "-" if rows.http_share is None else f"{rows.http_share:.0%}"  # noqa: E731
    lines.append(f"| HTTP share of its own offline | {share(ours)} | {share(theirs)} | |")
    lines.append(_line("HTTP, one stream at a time: TPOT p50 (ms)", ours.single, theirs.single,
                       lambda r: r.tpot_ms.p50, "{:.2f}"))
    lines.append(_line("HTTP, one stream at a time: TTFT p50 (ms)", ours.single, theirs.single,
                       lambda r: r.ttft_ms.p50, "{:.1f}"))
    lines.append(_line("offline, one stream at a time: TTFT p50 (ms)", ours.offline_single, None,
                       lambda r: r.ttft_ms.p50, "{:.1f}"))
    added = lambda rows: "-" if rows.ttft_added_ms is None else f"{rows.ttft_added_ms:.1f}"  # noqa: E731
    lines.append(f"| one stream: TTFT HTTP adds to offline's (ms) | {added(ours)} | {added(theirs)} | |")
    return "\n".join(lines) + "\n\nCPU time per process during each HTTP run:\n\n" + cpu_table(run.cpu)


def wave_ttft_p50(result: BenchResult, streams: int, later: bool) -> float | None:
    """TTFT p50 (ms) of the first wave (the first `streams` requests, sent together) or of the
    requests sent later, each as a stream ended. A closed loop's later requests arrive in bursts
    as streams end together, and cross a server's path one after another, so the two halves
    tell different stories."""
    requests = result.requests[streams:] if later else result.requests[:streams]
    ttfts = [1000 * (r.first_content - r.sent) for r in requests if r.ok and r.first_content is not None]
    return percentile(ttfts, 50) if ttfts else None


def _line(name: str, ours: BenchResult | None, theirs: BenchResult | None,
          value: Callable[[BenchResult], float | None], fmt: str) -> str:
    a = value(ours) if ours is not None else None
    b = value(theirs) if theirs is not None else None
    ratio = f"{a / b:.2f}×" if a is not None and b else "-"
    show = lambda v: "-" if v is None else fmt.format(v)  # noqa: E731
    return f"| {name} | {show(a)} | {show(b)} | {ratio} |"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True, help="a model directory both servers load")
    parser.add_argument("--config", type=Path, default=Path("configs/gpt2.yaml"), help="rayinfer's Serve config")
    parser.add_argument("--app-args", default="{}", help="JSON merged into the app's args, e.g. a design to try")
    parser.add_argument("--engine-env", default="{}",
                        help="JSON env vars for the app's runtime_env (its engine replica reads them), e.g. an LD_PRELOAD to try")
    parser.add_argument("--skip-offline", action="store_true", help="HTTP rows only (quicker design trials)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--vllm-venv", type=Path, default=None)
    parser.add_argument("--vllm-port", type=int, default=8100)
    parser.add_argument("--vllm-args", default="",
                        help="more flags for vLLM's server, e.g. '--stream-interval 8' (tokens a chunk)")
    parser.add_argument("--skip-vllm", action="store_true", help="rayinfer's rows only")
    parser.add_argument("--skip-rayinfer", action="store_true", help="vLLM's rows only")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="measure both servers this many times, alternating which goes first")
    parser.add_argument("--out", type=Path, default=None, help="directory for peers.json and peers.md")
    return parser.parse_args(argv)


def measure_round(args: argparse.Namespace, workload: TableWorkload, index: int) -> TableRun:
    """Both servers once; vLLM goes first in the 2nd, 4th, ... round (index odd), so the
    machine's drift falls on both."""
    cpu: dict[str, tuple[float, list[ProcessCpu]]] = {}
    started = utc_now()
    rows = {"rayinfer": ServerRows(), "vllm": ServerRows()}
    steps = [("rayinfer", args.skip_rayinfer, run_rayinfer), ("vllm", args.skip_vllm, run_vllm)]
    for name, skip, run in steps[::-1] if index % 2 else steps:
        if not skip:
            rows[name] = run(args, workload, cpu)
    return TableRun(workload, rows["rayinfer"], rows["vllm"], cpu, args.dtype, machine_line(started, utc_now()))


def report(runs: list[TableRun]) -> str:
    """rayinfer / vLLM over the rounds, then each round's table."""
    parts = ["rayinfer / vLLM, each round and the median:", "", ratios_table(runs)]
    parts += [f"\n## Round {i + 1}\n\n{table(run)}" for i, run in enumerate(runs)]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = TableWorkload(args.streams, args.prompt_tokens, args.max_tokens)
    runs = [measure_round(args, workload, i) for i in range(args.rounds)]
    text = report(runs)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "peers.md").write_text(text + "\n", encoding="utf-8")
        body = {"rounds": [asdict(run) for run in runs]}
        (args.out / "peers.json").write_text(json.dumps(body, indent=2, default=str) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
