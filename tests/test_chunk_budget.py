"""The engine's chunk budget: `auto` from the CPUs the replica's process may run on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployments.app import AppArgs
from deployments.routing.chunk_budget import CHUNKS_PER_S_PER_CPU, resolve

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_the_budget_is_auto_a_positive_rate_or_none() -> None:
    assert AppArgs().max_chunks_per_s == "auto"
    assert AppArgs(max_chunks_per_s=120).max_chunks_per_s == 120
    assert AppArgs(max_chunks_per_s=None).max_chunks_per_s is None
    for bad in (0, -5, "fast"):
        with pytest.raises(ValueError, match="max_chunks_per_s"):
            AppArgs(max_chunks_per_s=bad)


def test_auto_is_a_rate_per_cpu_of_the_process_and_a_number_stays_as_given() -> None:
    assert resolve("auto") == CHUNKS_PER_S_PER_CPU * len(os.sched_getaffinity(0))
    assert resolve(120.0) == 120.0
    assert resolve(None) is None


def test_auto_follows_the_cpus_a_container_or_taskset_gives_the_process() -> None:
    cpu = min(os.sched_getaffinity(0))
    code = (f"import os; os.sched_setaffinity(0, {{{cpu}}}); "
            "from deployments.routing.chunk_budget import resolve; print(resolve('auto'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert float(out.stdout) == CHUNKS_PER_S_PER_CPU


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_streams_on_the_auto_budget(path: Path) -> None:
    for application in yaml.safe_load(path.read_text())["applications"]:
        assert AppArgs.model_validate(application["args"]).max_chunks_per_s == "auto"
