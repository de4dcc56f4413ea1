"""HTTP ingress: the OpenAI-compatible API and /generate, as a thin shim over two handles.

A request's life here: check the API key -> read the body, at most max_body_bytes ->
validate it (deployments/protocol.py) -> tokenizer.encode (ids, length checks) ->
engine.generate streams (one per choice) -> detokenize incrementally, match
stop strings -> SSE, JSON or plain text. Errors before the first token are HTTP errors in
OpenAI's shape; after the stream has started, a final SSE error event and `[DONE]`.

Leaving an engine stream early (stop string, disconnect, error) cancels it, and the
engine aborts the request.
"""

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.engine import route_logs_to_serve
from deployments.handles import over_grpc
from deployments.protocol import (
    DEFAULT_MAX_BODY_BYTES, ApiError, BodyT, ChatBody, CompletionBody, GenerateBody, _SamplingBody, as_api_error,
    bad_request, documented_body, invalid_body, read_json_body, unknown_model,
)
from deployments.security import ApiKeys
from deployments.metrics import RequestCounterMiddleware, request_metrics
from deployments.tokenizer import ChatMessage, EncodeError, EncodeRequest, Encoded
from engine import GenerationChunk, ModelInfo, SamplingParams
from engine.detokenizer import IncrementalDetokenizer, TokenVocab
from engine.loader import load_tokenizer

logger = logging.getLogger("ray.serve")

_HEALTH_TIMEOUT_S = 5.0

api = FastAPI(title="rayinfer", description="OpenAI-compatible completions for GPT-2-family models")
api.add_middleware(RequestCounterMiddleware)


@api.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    error = invalid_body(exc.errors(), skip=1)  # loc starts with "body" (or "query")
    return JSONResponse(error.body, status_code=error.status)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """404, 405 and the like in OpenAI's shape too."""
    return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body, status_code=exc.status_code)


# ---- what a generation stream yields ----


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
        timings = chunk.timings or {}
        self.queue_wait_ms = 1000 * timings.get("queue_wait_s", 0.0)
        self.prefill_ms = 1000 * timings.get("prefill_s", 0.0)
        self.ttft_ms = 1000 * (time.perf_counter() - received_at)

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in asdict(self).items() if not k.startswith("_")}


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


# ---- response formats: completions and chat differ only in the choice objects ----


def completion_choice(delta: ChoiceDelta, is_first: bool) -> dict:
    return {"index": delta.index, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}


def chat_chunk_choice(delta: ChoiceDelta, is_first: bool) -> dict:
    message = {"role": "assistant", "content": delta.text} if is_first else {"content": delta.text}
    return {"index": delta.index, "delta": message, "logprobs": None, "finish_reason": delta.finish_reason}


@dataclass(frozen=True)
class OpenAIFormat:
    object: str  # of the non-stream body
    chunk_object: str
    id_prefix: str
    chunk_choice: Callable[[ChoiceDelta, bool], dict]
    choice: Callable[[int, str, str | None], dict]


