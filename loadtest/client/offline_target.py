"""The offline engine as a benchmark target: the workload run against an in-process
AsyncEngine (no HTTP, no Ray), measured the same way. It is the ceiling the
HTTP-through-Ray path is compared with.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine import AsyncEngine, EngineConfig
from loadtest.client.engine_streams import measure
from loadtest.client.results import BenchResult
from loadtest.client.workload import Workload


@dataclass(frozen=True)
class OfflineTarget:
    model: str = "gpt2"
    weights: str = "random"
    dtype: str = "bfloat16"
    label: str = "offline engine"
    engine: dict = field(default_factory=dict)  # other EngineConfig fields, e.g. a served config's `engine` args


def run_offline(target: OfflineTarget, workload: Workload) -> BenchResult:
    engine = AsyncEngine(EngineConfig(model=target.model, weights=target.weights, dtype=target.dtype, device="cpu",
                                       **target.engine))
    try:
        return asyncio.run(measure(engine.generate, target.model, target.label, workload))
    finally:
        engine.shutdown()
