# The app configs/tiny.yaml serves, on the suite's shared Serve instance, under a short chaos
# run (loadtest/chaos/run.py): its args as shipped, with API keys, and the tiny checkpoint
# instead of distilgpt2's architecture. test_serve_run checks what `serve run` itself exposes.
from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from deployments.app import build_app
from loadtest.chaos.config import ChaosConfig
from loadtest.chaos.run import check_loopback, run_chaos
from loadtest.chaos.verdict import summary
from tests.serve_helpers import ROOT, running_app

pytestmark = pytest.mark.serve

API_KEY = f"sk-chaos-{uuid.uuid4().hex}"


def tiny_yaml_args(model_dir: Path) -> dict:
    [app] = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())["applications"]
    return app["args"] | {"model": str(model_dir), "weights": "pretrained", "api_keys": [API_KEY]}


@pytest.fixture(scope="module")
def served(tiny_gpt2_dir: Path) -> Iterator[str]:
    with running_app(build_app(tiny_yaml_args(tiny_gpt2_dir)), "chaos") as instance:
        yield instance.url


def test_a_short_chaos_run_leaves_no_5xx_no_leaked_blocks_and_nothing_stuck(served: str) -> None:
    config = ChaosConfig(served, duration_s=10, warmup_s=2, concurrency=6, burst_every_s=3, burst_size=32,
                         burst_prompt_tokens=288, api_key=API_KEY)  # 9,216 tokens: past max_waiting_tokens
    report = asyncio.run(run_chaos(config))
    print(summary(report))
    assert report["passed"], report["failures"]
    # The mix is random and a 10 s run on a loaded machine may miss a rare kind: ask for
    # valid traffic, overload, and at least one bad input and one disconnect of any kind.
    kinds = set(report["requests"])
    assert {"stream", "complete", "burst"} <= kinds, kinds
    assert kinds & {"bad_input", "too_large", "bad_key"} and kinds & {"drop_mid_stream", "drop_queued", "drop_non_stream"}
    assert report["valid_5xx"] == 0 and report["kv_blocks"]["leaked"] == 0


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000"])
def test_chaos_refuses_any_server_but_this_machine(url: str) -> None:
    with pytest.raises(SystemExit):
        check_loopback(url)
