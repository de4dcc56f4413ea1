"""Server-sent events: a generation's deltas as OpenAI's streamed chunks, `data: {...}`
frames ending `data: [DONE]`; an error after the stream has started is a final error event."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from deployments.api.errors import as_api_error
from deployments.api.generation import Generation
from deployments.api.responses import OpenAIFormat


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def sse_events(gen: Generation, fmt: OpenAIFormat, include_usage: bool,
                     continuous_usage: bool = False) -> AsyncIterator[str]:
    """With continuous_usage (vLLM's continuous_usage_stats), each chunk also carries its
    choice's usage so far: its prompt's tokens and the choice's completion tokens."""
    def chunk(choices: list[dict], **extra: Any) -> dict:
        usage = {"usage": None} if include_usage else {}
        return {"id": gen.id, "object": fmt.chunk_object, "created": gen.created, "model": gen.model,
                "choices": choices, **usage, **extra}

    num_tokens, num_finished, started = 0, 0, set()
    choice_tokens = [0] * gen.n
    try:
        async with contextlib.aclosing(gen.deltas):
            async for delta in gen.deltas:
                num_tokens += delta.num_tokens
                choice_tokens[delta.index] += delta.num_tokens
                num_finished += delta.finish_reason is not None
                if not delta.text and delta.finish_reason is None and delta.index in started and not any(
                        (delta.logprobs or {}).values()):
                    continue
                is_last = num_finished == gen.n and not include_usage
                extra = {"server_timing": gen.timing.as_dict()} if is_last else {}
                if continuous_usage:
                    extra["usage"] = gen.usage(choice_tokens[delta.index], gen.choice_prompt_tokens[delta.index])
                yield sse(chunk([fmt.chunk_choice(delta, delta.index not in started)], **extra))
                started.add(delta.index)
        if include_usage:
            yield sse(chunk([], usage=gen.usage(num_tokens), server_timing=gen.timing.as_dict()))
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
        yield sse(as_api_error(exc, gen.id).body)
    yield sse("[DONE]")
