# Priorities and fair shares between tenants as clients meet them: a real Ray Serve instance
# on CPU with the tiny checkpoint and two API keys, each its own tenant (the fair policy, the
# default). The engine runs at most 2 sequences and lets 4 wait: two long streams fill it,
# so "queued behind a flood" and "over its share" are states a test sets up exactly, and a
# test asserts on the order requests start in, never on times.
# After every test the engine must be idle with every KV block back in the pool.
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine_faults import faulty_app
from tests.http_helpers import (
    PROMPTS, Stream, assert_idle_and_intact, assert_openai_error, greedy, until,
)
from tests.serve_helpers import ray_logs_dir, running_app, tiny_app_args

pytestmark = pytest.mark.serve

APP = "rayinfer"
HEAVY_KEY, LIGHT_KEY = f"sk-heavy-{uuid.uuid4().hex}", f"sk-light-{uuid.uuid4().hex}"
ENGINE_ARGS = {"num_kv_blocks": 160, "max_num_seqs": 2, "max_num_batched_tokens": 256,
               "max_waiting_requests": 4, "max_waiting_tokens": 2048}
LONG = 400  # output tokens of a stream that outlives the steps a test takes around it


@pytest.fixture(scope="module")
def base_url(tiny_gpt2_dir: Path) -> Iterator[str]:
    keys = [f"{HEAVY_KEY} name=heavy", f"{LIGHT_KEY} name=light weight=1"]
    args = tiny_app_args(tiny_gpt2_dir, engine=ENGINE_ARGS, tokenizer_num_replicas=1, api_keys=keys)
    with running_app(faulty_app(args), APP) as instance:
        yield instance.url


@pytest.fixture(scope="module")
def http_headers() -> dict[str, str]:
    return auth(LIGHT_KEY)


@pytest.fixture(autouse=True)
def the_engine_is_idle_and_intact_after_each_test(http: httpx.Client) -> Iterator[None]:
    yield
    assert_idle_and_intact(http, APP)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def stream_body(prompt: str, max_tokens: int, **fields) -> dict:
    return greedy(prompt, max_tokens=max_tokens, ignore_eos=True, stream=True, **fields)


async def started_in_order(streams: dict[str, Stream]) -> list[str]:
    """The names of `streams` in the order their first chunks arrived."""
    order: list[str] = []

    async def note(name: str, stream: Stream) -> None:
        await stream.first_chunk.wait()
        order.append(name)

    await asyncio.gather(*(note(name, stream) for name, stream in streams.items()))
    return order


def run_tenants(scenario, base_url: str):
    """`scenario(heavy, light)`: an async client for each key."""
    async def main():
        async with httpx.AsyncClient(base_url=base_url, timeout=180, headers=auth(HEAVY_KEY)) as heavy, \
                httpx.AsyncClient(base_url=base_url, timeout=180, headers=auth(LIGHT_KEY)) as light:
            return await scenario(heavy, light)
    return asyncio.run(main())


def test_a_light_tenants_request_is_not_queued_behind_a_floods_waiting_requests(base_url: str) -> None:
    async def scenario(heavy: httpx.AsyncClient, light: httpx.AsyncClient):
        running = [Stream(heavy, stream_body(p, LONG)) for p in PROMPTS[:2]]
        await until(heavy, lambda h: h["stats"]["num_running"] == 2)
        flood = {f"heavy-{i}": Stream(heavy, stream_body(PROMPTS[2], 8)) for i in range(2)}
        await until(heavy, lambda h: h["stats"]["num_waiting"] == 2)
        flood["light"] = Stream(light, stream_body(PROMPTS[0], 8))  # short of its share: runs at once
        order = await started_in_order(flood)
        await asyncio.gather(*(s.task for s in running + list(flood.values())))
        return order, running + list(flood.values())

    order, streams = run_tenants(scenario, base_url)
    assert order[0] == "light", order  # arrived last, started first: the flood had more service
    for stream in streams:
        assert (stream.status, stream.payloads[-1], stream.error) == (200, "[DONE]", None)


def test_a_flooding_tenant_gets_429s_while_the_others_requests_are_admitted(base_url: str) -> None:
    async def scenario(heavy: httpx.AsyncClient, light: httpx.AsyncClient):
        running = [Stream(heavy, stream_body(p, LONG)) for p in PROMPTS[:2]]
        await until(heavy, lambda h: h["stats"]["num_running"] == 2)
        queued = [Stream(heavy, stream_body(PROMPTS[2], 4)) for _ in range(4)]  # alone, it may fill the line
        await until(heavy, lambda h: h["stats"]["num_waiting"] == 4)
        heavy_refused = await heavy.post("/v1/completions", json=greedy(PROMPTS[0], max_tokens=4))
        admitted = [Stream(light, stream_body(PROMPTS[1], 4)) for _ in range(2)]  # its share: half of 4
        # short of its share of the slots, the light tenant runs at once (or waits its turn)
        await asyncio.gather(*(stream.first_chunk.wait() for stream in admitted))
        heavy_again = await heavy.post("/v1/completions", json=greedy(PROMPTS[0], max_tokens=4))
        await asyncio.gather(*(s.task for s in running + queued + admitted))
        return [heavy_refused, heavy_again], running + queued + admitted

    refused, served = run_tenants(scenario, base_url)
    for response in refused:
        error = assert_openai_error(response, 429, "rate_limit_exceeded")
        assert error["code"] == "engine_overloaded" and "tenant heavy" in error["message"]
        assert HEAVY_KEY not in response.text
    for stream in served:
        assert (stream.status, stream.payloads[-1], stream.error) == (200, "[DONE]", None)
    # a 429 is an answer: no traceback for it in the engine replica's log
    time.sleep(1)  # log handlers flush
    logs = ray_logs_dir() / "serve"
    engine_logs = [f.read_text(errors="replace") for f in logs.glob(f"replica_{APP}_EngineDeployment_*.log")]
    assert engine_logs and not any("EngineOverloadedError" in text for text in engine_logs)


def test_a_higher_priority_request_preempts_a_running_one_and_nothing_leaks(base_url: str) -> None:
    async def scenario(heavy: httpx.AsyncClient, light: httpx.AsyncClient):
        running = {f"low-{i}": Stream(heavy, stream_body(p, LONG, priority=5)) for i, p in enumerate(PROMPTS[:2])}
        await until(heavy, lambda h: h["stats"]["num_running"] == 2)
        before = (await heavy.get("/health")).json()["stats"]["num_preemptions"]
        urgent = Stream(heavy, stream_body(PROMPTS[2], 8, priority=-5))
        await urgent.task
        health = (await heavy.get("/health")).json()
        still_running = [name for name, s in running.items() if s.payloads[-1:] != ["[DONE]"]]
        await asyncio.gather(*(s.task for s in running.values()))
        return health["stats"]["num_preemptions"] - before, still_running, [urgent, *running.values()]

    num_preempted, still_running, streams = run_tenants(scenario, base_url)
    assert num_preempted >= 1
    assert len(still_running) == 2  # it finished while both long streams were still going
    for stream in streams:
        assert (stream.status, stream.payloads[-1], stream.error) == (200, "[DONE]", None)


def test_a_priority_outside_the_range_is_a_400_naming_it(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json=greedy(PROMPTS[0], max_tokens=2, priority=1000))
    error = assert_openai_error(response, 400, "invalid_request_error", "priority")
    assert "[-100, 100]" in error["message"]
