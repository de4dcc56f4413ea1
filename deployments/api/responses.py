"""The OpenAI wire format's response side: choice objects, whole bodies, usage; and the
plain-text stream of /generate. Completions and chat differ only in their choice objects.
SSE framing of the streamed chunks is deployments/api/sse.py."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from deployments.api.errors import as_api_error
from deployments.api.generation import ChoiceDelta, Generation, LogprobsFormat
from deployments.api.openai_logprobs import CompletionLogprobs, chat_logprobs
from engine.request.detokenizer import TokenVocab

logger = logging.getLogger("ray.serve")


def completion_chunk_choice(delta: ChoiceDelta, is_first: bool) -> dict:
    return completion_choice(delta.index, delta.text, delta.finish_reason, delta.logprobs)


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk_choice(delta: ChoiceDelta, is_first: bool) -> dict:
    message = {"role": "assistant", "content": delta.text} if is_first else {"content": delta.text}
    return {"index": delta.index, "delta": message, "logprobs": delta.logprobs, "finish_reason": delta.finish_reason}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def completion_logprobs(vocab: TokenVocab, num_top: int) -> LogprobsFormat:
    return CompletionLogprobs(vocab, num_top).format  # one per choice: it counts text_offset


def chat_logprobs_format(vocab: TokenVocab, num_top: int) -> LogprobsFormat:
    return functools.partial(chat_logprobs, vocab, num_top)


@dataclass(frozen=True)
class OpenAIFormat:
    object: str  # of the non-stream body
    chunk_object: str
    id_prefix: str
    chunk_choice: Callable[[ChoiceDelta, bool], dict]
    choice: Callable[[int, str, str | None, dict | None], dict]
    logprobs: Callable[[TokenVocab, int], LogprobsFormat]  # a choice's logprobs formatter


COMPLETIONS = OpenAIFormat("text_completion", "text_completion", "cmpl-", completion_chunk_choice,
                           completion_choice, completion_logprobs)
CHAT = OpenAIFormat("chat.completion", "chat.completion.chunk", "chatcmpl-", chat_chunk_choice, chat_choice,
                    chat_logprobs_format)


@dataclass
class Collected:
    """Every choice's whole text, finish reason and logprobs (each delta's lists joined)."""

    texts: list[str]
    finish_reasons: list[str | None]
    logprobs: list[dict | None]
    num_tokens: int = 0

    def add(self, delta: ChoiceDelta) -> None:
        i = delta.index
        self.texts[i] += delta.text
        self.finish_reasons[i] = delta.finish_reason or self.finish_reasons[i]
        self.num_tokens += delta.num_tokens
        if delta.logprobs is not None:
            so_far = self.logprobs[i] or {key: [] for key in delta.logprobs}
            self.logprobs[i] = {key: so_far[key] + values for key, values in delta.logprobs.items()}


async def collect(gen: Generation) -> Collected:
    collected = Collected([""] * gen.n, [None] * gen.n, [None] * gen.n)
    async with contextlib.aclosing(gen.deltas):
        async for delta in gen.deltas:
            collected.add(delta)
    return collected


async def openai_body(gen: Generation, fmt: OpenAIFormat) -> dict:
    c = await collect(gen)
    choices = [fmt.choice(i, *choice) for i, choice in enumerate(zip(c.texts, c.finish_reasons, c.logprobs))]
    return {"id": gen.id, "object": fmt.object, "created": gen.created, "model": gen.model,
            "choices": choices, "usage": gen.usage(c.num_tokens), "server_timing": gen.timing.as_dict()}


async def text_stream(gen: Generation) -> AsyncIterator[str]:
    try:
        async with contextlib.aclosing(gen.deltas):
            async for delta in gen.deltas:
                if delta.text:
                    yield delta.text
    except Exception as exc:  # noqa: BLE001 - text/plain has no error channel once started
        logger.warning("generation %s failed mid-stream: %s", gen.id, as_api_error(exc, gen.id))
