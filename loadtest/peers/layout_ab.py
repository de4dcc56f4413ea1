"""The HTTP routes in the engine replica (`ingress: engine`) against an Ingress deployment of
their own (`ingress: deployment`), as configs/gpt2.yaml runs each otherwise: both apps in
one Ray cluster, so a shared machine's drift reaches both alike. Throughput at 32 streams,
rounds alternating which goes first; then an engine replica killed under 16 streams in
each (loadtest/chaos/replica_kill.py). Wrap it in the machine's Ray lock where there is one.

    python -m loadtest.make_checkpoint /tmp/gpt2-random --arch gpt2
    python -m loadtest.peers.layout_ab --model /tmp/gpt2-random --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import ray
import yaml
from ray import serve

from deployments.app import make_app
from loadtest.client.http_target import BenchConfig, Target, run_benchmark
from loadtest.chaos.replica_kill import measure
from loadtest.client.workload import Workload

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gpt2.yaml"
LAYOUTS = ("engine", "deployment")
_HTTP_LIMITS = ("max_ongoing_requests", "max_queued_requests", "backpressure_config")


def app_for(layout: str, model: str) -> serve.Application:
    """configs/gpt2.yaml's app on `model` (its own weights) with the routes where `layout` says;
    with `deployment`, the proxy's limits go to the Ingress (its code's) instead of the engine."""
    [app] = yaml.safe_load(CONFIG.read_text())["applications"]
    options = {d.pop("name"): d for d in app["deployments"]}
    if layout == "deployment":
        options["EngineDeployment"] = {k: v for k, v in options["EngineDeployment"].items() if k not in _HTTP_LIMITS}
    return make_app({**app["args"], "model": model, "weights": "pretrained", "ingress": layout}, options)


def throughput(url: str, layout: str) -> float:
    workload = Workload(num_requests=64, prompt_tokens=16, max_tokens=64, concurrency=32, warmup=1)
    result = run_benchmark(BenchConfig(Target(url, layout, ignore_eos=True), workload, show_progress=False))
    assert result.failures == 0, result.errors
    return round(result.output_throughput, 1)


def run(model: str, rounds: int, port: int) -> dict:
    controller_options = yaml.safe_load(CONFIG.read_text())["controller_options"]
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)  # room for both apps
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, controller_options=controller_options)
        for layout in LAYOUTS:
            serve.run(app_for(layout, model), name=layout, route_prefix=f"/{layout}")
        url = f"http://127.0.0.1:{port}"
        tokens_per_s: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        for i in range(rounds):
            for layout in LAYOUTS[::1 if i % 2 == 0 else -1]:
                tokens_per_s[layout].append(throughput(f"{url}/{layout}", layout))
        kills = {layout: asyncio.run(measure(f"{url}/{layout}", layout)).row() for layout in LAYOUTS}
        return {"output_tokens_per_s": tokens_per_s, "kill": kills}
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a checkpoint directory (loadtest/make_checkpoint.py)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.model, args.rounds, args.port), indent=1))


if __name__ == "__main__":
    main()
