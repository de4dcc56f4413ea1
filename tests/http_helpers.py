"""What the HTTP tests share: request bodies, reading SSE, waiting on /health, OpenAI error
checks, background streams, and the engine deployment's own integrity check."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
from ray import serve

from tests.serve_helpers import MODEL

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]

T = TypeVar("T")


def greedy(prompt: str | list[int], max_tokens: int = 12, **fields: Any) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}


def sse_payloads(response: httpx.Response) -> list[str]:
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line.removeprefix("data: ") for line in lines]


def health_of(client: httpx.Client) -> tuple[int, dict]:
    response = client.get("/health", headers={})
    return response.status_code, response.json()


def engine_health(client: httpx.Client) -> dict:
    status, health = health_of(client)
    assert status == 200, health
    return health


def is_idle(health: dict) -> bool:
    """Up, nothing in the engine, every KV block back in the pool."""
    stats = health.get("stats", {})
    return health.get("num_active_requests") == 0 and stats.get("num_running") == 0 \
        and stats.get("num_waiting") == 0 and stats.get("num_kv_blocks_used") == 0


def wait_until_idle(client: httpx.Client, timeout_s: float = 90) -> dict:
    """/health once the engine is up and idle (or as it is at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, health = health_of(client)
        if (status == 200 and is_idle(health)) or time.monotonic() > deadline:
            return health
        time.sleep(0.1)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 20, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(interval_s)


def check_engine_integrity(app: str) -> None:
    """The serving engine's own KV pool check (ref counts, free + used = total), beyond the
    counts /health reports, in an app built with tests/engine_faults.py's faulty_app. Raises
    AssertionError (through Ray) when it fails."""
    serve.get_deployment_handle("EngineDeployment", app).check_integrity.remote().result(timeout_s=30)


def assert_idle_and_intact(client: httpx.Client, app: str) -> None:
    """The engine idle (nothing running, waiting or streaming), every KV block back in the
    pool, and its own integrity check passing: what a test leaves behind."""
    health = wait_until_idle(client)
    stats = health["stats"]
    assert (health["num_active_requests"], stats["num_running"], stats["num_waiting"]) == (0, 0, 0), health
    assert stats["num_kv_blocks_used"] == 0, "KV blocks leaked"
    check_engine_integrity(app)


def assert_openai_error(response: httpx.Response, status: int, type: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["type"], error["param"]) == (type, param), error
    return error


class Stream:
    """An SSE response read in the background: its payloads, and a way to drop it."""

    def __init__(self, http: httpx.AsyncClient, body: dict) -> None:
        self.payloads: list[str] = []
        self.status: int | None = None
        self.first_chunk = asyncio.Event()
        self.task = asyncio.create_task(self._read(http, body))

    async def _read(self, http: httpx.AsyncClient, body: dict) -> None:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            self.status = response.status_code
            async for line in response.aiter_lines():
                if line:
                    self.payloads.append(line.removeprefix("data: "))
                    self.first_chunk.set()
        self.first_chunk.set()

    async def drop(self) -> None:
        """Close the connection wherever the request is (queued, mid-stream)."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    @property
    def text(self) -> str:
        return "".join(json.loads(p)["choices"][0]["text"] for p in self.payloads[:-1])

    @property
    def error(self) -> dict | None:
        errors = [json.loads(p)["error"] for p in self.payloads if p != "[DONE]" and "error" in json.loads(p)]
        return errors[0] if errors else None


def run_async(scenario: Callable[[httpx.AsyncClient], Awaitable[T]], base_url: str,
              headers: dict[str, str] | None = None) -> T:
    """`scenario(http)` on a fresh event loop with an async client of the app."""
    async def main() -> T:
        async with httpx.AsyncClient(base_url=base_url, timeout=180, headers=headers) as http:
            return await scenario(http)

    return asyncio.run(main())


async def until(http: httpx.AsyncClient, predicate: Callable[[dict], bool], timeout_s: float = 20) -> dict:
    """/health once predicate(health) holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = (await http.get("/health")).json()
        if predicate(health):
            return health
        assert time.monotonic() < deadline, f"not reached: {health}"
        await asyncio.sleep(0.02)
