"""The OpenAI wire protocol at the ingress: request bodies, how they are read, and errors.

Every error leaves as the OpenAI error object `{"error": {"message", "type", "param",
"code"}}` with one of these statuses (never FastAPI's 422, never a bare 500 for bad input):

    400  invalid_request_error   malformed JSON, invalid UTF-8, not an object, a bad field
                                 (param names it; None for a body that is not an object)
    401  invalid_request_error   missing or wrong API key (code invalid_api_key)
    404  invalid_request_error   no such route
    413  invalid_request_error   body over max_body_bytes (code request_too_large)
    429  rate_limit_exceeded     the engine's waiting bounds or its Serve queue are full;
                                 Retry-After says when to come back
    503  server_error            the engine crashed or a replica is being replaced; Retry-After
    500  server_error            anything else (logged, without the request's content)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from deployments.tokenizer import EncodeError
from engine import EngineDeadError, EngineOverloadedError, SamplingParams
from engine.sampling_params import MAX_STOP_STRINGS

logger = logging.getLogger("ray.serve")

MAX_N = 8
DEFAULT_MAX_BODY_BYTES = 1 << 20
_RETRY_AFTER_UNAVAILABLE_S = 1.0  # a replica restart takes seconds

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
    # torch seeds are 64-bit; seed + choice index must stay one.
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
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
                 param: str | None = None, code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code
        self.retry_after_s = retry_after_s

    @property
    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

    @property
    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


def bad_request(error: EncodeError) -> ApiError:
    return ApiError(400, error.message, param=error.param, code=error.code)


def unknown_model(name: str) -> ApiError:
    return ApiError(400, f"the model {name!r} does not exist; GET /v1/models lists the served one",
                    param="model", code="model_not_found")


def overloaded(message: str, retry_after_s: float | None, code: str) -> ApiError:
    return ApiError(429, f"server overloaded, retry later: {message}", "rate_limit_exceeded",
                    code=code, retry_after_s=retry_after_s or 1.0)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, "server_error", code="service_unavailable",
                    retry_after_s=_RETRY_AFTER_UNAVAILABLE_S)


def as_api_error(exc: BaseException) -> ApiError:
    # An error raised in another replica arrives as a RayTaskError holding it as `cause`.
    cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, ApiError):
        return cause
    if isinstance(cause, EngineOverloadedError):
        return overloaded(str(cause), cause.retry_after_s, "engine_overloaded")
    if isinstance(cause, BackPressureError):
        return overloaded("the engine's request queue is full", cause.retry_after_s, "queue_full")
    if isinstance(cause, EngineDeadError):
        return unavailable("the engine has failed and is restarting; retry shortly")
    if isinstance(cause, (RayActorError, DeploymentUnavailableError)):
        return unavailable("a replica is unavailable or restarting; retry shortly")
    if isinstance(cause, ValueError):  # the engine rejected the request (validate_request)
        return ApiError(400, str(cause))
    # The type only: a message or traceback could quote the request.
    logger.error("request failed: %s", type(cause).__name__)
    return ApiError(500, "internal error", "server_error")


def invalid_body(errors: Sequence[Any], skip: int = 0) -> ApiError:
    """400, never FastAPI's 422; `param` names the offending top-level field."""
    # Of a union's member errors, the deepest says most ("prompt.1: not an integer").
    error = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = list(error.get("loc", ()))[skip:]
    param = loc[0] if loc and isinstance(loc[0], str) else None
    # Keep list indices, drop pydantic's union-member tags ("str", "list[int]", ...).
    where = ".".join(str(part) for i, part in enumerate(loc) if i == 0 or isinstance(part, int))
    message = error["msg"] if error.get("type") != "model_type" else "the body must be a JSON object"
    return ApiError(400, f"{where}: {message}" if where else message, param=param)


# ---- reading a body ----

BodyT = TypeVar("BodyT", bound=_Body)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, or 413 once it passes max_bytes: at once from Content-Length, else (a
    chunked upload) counted as it arrives, so an oversized body is never held whole."""
    too_large = ApiError(413, f"request body exceeds {max_bytes} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, num_bytes = [], 0
    async for chunk in request.stream():
        num_bytes += len(chunk)
        if num_bytes > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json_body(request: Request, model: type[BodyT], max_bytes: int) -> BodyT:
    """Any content type (`curl -d '{...}'` sends form-urlencoded); JSON parsed strictly."""
    try:
        return model.model_validate_json(await read_body(request, max_bytes))
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from None


def documented_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra` describing its JSON body for /docs. The routes read the raw
    body (so bad JSON gets OpenAI's 400, not FastAPI's 422), which hides it from FastAPI."""
    schema = model.model_json_schema()
    schema = _inline_refs(schema, schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    """Nested models in place of `#/$defs/...` references, which would resolve against the
    OpenAPI document rather than this schema."""
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline_refs(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {key: _inline_refs(value, defs) for key, value in node.items()}
    if isinstance(node, list):
        return [_inline_refs(value, defs) for value in node]
    return node
