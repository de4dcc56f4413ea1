"""The step loop's inbox: messages from any thread, and the event the loop sleeps on."""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.frontend.messages import InMessage


class Inbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._messages: list[InMessage] = []
        self._is_stopping = False

    def put(self, message: InMessage) -> None:
        with self._lock:
            self._messages.append(message)
            self._wake.set()

    def stop(self) -> None:
        with self._lock:
            self._is_stopping = True
            self._wake.set()

    def wait(self, timeout_s: float | None) -> bool:
        """Sleep until a put or stop (True), or until timeout_s passes (False)."""
        return self._wake.wait(timeout_s)

    def take(self, has_work: Callable[[], bool]) -> list[InMessage] | None:
        """Every message put since the last take; None once stopped. With no message and no
        work, the next wait sleeps: the wake flag is cleared under the lock, so a concurrent
        put sets it again after."""
        with self._lock:
            messages, self._messages = self._messages, []
            if self._is_stopping:
                return None
            if not messages and not has_work():
                self._wake.clear()
            return messages
