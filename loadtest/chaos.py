"""A bounded chaos run against a local rayinfer server, and its verdict.

    python -m loadtest.chaos --url http://127.0.0.1:8000 --duration 120 --out chaos_out

For `--duration` seconds (and at most `--max-requests` requests), `--concurrency` workers
send a random mix of valid requests (streaming and not, completions and chat), bad inputs
(each must get its 4xx), oversized bodies (413), wrong API keys (401, when a key is given)
and clients that leave: mid-stream, while queued, and on a non-streaming request. Every
`--burst-every` seconds a burst of `--burst-size` simultaneous long requests overloads the
engine: each must be served or refused with 429 and a Retry-After, never fail.

Then, once the server is idle, it passes when: no valid request got a 5xx or a broken
stream, every bad input got its status, no KV block is still in use (free = total), no
request is stuck in the engine (running = waiting = 0), and memory is flat: the engine
replica's RSS (from /health, read 3 s into idle after the warm-up, half-way and at the end) grew
less than `--max-rss-growth-mb` over the second half. The first half may still raise the
allocator's high-water mark (new batch shapes); a leak grows in both. It prints a summary,
writes `chaos.json` under `--out`, and exits 1 when it fails. It only talks to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from loadtest.prompts import make_prompt

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
VALID_KINDS = ("stream", "complete", "chat", "burst")
DISCONNECT_KINDS = ("drop_mid_stream", "drop_queued", "drop_non_stream")
REFUSED = 429  # the overload answer: fine for a valid request when it carries Retry-After


@dataclass(frozen=True)
class ChaosConfig:
    url: str
    duration_s: float = 120.0
    max_requests: int = 20_000
    concurrency: int = 8
    burst_every_s: float = 15.0
    burst_size: int = 64
    burst_prompt_tokens: int = 320  # 64 x 320 = 20,480 tokens: past gpt2.yaml's max_waiting_tokens
    warmup_s: float = 10.0
    api_key: str | None = None
    model: str | None = None
    max_body_bytes: int = 1 << 20
    max_rss_growth_mb: float = 64.0
    request_timeout_s: float = 120.0
    seed: int = 0


@dataclass
class Outcome:
    kind: str
    status: int | None  # None: the client left before a status, on purpose
    problem: str | None = None  # a valid request that failed, a bad input with the wrong status


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)

    def add(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    def requests_by_kind(self) -> dict[str, int]:
        return dict(Counter(o.kind for o in self.outcomes))

    def statuses_by_kind(self) -> dict[str, dict[str, int]]:
        table: dict[str, Counter] = defaultdict(Counter)
        for o in self.outcomes:
            table[o.kind][str(o.status) if o.status is not None else "client_left"] += 1
        return {kind: dict(counts) for kind, counts in sorted(table.items())}

    def problems(self) -> list[str]:
        return [f"{o.kind}: {o.problem}" for o in self.outcomes if o.problem]

    def num_valid_5xx(self) -> int:
        return sum(o.kind in VALID_KINDS and o.status is not None and o.status >= 500 for o in self.outcomes)


# ---- requests ----


def make_http(config: ChaosConfig) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency + config.burst_size + 8)
    return httpx.AsyncClient(base_url=config.url, headers=headers, timeout=config.request_timeout_s, limits=limits)


class Client:
    """One worker's view: its own random stream, the run's shared connection pool."""

    def __init__(self, config: ChaosConfig, rng: random.Random, http: httpx.AsyncClient) -> None:
        self.config, self.rng, self.http = config, rng, http

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

    async def valid_stream(self, kind: str = "stream", body: dict | None = None) -> Outcome:
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
            return refusal_or_problem("complete", response)
        return Outcome("complete", 200, None if response.json().get("choices") else "no choices")

    async def valid_chat(self) -> Outcome:
        messages = [{"role": "user", "content": make_prompt(self.rng.randint(4, 48), self.rng)}]
        body = {"messages": messages, "max_tokens": self.rng.randint(2, 32), "temperature": 0,
                "stream": self.rng.random() < 0.5}
        if body["stream"]:
            async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    return refusal_or_problem("chat", response)
                events = [line async for line in response.aiter_lines() if line]
                ok = events[-1:] == ["data: [DONE]"] and not error_events(events[:-1])
        else:
            response = await self.http.post("/v1/chat/completions", json=body)
            ok = response.status_code == 200
        if response.status_code != 200:
            return refusal_or_problem("chat", response)
        return Outcome("chat", 200, None if ok else "broken response")

    async def bad_input(self) -> Outcome:
        path, content, expected = self.rng.choice(bad_inputs(self.config.model))
        response = await self.http.post(path, content=content, headers={"content-type": "application/json"})
        return expect("bad_input", response, expected)

    async def too_large(self) -> Outcome:
        body = json.dumps(self.completion(stream=False)).encode()
        padded = body + b" " * (self.config.max_body_bytes + 1 - len(body))
        chunked = self.rng.random() < 0.5  # no Content-Length: the server must count
        response = await self.http.post("/v1/completions", content=in_chunks(padded) if chunked else padded)
        return expect("too_large", response, 413)

    async def bad_key(self) -> Outcome:
        headers = {"Authorization": f"Bearer wrong-{self.rng.randrange(1 << 30)}"}
        response = await self.http.post("/v1/completions", json=self.completion(stream=False), headers=headers)
        return expect("bad_key", response, 401)

    async def drop_mid_stream(self) -> Outcome:
        body = self.completion(stream=True, max_tokens=self.rng.randint(64, 256)) | {"ignore_eos": True}
        async with self.http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return refusal_or_problem("drop_mid_stream", response)
            num_events = self.rng.randint(1, 5)
            async for line in response.aiter_lines():
                num_events -= bool(line)
                if num_events == 0:
                    break  # leaving the block closes the connection mid-stream
        return Outcome("drop_mid_stream", None)

    async def drop_queued(self) -> Outcome:
        body = self.completion(stream=True, max_tokens=128) | {"ignore_eos": True}
        return await self._leave_after(self.http.post("/v1/completions", json=body), "drop_queued", 0.0, 0.05)

    async def drop_non_stream(self) -> Outcome:
        body = self.completion(stream=False, max_tokens=256) | {"ignore_eos": True}
        return await self._leave_after(self.http.post("/v1/completions", json=body), "drop_non_stream", 0.05, 0.5)

    async def _leave_after(self, request: Awaitable[httpx.Response], kind: str, low: float, high: float) -> Outcome:
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
            return await self.valid_stream("burst", body)
        response = await self.http.post("/v1/completions", json=body)
        return Outcome("burst", 200) if response.status_code == 200 else refusal_or_problem("burst", response)


def error_events(events: list[str]) -> list[dict]:
    """The OpenAI error objects among SSE `data:` lines (before [DONE])."""
    payloads = [json.loads(event.removeprefix("data: ")) for event in events]
    return [p["error"] for p in payloads if isinstance(p, dict) and "error" in p]


async def in_chunks(data: bytes, size: int = 65536) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def refusal_or_problem(kind: str, response: httpx.Response) -> Outcome:
    """A non-200 answer to a valid request: fine if it is an overload refusal."""
    if response.status_code == REFUSED and response.headers.get("retry-after"):
        return Outcome(kind, response.status_code)
    return Outcome(kind, response.status_code, f"HTTP {response.status_code}: {response.text[:200]}")


def expect(kind: str, response: httpx.Response, status: int) -> Outcome:
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
        body(model="no-such-model"), body(stream="yes"),
        b'{"prompt": "hello", "temperature": NaN}', b'{"prompt": "hello", "temperature": Infinity}',
        b'{"prompt": "hello",', b'{"prompt": "\xff\xfe"}', b'["hello"]', b"", b"null",
    ]
    chat = [json.dumps(b).encode() for b in (
        {"messages": []}, {"messages": "hi"}, {"messages": [{"role": "robot", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000},
    )]
    generate = [b'{"prompt": "hi", "max_new_tokens": 0}', b'{"prompt": ""}']
    return ([("/v1/completions", c, 400) for c in completions] + [("/v1/chat/completions", c, 400) for c in chat]
            + [("/generate", c, 400) for c in generate])


# ---- the run ----

WEIGHTS = {"stream": 30, "complete": 15, "chat": 10, "bad_input": 15, "too_large": 3, "bad_key": 4,
           "drop_mid_stream": 10, "drop_queued": 7, "drop_non_stream": 6}


async def worker(client: Client, tally: Tally, deadline: float, budget: list[int]) -> None:
    kinds = [k for k in WEIGHTS if k != "bad_key" or client.config.api_key]
    weights = [WEIGHTS[k] for k in kinds]
    while time.monotonic() < deadline and budget[0] > 0:
        budget[0] -= 1
        kind = client.rng.choices(kinds, weights)[0]
        tally.add(await run_one(kind, getattr(client, KIND_METHODS[kind])))


KIND_METHODS = {"stream": "valid_stream", "complete": "valid_complete", "chat": "valid_chat",
                **{k: k for k in ("bad_input", "too_large", "bad_key", *DISCONNECT_KINDS)}}


async def run_one(kind: str, method: Callable[[], Awaitable[Outcome]]) -> Outcome:
    try:
        return await method()
    except httpx.HTTPError as exc:  # the server closed on us, or timed out: never expected
        return Outcome(kind, None, f"{type(exc).__name__}: {exc}")


async def bursts(client: Client, tally: Tally, deadline: float) -> None:
    while time.monotonic() + client.config.burst_every_s < deadline:
        await asyncio.sleep(client.config.burst_every_s)
        for outcome in await client.burst():
            tally.add(outcome)


async def engine_health(client: Client) -> dict:
    try:
        return (await client.http.get("/health", timeout=10)).json()
    except (httpx.HTTPError, ValueError) as exc:  # busy or restarting: not idle yet
        return {"status": f"unreachable: {type(exc).__name__}"}


RSS_SETTLE_S = 3.0


async def wait_until_idle(client: Client, timeout_s: float = 60) -> dict:
    """/health once the engine is idle with every KV block free, or as it is at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = await engine_health(client)
        stats = health.get("stats", {})
        idle = health.get("num_active_requests") == 0 and stats.get("num_running") == 0 \
            and stats.get("num_waiting") == 0 and stats.get("num_kv_blocks_used") == 0
        if idle or time.monotonic() > deadline:
            if "stats" not in health:
                raise RuntimeError(f"the server is not healthy: {health}")
            return health
        await asyncio.sleep(0.25)


