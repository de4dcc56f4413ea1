"""The API's one failure policy (deployments/api/errors.py), a class a test, as a client meets
it on a real Serve instance with the tiny checkpoint: a request error is a 400 naming the
field, not found a 404, unavailable a 503 with Retry-After, internal a 500 naming the request
id and nothing of the failure, a request that fails inside an engine step a 500 (or its
stream's final error event) while the engine serves on. tests/test_reliability.py drives the
rest: bad fields (400 naming each), unknown routes (404), overload (429 with Retry-After: the
engine's waiting bounds and the proxy's queue, each filled), a dead engine (503)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import DeploymentUnavailableError

from deployments.api.errors import as_api_error
from deployments.api.lora_catalog import LoraCatalog
from deployments.api.routes import api
from deployments.api.security import ApiKeys
from deployments.api.serving import Serving
from engine import ModelInfo
from tests.engine_faults import faulty_app
from tests.http_helpers import assert_idle_and_intact, assert_openai_error, greedy
from tests.serve_helpers import running_app, tiny_app_args

APP = "failure-policy"
REQUEST_ID = re.compile(r"request id ((cmpl|chatcmpl|gen|req)-[0-9a-f]{32})")


@pytest.fixture(scope="module")
def base_url(tiny_gpt2_dir: Path) -> Iterator[str]:
    args = tiny_app_args(tiny_gpt2_dir, engine={"num_kv_blocks": 64}, tokenizer_num_replicas=1)
    with running_app(faulty_app(args), APP) as instance:
        yield instance.url


def fail_next_request() -> None:
    serve.get_deployment_handle("EngineDeployment", APP).fail_next_request.remote().result(timeout_s=30)


def assert_internal(error: dict) -> str:
    """A 500's error object: the request id and nothing else of what failed; the id."""
    assert (error["type"], error["param"], error["code"]) == ("server_error", None, None), error
    found = REQUEST_ID.search(error["message"])
    assert found and error["message"] == f"internal error (request id {found[1]})", error
    return found[1]


def test_an_arbitrary_value_error_is_internal_not_a_400_quoting_it(caplog) -> None:
    logger = logging.getLogger("ray.serve")  # Ray's own logger: it does not propagate to caplog's
    logger.addHandler(caplog.handler)
    try:
        error = as_api_error(ValueError("secret-request-content"), "cmpl-" + "0" * 32)
    finally:
        logger.removeHandler(caplog.handler)
    assert error.status == 500 and assert_internal(error.body["error"]) == "cmpl-" + "0" * 32
    assert "secret-request-content" not in caplog.text and "ValueError" in caplog.text


@pytest.mark.serve
@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", greedy("hi", max_tokens=1, model="gpt-4")),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}),
    ("/tokenize", {"model": "gpt-4", "prompt": "hi"}),
])
def test_a_model_this_server_does_not_serve_is_a_404_naming_it(http: httpx.Client, path: str, body: dict) -> None:
    """As OpenAI's and vLLM's: not found, not a bad request."""
    response = http.post(path, json=body)
    assert assert_openai_error(response, 404, "invalid_request_error", "model")["code"] == "model_not_found"


@pytest.mark.serve
def test_a_request_failing_inside_a_step_is_a_500_naming_its_id_and_the_engine_serves_on(http: httpx.Client) -> None:
    fail_next_request()
    response = http.post("/v1/completions", json=greedy("hi", max_tokens=8, ignore_eos=True))
    assert assert_internal(assert_openai_error(response, 500, "server_error")).startswith("cmpl-")
    assert http.post("/v1/completions", json=greedy("hi", max_tokens=8)).status_code == 200
    assert_idle_and_intact(http, APP)


@pytest.mark.serve
def test_a_stream_failing_inside_a_step_ends_with_an_error_event_and_the_engine_serves_on(http: httpx.Client) -> None:
    fail_next_request()
    with http.stream("POST", "/v1/completions", json=greedy("hi", max_tokens=8, ignore_eos=True, stream=True)) as r:
        assert r.status_code == 200  # its first token came: the failure is its second
        payloads = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    assert "choices" in events[0] and set(events[-1]) == {"error"}
    assert assert_internal(events[-1]["error"]) == events[0]["id"]
    assert http.post("/v1/completions", json=greedy("hi", max_tokens=8)).status_code == 200
    assert_idle_and_intact(http, APP)


class DownTokenizer:
    """A tokenizer deployment's handle whose replica is down: every call raises `error`, as
    Serve's handle does (the fault injected; the routes, their app and errors are real)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __getattr__(self, method: str) -> DownTokenizer:
        return self

    async def remote(self, *args) -> None:
        raise self.error


def app_with_policy(serving: Serving) -> FastAPI:
    """The three tokenizer routes as the Ingress serves them (a line each into Serving),
    under the product app's error handling: its middleware and handlers."""
    app = FastAPI()
    app.router.routes = []
    app.user_middleware = list(api.user_middleware)
    app.exception_handlers = dict(api.exception_handlers)
    app.post("/tokenize")(serving.tokenize)
    app.post("/detokenize")(serving.detokenize)
    app.get("/tokenizer_info")(serving.tokenizer_info)
    return app


UNAVAILABLE = [ActorDiedError(), ActorUnavailableError("the replica is restarting", None),
               DeploymentUnavailableError(DeploymentID("TokenizerDeployment", APP))]


@pytest.mark.parametrize("error", UNAVAILABLE, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/tokenizer_info", None),
])
def test_a_tokenizer_route_with_its_replica_down_is_the_encode_paths_503_with_retry_after(
        method: str, path: str, body: dict | None, error: Exception) -> None:
    tokenizer = DownTokenizer(error)
    info = ModelInfo("tiny", "random", 1024, 50257, 50256, "float32", "cpu")
    serving = Serving(tokenizer, None, None, "tiny", ApiKeys([]), 1 << 20, info, None, LoraCatalog("tiny"))
    encode_path = as_api_error(error)
    with TestClient(app_with_policy(serving)) as client:
        response = client.request(method, path, json=body)
    assert response.json() == encode_path.body and encode_path.status == 503
    assert_openai_error(response, 503, "server_error")
    assert response.headers["retry-after"] == "1"
