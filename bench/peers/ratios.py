"""rayinfer's figures over vLLM's, read off peer tables: each round's ratio and the median
over rounds.

Why rounds: on the 2-core VM this project measures on, the same code's throughput moves by
a third between runs minutes apart (BENCHMARKS.md, HTTP), so one table's ratio says little
alone. `python -m bench.peers.peer_table --rounds N` alternates which server goes first, and
this report puts every round's ratio beside the median.

A run here is anything with `rayinfer` and `vllm` rows (peer_table.TableRun), and rows
anything with `offline`, `concurrent` and `single` results and an `http_share`
(peer_table.ServerRows): this module imports neither.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Rows = Any  # peer_table.ServerRows


@dataclass(frozen=True)
class Ratio:
    name: str
    figure: Callable[[Rows, Rows], float | None]  # (rayinfer's rows, vLLM's) -> the figure
    unit: str = "×"

    def show(self, figure: float | None) -> str:
        if figure is None:
            return "-"
        return f"{figure:.0%}" if self.unit == "%" else f"{figure:.2f}×"


def ratio(value: Callable[[Any], float], which: str) -> Callable[[Rows, Rows], float | None]:
    """rayinfer's value over vLLM's, of the rows' `which` run (offline, concurrent, single)."""
    def figure(ours: Rows, theirs: Rows) -> float | None:
        a, b = getattr(ours, which), getattr(theirs, which)
        if a is None or b is None or not value(b):
            return None
        return value(a) / value(b)
    return figure


RATIOS = (
    Ratio("offline: tok/s", ratio(lambda r: r.output_throughput, "offline")),
    Ratio("HTTP streams: tok/s", ratio(lambda r: r.output_throughput, "concurrent")),
    Ratio("HTTP streams: TTFT p50", ratio(lambda r: r.ttft_ms.p50, "concurrent")),
    Ratio("one stream: TPOT p50", ratio(lambda r: r.tpot_ms.p50, "single")),
    Ratio("one stream: TTFT p50", ratio(lambda r: r.ttft_ms.p50, "single")),
    Ratio("rayinfer's HTTP share of its own offline", lambda ours, theirs: ours.http_share, unit="%"),
)


def ratios_table(runs: Sequence[Any]) -> str:
    """One line per ratio: each round's figure and the median of those known."""
    head = "| rayinfer / vLLM | " + " | ".join(f"round {i + 1}" for i in range(len(runs))) + " | median |"
    lines = [head, "|---" * (len(runs) + 2) + "|"]
    for item in RATIOS:
        figures = [item.figure(run.rayinfer, run.vllm) for run in runs]
        known = [f for f in figures if f is not None]
        median = statistics.median(known) if known else None
        lines.append(f"| {item.name} | {' | '.join(item.show(f) for f in figures)} | {item.show(median)} |")
    return "\n".join(lines)
