"""The engine behind an asyncio front: a background step loop and per-request streams.

Threads and what they own:

    step loop thread   the LLMEngine (scheduler, blocks, model), built on this thread so
                       its torch thread settings apply where the work runs; nothing else
                       touches it
    asyncio loop(s)    the streams; consumers await them

Requests and aborts reach the loop through an inbox (one lock); the loop sleeps on an
Event while it has no work, never polling. Each step's outputs cross back in one
call_soon_threadsafe per event loop with consumers (normally exactly one), and a stream's
consumer takes every token that arrived since its last wake-up as one chunk.

Chunking adapts to load. A consumer is woken for its first token and its finish at once;
in between, when `max_chunks_per_s` is set, only once it has k tokens waiting, where k is
the smallest count that keeps all streams together under that many chunks per second at
the current step rate: k = 1 at light load, more as streams pile up. Streaming each chunk
across processes costs CPU (Ray: ~0.4 ms a chunk), so without this a 32-stream batch
spends its CPU moving single tokens; there is no timer, so no latency is added when idle.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.heap import trim_heap
from engine.llm_engine import LLMEngine
from engine.logprobs import TokenLogprob
from engine.outputs import EngineDeadError, EngineOverloadedError, EngineStats, ModelInfo, StepOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_STEP_RATE_SMOOTHING = 0.1  # weight of the newest step in the steps/s moving average
_TRIM_AFTER_IDLE_S = 2.0  # an idle step loop hands freed heap pages back once (engine/heap.py)


@dataclass(frozen=True)
class GenerationChunk:
    """Every token of one request that was ready since the consumer's last chunk."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None  # set on the last chunk
    num_prompt_tokens: int
    num_cached_tokens: int
    # Server-side breakdown in seconds, on the first and the last chunk:
    # queue_wait_s (arrival -> first scheduled), prefill_s (-> first token), ttft_s.
    timings: dict[str, float] | None = None
    # Where params.logprobs is set: one per token_ids entry, and the output's total so far.
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    # On the first chunk, where params.prompt_logprobs is set: one per prompt token, the first None.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass
class _Stream:
    num_prompt_tokens: int
    event: asyncio.Event = field(default_factory=asyncio.Event)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    last: StepOutput | None = None
    error: BaseException | None = None
    finished: bool = False
    num_chunks: int = 0

    @property
    def is_waiting(self) -> bool:
        """Admitted but no token yet: what the overload bounds count."""
        return self.last is None and self.error is None

    def push(self, output: StepOutput, min_tokens: int) -> None:
        if output.token_id is not None:
            self.token_ids.append(output.token_id)
        if output.logprob is not None:
            self.logprobs.append(output.logprob)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.last = output
        self.finished = output.finish_reason is not None
        if self.finished or self.num_chunks == 0 or len(self.token_ids) >= min_tokens:
            self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()

    def take_chunk(self, request_id: str) -> GenerationChunk:
        out = self.last
        token_ids, self.token_ids = self.token_ids, []
        logprobs, self.logprobs = self.logprobs, []
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        self.num_chunks += 1
        timings = _timings(out) if self.num_chunks == 1 or self.finished else None
        return GenerationChunk(request_id, token_ids, out.finish_reason if self.finished else None,
                               out.num_prompt_tokens, out.num_cached_tokens, timings,
                               logprobs if out.cumulative_logprob is not None else None,
                               out.cumulative_logprob, prompt_logprobs)


