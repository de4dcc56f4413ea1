"""The OpenAI wire format's response side: choice objects, whole bodies, usage; and the
plain-text stream of /generate. Completions and chat differ only in their choice objects.
SSE framing of the streamed chunks is deployments/sse.py."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from deployments.errors import as_api_error
from deployments.generation import ChoiceDelta, Generation

logger = logging.getLogger("ray.serve")


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
