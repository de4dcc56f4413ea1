"""How the suite's in-process Ray starts end: whatever a start began and its shutdown left
running is named and killed, so one module's leak or half-done start fails that module alone."""
from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from tests.serve_helpers import reaped

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_a_process_that_outlives_the_shutdown_is_named_and_killed() -> None:
    shutdowns = []
    with pytest.raises(AssertionError, match="outlived the test's shutdown") as failure:
        with reaped(lambda: shutdowns.append(True), "the test's shutdown", timeout_s=0.5):
            sleeper = subprocess.Popen(SLEEPER)
    assert shutdowns == [True]
    assert str(sleeper.pid) in str(failure.value)
    assert sleeper.wait(timeout=10) == -9  # SIGKILL


def test_a_start_that_fails_midway_still_has_what_it_began_killed() -> None:
    with pytest.raises(RuntimeError, match="the node timed out"):
        with reaped(lambda: None, "the test's shutdown", timeout_s=0.5):
            sleeper = subprocess.Popen(SLEEPER)
            raise RuntimeError("the node timed out during startup")
    assert sleeper.wait(timeout=10) == -9


def test_processes_running_before_the_block_are_left_alone() -> None:
    before = subprocess.Popen(SLEEPER)
    try:
        with reaped(lambda: None, "the test's shutdown", timeout_s=0.5):
            pass
        assert psutil.Process(before.pid).status() != psutil.STATUS_ZOMBIE
    finally:
        before.kill()
        before.wait()
