"""engine_cpu_bind: which cores an engine replica's threads run on. The choice of cores
from a spec, a replica's local rank and the machine's topology; binding a real process's
threads, those started before and after. (A real Serve app with two bound replicas:
tests/test_scale_out.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployments.replicas import cpu_binding
from deployments.app import AppArgs
from deployments.replicas.cpu_binding import ReplicaCores, cores_for, parse_cpulist, physical_cores_first


def test_a_cpulist_is_ranges_and_single_cpus() -> None:
    assert parse_cpulist("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpulist("5") == [5]
    for bad in ("", "3-1", "a", "-1", "0-"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


def test_a_spec_that_is_not_nobind_auto_or_cpu_lists_is_refused_naming_the_arg() -> None:
    assert AppArgs().engine_cpu_bind == "nobind"
    for good in ("auto", "nobind", "0-3|4-7", "0,2"):
        assert AppArgs(engine_cpu_bind=good).engine_cpu_bind == good
    for bad in ("cores", "0-3|", "auto|0"):
        with pytest.raises(ValueError, match="engine_cpu_bind"):
            AppArgs(engine_cpu_bind=bad)


@pytest.fixture
def two_cores_two_threads_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A topology this machine may not have: CPUs 0-1 and 2-3 are the two threads of cores 0 and 1."""
    for cpu, core in ((0, 0), (1, 0), (2, 1), (3, 1)):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    monkeypatch.setattr(cpu_binding, "_SYSFS_CPU", tmp_path)


def test_auto_takes_one_cpu_of_each_physical_core_before_any_sibling(two_cores_two_threads_each) -> None:
    assert physical_cores_first([0, 1, 2, 3]) == [0, 2, 1, 3]
    assert cores_for("auto", 0, 2, [0, 1, 2, 3]) == [0, 2]  # two cores, not two threads of one
    assert cores_for("auto", 1, 2, [0, 1, 2, 3]) == [1, 3]


def test_auto_gives_each_local_rank_its_own_group_until_the_cores_run_out() -> None:
    allowed = [0, 1, 2, 3, 4, 5]  # this machine's sysfs, or none: each CPU its own core either way
    groups = [cores_for("auto", rank, 2, allowed) for rank in range(3)]
    assert sorted(cpu for group in groups for cpu in group) == allowed
    assert cores_for("auto", 3, 2, allowed) is None  # no cores left: unbound, with a warning


def test_explicit_lists_go_one_per_local_rank_and_must_be_cpus_the_process_may_use() -> None:
    assert cores_for("0-1|2-3", 1, 2, [0, 1, 2, 3]) == [2, 3]
    assert cores_for("0-1|2-3", 2, 2, [0, 1, 2, 3]) is None  # no list for rank 2: unbound, with a warning
    with pytest.raises(ValueError, match=r"CPUs \[9\]"):
        cores_for("0,9", 0, 2, [0, 1, 2, 3])
    assert cores_for("nobind", 0, 2, [0, 1]) is None


def test_binding_where_the_os_cannot_is_refused_naming_the_arg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "sched_setaffinity")  # as on macOS
    with pytest.raises(ValueError, match="engine_cpu_bind: 'auto' needs Linux"):
        ReplicaCores("auto", 1)
    assert ReplicaCores("nobind", 1).cpus is None  # the default runs anywhere


_BIND_IN_A_CHILD = """
import json, os, threading
from deployments.replicas.cpu_binding import ReplicaCores

def affinities():
    return {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}

stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
cores = ReplicaCores("auto", 1)
cores.follow(1)  # the second replica of the node: the second core
after = threading.Thread(target=stop.wait); after.start()
seen = [affinities()]
cores.follow(0)  # renumbered by Serve: the first core
seen.append(affinities())
cores.follow(5)  # a rank past the cores: unbound again, on all the process's own
seen.append(affinities())
print(json.dumps(seen))
stop.set()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="written for a 2-CPU process")
def test_a_replica_binds_every_thread_and_follows_its_rank_when_serve_renumbers_it() -> None:
    own = sorted(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", _BIND_IN_A_CHILD], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, check=True).stdout
    rank_one, rank_zero, no_rank = json.loads(out)
    assert len(rank_one) == 3  # the main thread, one started before the binding, one after
    assert all(cpus == [own[1]] for cpus in rank_one.values()), rank_one
    assert all(cpus == [own[0]] for cpus in rank_zero.values()), rank_zero
    assert all(cpus == own for cpus in no_rank.values()), no_rank


@pytest.mark.parametrize("config", sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")),
                         ids=lambda path: path.name)
def test_every_config_file_validates_and_leaves_binding_to_the_os(config: Path) -> None:
    """No machine measured here gained from binding (BENCHMARKS.md, "Designs tried and rejected")."""
    application = yaml.safe_load(config.read_text())["applications"][0]
    assert AppArgs.model_validate(application["args"]).engine_cpu_bind == "nobind"
