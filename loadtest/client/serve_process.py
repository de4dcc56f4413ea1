"""`serve run` as a child process of a benchmark: started so that Ctrl-C reaches it, and
stopped with nothing it started left behind."""
from __future__ import annotations

import contextlib
import signal
import subprocess

import psutil


def restore_sigint() -> None:
    """A Popen `preexec_fn`. A benchmark run as a background job (`cmd &`) starts with SIGINT
    ignored, and its children inherit that, so serve run would never see the Ctrl-C that
    shuts its app and Ray down cleanly."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop(process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Ctrl-C, as a user stops serve run, and up to `timeout_s` for it to exit; then SIGKILL,
    by PID, to it and to whatever it started that still runs. Its process group would miss a
    child that left the group (Ray's `haproxy`, which then keeps the API's port)."""
    started: list[psutil.Process] = []
    with contextlib.suppress(psutil.NoSuchProcess):
        started = psutil.Process(process.pid).children(recursive=True)
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout_s)
    for child in [process, *started]:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            child.kill()  # psutil checks the PID still names the process it found
    process.wait()
