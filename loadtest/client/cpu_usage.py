"""CPU time each process on the machine took during a measured run: which of the server's
processes (proxy, ingress, engine replica; vLLM's API server, engine core) and the client
itself the cores went to.

    before = cpu_snapshot()
    ... run ...
    rows = cpu_since(before)   # processes that took CPU in between, busiest first
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass

import psutil

_MIN_CPU_S = 0.05  # processes below this are left out of reports
_CHILDREN_PID = -1  # the bench's children that exited during the run, as one row


@dataclass(frozen=True)
class ProcessCpu:
    pid: int
    name: str
    cpu_s: float  # user + system
    started: float = 0.0  # its create_time: with the pid, who it is (a Ray worker retitles itself per task)


def cpu_snapshot() -> dict[int, ProcessCpu]:
    """Every process's CPU seconds so far, plus those of this process's exited children."""
    snapshot = {}
    for process in psutil.process_iter(["pid", "name", "cmdline", "cpu_times", "create_time"]):
        info = process.info
        if info["cpu_times"] is not None:
            name = _name(info["name"] or "", info["cmdline"] or [])
            cpu_s = info["cpu_times"].user + info["cpu_times"].system
            snapshot[info["pid"]] = ProcessCpu(info["pid"], name, cpu_s, info["create_time"] or 0.0)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    snapshot[_CHILDREN_PID] = ProcessCpu(_CHILDREN_PID, "exited children of the bench",
                                         children.ru_utime + children.ru_stime)
    return snapshot


def cpu_since(before: dict[int, ProcessCpu]) -> list[ProcessCpu]:
    """CPU seconds per process since `before` (a process born since counts from zero)."""
    rows = []
    for pid, now in cpu_snapshot().items():
        then = before.get(pid)
        spent = now.cpu_s - (then.cpu_s if then is not None and then.started == now.started else 0.0)
        if spent >= _MIN_CPU_S:
            rows.append(ProcessCpu(pid, now.name, spent))
    return sorted(rows, key=lambda row: row.cpu_s, reverse=True)


def settle(max_busy: float = 0.1, timeout_s: float = 60.0) -> None:
    """Wait until the machine is idle (a server just stopped may still be tearing down)."""
    deadline = time.monotonic() + timeout_s
    while psutil.cpu_percent(interval=1.0) / 100 > max_busy and time.monotonic() < deadline:
        pass


def cpu_table(runs: dict[str, tuple[float, list[ProcessCpu]]]) -> str:
    """Markdown: per run (label -> (wall seconds, rows)), each process's CPU seconds."""
    lines = ["| run | wall (s) | CPU (s), all processes | process: CPU (s) |", "|---|---|---|---|"]
    for label, (wall_s, rows) in runs.items():
        detail = "; ".join(f"{row.name}: {row.cpu_s:.2f}" for row in rows)
        lines.append(f"| {label} | {wall_s:.1f} | {sum(row.cpu_s for row in rows):.1f} | {detail} |")
    return "\n".join(lines)


def _name(name: str, cmdline: list[str]) -> str:
    """Ray workers and vLLM's engine set their process titles (ray::ServeReplica:app:Engine,
    VLLM::EngineCore); a Python process is named for the module or script it runs."""
    title = cmdline[0] if cmdline else name
    if title.startswith(("ray::", "VLLM")):
        return title.split(" ")[0][:60]
    if not name.startswith("python"):
        return name
    if "-m" in cmdline[:-1]:
        return f"python -m {cmdline[cmdline.index('-m') + 1]}"
    script = next((arg for arg in cmdline[1:] if not arg.startswith("-")), "")
    return f"python {script.rsplit('/', 1)[-1]}" if script else name