async def rss_at_rest(client: Client) -> dict:
    """/health after the engine has been idle long enough to trim its heap (engine/heap.py:
    freed pages go back to the OS after 2 s idle), so RSS counts live memory only."""
    await wait_until_idle(client)
    await asyncio.sleep(RSS_SETTLE_S)
    return await wait_until_idle(client)


async def run_chaos(config: ChaosConfig) -> dict:
    check_loopback(config.url)
    rng = random.Random(config.seed)
    tally, started, budget = Tally(), time.monotonic(), [config.max_requests]
    async with make_http(config) as http:
        client = Client(config, rng, http)
        await warm_up(client, tally, time.monotonic() + config.warmup_s)
        rss = [(await rss_at_rest(client))["engine_rss_bytes"]]
        # Two halves, RSS read at idle after each: a leak grows in both, while an allocator
        # still reaching its high-water mark grows in the first only.
        for _ in range(2):
            await chaos_phase(config, rng, http, tally, time.monotonic() + config.duration_s / 2, budget)
            idle = await rss_at_rest(client)
            rss.append(idle["engine_rss_bytes"])
    return verdict(config, tally, idle, rss, time.monotonic() - started)


async def chaos_phase(config: ChaosConfig, rng: random.Random, http: httpx.AsyncClient, tally: Tally,
                      deadline: float, budget: list[int]) -> None:
    workers = [worker(Client(config, random.Random(rng.random()), http), tally, deadline, budget)
               for _ in range(config.concurrency)]
    await asyncio.gather(bursts(Client(config, random.Random(rng.random()), http), tally, deadline), *workers)


