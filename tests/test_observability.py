"""What an operator watches: our metrics on Ray's Prometheus export after real traffic, and a
headless locust run against the real app (zero failures, TTFT reported)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deployments.app import build_app
from loadtest.client.headless import run_locust
from tests.serve_helpers import running_app, tiny_app_args

pytestmark = pytest.mark.serve

APP = "observability"
NUM_KV_BLOCKS = 48
LOCAL_ENCODE_MAX_CHARS = 100  # the ingress encodes prompts up to this long, the tokenizer deployment the rest


@pytest.fixture(scope="module")
def server(tiny_gpt2_dir: Path) -> Iterator[tuple[str, str]]:
    """(API base URL, metrics export URL) of the app."""
    app = build_app(tiny_app_args(tiny_gpt2_dir, engine={"num_kv_blocks": NUM_KV_BLOCKS},
                                  local_encode_max_chars=LOCAL_ENCODE_MAX_CHARS))
    with running_app(app, APP) as instance:
        yield instance.url, instance.metrics_url


def test_locust_smoke_run_has_no_failures_and_reports_ttft(server, tmp_path):
    base_url, _ = server
    run = run_locust(base_url, tmp_path / "locust", users=4, spawn_rate=4, run_time="8s",
                     extra_args=("--prompt-tokens", "8", "--max-tokens", "8", "--model", "tiny",
                                 "--endpoint-weights", "completions=3,generate=1"))
    assert run.returncode == 0, run.output[-2000:]
    assert run.num_failures == 0, run.output[-2000:]
    ttft = run.entries[("METRIC", "ttft")]
    assert ttft.num_requests > 0 and ttft.median_ms > 0
    assert run.entries[("METRIC", "tpot")].num_requests > 0


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one Prometheus sample, summed over series matching the labels."""
    values = []
    for line in text.splitlines():
        match = re.match(rf"^{name}(?:{{(.*)}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            values.append(float(match.group(2)))
    return sum(values) if values else None


def scrape_until(url: str, app: str, expectations: dict, timeout_s: float = 30) -> None:
    """Poll the export until every expectation (a predicate on one sample of the Serve
    application `app`: the suite's other apps share the export) holds: Ray reports each
    replica's metrics every 0.5 s here, so values arrive a little late."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(url, timeout=5).text
        failing = {key: value for key, check in expectations.items()
                   if (value := sample(text, key[0], application=app, **dict(key[1:]))) is None or not check(value)}
        if not failing:
            return
        assert time.monotonic() < deadline, f"metrics not as expected: {failing}"
        time.sleep(0.5)


def test_metrics_reach_rays_prometheus_export_with_sensible_values(server):
    base_url, metrics_url = server
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for _ in range(3):  # one prompt of over two KV blocks: the second and third reuse its cached prefix
            body = {"model": "tiny", "prompt": "Hello there, " * 12, "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True}
            assert len(body["prompt"]) > LOCAL_ENCODE_MAX_CHARS
            assert client.post("/v1/completions", json=body).status_code == 200
        short = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}
        assert client.post("/v1/completions", json=short).status_code == 200
        assert client.post("/v1/completions", json={"model": "tiny", "prompt": ""}).status_code == 400
    at_least = lambda n: lambda v: v >= n  # noqa: E731
    scrape_until(metrics_url, APP, {
        ("ray_rayinfer_requests_total", ("endpoint", "/v1/completions"), ("status", "200")): at_least(4),
        ("ray_rayinfer_requests_total", ("endpoint", "/v1/completions"), ("status", "400")): at_least(1),
        ("ray_rayinfer_completion_tokens_total",): at_least(18),
        ("ray_rayinfer_prompt_tokens_total",): at_least(6),
        ("ray_rayinfer_prompt_tokens_total", ("tenant", "default")): at_least(6),  # one tenant: no keys
        ("ray_rayinfer_queue_wait_seconds_count", ("tenant", "default")): at_least(3),
        ("ray_rayinfer_ttft_seconds_count",): at_least(3),
        ("ray_rayinfer_ttft_seconds_sum",): lambda v: 0 < v < 60,
        ("ray_rayinfer_tpot_seconds_count",): at_least(3),
        ("ray_rayinfer_e2e_seconds_count",): at_least(3),
        ("ray_rayinfer_queue_wait_seconds_count",): at_least(3),
        ("ray_rayinfer_running_requests",): lambda v: v == 0,  # idle once the requests are done
        ("ray_rayinfer_waiting_requests",): lambda v: v == 0,
        ("ray_rayinfer_kv_blocks_used",): lambda v: v == 0,
        ("ray_rayinfer_kv_blocks_total",): lambda v: v == NUM_KV_BLOCKS,
        ("ray_rayinfer_kv_cache_usage",): lambda v: 0 <= v <= 1,
        ("ray_rayinfer_prefix_cache_hit_rate",): lambda v: 0 < v <= 1,
        # a prefill step per request (the prefix hits still compute the last block), 5 decodes each
        ("ray_rayinfer_engine_step_seconds_count", ("kind", "prefill")): at_least(3),
        ("ray_rayinfer_engine_step_seconds_count", ("kind", "decode")): at_least(15),
        ("ray_rayinfer_engine_step_seconds_sum", ("kind", "decode")): lambda v: 0 < v < 60,
        ("ray_rayinfer_iteration_tokens_count",): at_least(18),
        ("ray_rayinfer_iteration_tokens_bucket", ("le", "1.0")): at_least(15),  # the decodes, one token each
        # the long prompts by the tokenizer deployment, the short one in the ingress (the empty
        # prompt is refused untokenized)
        ("ray_rayinfer_tokenizer_batch_size_count", ("where", "deployment")): at_least(3),
        ("ray_rayinfer_tokenizer_latency_seconds_count", ("where", "deployment")): at_least(3),
        ("ray_rayinfer_tokenizer_batch_size_count", ("where", "ingress")): at_least(1),
        ("ray_rayinfer_tokenizer_batch_size_bucket", ("where", "ingress"), ("le", "1.0")): at_least(1),
    })
