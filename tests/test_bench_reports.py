# Benchmark reports open with the machine they ran on (loadtest/machine.py): figures from an
# AVX2 box and an AVX-512 BF16 one, or from an emulated run, must not be read side by side
# unlabelled.
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cpu import ISA_LEVELS, cpu_features
from loadtest.machine import machine_line
from loadtest.peer_table import ServerRows, TableRun, TableWorkload, table, wave_ttft_p50
from loadtest.results import RunInfo, summarize_run
from loadtest.sse import StreamRecord
from loadtest.workload import Workload

ROOT = Path(__file__).resolve().parents[1]


def test_the_peer_table_opens_with_the_cpu_kind_the_dtype_and_the_times() -> None:
    run = TableRun(TableWorkload(), ServerRows(), ServerRows(), {}, "float32",
                   machine_line("2026-11-26 10:00:00", "2026-11-26 10:05:00"))
    first = table(run).splitlines()[0]
    assert first.startswith(f"Machine: {cpu_features().machine} {cpu_features().isa} ")
    assert f"{os.cpu_count()} CPUs" in first
    assert "2026-11-26 10:00:00 to 2026-11-26 10:05:00 UTC" in first
    assert first.endswith("dtype float32")


def test_an_emulated_avx2_run_says_avx2_not_the_hardware_it_ran_on() -> None:
    env = {**os.environ, "RAYINFER_CPU_ISA": "avx2"}
    line = subprocess.run([sys.executable, "-c", "from loadtest.machine import machine_line; print(machine_line('a', 'b'))"],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    capped = ISA_LEVELS[min(ISA_LEVELS.index(cpu_features().isa), ISA_LEVELS.index("avx2"))]
    assert line.startswith(f"Machine: {cpu_features().machine} {capped} ")


def test_the_peer_table_splits_the_streams_ttft_into_the_first_wave_and_the_rest() -> None:
    # 2 streams, 4 requests: the first two sent together, the next two as each stream ended
    # (TTFTs 100, 300 | 50, 70 ms); a failed request counts in neither.
    records = [StreamRecord(start=t, first_content_at=t + ttft, end=t + 1.0, usage_tokens=4)
               for t, ttft in ((0.0, 0.1), (0.001, 0.3), (1.0, 0.05), (1.3, 0.07))]
    records.append(StreamRecord(start=1.4, error="overloaded"))
    result = summarize_run(RunInfo("rayinfer", "http://x"), Workload(num_requests=5, concurrency=2), records, 3.0)
    assert wave_ttft_p50(result, 2, later=False) == pytest.approx(200.0)
    assert wave_ttft_p50(result, 2, later=True) == pytest.approx(60.0)
    run = TableRun(TableWorkload(streams=2), ServerRows(concurrent=result), ServerRows(), {}, "bfloat16", "Machine: x")
    rows = table(run).splitlines()
    assert "| HTTP, 2 streams: TTFT p50 of the first 2 requests (ms) | 200.0 | - | - |" in rows
    assert "| HTTP, 2 streams: TTFT p50 of those sent as a stream ended (ms) | 60.0 | - | - |" in rows
