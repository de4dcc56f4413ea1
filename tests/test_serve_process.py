"""How benchmarks start and stop `serve run`: Ctrl-C reaches it even from a background job,
and a stop leaves nothing it started behind, a child that left its group included."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

from loadtest.client import serve_process

# A stand-in for a serve run that ignores Ctrl-C and has started a child in a session of
# its own (as Ray's HAProxy manager starts `haproxy`); it prints that child's pid.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_child_started_from_a_background_job_still_takes_ctrl_c() -> None:
    # The parent ignores SIGINT, as a background job does; the child reports what it inherited.
    parent = """
import signal, subprocess, sys
from loadtest.client import serve_process
signal.signal(signal.SIGINT, signal.SIG_IGN)
probe = "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
for preexec in (None, serve_process.restore_sigint):
    subprocess.run([sys.executable, "-c", probe], preexec_fn=preexec)
"""
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]  # ignored when inherited; Python's own handler with restore_sigint


def test_stop_sends_ctrl_c_and_returns_once_the_process_exits() -> None:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                               preexec_fn=serve_process.restore_sigint)
    time.sleep(0.5)  # past the interpreter's start, so that SIGINT raises KeyboardInterrupt
    serve_process.stop(process, timeout_s=30)
    assert process.returncode == -signal.SIGINT  # it died of the Ctrl-C, not of a SIGKILL after the time-out


def test_stop_kills_a_process_deaf_to_ctrl_c_and_the_child_that_left_its_group() -> None:
    process = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    child = psutil.Process(int(process.stdout.readline()))
    try:
        serve_process.stop(process, timeout_s=1)
        assert process.returncode == -signal.SIGKILL
        child.wait(timeout=10)  # raises TimeoutExpired if it outlived the stop
    finally:
        if child.is_running():
            child.kill()
        process.stdout.close()
