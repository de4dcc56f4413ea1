# The endpoints beside the OpenAI API that real clients probe, in vLLM's shapes, behind the
# app's API keys: /tokenize, /detokenize, /tokenizer_info (lm-eval's remote tokenizer),
# /version, and Prometheus /metrics on the API port (aiperf scrapes it there).
from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deployments.app import build_app
from tests.serve_helpers import running_app, tiny_app_args

pytestmark = pytest.mark.serve

API_KEY = "sk-tokenizer-test"
MAX_MODEL_LEN = 1024
APP = "tokenizer-endpoints"


@pytest.fixture(scope="module")
def base_url(tiny_gpt2_dir: Path) -> Iterator[str]:
    app = build_app(tiny_app_args(tiny_gpt2_dir, engine={"num_kv_blocks": 32}, api_keys=[API_KEY]))
    with running_app(app, APP) as instance:
        yield instance.url


@pytest.fixture(scope="module")
def http_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}



def test_tokenize_a_prompt_in_vllms_shape(http: httpx.Client, gpt2_tokenizer) -> None:
    text = "Hello, world! <|endoftext|>"
    response = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert response.status_code == 200, response.text
    ids = gpt2_tokenizer.encode(text)
    assert ids[-1] == gpt2_tokenizer.eos_token_id  # lm-eval reads eos_token_id this way
    assert response.json() == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}


def test_tokenize_returns_token_strings_on_request(http: httpx.Client, gpt2_tokenizer) -> None:
    body = http.post("/tokenize", json={"model": "tiny", "prompt": "Hi there", "return_token_strs": True}).json()
    assert body["token_strs"] == gpt2_tokenizer.convert_ids_to_tokens(gpt2_tokenizer.encode("Hi there"))


def test_tokenize_messages_gives_the_chat_prompts_tokens(http: httpx.Client) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    by_messages = http.post("/tokenize", json={"model": "tiny", "messages": messages}).json()
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 1}).json()
    by_prompt = http.post("/tokenize", json={"prompt": "system: Be brief.\nuser: Hi there\nassistant:"}).json()
    assert by_messages["tokens"] == by_prompt["tokens"]
    assert by_messages["count"] == chat["usage"]["prompt_tokens"]


def test_detokenize_in_vllms_shape(http: httpx.Client, gpt2_tokenizer) -> None:
    ids = gpt2_tokenizer.encode("Paris is lovely in spring.")
    response = http.post("/detokenize", json={"model": "tiny", "tokens": ids})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": "Paris is lovely in spring."}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/tokenize", {"prompt": 12}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"}, "chat_template"),
    ("/tokenize", {"prompt": "x", "unknown_field": 1}, "unknown_field"),
    ("/detokenize", {"tokens": [50257]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_tokenizer_requests_are_a_400_naming_the_param(http: httpx.Client, path: str, body: dict,
                                                           param: str) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_tokenizer_info_has_what_lm_eval_reads(http: httpx.Client) -> None:
    response = http.get("/tokenizer_info")
    assert response.status_code == 200, response.text
    info = response.json()
    assert info["eos_token"] == "<|endoftext|>" and info["bos_token"] == "<|endoftext|>"
    assert info["tokenizer_class"].startswith("GPT2Tokenizer")
    assert "vocab_file" not in info and "merges_file" not in info  # no server paths, as vLLM


def test_version(http: httpx.Client) -> None:
    response = http.get("/version")
    assert response.status_code == 200
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", response.json()["version"])


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"), ("GET", "/version"),
    ("GET", "/metrics"),
])
def test_every_new_endpoint_is_behind_the_api_keys(base_url: str, method: str, path: str) -> None:
    response = httpx.request(method, base_url + path, json={"prompt": "x", "tokens": [1]}, timeout=30)
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_metrics_on_the_api_port_are_rays_prometheus_export(http: httpx.Client) -> None:
    """The same samples the dashboard's Prometheus scrapes from each node's export port."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).status_code == 200
    deadline = time.monotonic() + 30
    # Ray exports every few seconds, each process on its own clock: the engine's counter and
    # the proxy's may each first show part of the run, or none of it
    while True:
        response = http.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        text = response.text
        completion_tokens = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                             if line.startswith("ray_rayinfer_completion_tokens_total")
                             and f'application="{APP}"' in line]  # the suite's other apps share the export
        serve_requests = re.search(r"^ray_serve_num_http_requests_total\{", text, re.M)  # Serve's own, as the dashboard shows
        if (sum(completion_tokens) >= 3 and serve_requests) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert re.search(r"^# TYPE ray_rayinfer_ttft_seconds histogram$", text, re.M)
    assert sum(completion_tokens) >= 3
    assert serve_requests
