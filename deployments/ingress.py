"""HTTP ingress: the OpenAI-compatible API and /generate, as a thin shim over two handles.

A request's life here: validate the body (pydantic) -> tokenizer.encode (ids, length
checks) -> engine.generate streams (one per choice) -> detokenize incrementally, match
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
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.engine import route_logs_to_serve
from deployments.tokenizer import ChatMessage, EncodeError, EncodeRequest, Encoded
from engine import EngineDeadError, GenerationChunk, ModelInfo, SamplingParams
from engine.detokenizer import IncrementalDetokenizer, TokenVocab
from engine.loader import load_tokenizer
from engine.sampling_params import MAX_STOP_STRINGS

logger = logging.getLogger("ray.serve")

MAX_N = 8
_HEALTH_TIMEOUT_S = 5.0

# ---- request bodies ----


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingBody(_Body):
    model: str | None = None
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    seed: int | None = None
    stop: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_params(self, max_tokens: int, index: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        seed = None if self.seed is None else self.seed + index  # n choices must differ
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=seed, stop=tuple(stop), ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionBody(_SamplingBody):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[StrictInt], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] = 16


class MessageBody(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str


class ChatBody(_SamplingBody):
    messages: Annotated[list[MessageBody], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # None: the rest of the context
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None


class GenerateBody(_Body):
    prompt: Annotated[str, Field(min_length=1)]
    max_new_tokens: Annotated[int, Field(ge=1)] = 16
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    stop_on_eos: bool = True


# ---- errors ----


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code

    @property
    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def bad_request(error: EncodeError) -> ApiError:
    return ApiError(400, error.message, param=error.param, code=error.code)


def as_api_error(exc: Exception) -> ApiError:
    # An error raised in the engine replica arrives as a RayTaskError holding it as `cause`.
    cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, ApiError):
        return cause
    if isinstance(cause, EngineDeadError):
        return ApiError(503, "the engine has failed and is restarting; retry shortly", "server_error")
    if isinstance(cause, ValueError):  # the engine rejected the request (validate_request)
        return ApiError(400, str(cause))
    logger.exception("request failed")
    return ApiError(500, "internal error", "server_error")


api = FastAPI(title="rayinfer", description="OpenAI-compatible completions for GPT-2-family models")


@api.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body, status_code=exc.status)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    error = invalid_body(exc.errors(), skip=1)  # loc starts with "body" (or "query")
    return JSONResponse(error.body, status_code=error.status)


def invalid_body(errors: Sequence[Any], skip: int = 0) -> ApiError:
    """400, never FastAPI's 422; `param` names the offending top-level field."""
    error = errors[0]
    loc = list(error.get("loc", ()))[skip:]
    param = loc[0] if loc and isinstance(loc[0], str) else None
    # Keep list indices, drop pydantic's union-member tags ("str", "list[int]", ...).
    where = ".".join(str(part) for i, part in enumerate(loc) if i == 0 or isinstance(part, int))
    return ApiError(400, f"{where}: {error['msg']}" if where else error["msg"], param=param)


async def parse_json_body(request: Request, model: type[_Body]) -> Any:
    """For endpoints curl reaches without a JSON content type (`curl -d '{...}'`)."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from None


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
    graceful_shutdown_timeout_s=30,
)
@serve.ingress(api)
class Ingress:
    async def __init__(self, tokenizer: DeploymentHandle, engine: DeploymentHandle, model_name: str) -> None:
        self._tokenizer = tokenizer
        self._engine = engine
        self._model_name = model_name
        route_logs_to_serve("engine")
        self._info: ModelInfo = await engine.model_info.remote()
        self._vocab = TokenVocab.from_tokenizer(load_tokenizer(self._info.name))

    @api.post("/v1/completions")
    async def completions(self, body: CompletionBody) -> Any:
        received_at = time.perf_counter()
        encoded, timing = await self._encode(EncodeRequest(prompt=body.prompt, max_tokens=body.max_tokens,
                                                           max_model_len=self._info.max_model_len))
        return await self._respond(body, encoded, timing, received_at, COMPLETIONS)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatBody) -> Any:
        received_at = time.perf_counter()
        messages = [ChatMessage(m.role, m.content) for m in body.messages]
        encoded, timing = await self._encode(EncodeRequest(
            messages=messages, max_tokens=body.max_completion_tokens or body.max_tokens,
            max_model_len=self._info.max_model_len))
        return await self._respond(body, encoded, timing, received_at, CHAT)

    @api.post("/generate")
    async def generate(self, request: Request) -> Any:
        received_at = time.perf_counter()
        body: GenerateBody = await parse_json_body(request, GenerateBody)
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
    async def models(self) -> dict:
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
            return JSONResponse(ApiError(503, f"engine unavailable: {exc!r}", "server_error").body, status_code=503)
        body = {"status": "dead" if status.is_dead else "ok", "model": asdict(status.model),
                "stats": asdict(status.stats), "num_active_requests": status.num_active_requests}
        return JSONResponse(body, status_code=503 if status.is_dead else 200)

    async def _encode(self, request: EncodeRequest) -> tuple[Encoded, ServerTiming]:
        started = time.perf_counter()
        result = await self._tokenizer.encode.remote(request)
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
        is_engine_done = False
        try:
            async for chunk in response:
                timing.record_first_token(chunk, received_at)
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
