# The HTTP API fuzzed as a property (loadtest/fuzz.py): bodies generated from the app's own
# /openapi.json, valid and not, for every POST route, against real Ray Serve with the tiny
# checkpoint. A short run of fresh random bodies each time (a failure names its body);
# `python -m loadtest.fuzz` runs a long one.
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.fuzz import Tally, engine_at_rest, fuzz
from tests.engine_faults import faulty_app
from tests.http_helpers import check_engine_integrity
from tests.serve_helpers import running_app, tiny_app_args

pytestmark = pytest.mark.serve

# A short context keeps every valid body's generation short: a run's time goes to many bodies.
ENGINE_ARGS = {"max_model_len": 64, "num_kv_blocks": 64, "max_num_seqs": 16, "max_num_batched_tokens": 256}
MAX_EXAMPLES = 500  # 12-18 s on 2 cores; `python -m loadtest.fuzz` runs as many as it is told


@pytest.fixture(scope="module")
def base_url(tiny_gpt2_dir: Path) -> Iterator[str]:
    with running_app(faulty_app(tiny_app_args(tiny_gpt2_dir, engine=ENGINE_ARGS)), "rayinfer") as instance:
        yield instance.url


def test_no_generated_body_gets_a_5xx_or_leaks_and_the_engine_serves_on(base_url: str) -> None:
    tally = Tally()
    fuzz(base_url, {}, MAX_EXAMPLES, tally)
    routes = {route for route, _ in tally.sent}
    # The LoRA load routes are documented always, and 404s here (allow_runtime_lora_updating is off).
    assert routes == {"POST /v1/completions", "POST /v1/chat/completions", "POST /generate", "POST /tokenize",
                      "POST /detokenize", "POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter"}, tally.summary()
    assert {status for _, status in tally.sent} & {200} and {status for _, status in tally.sent} & {400}
    assert engine_at_rest(base_url, {}) is None  # up, idle, every KV block back
    check_engine_integrity("rayinfer")
