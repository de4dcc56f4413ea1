"""What the routes do, between HTTP, the tokenizer deployment and the engine. A request's life here:

    check the API key -> read the body, at most max_body_bytes -> validate it
    (deployments/api/protocol.py) -> encode (ids, length checks; here or in the tokenizer
    deployment: deployments/api/prompt_encoding.py) -> engine.generate
    streams, one per choice (deployments/api/generation.py) -> SSE, JSON or plain text.

Errors before the first token are HTTP errors in OpenAI's shape (deployments/api/errors.py);
after the stream has started, a final SSE error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import time
import uuid
from collections.abc import Awaitable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray.serve.handle import DeploymentHandle

from deployments.api.encoding import EncodeRequest, Encoded
from deployments.api.engine_client import EngineClient
from deployments.api.errors import ApiError, as_api_error, unavailable
from deployments.api.generation import Choice, Generation, ServerTiming, choice_deltas
from deployments.api.http_body import BodyT, read_json_body
from deployments.api.lora_catalog import LoraCatalog
from deployments.api.prompt_encoding import PromptEncoding
from deployments.observability import prometheus
from deployments.api.protocol import (ChatBody, DetokenizeBody, GenerateBody, LoadLoraBody, OpenAIBody, TokenizeBody,
                                      UnloadLoraBody)
from deployments.api.responses import OpenAIFormat, collect, openai_body, text_stream
from deployments.api.security import ApiKeys, Tenant
from deployments.observability.metrics import request_metrics
from deployments.api.sse import sse_events
from deployments.api.streams import merge, prepend
from engine import ModelInfo
from engine.request.detokenizer import TokenVocab
from engine.request.lora_request import LoraRequest
from engine.request.request_rules import check_fits_waiting_bounds, check_priority, check_token_ids
from engine.request.scheduling import Scheduling

HEALTH_TIMEOUT_S = 5.0

T = TypeVar("T")


@dataclass(frozen=True)
class Serving:
    tokenizer: DeploymentHandle
    encoding: PromptEncoding
    engine: EngineClient
    model_name: str  # the served name: what `model` in a body must say
    api_keys: ApiKeys
    max_body_bytes: int
    info: ModelInfo
    vocab: TokenVocab
    loras: LoraCatalog  # the adapters a body's `model` may name besides model_name

    async def openai(self, request: Request, model: type[OpenAIBody], fmt: OpenAIFormat) -> Any:
        """The one body of /v1/completions and /v1/chat/completions."""
        received_at = time.perf_counter()
        body, tenant = await self.read_as_tenant(request, model)
        lora = self.loras.lookup(body.model)
        body.check()
        check_priority(body.priority, self.info.priority_range)
        scheduling = Scheduling(body.priority, tenant.label, tenant.weight)
        prompts, timing = await self.encode_all(body.encode_requests(self.info.max_model_len))
        self.check_fits(prompts, body)
        request_id = fmt.id_prefix + uuid.uuid4().hex
        choices = [self.choice(body, fmt, request_id, i * body.num_choices + j, encoded, j, scheduling, lora)
                   for i, encoded in enumerate(prompts) for j in range(body.num_choices)]
        gen = await self.start(request_id, choices, sum(len(e.token_ids) for e in prompts), timing, received_at)
        if body.stream:
            events = sse_events(gen, fmt, body.include_usage, body.continuous_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        return await whole(openai_body(gen, fmt), request_id)

    def check_fits(self, prompts: list[Encoded], body: OpenAIBody) -> None:
        """A request whose choices could never be admitted together under the engine's
        overload bounds is a 400 saying which, not a 429 that no retry gets past."""
        n = body.num_choices
        param = "n" if n > 1 else "messages" if isinstance(body, ChatBody) else "prompt"
        check_fits_waiting_bounds(len(prompts) * n, sum(len(e.token_ids) for e in prompts) * n,
                                  self.info.max_waiting_requests, self.info.max_waiting_tokens, param)

    def choice(self, body: OpenAIBody, fmt: OpenAIFormat, request_id: str, index: int, encoded: Encoded,
               seed_offset: int, scheduling: Scheduling, lora: LoraRequest | None = None) -> Choice:
        """Choice `index` (prompt-major: prompt i's n choices are i*n .. i*n + n - 1, as OpenAI)."""
        params = body.choice_params(encoded.max_tokens, seed_offset)
        logprobs = None if params.logprobs is None else fmt.logprobs(self.vocab, params.logprobs)
        return Choice(index, f"{request_id}-{index}", encoded.token_ids, params,
                      echo=bool(getattr(body, "echo", False)), include_stop_str=body.include_stop_str_in_output,
                      format_logprobs=logprobs, scheduling=scheduling, lora=lora)

    async def generate(self, request: Request) -> Any:
        """/generate: plain text, streamed or whole."""
        received_at = time.perf_counter()
        body, tenant = await self.read_as_tenant(request, GenerateBody)
        [encoded], timing = await self.encode_all([body.encode_request(self.info.max_model_len)])
        request_id = "gen-" + uuid.uuid4().hex
        choice = Choice(0, request_id, encoded.token_ids, body.sampling_params(encoded.max_tokens),
                        scheduling=Scheduling(tenant=tenant.label, weight=tenant.weight))
        gen = await self.start(request_id, [choice], len(encoded.token_ids), timing, received_at)
        headers = {"Server-Timing": timing.header()}
        if body.stream:
            return StreamingResponse(text_stream(gen), media_type="text/plain; charset=utf-8", headers=headers)
        return PlainTextResponse((await whole(collect(gen), request_id)).texts[0], headers=headers)

    def models(self, request: Request) -> dict:
        """The base model's card, then each adapter's (vLLM's shape: `parent` the base model)."""
        self.api_keys.check(request.headers.get("authorization"))
        info = self.info
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rayinfer",
                "root": info.name, "parent": None, "weights": info.weights, "max_model_len": info.max_model_len,
                "dtype": info.dtype, "device": info.device}
        return {"object": "list", "data": [card, *self.loras.cards(created=0)]}

    async def load_lora(self, request: Request) -> PlainTextResponse:
        """/v1/load_lora_adapter: an engine replica reads the adapter before the catalog lists
        it, so an adapter the engine refuses is a 400 naming why, never a listed name that fails."""
        self.loras.check_runtime_updating()
        body = await self.read(request, LoadLoraBody)
        lora = self.loras.resolve(body.lora_name, body.lora_path)
        try:
            await self.engine.load_lora(lora)
        except Exception as exc:
            error = as_api_error(exc)
            # The engine names the adapter in `model`, a field this body does not have.
            raise (ApiError(400, str(error), param="lora_path", code=error.code) if error.status == 400
                   else error) from exc
        self.loras.add(lora)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.name}' added successfully.")

    async def unload_lora(self, request: Request) -> PlainTextResponse:
        """/v1/unload_lora_adapter: new requests naming it get 404 at once; running ones
        finish under it (their engine replica still holds it)."""
        self.loras.check_runtime_updating()
        body = await self.read(request, UnloadLoraBody)
        name = self.loras.remove(body.lora_name).name
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def health(self) -> JSONResponse:
        try:
            status = await asyncio.wait_for(self.engine.status(), HEALTH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - unreachable or restarting: unhealthy
            error = exc if isinstance(exc, ApiError) else unavailable(f"engine unavailable: {type(exc).__name__}")
            return JSONResponse(error.body, status_code=503, headers=error.headers)
        body = {"status": "dead" if status.is_dead else "ok", "model": asdict(status.model),
                "stats": asdict(status.stats), "num_active_requests": status.num_active_requests,
                "engine_rss_bytes": status.rss_bytes}
        return JSONResponse(body, status_code=503 if status.is_dead else 200)

    async def tokenize(self, request: Request) -> dict:
        body = await self.read(request, TokenizeBody)
        ids, strs = await self.tokenizer.tokenize.remote(body.text(), bool(body.return_token_strs))
        return {"count": len(ids), "max_model_len": self.info.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: Request) -> dict:
        body = await self.read(request, DetokenizeBody)
        check_token_ids(body.tokens, self.info.vocab_size, "tokens")
        return {"prompt": await self.tokenizer.detokenize.remote(body.tokens)}

    async def tokenizer_info(self, request: Request) -> dict:
        self.api_keys.check(request.headers.get("authorization"))
        return await self.tokenizer.info.remote()

    def version(self, request: Request) -> dict:
        self.api_keys.check(request.headers.get("authorization"))
        return {"version": importlib.metadata.version("rayinfer")}

    async def metrics(self, request: Request) -> PlainTextResponse:
        self.api_keys.check(request.headers.get("authorization"))
        async with httpx.AsyncClient() as http:
            text = await prometheus.scrape(http)
        return PlainTextResponse(text, media_type=prometheus.CONTENT_TYPE)

    async def read(self, request: Request, model: type[BodyT]) -> BodyT:
        return (await self.read_as_tenant(request, model))[0]

    async def read_as_tenant(self, request: Request, model: type[BodyT]) -> tuple[BodyT, Tenant]:
        """Auth first (an unauthorized body is never read), then the size-capped body, then
        the model where the body names one (the served model or an adapter); and whose request it is."""
        key_tenant = self.api_keys.check(request.headers.get("authorization"))
        body = await read_json_body(request, model, self.max_body_bytes)
        self.loras.lookup(getattr(body, "model", None))  # a 404 for a name neither the base model nor an adapter
        return body, self.api_keys.tenant(key_tenant, getattr(body, "user", None))

    async def encode_all(self, requests: list[EncodeRequest]) -> tuple[list[Encoded], ServerTiming]:
        started = time.perf_counter()
        results = await self.encoding(requests)
        return results, ServerTiming(tokenize_ms=1000 * (time.perf_counter() - started))

    async def start(self, request_id: str, choices: list[Choice], num_prompt_tokens: int,
                    timing: ServerTiming, received_at: float) -> Generation:
        """Starts one engine request per choice and waits for the first delta, so errors
        raised before any token (the engine's own validation) become HTTP errors."""
        streams = [choice_deltas(self.engine, self.vocab, c, timing, received_at) for c in choices]
        deltas = streams[0] if len(streams) == 1 else merge(streams)
        try:
            first = await self.engine.while_up(anext(deltas))
        except Exception as exc:
            error = as_api_error(exc, request_id)
            if error.code == "engine_overloaded":
                request_metrics().record_rejected(choices[0].scheduling.tenant)
            raise error from exc
        lora = choices[0].lora  # a request's choices share one: its response names it, as vLLM's
        return Generation(request_id, self.model_name if lora is None else lora.name,
                          [len(c.prompt_token_ids) for c in choices],
                          num_prompt_tokens, prepend(first, deltas), timing)


async def whole(body: Awaitable[T], request_id: str) -> T:
    """A non-streamed body; an error after its first token is an HTTP error in OpenAI's shape
    too: an engine replica that died mid-generation a 503 with Retry-After, a request that
    failed inside a step a 500 naming request_id."""
    try:
        return await body
    except Exception as exc:
        raise as_api_error(exc, request_id) from exc
