"""What clients meet when an engine replica is SIGKILLed under load: how the streams in
flight end, how long requests and /health sent during the outage wait and what they get,
and how long until a request is served again. Run on the machine that runs the replica
(the kill is by the process's title).

    python -m loadtest.chaos.replica_kill --url http://127.0.0.1:8000 --app rayinfer --streams 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import psutil

_PROMPT = "The quick brown fox jumps over the lazy dog and"


@dataclass(frozen=True)
class Answer:
    sent_s: float  # after the kill
    wait_s: float
    status: int | None  # None: no answer (connection error)
    is_json_with_retry_after: bool


@dataclass
class KillReport:
    stream_endings: Counter = field(default_factory=Counter)  # error+[DONE], [DONE], cut
    requests: list[Answer] = field(default_factory=list)  # non-streaming completions sent after the kill
    health: list[Answer] = field(default_factory=list)
    recovered_s: float | None = None  # the first 200 after the kill, answered at

    def outage(self, answers: list[Answer]) -> list[Answer]:
        """Those sent before the first 200 was answered."""
        end = self.recovered_s if self.recovered_s is not None else float("inf")
        return [a for a in answers if a.sent_s < end]

    def row(self) -> dict:
        during, health = self.outage(self.requests), self.outage(self.health)
        return {"streams": dict(self.stream_endings),
                "requests_during_outage": dict(Counter(a.status for a in during)),
                "request_wait_s_max": _max_wait(during),
                "request_503_json_retry_after": sum(a.status == 503 and a.is_json_with_retry_after for a in during),
                "health_during_outage": dict(Counter(a.status for a in health)),
                "health_wait_s_max": _max_wait(health),
                "recovered_s": None if self.recovered_s is None else round(self.recovered_s, 1)}


def _max_wait(answers: list[Answer]) -> float | None:
    return round(max(a.wait_s for a in answers), 2) if answers else None


def kill_replica(app: str, deployment: str = "EngineDeployment") -> int:
    """SIGKILL the one replica process of `deployment`; its PID."""
    title = f"ServeReplica:{app}:{deployment}"
    [process] = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and title in p.info["cmdline"][0]]
    process.kill()
    return process.pid


async def _stream(http: httpx.AsyncClient, body: dict, started: asyncio.Event) -> str:
    payloads: list[str] = []
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    payloads.append(line.removeprefix("data: "))
                    started.set()
    except httpx.HTTPError:
        return "cut"
    finally:
        started.set()
    if not payloads or payloads[-1] != "[DONE]":
        return "cut"
    return "error+[DONE]" if len(payloads) > 1 and "error" in json.loads(payloads[-2]) else "[DONE]"


async def _ask(http: httpx.AsyncClient, method: str, path: str, body: dict | None, t0: float) -> Answer:
    sent = time.monotonic()
    try:
        response = await http.request(method, path, json=body)
    except httpx.HTTPError:
        return Answer(sent - t0, time.monotonic() - sent, None, False)
    is_json = response.headers.get("content-type", "").startswith("application/json")
    return Answer(sent - t0, time.monotonic() - sent, response.status_code, is_json and "retry-after" in response.headers)


async def measure(url: str, app: str, num_streams: int = 16, period_s: float = 0.5, limit_s: float = 120.0,
                  model: str | None = None) -> KillReport:
    """Streams in flight, then the kill, then a request and a /health every period_s until a
    request is served again (or limit_s)."""
    named = {"model": model} if model else {}
    stream_body = {**named, "prompt": _PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    probe_body = {**named, "prompt": _PROMPT, "max_tokens": 4}
    report = KillReport()
    async with httpx.AsyncClient(base_url=url, timeout=limit_s) as http:
        events = [asyncio.Event() for _ in range(num_streams)]
        streams = [asyncio.create_task(_stream(http, stream_body, e)) for e in events]
        await asyncio.gather(*(e.wait() for e in events))
        kill_replica(app)
        t0 = time.monotonic()
        asks: list[asyncio.Task] = []
        while report.recovered_s is None and time.monotonic() - t0 < limit_s:
            asks.append(asyncio.create_task(_ask(http, "POST", "/v1/completions", probe_body, t0)))
            asks.append(asyncio.create_task(_ask(http, "GET", "/health", None, t0)))
            await asyncio.sleep(period_s)
            served = [a.result() for a in asks[::2] if a.done() and a.result().status == 200]
            if served:
                report.recovered_s = min(a.sent_s + a.wait_s for a in served)
        answers = await asyncio.gather(*asks)
        report.requests, report.health = list(answers[::2]), list(answers[1::2])
        report.stream_endings.update(await asyncio.gather(*streams))
    return report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--app", default="rayinfer", help="the Serve application whose engine replica is killed")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(measure(args.url, args.app, args.streams, model=args.model)).row()))


if __name__ == "__main__":
    main()
