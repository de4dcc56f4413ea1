"""Results as markdown tables: side by side, a concurrency sweep, rounds of --repeats."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median

from loadtest.client.results import BenchResult, Summary

_ROWS: list[tuple[str, str]] = [
    ("requests ok / failed", "counts"),
    ("duration (s)", "duration_s"),
    ("request throughput (req/s)", "request_throughput"),
    ("output throughput (tok/s)", "output_throughput"),
    ("mean output tokens / request", "mean_output_tokens"),
    ("TTFT p50 / p95 / p99 (ms)", "ttft_ms"),
    ("server tokenize p50 (ms)", "server:tokenize"),
    ("server queue wait p50 (ms)", "server:queue_wait"),
    ("server prefill p50 (ms)", "server:prefill"),
    ("server TTFT p50 (ms)", "server:ttft"),
    ("TPOT p50 / p95 / p99 (ms)", "tpot_ms"),
    ("ITL p50 / p95 / p99 (ms)", "itl_ms"),
    ("E2E p50 / p95 / p99 (ms)", "e2e_ms"),
]


def side_by_side_table(results: Sequence[BenchResult]) -> str:
    """Markdown: one row per metric, one column per server."""
    lines = [_row(["metric", *(r.label for r in results)]), "|---" * (len(results) + 1) + "|"]
    lines += [_row([name, *(_cell(r, key) for r in results)]) for name, key in _ROWS]
    return "\n".join(lines)


_SWEEP_COLUMNS = [
    "concurrency", "server", "ok / failed", "req/s", "tok/s",
    "TTFT p50 / p95 / p99 (ms)", "TPOT p50 (ms)", "ITL p50 (ms)", "E2E p50 (ms)",
]  # fmt: skip


def sweep_table(results: Sequence[BenchResult]) -> str:
    """Markdown: one row per (concurrency, server)."""
    lines = [_row(_SWEEP_COLUMNS), "|---" * len(_SWEEP_COLUMNS) + "|"]
    for r in results:
        rates = [f"{r.request_throughput:.2f}", f"{r.output_throughput:.1f}"]
        latencies = [_cell(r, "ttft_ms"), _ms(r.tpot_ms.p50), _ms(r.itl_ms.p50), _ms(r.e2e_ms.p50)]
        lines.append(_row([str(r.concurrency), r.label, _cell(r, "counts"), *rates, *latencies]))
    return "\n".join(lines)


def repeats_table(results: Sequence[BenchResult]) -> str:
    """Markdown: one row per round with each server's throughput and TTFT p50, then the
    medians; with two or more servers, the first's throughput as a share of the last's."""
    labels = list(dict.fromkeys(r.label for r in results))
    rounds = [[r for r in results if r.round == n] for n in sorted({r.round for r in results})]
    ratio = f"{labels[0]} / {labels[-1]}" if len(labels) > 1 else None
    header = ["round", *(f"{label}: tok/s, TTFT p50 (ms)" for label in labels), *([ratio] if ratio else [])]
    lines = [_row(header), "|---" * len(header) + "|"]
    for number, row in enumerate(rounds, start=1):
        share = [f"{_share(row):.0%}"] if ratio else []
        lines.append(_row([str(number), *(f"{r.output_throughput:.1f}, {_ms(r.ttft_ms.p50)}" for r in row), *share]))
    columns = [[row[i] for row in rounds] for i in range(len(labels))]
    medians = [f"**{median(r.output_throughput for r in column):.1f}**, "
               f"{_ms(median(r.ttft_ms.p50 or 0.0 for r in column))}" for column in columns]
    share = [f"**{median(_share(row) for row in rounds):.0%}**"] if ratio else []
    lines.append(_row(["median", *medians, *share]))
    return "\n".join(lines)


def _share(row: Sequence[BenchResult]) -> float:
    return row[0].output_throughput / row[-1].output_throughput if row[-1].output_throughput else 0.0


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _cell(result: BenchResult, key: str) -> str:
    if key == "counts":
        return f"{result.successes} / {result.failures}"
    if key.startswith("server:"):
        return _ms(result.server_timing_ms[key.removeprefix("server:")].p50)
    value = getattr(result, key)
    if isinstance(value, Summary):
        return " / ".join(_ms(v) for v in (value.p50, value.p95, value.p99))
    return f"{value:.2f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
