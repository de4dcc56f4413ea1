"""The workload through any callable shaped like AsyncEngine.generate (an in-process engine,
or the engine deployment over a Serve handle), measured as the HTTP target measures it."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable

from engine import GenerationChunk, SamplingParams
from engine.model.loader import load_tokenizer
from loadtest.client.results import BenchResult, RunInfo, summarize_run
from loadtest.client.sse_reader import StreamRecord
from loadtest.client.workload import Workload

# (request_id, prompt_token_ids, params) -> the request's chunks: AsyncEngine.generate's shape
Generate = Callable[[str, list[int], SamplingParams], AsyncIterator[GenerationChunk]]


async def measure(generate: Generate, tokenizer_name: str, label: str, workload: Workload,
                  where: str = "in-process") -> BenchResult:
    """The workload's prompts, encoded here, at its concurrency, through `generate`."""
    tokenizer = load_tokenizer(tokenizer_name)
    encode = lambda prompts: [tokenizer.encode(p) for p in prompts]  # noqa: E731
    params = SamplingParams(max_tokens=workload.max_tokens, temperature=workload.temperature, ignore_eos=True)
    bound = asyncio.Semaphore(workload.concurrency or workload.num_requests)
    warmup = encode(workload.prompts(workload.warmup, workload.seed + 1))
    await asyncio.gather(*(_one(generate, ids, params, bound) for ids in warmup))
    prompts = encode(workload.prompts(workload.num_requests, workload.seed))
    started = time.perf_counter()
    records = await asyncio.gather(*(_one(generate, ids, params, bound) for ids in prompts))
    return summarize_run(RunInfo(label, where), workload, list(records), time.perf_counter() - started)


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