COMPLETIONS = OpenAIFormat(
    "text_completion", "text_completion", "cmpl-", completion_choice,
    lambda index, text, finish: {"index": index, "text": text, "logprobs": None, "finish_reason": finish},
)
CHAT = OpenAIFormat(
    "chat.completion", "chat.completion.chunk", "chatcmpl-", chat_chunk_choice,
    lambda index, text, finish: {"index": index, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": finish},
)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def sse_events(gen: Generation, fmt: OpenAIFormat, include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices: list[dict], **extra: Any) -> dict:
        usage = {"usage": None} if include_usage else {}
        return {"id": gen.id, "object": fmt.chunk_object, "created": gen.created, "model": gen.model,
                "choices": choices, **usage, **extra}

    num_tokens, num_finished, started = 0, 0, set()
    try:
        async with contextlib.aclosing(gen.deltas):
            async for delta in gen.deltas:
                num_tokens += delta.num_tokens
                num_finished += delta.finish_reason is not None
                if not delta.text and delta.finish_reason is None and delta.index in started:
                    continue
                is_last = num_finished == gen.n and not include_usage
                extra = {"server_timing": gen.timing.as_dict()} if is_last else {}
                yield sse(chunk([fmt.chunk_choice(delta, delta.index not in started)], **extra))
                started.add(delta.index)
        if include_usage:
            yield sse(chunk([], usage=gen.usage(num_tokens), server_timing=gen.timing.as_dict()))
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
        yield sse(as_api_error(exc).body)
    yield sse("[DONE]")


async def collect(gen: Generation) -> tuple[list[str], list[str | None], int]:
    texts, finish_reasons, num_tokens = [""] * gen.n, [None] * gen.n, 0
    async with contextlib.aclosing(gen.deltas):
        async for delta in gen.deltas:
            texts[delta.index] += delta.text
            finish_reasons[delta.index] = delta.finish_reason or finish_reasons[delta.index]
            num_tokens += delta.num_tokens
    return texts, finish_reasons, num_tokens


async def openai_body(gen: Generation, fmt: OpenAIFormat) -> dict:
    texts, finish_reasons, num_tokens = await collect(gen)
    return {"id": gen.id, "object": fmt.object, "created": gen.created, "model": gen.model,
            "choices": [fmt.choice(i, text, finish) for i, (text, finish) in enumerate(zip(texts, finish_reasons))],
            "usage": gen.usage(num_tokens), "server_timing": gen.timing.as_dict()}


async def text_stream(gen: Generation) -> AsyncIterator[str]:
    try:
        async with contextlib.aclosing(gen.deltas):
            async for delta in gen.deltas:
                if delta.text:
                    yield delta.text
    except Exception as exc:  # noqa: BLE001 - text/plain has no error channel once started
        logger.warning("generation %s failed mid-stream: %s", gen.id, as_api_error(exc))


def server_timing_header(timing: ServerTiming) -> str:
    parts = {"tokenize": timing.tokenize_ms, "queue": timing.queue_wait_ms,
             "prefill": timing.prefill_ms, "ttft": timing.ttft_ms}
    return ", ".join(f"{name};dur={ms:.3f}" for name, ms in parts.items())


async def prepend(first: ChoiceDelta, rest: AsyncIterator[ChoiceDelta]) -> AsyncIterator[ChoiceDelta]:
    async with contextlib.aclosing(rest):
        yield first
        async for delta in rest:
            yield delta


async def merge(streams: list[AsyncIterator[ChoiceDelta]]) -> AsyncIterator[ChoiceDelta]:
    """Interleave the choices' deltas as they arrive; leaving early cancels them all."""
    queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[ChoiceDelta]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait(delta)
            queue.put_nowait(None)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        num_running = len(tasks)
        while num_running:
            item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


# ---- the deployment: last, because @serve.ingress pickles the app (and the globals its
# routes use) when it decorates the class ----


@serve.deployment(
    ray_actor_options={"num_cpus": 0.25},
    max_ongoing_requests=512,
    # Past 512 ongoing + 256 queued the proxy answers 429 + Retry-After itself (plain text).
    # Serve counts requests still being assigned as queued: keep this well above a burst.
    max_queued_requests=256,
    backpressure_config={"status_code": 429, "retry_after_s": 1},
    graceful_shutdown_timeout_s=30,
)
@serve.ingress(api)
class Ingress:
    async def __init__(self, tokenizer: DeploymentHandle, engine: DeploymentHandle, model_name: str,
                       api_keys: list[str] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self._tokenizer = over_grpc(tokenizer)
        self._engine = over_grpc(engine)
        self._model_name = model_name
        self._api_keys = ApiKeys.from_config(api_keys)
        self._max_body_bytes = max_body_bytes
        route_logs_to_serve("engine")
        self._info: ModelInfo = await self._engine.model_info.remote()
        self._vocab = TokenVocab.from_tokenizer(load_tokenizer(self._info.name))

    @api.post("/v1/completions", openapi_extra=documented_body(CompletionBody))
    async def completions(self, request: Request) -> Any:
        received_at = time.perf_counter()
        body = await self._read(request, CompletionBody)
        encoded, timing = await self._encode(EncodeRequest(prompt=body.prompt, max_tokens=body.max_tokens,
                                                           max_model_len=self._info.max_model_len))
        return await self._respond(body, encoded, timing, received_at, COMPLETIONS)

    @api.post("/v1/chat/completions", openapi_extra=documented_body(ChatBody))
    async def chat_completions(self, request: Request) -> Any:
        received_at = time.perf_counter()
        body = await self._read(request, ChatBody)
        messages = [ChatMessage(m.role, m.content) for m in body.messages]
        encoded, timing = await self._encode(EncodeRequest(
            messages=messages, max_tokens=body.max_completion_tokens or body.max_tokens,
            max_model_len=self._info.max_model_len))
        return await self._respond(body, encoded, timing, received_at, CHAT)

    @api.post("/generate", openapi_extra=documented_body(GenerateBody))
    async def generate(self, request: Request) -> Any:
        received_at = time.perf_counter()
        body = await self._read(request, GenerateBody)
        encoded, timing = await self._encode(EncodeRequest(prompt=body.prompt, max_tokens=body.max_new_tokens,
                                                           max_model_len=self._info.max_model_len))
        params = SamplingParams(max_tokens=encoded.max_tokens, temperature=body.temperature, top_p=body.top_p,
                                top_k=body.top_k, ignore_eos=not body.stop_on_eos)
        gen = await self._start("gen-", encoded, [params], timing, received_at)
        headers = {"Server-Timing": server_timing_header(timing)}
        if body.stream:
            return StreamingResponse(text_stream(gen), media_type="text/plain; charset=utf-8", headers=headers)
        texts, _, _ = await collect(gen)
        return PlainTextResponse(texts[0], headers=headers)

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self._api_keys.check(request.headers.get("authorization"))
        info = self._info
        card = {"id": self._model_name, "object": "model", "created": 0, "owned_by": "rayinfer",
                "root": info.name, "weights": info.weights, "max_model_len": info.max_model_len,
                "dtype": info.dtype, "device": info.device}
        return {"object": "list", "data": [card]}

    @api.get("/health")
    async def health(self) -> JSONResponse:
        try:
            status = await asyncio.wait_for(self._engine.status.remote(), _HEALTH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - unreachable or restarting: unhealthy
            error = ApiError(503, f"engine unavailable: {type(exc).__name__}", "server_error", retry_after_s=1)
            return JSONResponse(error.body, status_code=503, headers=error.headers)
        body = {"status": "dead" if status.is_dead else "ok", "model": asdict(status.model),
                "stats": asdict(status.stats), "num_active_requests": status.num_active_requests,
                "engine_rss_bytes": status.rss_bytes}
        return JSONResponse(body, status_code=503 if status.is_dead else 200)

    async def _read(self, request: Request, model: type[BodyT]) -> BodyT:
        """Auth first (an unauthorized body is never read), then the size-capped body, then
        the served model's name where the body names one."""
        self._api_keys.check(request.headers.get("authorization"))
        body = await read_json_body(request, model, self._max_body_bytes)
        name = getattr(body, "model", None)
        if name is not None and name != self._model_name:
            raise unknown_model(name)
        return body

    async def _encode(self, request: EncodeRequest) -> tuple[Encoded, ServerTiming]:
        started = time.perf_counter()
        try:
            result = await self._tokenizer.encode.remote(request)
        except Exception as exc:
            raise as_api_error(exc) from exc
        if isinstance(result, EncodeError):
            raise bad_request(result)
        return result, ServerTiming(tokenize_ms=1000 * (time.perf_counter() - started))

    async def _respond(self, body: _SamplingBody, encoded: Encoded, timing: ServerTiming,
                       received_at: float, fmt: OpenAIFormat) -> Any:
        params = [body.sampling_params(encoded.max_tokens, i) for i in range(body.n)]
        gen = await self._start(fmt.id_prefix, encoded, params, timing, received_at)
        if body.stream:
            return StreamingResponse(sse_events(gen, fmt, body.include_usage), media_type="text/event-stream")
        return await openai_body(gen, fmt)

    async def _start(self, id_prefix: str, encoded: Encoded, params: list[SamplingParams],
                     timing: ServerTiming, received_at: float) -> Generation:
        """Starts one engine request per choice and waits for the first delta, so errors
        raised before any token (the engine's own validation) become HTTP errors."""
        request_id = id_prefix + uuid.uuid4().hex
        streams = [self._choice(i, f"{request_id}-{i}", encoded.token_ids, p, timing, received_at)
                   for i, p in enumerate(params)]
        deltas = streams[0] if len(streams) == 1 else merge(streams)
        try:
            first = await anext(deltas)
        except Exception as exc:
            raise as_api_error(exc) from exc
        return Generation(request_id, self._model_name, len(encoded.token_ids), len(params),
                          prepend(first, deltas), timing)

    async def _choice(self, index: int, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      timing: ServerTiming, received_at: float) -> AsyncIterator[ChoiceDelta]:
        response = self._engine.options(stream=True).generate.remote(request_id, prompt_token_ids, params)
        detokenizer = IncrementalDetokenizer(self._vocab, params.stop)
        is_engine_done, num_tokens, first_timings = False, 0, None
        try:
            async for chunk in response:
                timing.record_first_token(chunk, received_at)
                first_timings = first_timings or chunk.timings
                num_tokens += len(chunk.token_ids)
                is_engine_done = chunk.finish_reason is not None
                delta = detokenizer.push(chunk.token_ids)
                if delta.stopped:
                    yield ChoiceDelta(index, delta.text, "stop", delta.num_tokens)
                    return
                text = delta.text + (detokenizer.finish() if is_engine_done else "")
                yield ChoiceDelta(index, text, chunk.finish_reason, delta.num_tokens)
        finally:
            if not is_engine_done:
                response.cancel()  # the engine's generator aborts the request
            if num_tokens:
                request_metrics().record_completion(
                    ttft_s=timing.ttft_ms / 1000, e2e_s=time.perf_counter() - received_at,
                    queue_wait_s=(first_timings or {}).get("queue_wait_s"),
                    num_prompt_tokens=len(prompt_token_ids), num_completion_tokens=num_tokens)
