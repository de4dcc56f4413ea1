"""Prefix-sharing workloads for the scale-out benchmarks, sent over HTTP with bench.py's
client.

    shared   num_prefixes system prompts of prefix_tokens each, every request one of them
             (uniformly) plus a suffix of its own: a router that keeps each prefix on one
             replica needs each replica's KV pool to hold only its share of the prefixes
    hot      the same, but hot_share of the requests on one prefix
    free     no shared prefix at all: prompts of random words

Prompts are words that are one GPT-2 token each (loadtest/client/prompts.py), so a prefix of N
words is N tokens and its full KV blocks are the same in every request that shares it.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Literal

import httpx

from loadtest.client.http_target import Target, send_request
from loadtest.client.prompts import make_prompt
from loadtest.client.results import BenchResult, RunInfo, summarize_run
from loadtest.client.workload import Workload

Kind = Literal["shared", "hot", "free"]


@dataclass(frozen=True)
class PrefixWorkload:
    kind: Kind
    num_requests: int = 96
    num_prefixes: int = 12
    prefix_tokens: int = 256
    suffix_tokens: int = 16
    max_tokens: int = 16
    concurrency: int = 8
    hot_share: float = 0.8
    seed: int = 0

    def prompts(self) -> list[str]:
        return [prompt for _, prompt in self.requests()]

    def requests(self) -> list[tuple[int | None, str]]:
        """(which shared prefix, or None; the prompt) for every request, in sending order."""
        rng = random.Random(self.seed)
        prefixes = [make_prompt(self.prefix_tokens, rng) for _ in range(self.num_prefixes)]
        requests = []
        for _ in range(self.num_requests):
            index = self._prefix_index(rng)
            prefix = make_prompt(self.prefix_tokens, rng) if index is None else prefixes[index]
            requests.append((index, prefix + make_prompt(self.suffix_tokens, rng)))
        return requests

    def _prefix_index(self, rng: random.Random) -> int | None:
        if self.kind == "free":
            return None
        if self.kind == "hot" and rng.random() < self.hot_share:
            return 0
        return rng.randrange(self.num_prefixes)

    def ideal_hit_tokens(self, block_size: int) -> int:
        """Prefix-cache hits if each prefix missed once in the whole system and never again."""
        indices = [index for index, _ in self.requests() if index is not None]
        return (len(indices) - len(set(indices))) * (self.prefix_tokens // block_size * block_size)

    def as_bench_workload(self) -> Workload:
        return Workload(num_requests=self.num_requests, prompt_tokens=self.prefix_tokens + self.suffix_tokens,
                        max_tokens=self.max_tokens, temperature=0.0, concurrency=self.concurrency,
                        warmup=0, seed=self.seed)


def run_http(target: Target, workload: PrefixWorkload) -> BenchResult:
    """The workload's requests over HTTP, at most `concurrency` at once; bench.py's summary."""
    return asyncio.run(_run_http(target, workload))


async def _run_http(target: Target, workload: PrefixWorkload) -> BenchResult:
    bench_workload = workload.as_bench_workload()
    bound = asyncio.Semaphore(workload.concurrency)

    async def one(client: httpx.AsyncClient, prompt: str):
        async with bound:
            return await send_request(client, target, prompt, bench_workload)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), trust_env=False,
                                 limits=httpx.Limits(max_connections=None)) as client:
        started = time.perf_counter()
        records = await asyncio.gather(*(one(client, prompt) for prompt in workload.prompts()))
        duration = time.perf_counter() - started
    return summarize_run(RunInfo(target.label, target.url, target.api), bench_workload, list(records), duration)
