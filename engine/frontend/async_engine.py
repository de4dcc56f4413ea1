"""The engine behind an asyncio front: requests in, per-request chunk streams out.

Pieces, in the order a request passes them:

    admission.py       the overload bounds, checked before a request is admitted
    messages.py        what crosses between the asyncio side and the step loop thread
    step_loop.py       the thread that owns the LLMEngine and steps it while there is work
    request_stream.py  each request's tokens on the asyncio side, handed out as chunks

Each step's outputs arrive as one StepOutputs message per event loop, and a stream's
consumer takes every token that arrived since its last wake-up as one chunk.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, TypeVar

from engine.frontend.admission import TenantWork, check_waiting_bounds, has_waiting_bounds, retry_after_s
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.lora.registry import LoraInfo, LoraStats
from engine.frontend.messages import (
    AbortRequest, AddRequest, CallOnLoop, EngineFailed, OutMessage, RequestRejected, StepOutputs,
)
from engine.request.constraint import Constraint
from engine.request.outputs import EngineDeadError, EngineStats, GenerationChunk, ModelInfo
from engine.request.request_rules import check_request_id_free
from engine.frontend.request_stream import RequestStream, min_tokens_per_chunk
from engine.request.sampling_params import SamplingParams
from engine.request.scheduling import Scheduling
from engine.core.step_log import StepRecord
from engine.frontend.step_loop import StepLoop

if TYPE_CHECKING:  # imported where a constraint first needs it, not with every engine's start
    import xgrammar as xgr

T = TypeVar("T")


class AsyncEngine:
    def __init__(self, config: EngineConfig, max_chunks_per_s: float | None = None):
        self.config = config
        self.max_chunks_per_s = max_chunks_per_s
        self._streams: dict[str, RequestStream] = {}
        self.step_loop = StepLoop(config, self._receive)

    @property
    def engine(self) -> LLMEngine:
        """The step loop's engine: only its thread may call it while the loop runs."""
        return self.step_loop.engine

    @property
    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    @property
    def is_dead(self) -> bool:
        return self.step_loop.error is not None or not self.step_loop.is_alive()

    def check_health(self) -> None:
        if self.step_loop.error is not None:
            raise self.step_loop.error
        if not self.step_loop.is_alive():
            raise EngineDeadError("engine step loop is not running")

    def stats(self) -> EngineStats:
        """The stats as of the last step (read without stopping the loop)."""
        return self.step_loop.stats

    def drain_steps(self) -> list[StepRecord]:
        """The steps taken since the last call, oldest first (any thread may call it)."""
        return self.engine.step_log.drain()

    def num_active_requests(self) -> int:
        return len(self._streams)

    def waiting_work(self) -> tuple[int, int]:
        """Requests admitted but not yet past their first token, and their prompt tokens:
        what the overload bounds count. Call from the event loop that runs generate."""
        waiting = [s for s in self._streams.values() if s.is_waiting]
        return len(waiting), sum(s.num_prompt_tokens for s in waiting)

    def tenant_work(self, scheduling: Scheduling) -> TenantWork:
        """The waiting work of scheduling's tenant, and its share of the bounds by weight."""
        weights, num_waiting, num_tokens = {scheduling.tenant: scheduling.weight}, 0, 0
        for stream in self._streams.values():
            if not stream.is_waiting:
                continue
            tenant = stream.scheduling.tenant
            weights.setdefault(tenant, stream.scheduling.weight)
            if tenant == scheduling.tenant:
                num_waiting, num_tokens = num_waiting + 1, num_tokens + stream.num_prompt_tokens
        return TenantWork(scheduling.tenant, num_waiting, num_tokens, scheduling.weight / sum(weights.values()))

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       scheduling: Scheduling = Scheduling(),
                       lora_name: str | None = None) -> AsyncIterator[GenerationChunk]:
        """Stream a request's tokens.

        Raises before any chunk: InvalidRequestError (a ValueError) for a request that can
        never run (a constraint that does not compile; LLMEngine.add_request's rules, checked
        on the step loop thread),
        EngineOverloadedError when the waiting bounds are full, EngineDeadError when the
        step loop has crashed. `scheduling`: the request's priority and tenant (the
        policy's order, and per tenant bounds under the fair one). `lora_name`: a LoRA adapter
        add_lora loaded (InvalidRequestError, param "model", if none is), None the base model. Leaving the iterator early (break, cancellation, an error in
        the consumer) aborts the request; its KV blocks are free by the end of the next step.
        """
        grammar = await self._compile(params)
        stream = self._admit(request_id, len(prompt_token_ids), scheduling)
        self.step_loop.send(AddRequest(request_id, list(prompt_token_ids), params, asyncio.get_running_loop(),
                                       scheduling, grammar, lora_name))
        try:
            async for chunk in stream.chunks():
                yield chunk
        finally:
            del self._streams[request_id]
            if not stream.is_finished:
                self.abort(request_id)

    async def _compile(self, params: SamplingParams) -> xgr.CompiledGrammar | None:
        """The constraint's grammar, compiled on a worker thread (a cache hit returns at once),
        so that a slow schema never holds up the step loop or this event loop. Raises
        InvalidRequestError where it does not compile."""
        constraint = getattr(params, "constraint", None)  # params not yet checked: the step loop checks them
        if not isinstance(constraint, Constraint):
            return None
        return await asyncio.to_thread(self.engine.grammars.compile, constraint)

    def abort(self, request_id: str) -> None:
        self.step_loop.send(AbortRequest(request_id))


    # LoRA adapters, on the step loop's thread between two steps (LLMEngine's, which say what they raise).
    async def add_lora(self, name: str, path: str) -> LoraInfo:
        return await self.call_on_loop(lambda engine: engine.add_lora(name, path))

    async def remove_lora(self, name: str) -> bool:
        return await self.call_on_loop(lambda engine: engine.remove_lora(name))

    async def list_loras(self) -> list[LoraInfo]:
        return await self.call_on_loop(lambda engine: engine.list_loras())

    async def lora_stats(self) -> LoraStats | None:
        return await self.call_on_loop(lambda engine: engine.lora_stats())

    async def call_on_loop(self, fn: Callable[[LLMEngine], T]) -> T:
        """fn(engine) on the step loop's thread, between two steps, and its result."""
        self.check_health()  # a dead loop would never answer
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.step_loop.send(CallOnLoop(fn, done))
        return await asyncio.wrap_future(done)

    def shutdown(self, timeout: float = 5.0) -> None:
        self.step_loop.stop(timeout)

    def _admit(self, request_id: str, num_prompt_tokens: int, scheduling: Scheduling) -> RequestStream:
        self.check_health()
        check_request_id_free(request_id, self._streams)
        if has_waiting_bounds(self.config):
            retry_after = retry_after_s(self.step_loop.stats.num_waiting, self.step_loop.step_rate.per_s)
            tenant = self.tenant_work(scheduling) if self.config.scheduling_policy == "fair" else None
            check_waiting_bounds(self.config, *self.waiting_work(), num_prompt_tokens, retry_after, tenant)
        stream = self._streams[request_id] = RequestStream(request_id, num_prompt_tokens, scheduling)
        return stream

    def _receive(self, message: OutMessage) -> None:
        """The step loop's messages, on this request's event loop."""
        match message:
            case StepOutputs(outputs, steps_per_s):
                min_tokens = min_tokens_per_chunk(len(self._streams), steps_per_s, self.max_chunks_per_s)
                for output in outputs:
                    if (stream := self._streams.get(output.request_id)) is not None:
                        stream.push(output, min_tokens)
            case RequestRejected(request_id, error):
                if (stream := self._streams.get(request_id)) is not None:
                    stream.fail(error)
            case EngineFailed(error):
                for stream in list(self._streams.values()):
                    stream.fail(error)

