"""One request's stream on the asyncio side: the tokens the step loop delivered, handed
to the consumer as chunks.

Chunking adapts to load. A consumer is woken for its first token and its finish at once;
in between, when the engine has a `max_chunks_per_s` budget, only once it has k tokens
waiting, where k is the smallest count that keeps all streams together under that many
chunks per second at the current step rate: k = 1 at light load, more as streams pile up.
Streaming each chunk across processes costs CPU, so without this a 32-stream batch spends
its CPU moving single tokens; there is no timer, so no latency is added when idle.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.request.token_logprob import TokenLogprob
from engine.request.outputs import ChunkTimings, GenerationChunk, RequestFailedError, StepOutput
from engine.request.scheduling import Scheduling


def min_tokens_per_chunk(num_streams: int, steps_per_s: float, max_chunks_per_s: float | None) -> int:
    if not max_chunks_per_s or steps_per_s <= 0:
        return 1
    return max(1, math.ceil(num_streams * steps_per_s / max_chunks_per_s))


@dataclass
class RequestStream:
    request_id: str
    num_prompt_tokens: int
    scheduling: Scheduling = Scheduling()  # its tenant's waiting work is bounded too (admission.py)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    last: StepOutput | None = None
    error: BaseException | None = None
    is_finished: bool = False
    num_chunks: int = 0

    @property
    def is_waiting(self) -> bool:
        """Admitted but no token yet: what the overload bounds count."""
        return self.last is None and self.error is None

    def push(self, output: StepOutput, min_tokens: int) -> None:
        if output.finish_reason == "error":  # ended and freed by the engine: nothing left to abort
            self.is_finished = True
            self.fail(RequestFailedError(f"request {self.request_id} failed inside an engine step"))
            return
        if output.token_id is not None:
            self.token_ids.append(output.token_id)
        if output.logprob is not None:
            self.logprobs.append(output.logprob)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.last = output
        self.is_finished = output.finish_reason is not None
        if self.is_finished or self.num_chunks == 0 or len(self.token_ids) >= min_tokens:
            self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        """Chunks until the finished one; raises the error a fail() handed in, after the
        tokens delivered before it (a consumer that wakes after both still gets them)."""
        while True:
            await self.event.wait()
            self.event.clear()
            if self.token_ids or (self.is_finished and self.error is None):
                chunk = self._take_chunk()
                yield chunk
                if chunk.finish_reason is not None:
                    return
            if self.error is not None:
                raise self.error

    def _take_chunk(self) -> GenerationChunk:
        out = self.last
        token_ids, self.token_ids = self.token_ids, []
        logprobs, self.logprobs = self.logprobs, []
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        self.num_chunks += 1
        timings = ChunkTimings.of(out.timings) if self.num_chunks == 1 or self.is_finished else None
        return GenerationChunk(self.request_id, token_ids, out.finish_reason if self.is_finished else None,
                               out.num_prompt_tokens, timings, logprobs if out.cumulative_logprob is not None else None,
                               out.cumulative_logprob, prompt_logprobs)
