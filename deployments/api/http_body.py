"""Reading a request's JSON body: size-capped, strictly parsed (a key given twice in an
object is a 400), errors in OpenAI's shape; and how the routes still describe their bodies
in /docs."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from deployments.api.errors import ApiError, invalid_body

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
    raw = await read_body(request, max_bytes)
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from None
    check_no_duplicate_keys(raw)
    return body


def check_no_duplicate_keys(raw: bytes) -> None:
    """A 400 naming the field where an object repeats a key. JSON leaves a repeated key's
    meaning open and parsers differ (pydantic's keeps the last value, others the first), so
    a proxy that checked one value could pass the other on: refused, never guessed. Called
    once pydantic has parsed the body, so `raw` is a JSON object."""
    repeats = _Repeats()
    try:
        body = json.loads(raw, object_pairs_hook=repeats)
    except ValueError:  # what pydantic's parser took and Python's does not: nothing to compare
        return
    if repeats.found is None:
        return
    key, obj = repeats.found
    if obj is body:
        raise ApiError(400, f"{key}: given more than once", param=key)
    field = next(name for name, value in body.items() if _holds(value, obj))
    raise ApiError(400, f"{field}: an object in it repeats a key", param=field)


class _Repeats:
    """json.loads' object_pairs_hook: each object as a dict, noting the first that repeats a key."""

    def __init__(self) -> None:
        self.found: tuple[str, dict] | None = None

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) < len(pairs) and self.found is None:
            self.found = (_first_repeat(pairs), obj)
        return obj


def _first_repeat(pairs: list[tuple[str, Any]]) -> str:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            return key
        seen.add(key)
    raise AssertionError("no key repeats")


def _holds(value: Any, obj: dict) -> bool:
    if value is obj:
        return True
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return any(_holds(child, obj) for child in children)


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
