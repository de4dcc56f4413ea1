"""The API's one failure policy. Every failure leaves the ingress as OpenAI's error object
`{"error": {"message", "type", "param", "code"}}` with one of these statuses (never FastAPI's
422, never a bare 500):

    400  invalid_request_error   a request error: malformed JSON, invalid UTF-8, not an object, a bad
                                 field (param names it; None for a body that is not an object). Only
                                 the errors raised for bad input: the protocol's validation, ApiError,
                                 InvalidRequestError; an arbitrary ValueError is internal (500)
    401  invalid_request_error   missing or wrong API key (code invalid_api_key)
    404  invalid_request_error   not found: no such route; a model this server does not serve (param
                                 model, code model_not_found, as OpenAI's)
    413  invalid_request_error   body over max_body_bytes (code request_too_large)
    429  rate_limit_exceeded     overload: the engine's waiting bounds or its Serve queue are full;
                                 Retry-After says when to come back
    503  server_error            unavailable: the engine crashed, or an engine or tokenizer replica is
                                 down or being replaced; Retry-After
    500  server_error            internal: anything else, a request that failed inside an engine step
                                 (RequestFailedError: it alone, the engine serves on) included. The
                                 message says only "internal error" and the request id; the log has
                                 the error's type under that id, never the request's content

Before a response has started these are its status and body (the routes raise them, and
`ErrorPolicy` catches what a route did not); once a stream has started, its last SSE event
carries the same error object before `[DONE]` (deployments/api/sse.py).

Numbers at the edges of JSON, each a 400 on purpose (the ranges: engine/request/sampling_limits.py):
- NaN, Infinity and -Infinity parse (as Python's json reads them), and every numeric field
  refuses them: param names the field.
- An integer past its field's range, int64's included, names the field; one of more than
  4300 digits is past what the parser reads ("number out of range"), param null.
- A key given twice in one object names the top-level field it is in (http_body.py).
- logit_bias keys are ASCII decimal token ids; "²", "①", "07", "-1" name logit_bias.
- A request that can never be admitted under the engine's overload bounds (prompts x n past
  max_waiting_requests, their tokens past max_waiting_tokens) names prompt, messages or n.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from deployments.api.encoding import EncodeError
from engine import EngineDeadError, EngineOverloadedError
from engine.request.invalid_request import InvalidRequestError

logger = logging.getLogger("ray.serve")

_RETRY_AFTER_UNAVAILABLE_S = 1.0  # a replica restart takes seconds


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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def bad_request(error: EncodeError) -> ApiError:
    return ApiError(400, error.message, param=error.param, code=error.code)


def unknown_model(name: str) -> ApiError:
    return ApiError(404, f"the model {name!r} does not exist; GET /v1/models lists the served one",
                    param="model", code="model_not_found")


def overloaded(message: str, retry_after_s: float | None, code: str) -> ApiError:
    return ApiError(429, f"server overloaded, retry later: {message}", "rate_limit_exceeded",
                    code=code, retry_after_s=retry_after_s or 1.0)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, "server_error", code="service_unavailable",
                    retry_after_s=_RETRY_AFTER_UNAVAILABLE_S)


def as_api_error(exc: BaseException, request_id: str | None = None) -> ApiError:
    """The error in OpenAI's shape, by the policy above; an internal one is logged by its type
    and request_id (one is made where the request has none yet)."""
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
    if isinstance(cause, InvalidRequestError):  # the engine rejected the request (request_rules.py)
        return ApiError(400, str(cause), param=cause.param, code=cause.code)
    return internal(cause, request_id or f"req-{uuid.uuid4().hex}")


def internal(error: BaseException, request_id: str) -> ApiError:
    # The type only: a message or traceback could quote the request.
    logger.error("request %s failed: %s", request_id, type(error).__name__)
    return ApiError(500, f"internal error (request id {request_id})", "server_error")


class ErrorPolicy:
    """Whatever a route raised that no handler turned into a response, as the policy says
    (a tokenizer replica that is down: 503; anything unexpected: 500), not Starlette's bare
    500 and traceback. Pure ASGI, so streams pass through untouched; an error after a
    response has started is the stream's own to report (deployments/api/sse.py)."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_and_note_start(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_start)
        except Exception as exc:  # noqa: BLE001 - every failure leaves in OpenAI's shape
            if started:
                raise
            await as_api_error(exc).response()(scope, receive, send)


_MESSAGES = {
    "model_type": "the body must be a JSON object",
    "extra_forbidden": "unknown field: docs/api.md's field table lists every field rayinfer takes",
    # the bodies' one pattern: token ids as logit_bias's keys (deployments/api/protocol.py, TokenIdKey)
    "string_pattern_mismatch": 'keys must be token ids: ASCII decimal digits, no sign or leading zero (e.g. "50256")',
}


def invalid_body(errors: Sequence[Any], skip: int = 0) -> ApiError:
    """400, never FastAPI's 422; `param` names the offending top-level field."""
    # Of a union's member errors, the deepest says most ("prompt.1: not an integer").
    error = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = list(error.get("loc", ()))[skip:]
    param = loc[0] if loc and isinstance(loc[0], str) else None
    # Keep field names and list indices, drop pydantic's union-member tags ("str", "list[int]", ...).
    where = ".".join(str(part) for i, part in enumerate(loc) if i == 0 or _is_path_part(part))
    message = _MESSAGES.get(error.get("type"), error["msg"])
    return ApiError(400, f"{where}: {message}" if where else message, param=param)


def _is_path_part(part: Any) -> bool:
    return isinstance(part, int) or (str(part).isidentifier() and part not in _TYPE_TAGS)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
