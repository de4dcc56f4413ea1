# `serve run configs/gpt2.yaml` as a user runs it, in a subprocess: it becomes ready,
# streams, and on Ctrl-C (SIGINT) shuts Serve and its own Ray cluster down, leaving no
# process behind. The config is the real one with two changes for a shared test machine:
# a free port, and a small KV pool.
from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import yaml

from deployments.replicas.ingress import ON_REPLICA_LOOP
from tests.serve_helpers import ROOT, free_port, proxy_process, replica_process, serve_run

pytestmark = pytest.mark.serve


def derived_config(tmp_path: Path, port: int) -> Path:
    config = yaml.safe_load((ROOT / "configs" / "gpt2.yaml").read_text())
    config["http_options"]["port"] = port
    config["applications"][0]["args"]["engine"]["num_kv_blocks"] = 256
    path = tmp_path / "gpt2.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_serve_run_gpt2_yaml_serves_a_stream_and_shuts_down_cleanly_on_sigint(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # gpt2 with weights: auto -> random, at once
    config = derived_config(tmp_path, port)
    with serve_run(config, tmp_path / "serve_run.log", env) as run:
        run.wait_until_ready(f"{url}/v1/models")
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["weights"] == "random"
        body = {"model": "gpt2", "prompt": "Hello", "max_tokens": 4, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            payloads = [line.removeprefix("data: ") for line in response.iter_lines() if line]
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["usage"]["completion_tokens"] == 4
        # ingress: deployment: the routes in an Ingress replica, on its own loop, and so the engine's code
        for deployment in ("Ingress", "EngineDeployment"):
            environ = replica_process(deployment).environ()
            assert {name: environ.get(name) for name in ON_REPLICA_LOOP} == ON_REPLICA_LOOP
        controller_env = yaml.safe_load(config.read_text())["controller_options"]["runtime_env"]["env_vars"]
        proxy = proxy_process().environ()  # the config's controller_options reached Serve's proxy
        assert {name: proxy.get(name) for name in controller_env} == controller_env
        run.stop(timeout_s=60)

