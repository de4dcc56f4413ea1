"""Run loadtest/locustfile.py headless in a subprocess and read back its statistics, for
smoke tests (locust monkey-patches the process with gevent, so it never runs in-process)."""

from __future__ import annotations

import csv
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

LOCUSTFILE = Path(__file__).resolve().parents[1] / "locustfile.py"


@dataclass(frozen=True)
class EntryStats:
    num_requests: int
    num_failures: int
    median_ms: float
    p95_ms: float


@dataclass(frozen=True)
class LocustRun:
    returncode: int
    output: str
    entries: dict[tuple[str, str], EntryStats]  # (type, name), e.g. ("METRIC", "ttft")

    @property
    def num_failures(self) -> int:
        return sum(entry.num_failures for entry in self.entries.values())


def run_locust(
    host: str,
    csv_prefix: Path,
    users: int = 4,
    spawn_rate: float = 4,
    run_time: str = "5s",
    extra_args: tuple[str, ...] = (),
    timeout_s: float = 120,
) -> LocustRun:
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
        "-u", str(users), "-r", str(spawn_rate), "-t", run_time, "--host", host,
        "--csv", str(csv_prefix), *extra_args,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    stats_file = Path(f"{csv_prefix}_stats.csv")
    entries = read_stats(stats_file) if stats_file.is_file() else {}
    return LocustRun(done.returncode, done.stdout + done.stderr, entries)


def read_stats(path: Path) -> dict[tuple[str, str], EntryStats]:
    with path.open(newline="", encoding="utf-8") as file:
        rows = [row for row in csv.DictReader(file) if row["Name"] != "Aggregated"]
    return {(row["Type"], row["Name"]): _entry(row) for row in rows}


def _entry(row: dict[str, str]) -> EntryStats:
    return EntryStats(
        num_requests=int(row["Request Count"]),
        num_failures=int(row["Failure Count"]),
        median_ms=float(row["Median Response Time"]),
        p95_ms=float(row["95%"]) if row["95%"] not in ("", "N/A") else float("nan"),
    )
