"""The offline engine as a benchmark target: the same workload as bench.py, run against an
in-process AsyncEngine (no HTTP, no Ray), measured the same way. It is the ceiling the
HTTP-through-Ray path is compared with.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.loader import load_tokenizer
from loadtest.bench import BenchConfig, BenchResult, Target, Workload, summarize_run
from loadtest.sse import StreamRecord


@dataclass(frozen=True)
class OfflineTarget:
    model: str = "gpt2"
    weights: str = "random"
    dtype: str = "bfloat16"
    label: str = "offline engine"


def run_offline(target: OfflineTarget, workload: Workload) -> BenchResult:
    engine = AsyncEngine(EngineConfig(model=target.model, weights=target.weights, dtype=target.dtype, device="cpu"))
    try:
        return asyncio.run(_benchmark(engine, target, workload))
    finally:
        engine.shutdown()


async def _benchmark(engine: AsyncEngine, target: OfflineTarget, workload: Workload) -> BenchResult:
    tokenizer = load_tokenizer(target.model)
    encode = lambda prompts: [tokenizer.encode(p) for p in prompts]  # noqa: E731
    params = SamplingParams(max_tokens=workload.max_tokens, temperature=workload.temperature, ignore_eos=True)
    bound = asyncio.Semaphore(workload.concurrency or workload.num_requests)
    await asyncio.gather(*(_one(engine, ids, params, bound) for ids in encode(workload.prompts(workload.warmup, workload.seed + 1))))
    prompts = encode(workload.prompts(workload.num_requests, workload.seed))
    started = time.perf_counter()
    records = await asyncio.gather(*(_one(engine, ids, params, bound) for ids in prompts))
    config = BenchConfig(Target("in-process", target.label), workload, show_progress=False)
    return summarize_run(config, list(records), time.perf_counter() - started)


async def _one(engine: AsyncEngine, prompt_ids: list[int], params: SamplingParams, bound: asyncio.Semaphore) -> StreamRecord:
    async with bound:
        record = StreamRecord(start=time.perf_counter())
        record.usage_tokens = 0
        stream = engine.generate(uuid.uuid4().hex, prompt_ids, params)
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                record.usage_tokens += len(chunk.token_ids)
                record.add_content(time.perf_counter())
        record.end = time.perf_counter()
        return record
