"""One chaos worker's requests, one method per scenario, each returning its Outcome."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

from loadtest.chaos.config import ChaosConfig
from loadtest.chaos.scenarios import Outcome, Scenario
from loadtest.client.prompts import make_prompt

REFUSED = 429  # the overload answer: fine for a valid request when it carries Retry-After


def make_http(config: ChaosConfig) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency + config.burst_size + 8)
    return httpx.AsyncClient(base_url=config.url, headers=headers, timeout=config.request_timeout_s, limits=limits)


class Client:
    """One worker's view: its own random stream, the run's shared connection pool."""

    def __init__(self, config: ChaosConfig, rng: random.Random, http: httpx.AsyncClient) -> None:
        self.config, self.rng, self.http = config, rng, http

    def request(self, scenario: Scenario) -> Callable[[], Awaitable[Outcome]]:
        """The method that sends one request of `scenario` (bursts: see burst)."""
        return {
            Scenario.STREAM: self.valid_stream, Scenario.COMPLETE: self.valid_complete, Scenario.CHAT: self.valid_chat,
            Scenario.BAD_INPUT: self.bad_input, Scenario.TOO_LARGE: self.too_large, Scenario.BAD_KEY: self.bad_key,
            Scenario.DROP_MID_STREAM: self.drop_mid_stream, Scenario.DROP_QUEUED: self.drop_queued,
            Scenario.DROP_NON_STREAM: self.drop_non_stream,
        }[scenario]

    def completion(self, stream: bool, max_tokens: int | None = None, prompt_tokens: int | None = None) -> dict:
        rng = self.rng
        body = {"prompt": make_prompt(prompt_tokens or rng.randint(4, 96), rng),
                "max_tokens": max_tokens or rng.randint(2, 48), "stream": stream}
        if rng.random() < 0.5:
            body |= {"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(1 << 30)}
        else:
            body["temperature"] = 0
        if rng.random() < 0.2:
            body["stop"] = [rng.choice([".", ",", " the"])]
        if self.config.model:
            body["model"] = self.config.model
        return body

    async def valid_stream(self, kind: Scenario = Scenario.STREAM, body: dict | None = None) -> Outcome:
        body = body or self.completion(stream=True)
        async with self.http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return refusal_or_problem(kind, response)
            events = [line async for line in response.aiter_lines() if line]
        if not events or events[-1] != "data: [DONE]":
            return Outcome(kind, 200, "stream did not end with [DONE]")
        errors = error_events(events[:-1])
        return Outcome(kind, 200, f"error event: {errors[0]}" if errors else None)

    async def valid_complete(self) -> Outcome:
        response = await self.http.post("/v1/completions", json=self.completion(stream=False))
        if response.status_code != 200:
            return refusal_or_problem(Scenario.COMPLETE, response)
        return Outcome(Scenario.COMPLETE, 200, None if response.json().get("choices") else "no choices")

    async def valid_chat(self) -> Outcome:
        messages = [{"role": "user", "content": make_prompt(self.rng.randint(4, 48), self.rng)}]
        body = {"messages": messages, "max_tokens": self.rng.randint(2, 32), "temperature": 0,
                "stream": self.rng.random() < 0.5}
        if body["stream"]:
            async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    return refusal_or_problem(Scenario.CHAT, response)
                events = [line async for line in response.aiter_lines() if line]
                ok = events[-1:] == ["data: [DONE]"] and not error_events(events[:-1])
        else:
            response = await self.http.post("/v1/chat/completions", json=body)
            ok = response.status_code == 200
        if response.status_code != 200:
            return refusal_or_problem(Scenario.CHAT, response)
        return Outcome(Scenario.CHAT, 200, None if ok else "broken response")

    async def bad_input(self) -> Outcome:
        path, content, expected = self.rng.choice(bad_inputs(self.config.model))
        response = await self.http.post(path, content=content, headers={"content-type": "application/json"})
        return expect(Scenario.BAD_INPUT, response, expected)

    async def too_large(self) -> Outcome:
        body = json.dumps(self.completion(stream=False)).encode()
        padded = body + b" " * (self.config.max_body_bytes + 1 - len(body))
        chunked = self.rng.random() < 0.5  # no Content-Length: the server must count
        response = await self.http.post("/v1/completions", content=in_chunks(padded) if chunked else padded)
        return expect(Scenario.TOO_LARGE, response, 413)

    async def bad_key(self) -> Outcome:
        headers = {"Authorization": f"Bearer wrong-{self.rng.randrange(1 << 30)}"}
        response = await self.http.post("/v1/completions", json=self.completion(stream=False), headers=headers)
        return expect(Scenario.BAD_KEY, response, 401)

    async def drop_mid_stream(self) -> Outcome:
        body = self.completion(stream=True, max_tokens=self.rng.randint(64, 256)) | {"ignore_eos": True}
        async with self.http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return refusal_or_problem(Scenario.DROP_MID_STREAM, response)
            num_events = self.rng.randint(1, 5)
            async for line in response.aiter_lines():
                num_events -= bool(line)
                if num_events == 0:
                    break  # leaving the block closes the connection mid-stream
        return Outcome(Scenario.DROP_MID_STREAM, None)

    async def drop_queued(self) -> Outcome:
        body = self.completion(stream=True, max_tokens=128) | {"ignore_eos": True}
        return await self._leave_after(self.http.post("/v1/completions", json=body), Scenario.DROP_QUEUED, 0.0, 0.05)

    async def drop_non_stream(self) -> Outcome:
        body = self.completion(stream=False, max_tokens=256) | {"ignore_eos": True}
        request = self.http.post("/v1/completions", json=body)
        return await self._leave_after(request, Scenario.DROP_NON_STREAM, 0.05, 0.5)

    async def _leave_after(self, request: Awaitable[httpx.Response], kind: Scenario, low: float, high: float) -> Outcome:
        task = asyncio.ensure_future(request)
        done, _ = await asyncio.wait({task}, timeout=self.rng.uniform(low, high))
        if not done:
            task.cancel()  # closes the connection: the server must abort the request
            await asyncio.gather(task, return_exceptions=True)
            return Outcome(kind, None)
        response = task.result()
        return Outcome(kind, response.status_code) if response.status_code == 200 else refusal_or_problem(kind, response)

    async def burst(self) -> list[Outcome]:
        bodies = [self.completion(stream=self.rng.random() < 0.5, max_tokens=32,
                                  prompt_tokens=self.config.burst_prompt_tokens)
                  for _ in range(self.config.burst_size)]
        return await asyncio.gather(*(self._burst_one(body) for body in bodies))

    async def _burst_one(self, body: dict) -> Outcome:
        if body["stream"]:
            return await self.valid_stream(Scenario.BURST, body)
        response = await self.http.post("/v1/completions", json=body)
        return Outcome(Scenario.BURST, 200) if response.status_code == 200 else refusal_or_problem(Scenario.BURST, response)


def error_events(events: list[str]) -> list[dict]:
    """The OpenAI error objects among SSE `data:` lines (before [DONE])."""
    payloads = [json.loads(event.removeprefix("data: ")) for event in events]
    return [p["error"] for p in payloads if isinstance(p, dict) and "error" in p]


async def in_chunks(data: bytes, size: int = 65536) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def refusal_or_problem(kind: Scenario, response: httpx.Response) -> Outcome:
    """A non-200 answer to a valid request: fine if it is an overload refusal."""
    if response.status_code == REFUSED and response.headers.get("retry-after"):
        return Outcome(kind, response.status_code)
    return Outcome(kind, response.status_code, f"HTTP {response.status_code}: {response.text[:200]}")


def expect(kind: Scenario, response: httpx.Response, status: int) -> Outcome:
    if response.status_code == status and response.headers.get("content-type") == "application/json" \
            and "error" in response.json():
        return Outcome(kind, status)
    return Outcome(kind, response.status_code, f"expected {status}, got {response.status_code}: {response.text[:200]}")


def bad_inputs(model: str | None) -> list[tuple[str, bytes, int]]:
    """(path, raw body, expected status): each a mistake a client makes."""
    def body(**fields) -> bytes:
        return json.dumps({"prompt": "hello", "max_tokens": 4, **fields}).encode()

    completions = [
        body(prompt=""), body(prompt=7), body(prompt=[50257]), body(prompt=[-1]), body(prompt=[1] * 1024),
        body(max_tokens=0), body(max_tokens=5000), body(max_tokens="4"), body(temperature=-1), body(top_p=0),
        body(top_p=2), body(top_k=-5), body(stop=["x"] * 17), body(stop=[""]), body(n=0), body(n=99),
        body(stream="yes"),
        b'{"prompt": "hello", "temperature": NaN}', b'{"prompt": "hello", "temperature": Infinity}',
        b'{"prompt": "hello",', b'{"prompt": "\xff\xfe"}', b'["hello"]', b"", b"null",
    ]
    chat = [json.dumps(b).encode() for b in (
        {"messages": []}, {"messages": "hi"}, {"messages": [{"role": "robot", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000},
    )]
    generate = [b'{"prompt": "hi", "max_new_tokens": 0}', b'{"prompt": ""}']
    unknown_model = ("/v1/completions", body(model="no-such-model"), 404)  # not found, as OpenAI answers
    return ([("/v1/completions", c, 400) for c in completions] + [("/v1/chat/completions", c, 400) for c in chat]
            + [("/generate", c, 400) for c in generate] + [unknown_model])
