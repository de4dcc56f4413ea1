"""A bounded chaos run against a local rayinfer server, and its verdict.

    python -m loadtest.chaos.run --url http://127.0.0.1:8000 --duration 120 --out chaos_out

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
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from loadtest.chaos.client import Client, make_http
from loadtest.chaos.config import ChaosConfig
from loadtest.chaos.scenarios import WEIGHTS, Outcome, Scenario, Tally
from loadtest.chaos.verdict import summary, verdict

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


async def worker(client: Client, tally: Tally, deadline: float, budget: list[int]) -> None:
    scenarios = [s for s in WEIGHTS if s is not Scenario.BAD_KEY or client.config.api_key]
    weights = [WEIGHTS[s] for s in scenarios]
    while time.monotonic() < deadline and budget[0] > 0:
        budget[0] -= 1
        scenario = client.rng.choices(scenarios, weights)[0]
        tally.add(await run_one(scenario, client.request(scenario)))


async def run_one(kind: Scenario, method: Callable[[], Awaitable[Outcome]]) -> Outcome:
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
    """/health after the engine has been idle long enough to trim its heap (engine/core/heap.py:
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
        for outcome in await asyncio.gather(*(run_one(Scenario.STREAM, client.valid_stream)
                                              for _ in range(client.config.concurrency))):
            tally.add(outcome)


def check_loopback(url: str) -> None:
    host = urlsplit(url).hostname
    if host not in LOOPBACK_HOSTS:
        raise SystemExit(f"chaos runs only against this machine (127.0.0.1, localhost, ::1), not {host!r}")


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
