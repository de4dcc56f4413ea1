"""A compile on a thread of its own while the engine serves: the replica answers on the eager
path from its first second, and its step loop takes the compiled graph at a step boundary
once the thread has it (LLMEngine's compile_in_background).

Torch threads: torch.set_num_threads sets the OpenMP thread count of the calling thread
only (engine/core/step_threads.py), so the step loop's one-thread steps and this thread's count,
the engine's (for inductor's heuristics and the warm-up calls), don't meet. A new thread
starts at the count most recently set by any thread, the engine's when the engine starts
this one before its first step; it is set only where it differs, as a set also clears
ATen's oneDNN cache under the step loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from engine.model.progress import progress

logger = logging.getLogger(__name__)

T = TypeVar("T")


class BackgroundCompile(Generic[T]):
    def __init__(self, compile_now: Callable[[], T], threads: int, what: str,
                 on_done: Callable[[], None] | None = None):
        """Start compile_now() on a daemon thread at `threads` torch threads; `what` names it
        in the log; on_done is called on that thread when it ends (to wake a sleeping loop)."""
        self.what = what
        self.started = time.monotonic()
        self._result: T | None = None
        self._done = threading.Event()
        self._on_done = on_done
        self._thread = threading.Thread(target=self._run, args=(compile_now, threads), name="rayinfer-compile",
                                        daemon=True)
        self._thread.start()

    def take(self) -> T | None:
        """The result, once, after the compile ends: None before it does, after it was taken,
        and where compile_now raised (logged on the thread)."""
        if not self._done.is_set():
            return None
        result, self._result = self._result, None
        return result

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the compile ends (True) or timeout_s passes (False)."""
        return self._done.wait(timeout_s)

    @property
    def is_done(self) -> bool:
        return self._done.is_set()

    def _run(self, compile_now: Callable[[], T], threads: int) -> None:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        try:
            with progress(f"compiling {self.what} in the background, steps run eagerly meanwhile"):
                self._result = compile_now()
        except Exception:  # noqa: BLE001 - the engine keeps serving eagerly; say why
            logger.exception("%s: the background compile failed; steps stay eager", self.what)
        finally:
            self._done.set()
            if self._on_done is not None:
                self._on_done()
