"""One HTTP request's generation: each choice's engine stream turned into text deltas
(incremental detokenization, stop strings), and where its time to first token went.

Leaving a choice's stream early (stop string, disconnect, error) cancels its engine
stream, and the engine aborts the request.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

from ray.serve.handle import DeploymentHandle

from deployments.metrics import request_metrics
from engine import GenerationChunk, SamplingParams
from engine.detokenizer import IncrementalDetokenizer, TokenVocab


@dataclass(frozen=True)
class ChoiceDelta:
    index: int
    text: str
    finish_reason: str | None
    num_tokens: int  # output tokens this delta accounts for


@dataclass
class ServerTiming:
    """Where a request's TTFT went, in milliseconds; the first token of any choice counts."""

    tokenize_ms: float = 0.0
    queue_wait_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    _has_first_token: bool = field(default=False, repr=False)

    def record_first_token(self, chunk: GenerationChunk, received_at: float) -> None:
        if self._has_first_token:
            return
        self._has_first_token = True
        if chunk.timings is not None:
            self.queue_wait_ms = 1000 * chunk.timings.queue_wait_s
            self.prefill_ms = 1000 * chunk.timings.prefill_s
        self.ttft_ms = 1000 * (time.perf_counter() - received_at)

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in asdict(self).items() if not k.startswith("_")}

    def header(self) -> str:
        """The Server-Timing header's value."""
        parts = {"tokenize": self.tokenize_ms, "queue": self.queue_wait_ms,
                 "prefill": self.prefill_ms, "ttft": self.ttft_ms}
        return ", ".join(f"{name};dur={ms:.3f}" for name, ms in parts.items())


@dataclass
class Generation:
    """One HTTP request's generation: its choices' merged deltas and its bookkeeping."""

    id: str
    model: str
    num_prompt_tokens: int
    n: int
    deltas: AsyncIterator[ChoiceDelta]
    timing: ServerTiming
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self, num_completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": num_completion_tokens,
                "total_tokens": self.num_prompt_tokens + num_completion_tokens}


@dataclass(frozen=True)
class Choice:
    """One of a request's n choices: its own engine request."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


async def choice_deltas(engine: DeploymentHandle, vocab: TokenVocab, choice: Choice, timing: ServerTiming,
                        received_at: float) -> AsyncIterator[ChoiceDelta]:
    """The choice's text as it is generated; the engine request starts at the first anext."""
    response = engine.options(stream=True).generate.remote(choice.request_id, choice.prompt_token_ids, choice.params)
    detokenizer = IncrementalDetokenizer(vocab, choice.params.stop)
    is_engine_done, num_tokens, first_timings = False, 0, None
    try:
        async for chunk in response:
            timing.record_first_token(chunk, received_at)
            first_timings = first_timings or chunk.timings
            num_tokens += len(chunk.token_ids)
            is_engine_done = chunk.finish_reason is not None
            delta = detokenizer.push(chunk.token_ids)
            if delta.stopped:
                yield ChoiceDelta(choice.index, delta.text, "stop", delta.num_tokens)
                return
            text = delta.text + (detokenizer.finish() if is_engine_done else "")
            yield ChoiceDelta(choice.index, text, chunk.finish_reason, delta.num_tokens)
    finally:
        if not is_engine_done:
            response.cancel()  # the engine's generator aborts the request
        if num_tokens:
            request_metrics().record_completion(
                ttft_s=timing.ttft_ms / 1000, e2e_s=time.perf_counter() - received_at,
                queue_wait_s=first_timings.queue_wait_s if first_timings else None,
                num_prompt_tokens=len(choice.prompt_token_ids), num_completion_tokens=num_tokens)
