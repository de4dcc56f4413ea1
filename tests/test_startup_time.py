"""The start-up bench (bench/peers/startup_time.py): its clock runs from launch to the first
answered completion and, where the server logs one, to its full-speed line; a cold run
starts from empty compile caches."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from bench.peers.startup_time import FULL_SPEED_LINE, cold_env, time_start
from tests.serve_helpers import free_port

# A server that listens only after a delay, answers completions, then logs the full-speed
# line after another: the shape of a replica that serves on eager steps while its graph compiles.
_SERVER = textwrap.dedent("""
    import http.server, sys, threading, time
    listen_after_s, full_speed_after_s, port = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200); self.send_header("content-length", "2"); self.end_headers()
            self.wfile.write(b"{}")
        def log_message(self, *args): pass
    time.sleep(listen_after_s)
    server = http.server.HTTPServer(("127.0.0.1", port), Handler)
    timer = threading.Timer(full_speed_after_s, lambda: print("INFO decode graph ready after 1.0 s", flush=True))
    timer.daemon = True  # Ctrl-C ends the server at once
    timer.start()
    server.serve_forever()
""")


def test_the_clock_stops_at_the_first_answer_and_at_the_full_speed_line(tmp_path):
    port = free_port()
    command = [sys.executable, "-c", _SERVER, "1.0", "1.0", str(port)]
    timing = time_start(command, f"http://127.0.0.1:{port}", "gpt2", tmp_path / "server.log", timeout_s=30,
                        full_speed_line=FULL_SPEED_LINE)
    assert 1.0 <= timing.first_answer_s < timing.full_speed_s
    assert timing.full_speed_s - timing.first_answer_s >= 0.5  # the line came a second after listening


def test_without_a_full_speed_line_only_the_first_answer_is_timed(tmp_path):
    port = free_port()
    command = [sys.executable, "-c", _SERVER, "0.0", "60.0", str(port)]
    timing = time_start(command, f"http://127.0.0.1:{port}", "gpt2", tmp_path / "server.log", timeout_s=30)
    assert timing.full_speed_s is None and timing.first_answer_s < 30


def test_a_server_that_exits_before_answering_is_an_error(tmp_path):
    with pytest.raises(RuntimeError, match="exited"):
        time_start([sys.executable, "-c", "pass"], f"http://127.0.0.1:{free_port()}", "gpt2",
                   tmp_path / "server.log", timeout_s=30)


def test_a_cold_run_gets_empty_compile_caches_and_tuning_tables_of_its_own(tmp_path):
    base = {"PATH": "/usr/bin", "TORCHINDUCTOR_CACHE_DIR": "/warm"}
    first, second = cold_env(base, tmp_path / "run-0"), cold_env(base, tmp_path / "run-1")
    for env in (first, second):
        assert env["PATH"] == "/usr/bin"
        for name in ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT"):
            assert Path(env[name]).is_dir() and not any(Path(env[name]).iterdir())
    assert first["TORCHINDUCTOR_CACHE_DIR"] != second["TORCHINDUCTOR_CACHE_DIR"]
    for env, root in ((first, tmp_path / "run-0"), (second, tmp_path / "run-1")):  # no tuning table: measured anew
        assert Path(env["RAYINFER_TUNING_DIR"]).parent == root and not Path(env["RAYINFER_TUNING_DIR"]).exists()
    assert base["TORCHINDUCTOR_CACHE_DIR"] == "/warm"  # the caller's environment untouched
