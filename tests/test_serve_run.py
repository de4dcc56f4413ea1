# `serve run configs/gpt2.yaml` as a user runs it, in a subprocess, with API keys from the
# environment: it becomes ready, listens on loopback only, takes its compiled decode graph,
# serves 16 chat streams at once whose tokens Hugging Face transformers scores as its own, and
# on Ctrl-C (SIGINT) shuts Serve and its own Ray cluster down, leaving no process behind. The
# config is the shipped one (this CPU's dtype, compile_decode on) with three changes for a
# test machine: a free port, a small KV pool, and the model: a GPT-2-small checkpoint of
# random weights made peaked (tests/engine_helpers.py), served as "gpt2".
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import torch
import yaml
from ray.dashboard.consts import DASHBOARD_METRIC_PORT

from deployments.replicas.ingress import ON_REPLICA_LOOP
from engine.request.detokenizer import TokenVocab
from tests.engine_helpers import hf_model, hf_scores
from tests.http_helpers import engine_health
from tests.serve_helpers import ROOT, ServeRun, free_port, proxy_process, replica_process, serve_run

pytestmark = [pytest.mark.serve, pytest.mark.own_cluster]  # `serve run` starts its own

API_KEY = f"sk-serve-run-{uuid.uuid4().hex}"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GRAPH_TIMEOUT_S = 480  # the background compile of GPT-2 small's graph: ~70 s on 2 idle cores, cold
NUM_STREAMS = 16
MAX_TOKENS = 16
# Two full KV blocks of 16 tokens that every stream's prompt starts with: all but the first
# stream to reach them take them from the prefix cache.
SYSTEM = ("You are a weather assistant. Answer every question about the weather in one short, "
          "plain sentence, and never say more than you were asked.")
# A served token's logprob may be off HF fp32's by this many times HF's own error in the served
# dtype at that position, plus a floor: our kernels round in another order than HF's, so the
# errors are alike in size, not equal, and HF's own is near 0 at some positions by chance. The
# floor is one bf16 step at this model's logit size (16 to 32: 0.125); in fp32 HF's own error
# is 0 and the floor alone bounds ours.
ERROR_FACTOR = 4
FLOOR = {"bfloat16": 0.125, "float32": 0.01}


def derived_config(tmp_path: Path, port: int, model_dir: Path) -> Path:
    config = yaml.safe_load((ROOT / "configs" / "gpt2.yaml").read_text())
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    args["engine"]["num_kv_blocks"] = 256
    args |= {"model": str(model_dir), "served_model_name": "gpt2"}
    path = tmp_path / "gpt2.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory,
           peaked_gpt2_small_dir: Path) -> Iterator[tuple[str, Path, ServeRun]]:
    """(URL, config, the run) of the shipped config, ready; stopped on the way out if a test didn't."""
    tmp_path = tmp_path_factory.mktemp("serve-run")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = derived_config(tmp_path, port, peaked_gpt2_small_dir)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAYINFER_API_KEYS": API_KEY}
    with serve_run(config, tmp_path / "serve_run.log", env) as run:
        run.wait_until_ready(f"{url}/health")
        yield url, config, run


def chat_body(i: int) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Will it rain in town {i}?"}]
    return {"model": "gpt2", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 5, "stream": True}


async def one_stream(http: httpx.AsyncClient, body: dict) -> list[dict]:
    """The stream's logprobs entries, token by token (each with its bytes and logprob)."""
    entries = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    entries += (choice.get("logprobs") or {}).get("content") or []
    return entries


def streams_at_once(url: str, bodies: list[dict]) -> list[list[dict]]:
    async def main() -> list[list[dict]]:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as http:
            return await asyncio.gather(*(one_stream(http, body) for body in bodies))

    return asyncio.run(main())


def listening(process: psutil.Process) -> list[tuple[str, int, str]]:
    """(address, port, command line) of every socket the process and its children listen on."""
    found = []
    for p in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(p.cmdline())
            found += [(c.laddr.ip, c.laddr.port, cmdline) for c in p.net_connections("inet")
                      if c.status == psutil.CONN_LISTEN]
    return found


