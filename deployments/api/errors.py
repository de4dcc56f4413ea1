"""Errors in OpenAI's shape: every failure leaves the ingress as the error object
`{"error": {"message", "type", "param", "code"}}` with one of these statuses (never
FastAPI's 422, never a bare 500 for bad input):

    400  invalid_request_error   malformed JSON, invalid UTF-8, not an object, a bad field
                                 (param names it; None for a body that is not an object)
    401  invalid_request_error   missing or wrong API key (code invalid_api_key)
    404  invalid_request_error   no such route
    413  invalid_request_error   body over max_body_bytes (code request_too_large)
    429  rate_limit_exceeded     the engine's waiting bounds or its Serve queue are full;
                                 Retry-After says when to come back
    503  server_error            the engine crashed or a replica is being replaced; Retry-After
    500  server_error            anything else (logged by type and request id, never content)

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
from collections.abc import Sequence
from typing import Any

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


def as_api_error(exc: BaseException, request_id: str | None = None) -> ApiError:
    """The error in OpenAI's shape; an unexpected one is logged by its type and request_id."""
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
    if isinstance(cause, ValueError):
        return ApiError(400, str(cause))
    # The type only: a message or traceback could quote the request.
    logger.error("request %s failed: %s", request_id or "(before its id)", type(cause).__name__)
    return ApiError(500, "internal error", "server_error")


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
