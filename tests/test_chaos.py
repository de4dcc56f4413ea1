# The app as `serve run configs/tiny.yaml` starts it, with API keys from the environment,
# under a short chaos run (loadtest/chaos/run.py), and what it exposes on the network. The
# config is the real one with two changes for a shared test machine: a free port, and the
# tiny checkpoint instead of distilgpt2's architecture.
from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml
from ray.dashboard.consts import DASHBOARD_METRIC_PORT

from loadtest.chaos.run import check_loopback, run_chaos
from loadtest.chaos.config import ChaosConfig
from loadtest.chaos.verdict import summary
from tests.serve_helpers import ROOT, free_port, serve_run

pytestmark = [pytest.mark.serve, pytest.mark.own_cluster]  # `serve run` starts its own

API_KEY = f"sk-chaos-{uuid.uuid4().hex}"


def derived_config(tmp_path: Path, port: int, model_dir: Path) -> Path:
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    config["http_options"]["port"] = port
    config["applications"][0]["args"] |= {"model": str(model_dir), "weights": "pretrained"}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_gpt2_dir: Path) -> Iterator[tuple[str, psutil.Process]]:
    tmp_path = tmp_path_factory.mktemp("chaos")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAYINFER_API_KEYS": API_KEY}
    with serve_run(derived_config(tmp_path, port, tiny_gpt2_dir), tmp_path / "serve_run.log", env) as run:
        run.wait_until_ready(f"{url}/health")
        yield url, psutil.Process(run.proc.pid)
        run.stop(timeout_s=90)


def listening(process: psutil.Process) -> list[tuple[str, int, str]]:
    """(address, port, command line) of every socket the process and its children listen on."""
    found = []
    for p in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(p.cmdline())
            found += [(c.laddr.ip, c.laddr.port, cmdline) for c in p.net_connections("inet")
                      if c.status == psutil.CONN_LISTEN]
    return found


def test_http_and_the_dashboard_listen_on_loopback_only(served: tuple[str, psutil.Process]) -> None:
    url, process = served
    sockets = listening(process)
    http = [ip for ip, port, _ in sockets if port == int(url.rsplit(":", 1)[1])]
    # The dashboard's own Prometheus exporter binds every interface unless the node's IP is
    # a loopback one (docs/security.md, "Opening the server deliberately"); its UI and API must not.
    dashboard = [(ip, port) for ip, port, cmdline in sockets
                 if "dashboard/dashboard.py" in cmdline and port != DASHBOARD_METRIC_PORT]
    assert http == ["127.0.0.1"]
    assert dashboard and {ip for ip, _ in dashboard} == {"127.0.0.1"}, dashboard


def test_a_short_chaos_run_leaves_no_5xx_no_leaked_blocks_and_nothing_stuck(
        served: tuple[str, psutil.Process]) -> None:
    config = ChaosConfig(served[0], duration_s=10, warmup_s=2, concurrency=6, burst_every_s=3, burst_size=32,
                         burst_prompt_tokens=288, api_key=API_KEY)  # 9,216 tokens: past max_waiting_tokens
    report = asyncio.run(run_chaos(config))
    print(summary(report))
    assert report["passed"], report["failures"]
    # The mix is random and a 10 s run on a loaded machine may miss a rare kind: ask for
    # valid traffic, overload, and at least one bad input and one disconnect of any kind.
    kinds = set(report["requests"])
    assert {"stream", "complete", "burst"} <= kinds, kinds
    assert kinds & {"bad_input", "too_large", "bad_key"} and kinds & {"drop_mid_stream", "drop_queued", "drop_non_stream"}
    assert report["valid_5xx"] == 0 and report["kv_blocks"]["leaked"] == 0


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000"])
def test_chaos_refuses_any_server_but_this_machine(url: str) -> None:
    with pytest.raises(SystemExit):
        check_loopback(url)
