"""Progress lines for the slow steps of an engine's start: a step that runs past a couple of
seconds says what it is doing, and keeps saying how long it has taken until it ends, so a
log read during a slow start shows where the time goes."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)

QUIET_S = 2.0  # a step this short logs nothing
EVERY_S = 10.0  # then a line this often while it runs


@contextlib.contextmanager
def progress(doing: str, quiet_s: float = QUIET_S, every_s: float = EVERY_S) -> Iterator[None]:
    """Run the block; past quiet_s, log "<doing> (N s so far)" every every_s and, at the end,
    "<doing>: done in N s". A timer thread of its own writes the lines, ended with the block."""
    start, finished = time.monotonic(), threading.Event()

    def report() -> None:
        wait_s = quiet_s
        while not finished.wait(wait_s):
            logger.info("start-up: %s (%.0f s so far)", doing, time.monotonic() - start)
            wait_s = every_s

    reporter = threading.Thread(target=report, name="rayinfer-progress", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        finished.set()
        reporter.join()
        elapsed = time.monotonic() - start
        if elapsed > quiet_s:
            logger.info("start-up: %s: done in %.1f s", doing, elapsed)
