"""The step loop thread: the one owner of the LLMEngine (scheduler, blocks, model).

It is built on this thread so its torch thread settings apply where the work runs; nothing
else touches it. Messages arrive through the inbox (engine/frontend/inbox.py); the loop sleeps on
it while it has no work, never polling. Each step's outputs leave in one
call_soon_threadsafe per event loop with requests in that step (normally exactly one).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from engine.config import EngineConfig
from engine.core.heap import trim_heap
from engine.frontend.inbox import Inbox
from engine.core.llm_engine import LLMEngine
from engine.frontend.messages import (
    AbortRequest, AddRequest, CallOnLoop, EngineFailed, GraphCompiled, InMessage, OutMessage,
    RequestRejected, StepOutputs,
)
from engine.request.outputs import EngineDeadError, EngineStats, StepOutput
from engine.model.progress import progress

logger = logging.getLogger(__name__)

_STEP_RATE_SMOOTHING = 0.1  # weight of the newest step in the steps/s moving average
_TRIM_AFTER_IDLE_S = 2.0  # an idle step loop hands freed heap pages back once (engine/core/heap.py)


class StepRate:
    """Steps per second, a moving average over busy time only."""

    def __init__(self) -> None:
        self.per_s = 0.0
        self._last: float | None = None

    def tick(self) -> None:
        now = time.monotonic()
        if self._last is not None:
            rate = 1.0 / max(now - self._last, 1e-6)
            self.per_s += _STEP_RATE_SMOOTHING * (rate - self.per_s)
        self._last = now

    def pause(self) -> None:
        self._last = None  # idle time is not a step


class StepLoop:
    def __init__(self, config: EngineConfig, on_output: Callable[[OutMessage], None]) -> None:
        self.config = config
        self._on_output = on_output  # called on each request's event loop
        self.engine: LLMEngine  # set on the loop thread before __init__ returns
        self.stats: EngineStats  # as of the last step: read without stopping the loop
        self.error: EngineDeadError | None = None
        self.step_rate = StepRate()
        self._inbox = Inbox()
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}  # loop thread only
        self._is_heap_trimmed = False
        self._start_thread()

    def send(self, message: InMessage) -> None:
        self._inbox.put(message)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float) -> None:
        self._inbox.stop()
        self._thread.join(timeout_s)

    def _start_thread(self) -> None:
        ready, init_error = threading.Event(), []
        self._thread = threading.Thread(target=self._run, args=(ready, init_error), name="rayinfer-step-loop",
                                        daemon=True)
        self._thread.start()
        ready.wait()
        if init_error:
            raise init_error[0]

    # ---- on the loop thread ----

    def _run(self, ready: threading.Event, init_error: list[BaseException]) -> None:
        try:
            # serving starts on eager steps; the compiled graph joins when ready
            self.engine = LLMEngine(self.config, compile_in_background=True,
                                    on_compiled=lambda: self._inbox.put(GraphCompiled()))
            with progress("a warm-up request through prefill and decode"):
                self.engine.warmup()
            self.stats = self.engine.stats()
        except BaseException as exc:  # noqa: BLE001 - re-raised by __init__
            init_error.append(exc)
            return
        finally:
            ready.set()
        try:
            self._loop_forever()
        except BaseException as exc:  # noqa: BLE001 - any crash must fail requests, not hang them
            logger.exception("engine step loop crashed")
            self.error = EngineDeadError(f"engine step loop crashed: {exc!r}")
            for loop in set(self._loops.values()):
                _send(loop, self._on_output, EngineFailed(self.error))

    def _loop_forever(self) -> None:
        while self._wait_for_work():
            outputs = self._step()
            self.step_rate.tick()
            self.stats = self.engine.stats()
            self._publish(outputs)
            if not self.engine.has_unfinished_requests():
                self.step_rate.pause()

    def _step(self) -> list[StepOutput]:
        return self.engine.step()

    def _wait_for_work(self) -> bool:
        """Apply queued messages; sleep while there is nothing to step. False = stop.

        The one timed wait: after _TRIM_AFTER_IDLE_S with no work the heap is trimmed,
        once; the loop then sleeps until woken."""
        while True:
            if not self._inbox.wait(None if self._is_heap_trimmed else _TRIM_AFTER_IDLE_S):
                trim_heap()
                self._is_heap_trimmed = True
                continue
            messages = self._inbox.take(self.engine.has_unfinished_requests)
            if messages is None:
                return False
            for message in messages:
                self._apply(message)
            if self.engine.has_unfinished_requests():
                self._is_heap_trimmed = False
                return True
            self.stats = self.engine.stats()

    def _apply(self, message: InMessage) -> None:
        match message:
            case AddRequest(request_id, prompt_token_ids, params, loop, scheduling, grammar, lora_name):
                try:
                    self.engine.add_request(request_id, prompt_token_ids, params, scheduling, grammar, lora_name)
                    self._loops[request_id] = loop
                except ValueError as exc:
                    _send(loop, self._on_output, RequestRejected(request_id, exc))
                except Exception as exc:  # noqa: BLE001 - one request's values fail it alone, never the loop
                    # The type and the id only: a message could quote the request.
                    logger.error("request %s refused at admission: unexpected %s", request_id, type(exc).__name__)
                    _send(loop, self._on_output, RequestRejected(request_id, exc))
            case AbortRequest(request_id):
                self.engine.abort_request(request_id)
                self._loops.pop(request_id, None)
            case GraphCompiled():
                self.engine.take_compiled_graph()
            case CallOnLoop(fn, done):
                try:
                    done.set_result(fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - the caller's, handed back to it
                    done.set_exception(exc)

    def _publish(self, outputs: list[StepOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[StepOutput]] = {}
        for output in outputs:
            loop = self._loops[output.request_id]
            by_loop.setdefault(loop, []).append(output)
            if output.finish_reason is not None:
                del self._loops[output.request_id]
        for loop, batch in by_loop.items():
            if not _send(loop, self._on_output, StepOutputs(batch, self.step_rate.per_s)):
                self._abandon(loop)

    def _abandon(self, loop: asyncio.AbstractEventLoop) -> None:
        """Abort the requests of an event loop that closed under them: nobody can receive
        their tokens, and their KV blocks must not wait for an abort that will never come."""
        for request_id in [r for r, request_loop in self._loops.items() if request_loop is loop]:
            self.engine.abort_request(request_id)
            del self._loops[request_id]


def _send(loop: asyncio.AbstractEventLoop, callback, item) -> bool:
    """callback(item) on the consumer's event loop; False where that loop has closed."""
    try:
        loop.call_soon_threadsafe(callback, item)
    except RuntimeError:  # asyncio's "Event loop is closed"
        return False
    return True
