"""Reading a request's JSON body: size-capped, strictly parsed, errors in OpenAI's shape;
and how the routes still describe their bodies in /docs."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from deployments.errors import ApiError, invalid_body

DEFAULT_MAX_BODY_BYTES = 1 << 20

BodyT = TypeVar("BodyT", bound=BaseModel)


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