async def warm_up(client: Client, tally: Tally, deadline: float) -> None:
    """A burst, then valid traffic until the deadline: the RSS baseline is taken after the
    largest batches have been run once, past the allocator's warm-up."""
    for outcome in await client.burst():
        tally.add(outcome)
    while time.monotonic() < deadline:
        for outcome in await asyncio.gather(*(run_one("stream", client.valid_stream)
                                              for _ in range(client.config.concurrency))):
            tally.add(outcome)


def verdict(config: ChaosConfig, tally: Tally, idle: dict, rss: list[int], elapsed_s: float) -> dict:
    stats = idle["stats"]
    report = {
        "config": asdict(config) | {"api_key": "set" if config.api_key else None},
        "elapsed_s": round(elapsed_s, 1),
        "requests": tally.requests_by_kind(),
        "num_requests": len(tally.outcomes),
        "statuses": tally.statuses_by_kind(),
        "valid_5xx": tally.num_valid_5xx(),
        "problems": tally.problems(),
        "kv_blocks": {"total": stats["num_kv_blocks_total"], "free_at_idle": stats["num_kv_blocks_total"]
                      - stats["num_kv_blocks_used"], "leaked": stats["num_kv_blocks_used"]},
        "stuck": {"num_active_requests": idle["num_active_requests"], "num_running": stats["num_running"],
                  "num_waiting": stats["num_waiting"]},
        "engine_rss_mb": {"after_warmup": mb(rss[0]), "half_way": mb(rss[1]), "end": mb(rss[2]),
                          "growth_first_half": mb(rss[1] - rss[0]), "growth_second_half": mb(rss[2] - rss[1])},
    }
    report["failures"] = failures(config, report)
    report["passed"] = not report["failures"]
    return report


