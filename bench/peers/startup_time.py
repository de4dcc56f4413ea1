"""Seconds from `serve run CONFIG` to its first answered completion, the way a user meets a
start: the command launched, a POST /v1/completions every 0.25 s from that moment, the
clock stopped at the first 200; then Ctrl-C and a wait until it has exited. With
--vllm-checkpoint, vLLM's CPU server (bench/peers/vllm_peer.py) timed the same way.

    flock /tmp/rayinfer-ray.lock python -m bench.peers.startup_time --config configs/gpt2.yaml --runs 3

Run it once before the measured runs (--warmup 1, the default) so that every cache a later
start reads (kernels, inductor's graphs) is warm. --cold times the first start after install
instead: each run gets empty compile caches (TORCHINDUCTOR_CACHE_DIR, VLLM_CACHE_ROOT) and
tuning tables (RAYINFER_TUNING_DIR), and no warm-up; our kernels stay, as `pip install`
built them. rayinfer answers on eager steps while its decode graph compiles, so it also
reports full speed: its log's "decode graph ready" line. vLLM compiles before it serves, so
its first answer is its full speed. One line per run, then the medians. Each run's server
log is kept in --log-dir.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadtest.client.serve_process import restore_sigint, stop
from bench.peers.vllm_peer import VllmServerConfig, require_vllm

POLL_S = 0.25
REQUEST_TIMEOUT_S = 30.0
FULL_SPEED_LINE = b"decode graph ready after"  # engine/core/llm_engine.py logs it when steps switch to the graph


@dataclass(frozen=True)
class StartTiming:
    first_answer_s: float
    full_speed_s: float | None  # None: the server was not asked to report it


def time_start(command: list[str], url: str, model: str, log_path: Path, timeout_s: float,
               env: dict[str, str] | None = None, full_speed_line: bytes | None = None) -> StartTiming:
    """Launch `command`, poll `url` until a completion is answered, then (with `full_speed_line`)
    watch its log for that line; seconds from launch to each."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 4}
    with log_path.open("wb") as log, httpx.Client(trust_env=False, timeout=REQUEST_TIMEOUT_S) as client:
        start = time.monotonic()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   preexec_fn=restore_sigint, start_new_session=True)
        try:
            answered = poll_until_answered(client, process, url + "/v1/completions", body, start, timeout_s)
            full_speed = None
            if full_speed_line is not None:
                full_speed = wait_for_line(process, log_path, full_speed_line, start, timeout_s)
            return StartTiming(answered, full_speed)
        finally:
            stop(process)


def cold_env(base: dict[str, str], root: Path) -> dict[str, str]:
    """`base` with empty caches under `root`: inductor's (ours, and torch's in vLLM), vLLM's own
    and our tuner's tables (engine/core/tuning_cache.py)."""
    (root / "inductor").mkdir(parents=True)
    (root / "vllm").mkdir()
    return {**base, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "VLLM_CACHE_ROOT": str(root / "vllm"),
            "RAYINFER_TUNING_DIR": str(root / "tuning")}


def poll_until_answered(client: httpx.Client, process: subprocess.Popen, url: str, body: dict, start: float,
                        timeout_s: float) -> float:
    def answered() -> bool:
        try:
            return client.post(url, json=body).status_code == 200
        except httpx.HTTPError:
            return False  # not listening yet

    return poll(process, answered, "answering", start, timeout_s)


def wait_for_line(process: subprocess.Popen, log_path: Path, line: bytes, start: float, timeout_s: float) -> float:
    return poll(process, lambda: line in log_path.read_bytes(), f"logging {line.decode()!r}", start, timeout_s)


def poll(process: subprocess.Popen, is_done: Callable[[], bool], what: str, start: float, timeout_s: float) -> float:
    """Seconds from `start` until `is_done()`, asked every POLL_S while `process` runs."""
    while time.monotonic() - start < timeout_s:
        if is_done():
            return time.monotonic() - start
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode} before {what}")
        time.sleep(POLL_S)
    raise TimeoutError(f"not {what} within {timeout_s:.0f} s")


def time_runs(label: str, launch, num_warmup: int, num_runs: int) -> list[StartTiming]:
    """`launch(run_index)` -> StartTiming; warm-up runs are printed but not counted."""
    timings = []
    for index in range(num_warmup + num_runs):
        is_warmup = index < num_warmup
        timing = launch(index)
        full_speed = "" if timing.full_speed_s is None else f", full speed after {timing.full_speed_s:.1f} s"
        print(f"{label} {'warm-up' if is_warmup else 'run'} {index}: first answer after "
              f"{timing.first_answer_s:.1f} s{full_speed}", flush=True)
        if not is_warmup:
            timings.append(timing)
    if timings:
        print_medians(label, timings)
    return timings


def print_medians(label: str, timings: list[StartTiming]) -> None:
    for what, seconds in (("first answer", [t.first_answer_s for t in timings]),
                          ("full speed", [t.full_speed_s for t in timings if t.full_speed_s is not None])):
        if seconds:
            print(f"{label}: {what} median {statistics.median(seconds):.1f} s over {len(seconds)} runs "
                  f"({', '.join(f'{s:.1f}' for s in seconds)})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/gpt2.yaml")
    parser.add_argument("--model", default="gpt2", help="the served model name requests ask for")
    parser.add_argument("--port", type=int, default=8000, help="the config's HTTP port")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="uncounted runs first, to warm every cache")
    parser.add_argument("--cold", action="store_true", help="time the first start after install: every run with "
                        "empty compile caches, no warm-up")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/startup_time"))
    parser.add_argument("--vllm-checkpoint", type=Path, help="also time vLLM's CPU server on this checkpoint "
                        "(python -m loadtest.make_checkpoint DIR)")
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    num_warmup = 0 if args.cold else args.warmup
    caches = tempfile.TemporaryDirectory(prefix="startup-caches-")

    def run_env(base: dict[str, str], label: str, index: int) -> dict[str, str]:
        return cold_env(base, Path(caches.name) / f"{label}-{index}") if args.cold else base

    def launch_serve(index: int) -> StartTiming:
        return time_start(["serve", "run", args.config], f"http://127.0.0.1:{args.port}", args.model,
                          args.log_dir / f"serve-{index}.log", args.timeout_s,
                          env=run_env(dict(os.environ), "rayinfer", index), full_speed_line=FULL_SPEED_LINE)

    with caches:
        time_runs("rayinfer", launch_serve, num_warmup, args.runs)
        if args.vllm_checkpoint:
            setup = require_vllm()
            config = VllmServerConfig(args.vllm_checkpoint.resolve(), served_model_name=args.model)

            def launch_vllm(index: int) -> StartTiming:
                return time_start(config.command(setup), config.url, args.model, args.log_dir / f"vllm-{index}.log",
                                  args.timeout_s, env=run_env(setup.env(), "vllm", index))

            time_runs("vLLM", launch_vllm, num_warmup, args.runs)


if __name__ == "__main__":
    main()
