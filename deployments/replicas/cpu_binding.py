"""Which CPU cores an engine replica's threads run on (the config's `engine_cpu_bind`).

Ray reserves CPUs for a replica as a count, not as cores: without binding, the OpenMP
threads of every engine replica on a node float over all its cores, and two replicas'
threads share cores while others sit idle. Binding gives each replica of a node cores of
its own, as vLLM's VLLM_CPU_OMP_THREADS_BIND does for its data-parallel ranks. Specs:

  nobind      leave the threads where the OS puts them
  auto        the replica with local rank r (Serve's rank among this deployment's replicas
              on its node) takes the (r+1)-th group of `threads` cores, distinct physical
              cores first, out of the cores the process may use; none if they run out
  0-3|4-7     explicit lists, one per local rank, `|` between them (cpulist syntax)

Binding sets the affinity of every thread the process has (threads started later inherit
it), so the step loop, the OpenMP pool and Ray's own threads all stay on the replica's cores.
Serve keeps a node's local ranks contiguous as replicas come and go; a replica it renumbers
moves to its new rank's cores (EngineDeployment.reconfigure).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("ray.serve")  # the replica's log file

_SYSFS_CPU = Path("/sys/devices/system/cpu")


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]; raises ValueError on anything else."""
    cpus: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        start, stop = int(first), int(last if dash else first)
        if start < 0 or stop < start:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.extend(range(start, stop + 1))
    return cpus


def validate_spec(spec: str) -> str:
    """`spec` itself if it is nobind, auto or lists of CPUs; raises ValueError naming it."""
    if spec not in ("nobind", "auto"):
        try:
            for cpus in spec.split("|"):
                parse_cpulist(cpus)
        except ValueError:
            raise ValueError(f"engine_cpu_bind: {spec!r} is not nobind, auto or CPU lists such as 0-3|4-7") from None
    return spec


def physical_cores_first(cpus: list[int]) -> list[int]:
    """`cpus` ordered so the first CPU of each physical core comes before any sibling: a
    group of n cores then has n cores' worth of execution units where the node has them."""
    seen: set[tuple[str, str]] = set()
    first, siblings = [], []
    for cpu in sorted(cpus):
        core = _core_of(cpu)
        (siblings if core in seen else first).append(cpu)
        seen.add(core)
    return first + siblings


def _core_of(cpu: int) -> tuple[str, str]:
    topology = _SYSFS_CPU / f"cpu{cpu}" / "topology"
    try:
        return (topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()
    except OSError:  # no sysfs topology (a container may hide it): every CPU its own core
        return "", str(cpu)


def cores_for(spec: str, local_rank: int, threads: int, allowed: list[int]) -> list[int] | None:
    """The cores a replica of `local_rank` binds to, or None to leave it unbound."""
    if spec == "nobind":
        return None
    if spec != "auto":
        lists = spec.split("|")
        if local_rank >= len(lists):
            logger.warning("engine_cpu_bind: no CPU list for local rank %d (%d given); not bound", local_rank, len(lists))
            return None
        cpus = parse_cpulist(lists[local_rank])
        if not set(cpus) <= set(allowed):
            raise ValueError(f"engine_cpu_bind: CPUs {sorted(set(cpus) - set(allowed))} are not among this process's {allowed}")
        return cpus
    ordered = physical_cores_first(allowed)
    group = ordered[local_rank * threads:(local_rank + 1) * threads]
    if len(group) < threads:
        logger.warning("engine_cpu_bind: auto: local rank %d needs cores %d-%d of %d; not bound",
                       local_rank, local_rank * threads, (local_rank + 1) * threads - 1, len(ordered))
        return None
    return sorted(group)


def bind_process(cpus: list[int]) -> None:
    """Every thread of this process onto `cpus`."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # the thread ended since the listing
            pass


class ReplicaCores:
    """The cores one engine replica's process runs on, following its local rank: Serve keeps a
    node's local ranks contiguous as replicas come and go, so a replica's rank may change
    while it runs (then Serve calls the deployment's `reconfigure`)."""

    def __init__(self, spec: str, threads: int):
        if spec != "nobind" and not hasattr(os, "sched_setaffinity"):
            raise ValueError(f"engine_cpu_bind: {spec!r} needs Linux's sched_setaffinity; use nobind here")
        self.spec = spec
        self.threads = threads
        # the process's own, before any binding
        self.allowed = sorted(os.sched_getaffinity(0)) if spec != "nobind" else []
        self.local_rank: int | None = None
        self.cpus: list[int] | None = None  # None: unbound

    def follow(self, local_rank: int) -> None:
        """Bind to `local_rank`'s cores; to all the process's own where that rank gets none."""
        if self.spec == "nobind" or local_rank == self.local_rank:
            return
        self.local_rank = local_rank
        self.cpus = cores_for(self.spec, local_rank, self.threads, self.allowed)
        bind_process(self.cpus or self.allowed)
        if self.cpus is not None:
            logger.info("engine replica (local rank %d) bound to CPUs %s", local_rank, self.cpus)
