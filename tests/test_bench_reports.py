# Benchmark reports open with the machine they ran on (loadtest/client/machine.py): figures from an
# AVX2 box and an AVX-512 BF16 one, or from an emulated run, must not be read side by side
# unlabelled.
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from engine.kernels.cpu import ISA_LEVELS, cpu_features
from loadtest.client.machine import machine_line
from bench.peers.ratios import ratios_table
from bench.peers.peer_table import ServerRows, TableRun, TableWorkload, table, wave_ttft_p50
from loadtest.client.results import RunInfo, Summary, summarize_run
from loadtest.client.sse_reader import StreamRecord
from loadtest.client.workload import Workload

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
    line = subprocess.run([sys.executable, "-c", "from loadtest.client.machine import machine_line; print(machine_line('a', 'b'))"],
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


def test_the_peer_table_says_what_ttft_the_http_path_adds_to_the_offline_engines() -> None:
    rows = rows_with(900.0, 800.0, 300.0, 16.0, 47.5)
    rows.offline_single = replace(rows.single, ttft_ms=Summary(15.0, 15.0, 15.0, 15.0))
    lines = table(TableRun(TableWorkload(), rows, ServerRows(), {}, "bfloat16", "Machine: x")).splitlines()
    assert "| offline, one stream at a time: TTFT p50 (ms) | 15.0 | - | - |" in lines
    assert "| one stream: TTFT HTTP adds to offline's (ms) | 32.5 | - | |" in lines
    assert "| HTTP share of its own offline | 89% | - | |" in lines


def rows_with(offline_tps: float, streams_tps: float, streams_ttft: float, tpot: float, ttft: float) -> ServerRows:
    """ServerRows whose results carry just the figures the ratios read."""
    base = summarize_run(RunInfo("x", "http://x"), Workload(num_requests=1, concurrency=1),
                         [StreamRecord(start=0.0, first_content_at=0.1, end=1.0, usage_tokens=4)], 1.0)
    summary = lambda p50: Summary(p50, p50, p50, p50)  # noqa: E731
    return ServerRows(offline=replace(base, output_throughput=offline_tps),
                      concurrent=replace(base, output_throughput=streams_tps, ttft_ms=summary(streams_ttft)),
                      single=replace(base, tpot_ms=summary(tpot), ttft_ms=summary(ttft)))


def test_the_ratios_table_shows_each_rounds_ratio_and_the_median() -> None:
    theirs = rows_with(600.0, 500.0, 400.0, 16.0, 30.0)
    rounds = [rows_with(780.0, 650.0, 300.0, 16.0, 36.0),   # offline 1.30, streams 1.30, TTFT 0.75, TPOT 1.00, TTFT 1.20
              rows_with(660.0, 550.0, 480.0, 13.6, 27.0),   # 1.10, 1.10, 1.20, 0.85, 0.90
              rows_with(840.0, 700.0, 360.0, 14.0, 33.0)]   # 1.40, 1.40, 0.90, 0.875, 1.10
    runs = [TableRun(TableWorkload(), ours, theirs, {}, "bfloat16", "Machine: x") for ours in rounds]
    lines = ratios_table(runs).splitlines()
    assert lines[0] == "| rayinfer / vLLM | round 1 | round 2 | round 3 | median |"
    assert "| offline: tok/s | 1.30× | 1.10× | 1.40× | 1.30× |" in lines
    assert "| HTTP streams: TTFT p50 | 0.75× | 1.20× | 0.90× | 0.90× |" in lines
    assert "| one stream: TPOT p50 | 1.00× | 0.85× | 0.88× | 0.88× |" in lines
    assert "| one stream: TTFT p50 | 1.20× | 0.90× | 1.10× | 1.10× |" in lines
    # the share is rayinfer's HTTP over its own offline: 650/780, 550/660, 700/840 = 83% each
    assert "| rayinfer's HTTP share of its own offline | 83% | 83% | 83% | 83% |" in lines


def test_a_ratio_without_the_peers_figures_is_left_blank() -> None:
    ours = rows_with(780.0, 650.0, 300.0, 16.0, 36.0)
    run = TableRun(TableWorkload(), ours, ServerRows(), {}, "bfloat16", "Machine: x")
    assert "| offline: tok/s | - | - |" in ratios_table([run]).splitlines()
