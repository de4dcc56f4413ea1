"""Issue 15's goals read off peer tables: each round's figure, the median over rounds, and
in how many rounds the goal was met.

Why rounds: on the 2-core VM this project measures on, the same code's throughput moves by
a third between runs minutes apart (BENCHMARKS.md, HTTP), so one table's
ratio can meet a goal that the next misses. `python -m loadtest.peers.peer_table --rounds N`
alternates which server goes first, and this report puts every round's figure beside the
median.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loadtest.peers.peer_table import ServerRows, TableRun
    from loadtest.client.results import BenchResult


@dataclass(frozen=True)
class Goal:
    name: str
    figure: Callable[[ServerRows, ServerRows], float | None]  # (rayinfer, vLLM) -> the goal's figure
    bound: float
    at_least: bool  # met when the figure is >= bound (else <= bound)
    unit: str = "×"

    def is_met(self, figure: float) -> bool:
        return figure >= self.bound if self.at_least else figure <= self.bound

    def show(self, figure: float | None) -> str:
        if figure is None:
            return "-"
        text = f"{figure:.0%}" if self.unit == "%" else f"{figure:.2f}×"
        return f"**{text}**" if self.is_met(figure) else text

    def wording(self) -> str:
        bound = f"{self.bound:.0%}" if self.unit == "%" else f"{self.bound:.1f}×"
        return f"{self.name} {'≥' if self.at_least else '≤'} {bound}"


def ratio(value: Callable[[BenchResult], float], which: str) -> Callable[[ServerRows, ServerRows], float | None]:
    """rayinfer's value over vLLM's, of the rows' `which` run (offline, concurrent, single)."""
    def figure(ours: ServerRows, theirs: ServerRows) -> float | None:
        a, b = getattr(ours, which), getattr(theirs, which)
        if a is None or b is None or not value(b):
            return None
        return value(a) / value(b)
    return figure


GOALS = (
    Goal("offline: tok/s", ratio(lambda r: r.output_throughput, "offline"), 1.2, at_least=True),
    Goal("HTTP streams: tok/s", ratio(lambda r: r.output_throughput, "concurrent"), 1.2, at_least=True),
    Goal("HTTP streams: TTFT p50", ratio(lambda r: r.ttft_ms.p50, "concurrent"), 0.8, at_least=False),
    Goal("one stream: TPOT p50", ratio(lambda r: r.tpot_ms.p50, "single"), 0.9, at_least=False),
    Goal("one stream: TTFT p50", ratio(lambda r: r.ttft_ms.p50, "single"), 1.0, at_least=False),
    Goal("HTTP share of own offline", lambda ours, theirs: ours.http_share, 0.85, at_least=True, unit="%"),
)


def goals_table(runs: list[TableRun]) -> str:
    """One line per goal: each round's figure (bold where met), the median, rounds met."""
    head = "| goal | " + " | ".join(f"round {i + 1}" for i in range(len(runs))) + " | median | met in |"
    lines = [head, "|---" * (len(runs) + 3) + "|"]
    for goal in GOALS:
        figures = [goal.figure(run.rayinfer, run.vllm) for run in runs]
        known = [f for f in figures if f is not None]
        median = statistics.median(known) if known else None
        met = sum(goal.is_met(f) for f in known)
        cells = " | ".join(goal.show(f) for f in figures)
        lines.append(f"| {goal.wording()} | {cells} | {goal.show(median)} | {met} of {len(known)} |")
    return "\n".join(lines)
