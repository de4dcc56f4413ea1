"""An OpenAI-compatible HTTP server as a benchmark target: the workload's streaming
completions sent with httpx, closed loop (a concurrency bound) or open loop (an arrival rate)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx
from tqdm import tqdm

from loadtest.client.results import BenchResult, RunInfo, summarize_run
from loadtest.client.sse_reader import Api, SSEParser, StreamRecord
from loadtest.client.workload import Workload, arrival_gaps


@dataclass(frozen=True)
class Target:
    """One server under test. `ignore_eos` sends the (vLLM-style) `ignore_eos` extension,
    which stock OpenAI servers such as `transformers serve` reject with 422."""

    url: str
    label: str
    model: str | None = None
    api: Api = "completions"
    ignore_eos: bool = False
    priority: int | None = None  # sent as vLLM's `priority` where set

    @property
    def endpoint(self) -> str:
        path = "/v1/chat/completions" if self.api == "chat" else "/v1/completions"
        return self.url.rstrip("/") + path


@dataclass(frozen=True)
class BenchConfig:
    target: Target
    workload: Workload
    show_progress: bool = True


def request_body(target: Target, prompt: str, workload: Workload) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": workload.max_tokens,
        "temperature": workload.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if target.model is not None:
        body["model"] = target.model
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.priority is not None:
        body["priority"] = target.priority
    return body


async def send_request(client: httpx.AsyncClient, target: Target, prompt: str, workload: Workload) -> StreamRecord:
    record = StreamRecord(start=time.perf_counter(), api=target.api)
    try:
        async with client.stream("POST", target.endpoint, json=request_body(target, prompt, workload)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                record.fail(f"HTTP {response.status_code}: {body[:300]}")
            else:
                await _read_events(response, record)
    except httpx.HTTPError as error:
        record.fail(f"{type(error).__name__}: {error}")
    record.end = time.perf_counter()
    return record


async def _read_events(response: httpx.Response, record: StreamRecord) -> None:
    parser = SSEParser()
    async for chunk in response.aiter_bytes():
        now = time.perf_counter()
        for data in parser.feed(chunk):
            record.add_event(data, now)
    for data in parser.flush():
        record.add_event(data, time.perf_counter())


def run_benchmark(config: BenchConfig) -> BenchResult:
    """Run one workload against one server (warm-up first) and summarise it."""
    return asyncio.run(benchmark(config))


async def benchmark(config: BenchConfig) -> BenchResult:
    workload, target = config.workload, config.target
    async with _client(workload) as client:
        if workload.warmup:
            await _warm_up(client, config)
        prompts = workload.prompts(workload.num_requests, workload.seed)
        with heap_frozen(), tqdm(total=len(prompts), desc=target.label, disable=not config.show_progress) as progress:
            started = time.perf_counter()
            records = await _send_all(client, config, prompts, progress)
            duration = time.perf_counter() - started
    return summarize_run(RunInfo(target.label, target.url, target.api), workload, records, duration)


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """The objects this process holds before a timed run kept out of the garbage collector's
    passes during it, as vLLM's benchmark_serving does: a full pass walks all of them (an
    offline engine run earlier in the same process leaves hundreds of thousands:
    BENCHMARKS.md, "Designs shipped"), and a pass mid-burst holds back every request not yet sent,
    its TTFT counting the wait."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_sweep(
    targets: Sequence[Target], workload: Workload, levels: Sequence[int], progress: bool = True
) -> list[BenchResult]:
    """Every concurrency level, each server in turn at that level (never two at once)."""
    results = []
    for level in levels:
        closed = replace(workload, concurrency=level, request_rate=None)
        for target in targets:
            results.append(run_benchmark(BenchConfig(target, closed, progress)))
    return results


def _client(workload: Workload) -> httpx.AsyncClient:
    # No proxy from the environment: benchmarks talk to local servers.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(workload.timeout_s, connect=10.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        trust_env=False,
    )


async def _warm_up(client: httpx.AsyncClient, config: BenchConfig) -> None:
    workload = config.workload
    concurrency = workload.concurrency or workload.warmup
    warmup = replace(workload, num_requests=workload.warmup, concurrency=concurrency, request_rate=None)
    prompts = warmup.prompts(workload.warmup, workload.seed + 1)
    await _send_all(client, replace(config, workload=warmup), prompts, None)


async def _send_all(
    client: httpx.AsyncClient, config: BenchConfig, prompts: list[str], progress: tqdm | None
) -> list[StreamRecord]:
    workload = config.workload
    bound = asyncio.Semaphore(workload.concurrency) if workload.concurrency else None

    async def one(prompt: str) -> StreamRecord:
        async with bound if bound is not None else contextlib.nullcontext():
            record = await send_request(client, config.target, prompt, workload)
        if progress is not None:
            progress.update(1)
        return record

    if workload.request_rate is None:
        return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))
    return list(await asyncio.gather(*[task async for task in _arrivals(one, prompts, workload)]))


async def _arrivals(
    send: Callable[[str], Awaitable[StreamRecord]], prompts: list[str], workload: Workload
) -> AsyncIterator[asyncio.Task[StreamRecord]]:
    """Start each request at its arrival time, measured from the first (no drift from late wake-ups)."""
    assert workload.request_rate is not None
    gaps = arrival_gaps(len(prompts), workload.request_rate, workload.arrival, random.Random(workload.seed))
    started, due = time.perf_counter(), 0.0
    for prompt, gap in zip(prompts, gaps):
        due += gap
        await asyncio.sleep(max(0.0, started + due - time.perf_counter()))
        yield asyncio.create_task(send(prompt))
