# `serve run configs/gpt2.yaml` as a user runs it, in a subprocess: it becomes ready,
# streams, and on Ctrl-C (SIGINT) shuts Serve and its own Ray cluster down, leaving no
# process behind. The config is the real one with two changes for a shared test machine:
# a free port, and a small KV pool.
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.serve_helpers import free_port, wait_for_exit

pytestmark = pytest.mark.serve

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 180


def serve_executable() -> str:
    beside_python = Path(sys.executable).with_name("serve")
    return str(beside_python) if beside_python.exists() else shutil.which("serve")


def derived_config(tmp_path: Path, port: int) -> Path:
    config = yaml.safe_load((ROOT / "configs" / "gpt2.yaml").read_text())
    config["http_options"]["port"] = port
    config["applications"][0]["args"]["engine"]["num_kv_blocks"] = 256
    path = tmp_path / "gpt2.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def wait_until_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"serve run exited early:\n{log.read_text()[-4000:]}"
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    pytest.fail(f"not ready after {READY_TIMEOUT_S}s:\n{log.read_text()[-4000:]}")


def test_serve_run_gpt2_yaml_serves_a_stream_and_shuts_down_cleanly_on_sigint(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve_run.log"
    # --address local: our own cluster, never one another process on this machine started.
    command = [serve_executable(), "run", "--address", "local", str(derived_config(tmp_path, port))]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # gpt2 with weights: auto -> random, at once
    descendants: list[int] = []
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_ready(proc, url, log)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["weights"] == "random"
        body = {"model": "gpt2", "prompt": "Hello", "max_tokens": 4, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            payloads = [line.removeprefix("data: ") for line in response.iter_lines() if line]
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["usage"]["completion_tokens"] == 4

        descendants = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
        assert wait_for_exit(descendants) == [], "Ray processes outlived serve run"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in wait_for_exit(descendants, timeout_s=0):  # only what our serve run started
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
