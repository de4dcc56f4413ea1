"""Seconds from `serve run CONFIG` to its first answered completion, the way a user meets a
start: the command launched, a POST /v1/completions every 0.25 s from that moment, the
clock stopped at the first 200; then Ctrl-C and a wait until it has exited. With
--vllm-checkpoint, vLLM's CPU server (loadtest/peers/vllm_peer.py) timed the same way.

    flock /tmp/rayinfer-ray.lock python -m loadtest.peers.startup_time --config configs/gpt2.yaml --runs 3

Run it once before the measured runs (--warmup 1, the default) so that every cache a later
start reads (kernels, inductor's graphs) is warm; --warmup 0 on a fresh machine times the
cold start. One line per run, then the median. Each run's server log is kept in --log-dir.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import httpx

from loadtest.client.serve_process import restore_sigint, stop
from loadtest.peers.vllm_peer import VllmServerConfig, require_vllm

POLL_S = 0.25
REQUEST_TIMEOUT_S = 30.0


def first_answer_s(command: list[str], url: str, model: str, log_path: Path, timeout_s: float,
                   env: dict[str, str] | None = None) -> float:
    """Launch `command`, poll `url` until a completion is answered; seconds from launch to it."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 4}
    with log_path.open("wb") as log, httpx.Client(trust_env=False, timeout=REQUEST_TIMEOUT_S) as client:
        start = time.monotonic()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   preexec_fn=restore_sigint, start_new_session=True)
        try:
            return poll_until_answered(client, process, url + "/v1/completions", body, start, timeout_s)
        finally:
            stop(process)


def poll_until_answered(client: httpx.Client, process: subprocess.Popen, url: str, body: dict, start: float,
                        timeout_s: float) -> float:
    while time.monotonic() - start < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode} before answering")
        try:
            if client.post(url, json=body).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(POLL_S)
    raise TimeoutError(f"no answer within {timeout_s:.0f} s")


def time_runs(label: str, launch, num_warmup: int, num_runs: int) -> list[float]:
    """`launch(run_index)` -> seconds; warm-up runs are printed but not counted."""
    times = []
    for index in range(num_warmup + num_runs):
        is_warmup = index < num_warmup
        seconds = launch(index)
        print(f"{label} {'warm-up' if is_warmup else 'run'} {index}: first answer after {seconds:.1f} s", flush=True)
        if not is_warmup:
            times.append(seconds)
    if times:
        print(f"{label}: median {statistics.median(times):.1f} s over {len(times)} runs "
              f"({', '.join(f'{t:.1f}' for t in times)})", flush=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/gpt2.yaml")
    parser.add_argument("--model", default="gpt2", help="the served model name requests ask for")
    parser.add_argument("--port", type=int, default=8000, help="the config's HTTP port")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="uncounted runs first (0: time the cold start)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/startup_time"))
    parser.add_argument("--vllm-checkpoint", type=Path, help="also time vLLM's CPU server on this checkpoint "
                        "(python -m loadtest.make_checkpoint DIR)")
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)

    def launch_serve(index: int) -> float:
        return first_answer_s(["serve", "run", args.config], f"http://127.0.0.1:{args.port}", args.model,
                              args.log_dir / f"serve-{index}.log", args.timeout_s)

    time_runs("rayinfer", launch_serve, args.warmup, args.runs)
    if args.vllm_checkpoint:
        setup, config = require_vllm(), VllmServerConfig(args.vllm_checkpoint.resolve(), served_model_name=args.model)

        def launch_vllm(index: int) -> float:
            return first_answer_s(config.command(setup), config.url, args.model, args.log_dir / f"vllm-{index}.log",
                                  args.timeout_s, env=setup.env())

        time_runs("vLLM", launch_vllm, args.warmup, args.runs)


if __name__ == "__main__":
    main()