def failures(config: ChaosConfig, report: dict) -> list[str]:
    found = []
    if report["valid_5xx"]:
        found.append(f"{report['valid_5xx']} valid requests got a 5xx")
    if report["problems"]:
        found.append(f"{len(report['problems'])} requests misbehaved (see problems)")
    if report["kv_blocks"]["leaked"]:
        found.append(f"{report['kv_blocks']['leaked']} KV blocks still in use at idle")
    if any(report["stuck"].values()):
        found.append(f"requests stuck in the engine: {report['stuck']}")
    growth = report["engine_rss_mb"]["growth_second_half"]
    if growth > config.max_rss_growth_mb:
        found.append(f"engine RSS grew {growth} MB in the second half (limit {config.max_rss_growth_mb})")
    return found


def mb(num_bytes: int) -> float:
    return round(num_bytes / 2**20, 1)


def check_loopback(url: str) -> None:
    host = urlsplit(url).hostname
    if host not in LOOPBACK_HOSTS:
        raise SystemExit(f"chaos runs only against this machine (127.0.0.1, localhost, ::1), not {host!r}")


def summary(report: dict) -> str:
    lines = [f"chaos run: {report['num_requests']} requests in {report['elapsed_s']} s "
             f"-> {'PASSED' if report['passed'] else 'FAILED'}"]
    for kind, statuses in report["statuses"].items():
        lines.append(f"  {kind:<16} {sum(statuses.values()):>6}  " + ", ".join(f"{s}: {n}" for s, n in statuses.items()))
    kv, rss = report["kv_blocks"], report["engine_rss_mb"]
    lines += [f"  valid requests with a 5xx: {report['valid_5xx']}",
              f"  KV blocks: {kv['free_at_idle']}/{kv['total']} free at idle, {kv['leaked']} leaked",
              f"  stuck in the engine: {report['stuck']}",
              f"  engine RSS at idle: {rss['after_warmup']} MB after warm-up, {rss['half_way']} MB half-way "
              f"({rss['growth_first_half']:+}), {rss['end']} MB at the end ({rss['growth_second_half']:+})"]
    lines += [f"  FAIL: {f}" for f in report["failures"]] + [f"    {p}" for p in report["problems"][:10]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[ChaosConfig, Path | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of chaos after the warm-up")
    parser.add_argument("--max-requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--burst-every", type=float, default=15.0)
    parser.add_argument("--burst-size", type=int, default=64)
    parser.add_argument("--burst-prompt-tokens", type=int, default=320)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--api-key", default=os.environ.get("RAYINFER_API_KEYS", "").split(",")[0] or None,
                        help="defaults to the first of RAYINFER_API_KEYS")
    parser.add_argument("--model", default=None, help="model field to send (omitted when not given)")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="the server's max_body_bytes")
    parser.add_argument("--max-rss-growth-mb", type=float, default=64.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="directory for chaos.json")
    args = parser.parse_args(argv)
    config = ChaosConfig(args.url, args.duration, args.max_requests, args.concurrency, args.burst_every,
                         args.burst_size, args.burst_prompt_tokens, args.warmup, args.api_key, args.model,
                         args.max_body_bytes, args.max_rss_growth_mb, seed=args.seed)
    return config, args.out


def main(argv: list[str] | None = None) -> int:
    config, out = parse_args(argv)
    report = asyncio.run(run_chaos(config))
    print(summary(report))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "chaos.json").write_text(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
