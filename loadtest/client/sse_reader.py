"""Server-sent events read as the bytes arrive, and the OpenAI streaming chunks they carry.

Shared by bench.py (httpx) and locustfile.py (requests under gevent), so it imports
neither.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

Api = Literal["completions", "chat"]

SERVER_TIMING_KEYS = ("tokenize_ms", "queue_wait_ms", "prefill_ms", "ttft_ms")


class SSEParser:
    """Feed it bytes split anywhere; it returns the `data` of each event completed so far.

    Events end at a blank line (LF or CRLF); several `data:` lines in one event are joined
    with a newline; comments (lines starting with ':') and other fields are skipped.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            end = self._buffer.find(b"\n")
            if end < 0:
                return events
            line = self._buffer[:end].rstrip(b"\r").decode("utf-8", "replace")
            self._buffer = self._buffer[end + 1 :]
            event = self._take_line(line)
            if event is not None:
                events.append(event)

    def flush(self) -> list[str]:
        """Events left open when the stream ends without a final blank line."""
        return self.feed(b"\n\n")

    def _take_line(self, line: str) -> str | None:
        if not line:
            event, self._data = self._data, []
            return "\n".join(event) if event else None
        if line.startswith("data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


@dataclass
class StreamChunk:
    """What one SSE event of an OpenAI stream says."""

    text: str = ""
    is_done: bool = False
    error: str | None = None
    usage: dict[str, Any] | None = None
    server_timing: dict[str, float] = field(default_factory=dict)


def parse_chunk(data: str, api: Api = "completions") -> StreamChunk:
    if data.strip() == "[DONE]":
        return StreamChunk(is_done=True)
    try:
        payload = json.loads(data)
    except json.JSONDecodeError:
        return StreamChunk(error=f"malformed SSE data: {data[:200]!r}")
    if not isinstance(payload, dict):
        return StreamChunk(error=f"unexpected SSE data: {data[:200]!r}")
    if payload.get("error") is not None:
        return StreamChunk(error=_error_message(payload["error"]))
    usage = payload.get("usage") or None
    return StreamChunk(text=_text(payload, api), usage=usage, server_timing=_server_timing(payload, usage))


def _text(payload: dict[str, Any], api: Api) -> str:
    choices = payload.get("choices") or []
    if not choices:
        return ""
    if api == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def _server_timing(payload: dict[str, Any], usage: dict[str, Any] | None) -> dict[str, float]:
    timing = payload.get("server_timing") or (usage or {}).get("server_timing") or {}
    return {key: float(timing[key]) for key in SERVER_TIMING_KEYS if timing.get(key) is not None}


def _error_message(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


@dataclass
class StreamRecord:
    """One streamed response as the client saw it: when content arrived, how many tokens,
    what the server said about its own timing, and whether it reported an error.

    Times are `time.perf_counter()` seconds; `start` is when the request was sent.
    """

    start: float
    api: Api = "completions"
    first_content_at: float | None = None
    last_content_at: float | None = None
    end: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_content_chunks: int = 0
    usage_tokens: int | None = None
    server_timing: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    def add_event(self, data: str, now: float) -> None:
        chunk = parse_chunk(data, self.api)
        if chunk.error is not None and self.error is None:
            self.error = chunk.error
        if chunk.usage is not None and chunk.usage.get("completion_tokens") is not None:
            self.usage_tokens = int(chunk.usage["completion_tokens"])
        self.server_timing.update(chunk.server_timing)
        if chunk.text:
            self.add_content(now)

    def add_content(self, now: float) -> None:
        if self.last_content_at is None:
            self.first_content_at = now
        else:
            self.itl_s.append(now - self.last_content_at)
        self.last_content_at = now
        self.num_content_chunks += 1

    def fail(self, error: str) -> None:
        self.error = self.error or error

    @property
    def is_ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.num_content_chunks

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_content_at is None else self.first_content_at - self.start

    @property
    def e2e_s(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None with fewer than two tokens."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)
