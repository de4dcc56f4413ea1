"""docs/scale-out.png: the results page's scale-out rows as a plot
(`python -m bench.scale.scale_out_plot [PATH]`).

It draws what BENCHMARKS.md's scale-out table states, not a new run: each run's figure as
`bench.scale.scale_bench` reported it. After a new scale-out run, update the figures below with
the page's rows and draw it again."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Workload:
    name: str
    router_tok_s: tuple[float, ...]  # the prefix-aware router's runs
    serve_tok_s: tuple[float, ...]  # Serve's default router's runs, in the same command
    router_ttft_ms: tuple[float, ...]
    serve_ttft_ms: tuple[float, ...]


# BENCHMARKS.md, scale-out: configs/scale-out.yaml on 2 cores (2 engine replicas x 1 thread),
# each setup twice, A B B A (s15).
WORKLOADS = (
    Workload("shared prefixes", (154.7, 148.6), (112.3, 104.5), (147, 163), (493, 651)),
    Workload("one hot prefix", (192.2, 184.5), (156.3, 164.3), (238, 219), (541, 409)),
    Workload("no shared prefix", (71.1, 69.6), (68.4, 72.2), (1188, 1398), (1496, 1160)),
)
# BENCHMARKS.md, scale-out: 2 replicas vs 1 on lent 16-vCPU machines, 4 threads a replica, each
# replica bound to its cores in s18: (session, 1 replica's runs, 2 replicas' runs), output tok/s.
TWO_VS_ONE = (
    ("s14", (101.5, 175.4), (262.1, 280.2)),
    ("s17", (155.7, 109.6, 138.8), (198.7, 194.4, 210.0)),
    ("s18", (75.4, 118.6, 78.7), (190.0, 191.1, 239.1)),
)


def mean(values: tuple[float, ...]) -> float:
    return sum(values) / len(values)


def bars(axis, labels: list[str], groups: list[tuple[str, list[tuple[float, ...]]]], title: str) -> None:
    """Side-by-side bars (each group's mean) with every run as a dot on its bar."""
    width = 0.8 / len(groups)
    for g, (label, runs) in enumerate(groups):
        xs = [i + (g - (len(groups) - 1) / 2) * width for i in range(len(labels))]
        axis.bar(xs, [mean(r) for r in runs], width, label=label)
        for x, r in zip(xs, runs):
            axis.plot([x] * len(r), r, "k.", markersize=4)
    axis.set_xticks(range(len(labels)), labels)
    axis.set_title(title)
    axis.grid(True, axis="y", alpha=0.3)
    axis.legend()


def plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (tok_s, ttft, two) = plt.subplots(1, 3, figsize=(15, 4.2))
    names = [w.name for w in WORKLOADS]
    bars(tok_s, names, [("prefix router", [w.router_tok_s for w in WORKLOADS]),
                        ("Serve's default", [w.serve_tok_s for w in WORKLOADS])], "2 cores: output tok/s")
    bars(ttft, names, [("prefix router", [w.router_ttft_ms for w in WORKLOADS]),
                       ("Serve's default", [w.serve_ttft_ms for w in WORKLOADS])], "2 cores: TTFT p50 (ms)")
    sessions = [s for s, _, _ in TWO_VS_ONE]
    bars(two, sessions, [("1 replica", [one for _, one, _ in TWO_VS_ONE]),
                         ("2 replicas", [pair for _, _, pair in TWO_VS_ONE])],
         "16 vCPUs, 4 threads a replica: output tok/s")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    plot(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/scale-out.png"))