class AsyncEngine:
    def __init__(self, config: EngineConfig, max_chunks_per_s: float | None = None):
        self.config = config
        self.max_chunks_per_s = max_chunks_per_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[tuple] = []
        self._streams: dict[str, _Stream] = {}
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}  # step loop thread only
        self._error: EngineDeadError | None = None
        self._stopping = False
        self._steps_per_s = 0.0
        self._heap_trimmed = False
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rayinfer-step-loop", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            raise self._init_error

    @property
    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    @property
    def is_dead(self) -> bool:
        return self._error is not None or not self._thread.is_alive()

    def check_health(self) -> None:
        if self._error is not None:
            raise self._error
        if not self._thread.is_alive():
            raise EngineDeadError("engine step loop is not running")

    def stats(self) -> EngineStats:
        """The stats as of the last step (read without stopping the loop)."""
        return self._stats

    def num_active_requests(self) -> int:
        return len(self._streams)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        """Stream a request's tokens.

        Raises before any chunk: ValueError for a request that can never run,
        EngineOverloadedError when the waiting bounds are full, EngineDeadError when the
        step loop has crashed. Leaving the iterator early (break, cancellation, an error in
        the consumer) aborts the request; its KV blocks are free by the end of the next step.
        """
        self.check_health()
        self.engine.validate_request(prompt_token_ids, params)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check_capacity(len(prompt_token_ids))
        stream = self._streams[request_id] = _Stream(len(prompt_token_ids))
        self._submit(("add", request_id, list(prompt_token_ids), params, asyncio.get_running_loop()))
        try:
            while True:
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    raise stream.error
                if stream.token_ids or stream.finished:
                    chunk = stream.take_chunk(request_id)
                    yield chunk
                    if chunk.finish_reason is not None:
                        return
        finally:
            del self._streams[request_id]
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._stopping = True
            self._wake.set()
        self._thread.join(timeout)

    def _check_capacity(self, num_prompt_tokens: int) -> None:
        max_requests, max_tokens = self.config.max_waiting_requests, self.config.max_waiting_tokens
        if max_requests is None and max_tokens is None:
            return
        waiting = [s for s in self._streams.values() if s.is_waiting]
        if max_requests is not None and len(waiting) >= max_requests:
            raise EngineOverloadedError(f"{len(waiting)} requests are already waiting (limit {max_requests})",
                                        self._retry_after_s())
        queued_tokens = sum(s.num_prompt_tokens for s in waiting)
        if max_tokens is not None and waiting and queued_tokens + num_prompt_tokens > max_tokens:
            raise EngineOverloadedError(f"{queued_tokens} prompt tokens are already waiting (limit {max_tokens})",
                                        self._retry_after_s())

    def _retry_after_s(self) -> float:
        """Roughly how long the waiting work takes to start: a step per waiting request's prefill."""
        if self._steps_per_s <= 0:
            return 1.0
        return max(1.0, self._stats.num_waiting / self._steps_per_s)

    def _submit(self, command: tuple) -> None:
        with self._lock:
            self._inbox.append(command)
            self._wake.set()

    # ---- step loop thread ----

    def _run(self) -> None:
        try:
            self.engine = LLMEngine(self.config)
            self.engine.warmup()
            self._stats = self.engine.stats()
        except BaseException as exc:  # noqa: BLE001 - re-raised by __init__
            self._init_error = exc
            return
        finally:
            self._ready.set()
        try:
            self._loop_forever()
        except BaseException as exc:  # noqa: BLE001 - any crash must fail requests, not hang them
            logger.exception("engine step loop crashed")
            self._error = EngineDeadError(f"engine step loop crashed: {exc!r}")
            for loop in set(self._loops.values()):
                loop.call_soon_threadsafe(self._fail_all, self._error)

    def _loop_forever(self) -> None:
        last = None
        while self._wait_for_work():
            outputs = self.engine.step()
            now = time.monotonic()
            if last is not None:
                rate = 1.0 / max(now - last, 1e-6)
                self._steps_per_s += _STEP_RATE_SMOOTHING * (rate - self._steps_per_s)
            last = now
            self._stats = self.engine.stats()
            self._publish(outputs)
            if not self.engine.has_unfinished_requests():
                last = None  # idle time is not a step

    def _publish(self, outputs: list[StepOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[StepOutput]] = {}
        for output in outputs:
            loop = self._loops[output.request_id]
            by_loop.setdefault(loop, []).append(output)
            if output.finish_reason is not None:
                del self._loops[output.request_id]
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(self._deliver, batch, self._steps_per_s)

    def _wait_for_work(self) -> bool:
        """Apply queued commands; sleep while there is nothing to step. False = stop.

        The one timed wait: after _TRIM_AFTER_IDLE_S with no work the heap is trimmed,
        once; the loop then sleeps until woken."""
        while True:
            if not self._wake.wait(None if self._heap_trimmed else _TRIM_AFTER_IDLE_S):
                trim_heap()
                self._heap_trimmed = True
                continue
            with self._lock:
                commands, self._inbox = self._inbox, []
                if self._stopping:
                    return False
                if not commands and not self.engine.has_unfinished_requests():
                    self._wake.clear()  # under the lock: a concurrent submit re-sets it after
                    continue
            self._apply(commands)
            if self.engine.has_unfinished_requests():
                self._heap_trimmed = False
                return True
            self._stats = self.engine.stats()

    def _apply(self, commands: list[tuple]) -> None:
        for command in commands:
            if command[0] == "abort":
                self.engine.abort_request(command[1])
                self._loops.pop(command[1], None)
                continue
            _, request_id, prompt_token_ids, params, loop = command
            try:
                self.engine.add_request(request_id, prompt_token_ids, params)
                self._loops[request_id] = loop
            except ValueError as exc:
                loop.call_soon_threadsafe(self._fail_some, [(request_id, exc)])

    # ---- asyncio loop ----

    def _deliver(self, outputs: list[StepOutput], steps_per_s: float) -> None:
        min_tokens = self._min_tokens_per_chunk(steps_per_s)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.push(output, min_tokens)

    def _min_tokens_per_chunk(self, steps_per_s: float) -> int:
        if not self.max_chunks_per_s or steps_per_s <= 0:
            return 1
        return max(1, math.ceil(len(self._streams) * steps_per_s / self.max_chunks_per_s))

    def _fail_some(self, failures: list[tuple[str, BaseException]]) -> None:
        for request_id, exc in failures:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.fail(exc)

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.fail(error)


def _timings(output: StepOutput) -> dict[str, float]:
    t = output.timings
    values = {"queue_wait_s": t.queue_wait_s, "prefill_s": t.prefill_s, "ttft_s": t.ttft_s}
    return {k: v for k, v in values.items() if v is not None}
