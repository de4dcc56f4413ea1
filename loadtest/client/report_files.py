"""Results written to disk: bench.json (workload and every result), bench.md (the table)
and, for a sweep, sweep.png (throughput and TTFT against concurrency)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from loadtest.client.results import BenchResult
from loadtest.client.workload import Workload


def write_outputs(out: Path, workload: Workload, results: Sequence[BenchResult], table: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    document = {"workload": asdict(workload), "results": [asdict(r) for r in results]}
    (out / "bench.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    (out / "bench.md").write_text(table + "\n", encoding="utf-8")


def plot_sweep(results: Sequence[BenchResult], path: Path) -> None:
    """Output throughput and TTFT p50 against concurrency, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in dict.fromkeys(r.label for r in results):
        mine = [r for r in results if r.label == label]
        levels = [r.concurrency for r in mine]
        left.plot(levels, [r.output_throughput for r in mine], marker="o", label=label)
        right.plot(levels, [r.ttft_ms.p50 for r in mine], marker="o", label=label)
    levels = sorted({r.concurrency for r in results if r.concurrency is not None})
    for axis, title in ((left, "output throughput (tok/s)"), (right, "TTFT p50 (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(level) for level in levels], minor=False)
        axis.set_ylim(bottom=0)
        axis.set_xlabel("concurrency")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