def test_http_and_the_dashboard_listen_on_loopback_only(served) -> None:
    url, _, run = served
    sockets = listening(psutil.Process(run.proc.pid))
    http = [ip for ip, port, _ in sockets if port == int(url.rsplit(":", 1)[1])]
    # The dashboard's own Prometheus exporter binds every interface unless the node's IP is
    # a loopback one (docs/security.md, "Opening the server deliberately"); its UI and API must not.
    dashboard = [(ip, port) for ip, port, cmdline in sockets
                 if "dashboard/dashboard.py" in cmdline and port != DASHBOARD_METRIC_PORT]
    assert http == ["127.0.0.1"]
    assert dashboard and {ip for ip, _ in dashboard} == {"127.0.0.1"}, dashboard


def test_the_keys_from_the_environment_guard_the_api_and_not_health(served) -> None:
    url = served[0]
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200


def test_the_shipped_config_on_this_cpus_dtype_and_graph_serves_hf_s_tokens_at_gpt2_small_size(
        served, peaked_gpt2_small_dir: Path, gpt2_tokenizer) -> None:
    """16 chat streams at once, sharing a prompt prefix, on the compiled decode graph; HF scores
    each stream's served tokens teacher-forced, in fp32 and in the served dtype: every served
    logprob is within ERROR_FACTOR x HF's own error + FLOOR of HF fp32's, and every served
    (greedy) token is in HF fp32's top 5."""
    url, _, run = served
    run.wait_for_log("decode graph ready after", GRAPH_TIMEOUT_S)  # steps run on the graph from here
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        dtype = http.get("/v1/models").json()["data"][0]["dtype"]
        hits_before = engine_health(http)["stats"]["num_prefix_hit_tokens"]
        bodies = [chat_body(i) for i in range(NUM_STREAMS)]
        streamed = streams_at_once(url, bodies)
        prompts = [http.post("/tokenize", json={"model": "gpt2", "messages": b["messages"]}).json()["tokens"]
                   for b in bodies]
        assert engine_health(http)["stats"]["num_prefix_hit_tokens"] - hits_before >= (NUM_STREAMS - 1) * 32
    assert [len(entries) for entries in streamed] == [MAX_TOKENS] * NUM_STREAMS
    token_id = {token: i for i, token in enumerate(TokenVocab.from_tokenizer(gpt2_tokenizer).token_bytes)}
    fp32 = hf_model(peaked_gpt2_small_dir)
    served_dtype = hf_model(peaked_gpt2_small_dir, getattr(torch, dtype))
    outside, not_top5 = [], []
    for stream, (prompt, entries) in enumerate(zip(prompts, streamed)):
        tokens = [token_id[bytes(e["bytes"])] for e in entries]
        reference, hf_dtype = hf_scores(fp32, prompt, tokens), hf_scores(served_dtype, prompt, tokens)
        for position, (token, entry) in enumerate(zip(tokens, entries)):
            expected = reference[position, token].item()
            hf_error, error = abs(hf_dtype[position, token].item() - expected), abs(entry["logprob"] - expected)
            if error > ERROR_FACTOR * hf_error + FLOOR[dtype]:
                outside.append(f"stream {stream}, position {position}: off by {error:.4f}, HF {dtype} by {hf_error:.4f}")
            if token not in reference[position].topk(5).indices.tolist():
                not_top5.append(f"stream {stream}, position {position}")
    assert outside == [] and not_top5 == [], (outside, not_top5)


def test_serve_run_gpt2_yaml_serves_a_stream_and_shuts_down_cleanly_on_sigint(served) -> None:
    """The module's last test: it stops the app."""
    url, config, run = served
    assert httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"][0]["weights"] == "pretrained"
    body = {"model": "gpt2", "prompt": "Hello", "max_tokens": 4, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        payloads = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["usage"]["completion_tokens"] == 4
    # the routes in an Ingress replica, on its own loop, and so the engine's code
    for deployment in ("Ingress", "EngineDeployment"):
        environ = replica_process(deployment).environ()
        assert {name: environ.get(name) for name in ON_REPLICA_LOOP} == ON_REPLICA_LOOP
    controller_env = yaml.safe_load(config.read_text())["controller_options"]["runtime_env"]["env_vars"]
    proxy = proxy_process().environ()  # the config's controller_options reached Serve's proxy
    assert {name: proxy.get(name) for name in controller_env} == controller_env
    run.stop(timeout_s=60)
