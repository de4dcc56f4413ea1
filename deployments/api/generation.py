"""One HTTP request's generation: each choice's engine stream turned into text deltas
(incremental detokenization, stop strings), and where its time to first token went.

Leaving a choice's stream early (stop string, disconnect, error) cancels its engine
stream, and the engine aborts the request.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field

from deployments.api.engine_client import EngineClient
from deployments.observability.metrics import request_metrics
from deployments.api.openai_logprobs import Scored
from engine import GenerationChunk, SamplingParams
from engine.request.detokenizer import IncrementalDetokenizer, TokenVocab
from engine.request.lora_request import LoraRequest
from engine.request.scheduling import Scheduling


@dataclass(frozen=True)
class ChoiceDelta:
    index: int
    text: str
    finish_reason: str | None
    num_tokens: int  # output tokens this delta accounts for
    logprobs: dict | None = None  # in the response's wire shape, where the request asked for them


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
    choice_prompt_tokens: list[int]  # by choice index: the length of the prompt it continues
    num_prompt_tokens: int  # of every prompt, each counted once
    deltas: AsyncIterator[ChoiceDelta]
    timing: ServerTiming
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n(self) -> int:
        return len(self.choice_prompt_tokens)

    def usage(self, num_completion_tokens: int, num_prompt_tokens: int | None = None) -> dict[str, int]:
        prompt = self.num_prompt_tokens if num_prompt_tokens is None else num_prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": num_completion_tokens,
                "total_tokens": prompt + num_completion_tokens}


LogprobsFormat = Callable[[Sequence[Scored]], dict]


@dataclass(frozen=True)
class Choice:
    """One of a request's choices: its own engine request, and what its text carries."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    echo: bool = False  # the prompt's text (and, with logprobs, its logprobs) leads the choice's
    include_stop_str: bool = False
    format_logprobs: LogprobsFormat | None = None  # set where the request asked for logprobs
    scheduling: Scheduling = Scheduling()  # its priority and tenant
    lora: LoraRequest | None = None  # the adapter it runs under (None: the base model)


async def choice_deltas(engine: EngineClient, vocab: TokenVocab, choice: Choice, timing: ServerTiming,
                        received_at: float) -> AsyncIterator[ChoiceDelta]:
    """The choice's text as it is generated; the engine request starts at the first anext."""
    response = engine.generate(choice.request_id, choice.prompt_token_ids, choice.params, choice.scheduling,
                               choice.lora)
    text = ChoiceText(vocab, choice)
    is_engine_done, num_tokens, first_timings = False, 0, None
    try:
        async for chunk in response:
            timing.record_first_token(chunk, received_at)
            first_timings = first_timings or chunk.timings
            num_tokens += len(chunk.token_ids)
            is_engine_done = chunk.finish_reason is not None
            delta = text.push(chunk)
            yield delta
            if delta.finish_reason is not None:
                return
    finally:
        if not is_engine_done:
            response.cancel()  # the engine's generator aborts the request
        if num_tokens:
            request_metrics().record_completion(
                ttft_s=timing.ttft_ms / 1000, e2e_s=time.perf_counter() - received_at,
                queue_wait_s=first_timings.queue_wait_s if first_timings else None,
                num_prompt_tokens=len(choice.prompt_token_ids), num_completion_tokens=num_tokens,
                tenant=choice.scheduling.tenant)


class ChoiceText:
    """Engine chunks -> one choice's deltas: incremental text with stop strings, the echoed
    prompt leading the first, and the logprobs of the tokens each delta accounts for."""

    def __init__(self, vocab: TokenVocab, choice: Choice) -> None:
        self._vocab, self._choice = vocab, choice
        self._detokenizer = IncrementalDetokenizer(vocab, choice.params.stop)
        self._is_first = True

    def push(self, chunk: GenerationChunk) -> ChoiceDelta:
        choice = self._choice
        lead, scored = _echo(self._vocab, choice, chunk) if self._is_first else ("", [])
        self._is_first = False
        delta = self._detokenizer.push(chunk.token_ids)
        scored += _scored(chunk, delta.num_tokens)
        logprobs = choice.format_logprobs(scored) if choice.format_logprobs else None
        if delta.stopped:
            stop = self._detokenizer.stop_str if choice.include_stop_str else ""
            return ChoiceDelta(choice.index, lead + delta.text + stop, "stop", delta.num_tokens, logprobs)
        tail = self._detokenizer.finish() if chunk.finish_reason is not None else ""
        return ChoiceDelta(choice.index, lead + delta.text + tail, chunk.finish_reason, delta.num_tokens, logprobs)


def _echo(vocab: TokenVocab, choice: Choice, chunk: GenerationChunk) -> tuple[str, list[Scored]]:
    """The prompt's text and scored tokens, which lead an echoed choice's first delta."""
    if not choice.echo:
        return "", []
    ids = choice.prompt_token_ids
    text = b"".join(vocab.token_bytes[t] for t in ids).decode("utf-8", "replace")
    scores = chunk.prompt_logprobs or (None,) * len(ids)
    return text, [Scored(t, s) for t, s in zip(ids, scores)]


def _scored(chunk: GenerationChunk, num_tokens: int) -> list[Scored]:
    """The chunk's tokens that belong to the output (through a stop) with their logprobs."""
    if chunk.logprobs is None:
        return []
    return [Scored(t, lp) for t, lp in zip(chunk.token_ids[:num_tokens], chunk.logprobs)]
