"""The offline engine as a benchmark target: the workload run against an in-process
AsyncEngine (no HTTP, no Ray), measured the same way. It is the ceiling the
HTTP-through-Ray path is compared with, so it is measured at full speed: once the engine
has logged that its decode graph is ready (it serves on eager steps until then).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine import AsyncEngine, EngineConfig
from loadtest.client.engine_streams import measure
from loadtest.client.results import BenchResult
from loadtest.client.workload import Workload

FULL_SPEED_TIMEOUT_S = 300.0
_FULL_SPEED = "decode graph ready"  # engine/core/llm_engine.py, when steps switch to the compiled graph
_NO_GRAPH = ("did not compile", "background compile failed")  # the engine stays eager: as fast as it gets


@dataclass(frozen=True)
class OfflineTarget:
    model: str = "gpt2"
    weights: str = "random"
    dtype: str = "bfloat16"
    label: str = "offline engine"
    engine: dict = field(default_factory=dict)  # other EngineConfig fields, e.g. a served config's `engine` args


def run_offline(target: OfflineTarget, workload: Workload) -> BenchResult:
    return run_offline_all(target, [workload])[0]


def run_offline_all(target: OfflineTarget, workloads: list[Workload]) -> list[BenchResult]:
    """Each workload in turn on one engine, started once (its graph compiled once)."""
    config = EngineConfig(model=target.model, weights=target.weights, dtype=target.dtype, device="cpu",
                          **target.engine)
    with full_speed_watch() as at_full_speed:
        engine = AsyncEngine(config)
        if config.decode_compiled and not at_full_speed.wait(FULL_SPEED_TIMEOUT_S):
            print(f"{target.label}: no decode graph after {FULL_SPEED_TIMEOUT_S:.0f} s; measured as it is")
    try:
        return [asyncio.run(measure(engine.generate, target.model, target.label, w)) for w in workloads]
    finally:
        engine.shutdown()


class _FullSpeedHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(_FULL_SPEED) or any(text in message for text in _NO_GRAPH):
            self.event.set()


@contextlib.contextmanager
def full_speed_watch() -> Iterator[threading.Event]:
    """An event set when the engine's log says its steps are as fast as they will get."""
    logger, handler = logging.getLogger("engine"), _FullSpeedHandler()
    level = logger.level
    logger.setLevel(min(level or logging.INFO, logging.INFO))
    logger.addHandler(handler)
    try:
        yield handler.event
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
