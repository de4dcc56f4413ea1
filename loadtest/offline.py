"""The offline engine as a benchmark target: the same workload as bench.py, run against an
in-process AsyncEngine (no HTTP, no Ray), measured the same way. It is the ceiling the
HTTP-through-Ray path is compared with.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine import AsyncEngine, EngineConfig, GenerationChunk, SamplingParams
from engine.loader import load_tokenizer
from loadtest.bench import BenchConfig, BenchResult, Target, Workload, summarize_run
from loadtest.sse import StreamRecord

# (request_id, prompt_token_ids, params) -> the request's chunks: AsyncEngine.generate's shape
Generate = Callable[[str, list[int], SamplingParams], AsyncIterator[GenerationChunk]]


@dataclass(frozen=True)
class OfflineTarget:
    model: str = "gpt2"
    weights: str = "random"
    dtype: str = "bfloat16"
    label: str = "offline engine"


def run_offline(target: OfflineTarget, workload: Workload) -> BenchResult:
    engine = AsyncEngine(EngineConfig(model=target.model, weights=target.weights, dtype=target.dtype, device="cpu"))
    try:
        return asyncio.run(measure(engine.generate, target.model, target.label, workload))
    finally:
        engine.shutdown()


async def measure(generate: Generate, tokenizer_name: str, label: str, workload: Workload,
                  where: str = "in-process") -> BenchResult:
    """bench.py's workload (its prompts, encoded here, and its concurrency) through `generate`."""
    tokenizer = load_tokenizer(tokenizer_name)
    encode = lambda prompts: [tokenizer.encode(p) for p in prompts]  # noqa: E731
    params = SamplingParams(max_tokens=workload.max_tokens, temperature=workload.temperature, ignore_eos=True)
    bound = asyncio.Semaphore(workload.concurrency or workload.num_requests)
    warmup = encode(workload.prompts(workload.warmup, workload.seed + 1))
    await asyncio.gather(*(_one(generate, ids, params, bound) for ids in warmup))
    prompts = encode(workload.prompts(workload.num_requests, workload.seed))
    started = time.perf_counter()
    records = await asyncio.gather(*(_one(generate, ids, params, bound) for ids in prompts))
    config = BenchConfig(Target(where, label), workload, show_progress=False)
    return summarize_run(config, list(records), time.perf_counter() - started)


async def _one(generate: Generate, prompt_ids: list[int], params: SamplingParams,
               bound: asyncio.Semaphore) -> StreamRecord:
    async with bound:
        record = StreamRecord(start=time.perf_counter())
        record.usage_tokens = 0
        stream = generate(uuid.uuid4().hex, prompt_ids, params)
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                record.usage_tokens += len(chunk.token_ids)
                record.add_content(time.perf_counter())
        record.end = time.perf_counter()
        return record
