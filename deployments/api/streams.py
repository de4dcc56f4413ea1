"""Async-stream plumbing: put a first item back in front of a stream, merge several."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    async with contextlib.aclosing(rest):
        yield first
        async for item in rest:
            yield item


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Interleave the streams' items as they arrive; leaving early cancels them all."""
    queue: asyncio.Queue[T | BaseException | None] = asyncio.Queue()
    tasks = [asyncio.create_task(pump(stream, queue)) for stream in streams]
    try:
        num_running = len(tasks)
        while num_running:
            item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def pump(stream: AsyncIterator[T], queue: asyncio.Queue[T | BaseException | None]) -> None:
    """Every item of `stream` into `queue`, then None; an error goes in as the last item."""
    try:
        async for item in stream:
            queue.put_nowait(item)
        queue.put_nowait(None)
    except Exception as exc:  # noqa: BLE001 - handed to the consumer
        queue.put_nowait(exc)
