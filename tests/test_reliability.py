# Reliability and security as a client meets them: a real Ray Serve instance on CPU with
# the tiny checkpoint, the routes in their Ingress deployment as shipped, API keys on, small
# bounds so overload is easy to reach, fast health checks so a crashed engine is replaced
# within seconds, and fault injection enabled.
#
# The engine runs at most 2 sequences and admits at most 2 more waiting ones: two long
# streams fill it, so "queued" and "overloaded" are states a test can set up exactly.
# After every test the engine must be idle with every KV block back in the pool.
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from deployments.api.prompt_encoding import DEFAULT_LOCAL_MAX_CHARS
from engine import LLM, SamplingParams
from tests.engine_faults import faulty_app
from tests.http_helpers import (
    MODEL, PROMPTS, Stream, assert_idle_and_intact, assert_openai_error, greedy, health_of, run_async, until, wait_for,
    wait_until_idle,
)
from tests.serve_helpers import ray_logs_dir, replica_process, running_app, tiny_app_args

pytestmark = pytest.mark.serve

APP = "rayinfer"
API_KEY = f"sk-test-{uuid.uuid4().hex}"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY_BYTES = 16 * 1024
# 160 blocks x 16 = 2560 tokens: two 900-token streams plus a 1024-token request fit.
ENGINE_ARGS = {"num_kv_blocks": 160, "max_num_seqs": 2, "max_num_batched_tokens": 256,
               "max_waiting_requests": 2, "max_waiting_tokens": 2048}
# The proxy holds at most 16 + 4 requests for the replica serving the routes; past that it sheds with 429.
HTTP_LIMITS = {"max_ongoing_requests": 16, "max_queued_requests": 4,
               "backpressure_config": {"status_code": 429, "retry_after_s": 1}}
LONG = 900  # output tokens of a stream that outlives the steps a test takes around it
RECOVERY_TIMEOUT_S = 90


def app_args(model_dir: Path, **overrides) -> dict:
    return tiny_app_args(model_dir, **{"engine": ENGINE_ARGS, "tokenizer_num_replicas": 1, "api_keys": [API_KEY],
                                       "max_body_bytes": MAX_BODY_BYTES, **overrides})


def deployment_options(engine_health_check_period_s: float = 1) -> dict[str, dict]:
    engine = {"health_check_period_s": engine_health_check_period_s, "health_check_timeout_s": 10}
    return {"EngineDeployment": engine, "TokenizerDeployment": {"health_check_period_s": 1}, "Ingress": HTTP_LIMITS}


@pytest.fixture(scope="module")
def base_url(tiny_gpt2_dir: Path) -> Iterator[str]:
    with running_app(faulty_app(app_args(tiny_gpt2_dir), deployment_options()), APP) as instance:
        yield instance.url


@pytest.fixture(scope="module")
def http_headers() -> dict[str, str]:
    return AUTH


@pytest.fixture(scope="module")
def offline(tiny_gpt2_dir: Path) -> LLM:
    return LLM(str(tiny_gpt2_dir), dtype="float32", **ENGINE_ARGS, compile_decode=False)


@pytest.fixture(autouse=True)
def the_serving_engine_is_idle_and_intact_after_each_test(http: httpx.Client) -> Iterator[None]:
    """After the crash and kill tests the serving engine is the replacement: those tests
    check what happened to the old one themselves."""
    yield
    assert_idle_and_intact(http, APP)


# ---- helpers ----


def long_stream(prompt: str, max_tokens: int = LONG) -> dict:
    return greedy(prompt, max_tokens=max_tokens, ignore_eos=True, stream=True)


def run(scenario, base_url: str):
    return run_async(scenario, base_url, AUTH)


async def fill_the_engine(http: httpx.AsyncClient) -> list[Stream]:
    """Two long streams running: every further request waits."""
    streams = [Stream(http, long_stream(p)) for p in PROMPTS[:2]]
    for stream in streams:
        await stream.first_chunk.wait()
    return streams


# ---- validation ----


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", greedy(""), "prompt"),
        ("/v1/completions", greedy(42), "prompt"),
        ("/v1/completions", greedy([1, "two"]), "prompt"),
        ("/v1/completions", greedy([50257]), "prompt"),
        ("/v1/completions", greedy([-1]), "prompt"),
        ("/v1/completions", greedy("hi", max_tokens=0), "max_tokens"),
        ("/v1/completions", greedy("hi", max_tokens="8"), "max_tokens"),
        ("/v1/completions", greedy("hi", max_tokens=1024), "max_tokens"),  # beyond the context
        ("/v1/completions", greedy("hi", temperature=-0.1), "temperature"),
        ("/v1/completions", greedy("hi", top_p=0), "top_p"),
        ("/v1/completions", greedy("hi", top_p=1.01), "top_p"),
        ("/v1/completions", greedy("hi", top_k=-2), "top_k"),
        ("/v1/completions", greedy("hi", stop=["x"] * 17), "stop"),
        ("/v1/completions", greedy("hi", stop=["ok", ""]), "stop"),
        ("/v1/completions", greedy("hi", n=0), "n"),
        ("/v1/completions", greedy("hi", n=9), "n"),
        ("/v1/completions", greedy("hi", seed=2**64), "seed"),
        ("/v1/completions", greedy("hi", stream="yes"), "stream"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000},
         "max_completion_tokens"),
        ("/generate", {"prompt": "", "max_new_tokens": 4}, "prompt"),
        ("/generate", {"prompt": "hi", "max_new_tokens": 1024}, "max_new_tokens"),  # beyond the context
        ("/generate", {"prompt": "hi", "temperature": None}, "temperature"),
    ],
)
def test_bad_fields_are_a_400_naming_the_param(http: httpx.Client, path: str, body: dict, param: str) -> None:
    assert_openai_error(http.post(path, json=body), 400, "invalid_request_error", param)


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', "temperature"),
        (b'{"model": "tiny", "prompt": "hi", "temperature": Infinity}', "temperature"),
        (b'{"model": "tiny", "prompt": "hi", "top_p": NaN}', "top_p"),
        (b'{"model": "tiny", "prompt": "hi",', None),  # malformed JSON
        (b'{"model": "tiny", "prompt": "\xff\xfe"}', None),  # invalid UTF-8
        (b'["hi"]', None),  # not an object
        (b'"hi"', None),
        (b"", None),
    ],
)
def test_bodies_that_are_not_valid_json_objects_are_a_400(http: httpx.Client, content: bytes,
                                                          param: str | None) -> None:
    response = http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert_openai_error(response, 400, "invalid_request_error", param)


def test_the_context_holds_exactly_1024_prompt_plus_output_tokens(http: httpx.Client) -> None:
    fits = http.post("/v1/completions", json=greedy([1] * 1023, max_tokens=1, ignore_eos=True))
    assert fits.status_code == 200, fits.text
    assert fits.json()["usage"] == {"prompt_tokens": 1023, "completion_tokens": 1, "total_tokens": 1024}
    error = assert_openai_error(http.post("/v1/completions", json=greedy([1] * 1024, max_tokens=1)),
                                400, "invalid_request_error", "prompt")
    assert error["code"] == "context_length_exceeded"
    assert http.post("/v1/completions", json=greedy([1] * 1000, max_tokens=24)).status_code == 200
    error = assert_openai_error(http.post("/v1/completions", json=greedy([1] * 1000, max_tokens=25)),
                                400, "invalid_request_error", "max_tokens")
    assert error["code"] == "context_length_exceeded"


def words(n: int) -> str:
    """n tokens of 4 characters: past DEFAULT_LOCAL_MAX_CHARS, the tokenizer deployment encodes them."""
    return " the" * n


def test_text_prompts_past_the_ingress_bound_get_the_same_context_errors_from_the_tokenizer(
        http: httpx.Client) -> None:
    assert len(words(1000)) > DEFAULT_LOCAL_MAX_CHARS  # so the tokenizer deployment encodes these
    error = assert_openai_error(http.post("/v1/completions", json=greedy(words(1024), max_tokens=1)),
                                400, "invalid_request_error", "prompt")
    assert error["code"] == "context_length_exceeded"
    error = assert_openai_error(http.post("/v1/completions", json=greedy(words(1000), max_tokens=25)),
                                400, "invalid_request_error", "max_tokens")
    assert error["code"] == "context_length_exceeded"
    fits = http.post("/v1/completions", json=greedy(words(1000), max_tokens=24, ignore_eos=True))
    assert fits.status_code == 200, fits.text
    assert fits.json()["usage"]["prompt_tokens"] == 1000


def padded_body(num_bytes: int) -> bytes:
    """A valid request body of exactly num_bytes (JSON allows trailing whitespace)."""
    body = json.dumps(greedy("hi", max_tokens=2)).encode()
    return body + b" " * (num_bytes - len(body))


def test_a_body_at_the_limit_is_served_and_one_byte_more_is_a_413(http: httpx.Client) -> None:
    at_limit = http.post("/v1/completions", content=padded_body(MAX_BODY_BYTES))
    assert at_limit.status_code == 200, at_limit.text
    over = http.post("/v1/completions", content=padded_body(MAX_BODY_BYTES + 1))
    assert assert_openai_error(over, 413, "invalid_request_error")["code"] == "request_too_large"


def test_a_chunked_body_without_content_length_is_counted_and_cut_at_the_limit(http: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        body = padded_body(MAX_BODY_BYTES * 4)
        yield from (body[i : i + 4096] for i in range(0, len(body), 4096))

    response = http.post("/v1/completions", content=chunks())  # an iterator: Transfer-Encoding: chunked
    assert "content-length" not in response.request.headers
    assert assert_openai_error(response, 413, "invalid_request_error")["code"] == "request_too_large"


def test_an_oversized_body_is_a_413_before_it_is_parsed(http: httpx.Client) -> None:
    garbage = b"{" * (MAX_BODY_BYTES + 1)  # would be a 400 if it were parsed
    assert http.post("/generate", content=garbage).status_code == 413


def test_unknown_routes_answer_in_the_openai_error_shape(http: httpx.Client) -> None:
    assert_openai_error(http.get("/v1/engines"), 404, "invalid_request_error")
    assert_openai_error(http.get("/v1/completions"), 405, "invalid_request_error")


# ---- API keys ----

API_ROUTES = [("POST", "/v1/completions", greedy("hi", max_tokens=1)),
              ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
              ("POST", "/generate", {"prompt": "hi", "max_new_tokens": 1}),
              ("GET", "/v1/models", None)]


@pytest.mark.parametrize(("method", "path", "body"), API_ROUTES)
@pytest.mark.parametrize("authorization", [None, "Bearer sk-wrong", f"Bearer {API_KEY}x", f"Basic {API_KEY}",
                                           f"Bearer {API_KEY[:-1]}"],
                         ids=["none", "wrong", "key-plus-one", "basic-scheme", "key-minus-one"])
def test_every_api_route_without_a_valid_key_is_a_401(base_url: str, method: str, path: str, body: dict | None,
                                                      authorization: str | None) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    response = httpx.request(method, base_url + path, json=body, headers=headers, timeout=30)
    assert assert_openai_error(response, 401, "invalid_request_error")["code"] == "invalid_api_key"
    assert API_KEY not in response.text


@pytest.mark.parametrize(("method", "path", "body"), API_ROUTES)
def test_every_api_route_serves_a_valid_key(http: httpx.Client, method: str, path: str,
                                            body: dict | None) -> None:
    assert http.request(method, path, json=body).status_code == 200


def test_health_needs_no_key(base_url: str) -> None:
    assert httpx.get(f"{base_url}/health").status_code == 200


# ---- overload ----


def test_past_the_waiting_bound_requests_get_429_with_retry_after_and_queued_ones_complete(base_url: str) -> None:
    async def scenario(http: httpx.AsyncClient):
        running = await fill_the_engine(http)
        queued = [Stream(http, long_stream(p, max_tokens=20)) for p in PROMPTS[1:]]
        await until(http, lambda h: h["stats"]["num_waiting"] == 2)
        rejected = await asyncio.gather(*(http.post("/v1/completions", json=greedy(p, max_tokens=4))
                                          for p in PROMPTS))
        await asyncio.gather(*(s.task for s in running + queued))
        return running, queued, rejected

    running, queued, rejected = run(scenario, base_url)
    for response in rejected:
        error = assert_openai_error(response, 429, "rate_limit_exceeded")
        assert error["code"] == "engine_overloaded"
        assert int(response.headers["retry-after"]) >= 1
    for stream in running + queued:
        assert (stream.status, stream.payloads[-1], stream.error) == (200, "[DONE]", None)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", greedy(PROMPTS, max_tokens=2), "prompt"),
    ("/v1/completions", greedy(PROMPTS[0], max_tokens=2, n=3), "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 3}, "n"),
])
def test_a_request_that_can_never_fit_the_waiting_bounds_is_a_400_naming_the_limit(http: httpx.Client, path: str,
                                                                                   body: dict, param: str) -> None:
    """On an idle engine: 3 engine requests (prompts x n) where 2 may wait. A 429 would send
    the client back for a retry that can never pass."""
    error = assert_openai_error(http.post(path, json=body), 400, "invalid_request_error", param)
    assert "max_waiting_requests (2)" in error["message"]


def test_the_proxy_sheds_requests_past_the_ingress_queue_with_429(base_url: str) -> None:
    async def scenario(http: httpx.AsyncClient):
        release = asyncio.Event()

        async def slow_upload() -> AsyncIterator[bytes]:
            yield b'{"model": "tiny", '
            await release.wait()
            yield b'"prompt": "hi", "max_tokens": 1}'

        # 16 slow uploads fill the ingress (max_ongoing_requests 16), 4 more wait in the
        # proxy's queue (max_queued_requests 4), and the proxy sheds the next at once. One
        # at a time: Serve counts requests still being assigned as queued, so a burst of
        # simultaneous arrivals is shed even before the ingress is full.
        uploads, shed = [], None
        try:
            for _ in range(20):
                uploads.append(asyncio.create_task(http.post("/v1/completions", content=slow_upload())))
                await asyncio.sleep(0.1)
            for _ in range(40):  # until the last uploads are in the queue
                response = await http.post("/v1/completions", json=greedy("hi", max_tokens=1))
                if response.status_code == 429 and "backpressure" in response.text:
                    shed = response
                    break
                await asyncio.sleep(0.25)
        finally:
            release.set()
        return shed, await asyncio.gather(*uploads)

    shed, uploads = run(scenario, base_url)
    assert shed is not None, "the proxy never shed a request"
    assert shed.headers.get("retry-after") == "1"  # Serve's own response: plain text, not the OpenAI shape
    assert all(not (r.status_code == 429 and "backpressure" in r.text) for r in uploads)  # none shed
    assert {r.status_code for r in uploads} <= {200, 429}  # served, or the engine's own 429


# ---- disconnects ----


def test_a_client_that_leaves_while_queued_is_aborted_and_the_others_are_unaffected(
        base_url: str, offline: LLM) -> None:
    async def scenario(http: httpx.AsyncClient):
        running = await fill_the_engine(http)
        queued = Stream(http, long_stream(PROMPTS[2]))
        await until(http, lambda h: h["stats"]["num_waiting"] == 1)
        await queued.drop()
        health = await until(http, lambda h: h["stats"]["num_waiting"] == 0)
        assert health["stats"]["num_running"] == 2  # the queued one left, the running stay
        assert queued.payloads == []
        await asyncio.gather(*(s.task for s in running))
        return running

    running = run(scenario, base_url)
    expected = offline.generate(PROMPTS[:2], SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True))
    assert [s.text for s in running] == [e.text for e in expected]


def test_a_client_that_leaves_mid_stream_is_aborted_and_the_others_are_unaffected(
        base_url: str, offline: LLM, http: httpx.Client) -> None:
    before = health_of(http)[1]["stats"]["num_generated_tokens"]

    async def scenario(http: httpx.AsyncClient):
        running, leaver = Stream(http, long_stream(PROMPTS[0], max_tokens=300)), Stream(http, long_stream(PROMPTS[2]))
        await asyncio.gather(running.first_chunk.wait(), leaver.first_chunk.wait())
        queued = Stream(http, long_stream(PROMPTS[1], max_tokens=300))  # runs once the leaver is gone
        await until(http, lambda h: h["stats"]["num_waiting"] == 1)
        await leaver.drop()
        await asyncio.gather(running.task, queued.task)
        return [running, queued]

    others = run(scenario, base_url)
    expected = offline.generate(PROMPTS[:2], SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
    assert [s.text for s in others] == [e.text for e in expected]
    assert wait_until_idle(http)["stats"]["num_generated_tokens"] - before < 600 + LONG  # the leaver was cut


def test_a_non_streaming_client_that_leaves_is_aborted(base_url: str, http: httpx.Client) -> None:
    before = health_of(http)[1]["stats"]["num_generated_tokens"]

    async def scenario(http: httpx.AsyncClient):
        request = asyncio.create_task(http.post("/v1/completions", json=greedy(PROMPTS[0], max_tokens=LONG,
                                                                                ignore_eos=True)))
        await until(http, lambda h: h["stats"]["num_running"] == 1)
        request.cancel()  # closes the connection before any response byte
        await asyncio.gather(request, return_exceptions=True)
        return await until(http, lambda h: h["num_active_requests"] == 0 and h["stats"]["num_running"] == 0)

    health = run(scenario, base_url)
    assert health["stats"]["num_generated_tokens"] - before < LONG


# ---- faults ----


def engine_handle():
    return serve.get_deployment_handle("EngineDeployment", APP)


def replica_names(deployment: str) -> list[str]:
    """The live replicas' actor names (a replacement gets a new one)."""
    names = ray.util.list_named_actors(all_namespaces=True)
    return [a["name"] for a in names if a["name"].startswith(f"SERVE_REPLICA::{APP}#{deployment}#")]


def kill_the_replica(deployment: str) -> str:
    [name] = replica_names(deployment)
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return name


def wait_until_served(http: httpx.Client, prompt: str = PROMPTS[0]) -> list[int]:
    """Send requests until one succeeds; the statuses of those that failed meanwhile."""
    failures, deadline = [], time.monotonic() + RECOVERY_TIMEOUT_S
    while True:
        response = http.post("/v1/completions", json=greedy(prompt, max_tokens=4))
        if response.status_code == 200:
            return failures
        assert time.monotonic() < deadline, f"not served again after {RECOVERY_TIMEOUT_S}s: {response.text}"
        failures.append(response.status_code)
        if response.headers.get("content-type", "").startswith("application/json"):
            assert response.json()["error"]["type"] == "server_error"
            assert response.headers["retry-after"] == "1"
        time.sleep(0.2)


def test_an_engine_crash_ends_live_streams_with_an_error_event_and_serve_replaces_the_engine(
        base_url: str, http: httpx.Client) -> None:
    [old_name] = replica_names("EngineDeployment")

    async def scenario(http: httpx.AsyncClient):
        streams = await fill_the_engine(http)
        await engine_handle().fail_next_step.remote()
        await asyncio.gather(*(s.task for s in streams))
        return streams

    for stream in run(scenario, base_url):
        assert stream.status == 200 and stream.payloads[-1] == "[DONE]"
        assert stream.error["type"] == "server_error"
        assert "error" in json.loads(stream.payloads[-2])  # the error event comes last, then [DONE]
    assert set(wait_until_served(http)) <= {503}
    wait_for(lambda: replica_names("EngineDeployment") not in ([], [old_name]), RECOVERY_TIMEOUT_S, 0.5)


def test_a_dead_engine_makes_health_and_requests_a_503_with_retry_after(tiny_gpt2_dir: Path, base_url: str) -> None:
    # Its own app, whose engine Serve health-checks too rarely to replace within the test:
    # the dead engine stays up to be asked.
    options = deployment_options(engine_health_check_period_s=600)
    serve.run(faulty_app(app_args(tiny_gpt2_dir, api_keys=[]), options), name="dead", route_prefix="/dead")
    try:
        serve.get_deployment_handle("EngineDeployment", "dead").fail_next_step.remote().result()
        with httpx.Client(base_url=f"{base_url}/dead", timeout=60) as dead:
            crashed = dead.post("/v1/completions", json=greedy(PROMPTS[0], max_tokens=4))  # its step raises
            assert assert_openai_error(crashed, 503, "server_error")["code"] == "service_unavailable"
            status, health = health_of(dead)
            assert (status, health["status"]) == (503, "dead")
            response = dead.post("/v1/completions", json=greedy(PROMPTS[0], max_tokens=4))
            assert assert_openai_error(response, 503, "server_error")["code"] == "service_unavailable"
            assert response.headers["retry-after"] == "1"
    finally:
        serve.delete("dead")


def test_a_killed_ingress_replica_is_replaced_and_service_resumes(http: httpx.Client) -> None:
    killed = kill_the_replica("Ingress")
    assert set(wait_until_served(http)) <= {503}  # the proxy keeps the port and answers meanwhile
    assert killed not in replica_names("Ingress")


NO_REPLICA = "no engine replica is up"  # the Ingress's own 503, given without waiting for one


def assert_unavailable(response: httpx.Response) -> str:
    """A JSON 503 in OpenAI's shape with Retry-After; its message."""
    error = assert_openai_error(response, 503, "server_error")
    assert error["code"] == "service_unavailable" and response.headers["retry-after"] == "1"
    return error["message"]


def test_a_killed_engine_replica_fails_fast_and_loud_until_its_replacement_serves(
        base_url: str, http: httpx.Client) -> None:
    [old_name] = replica_names("EngineDeployment")

    async def scenario(http: httpx.AsyncClient):
        stream = Stream(http, long_stream(PROMPTS[0]))
        await stream.first_chunk.wait()
        whole = asyncio.create_task(http.post("/v1/completions", json=greedy(PROMPTS[1], LONG, ignore_eos=True)))
        await until(http, lambda health: health["stats"]["num_running"] == 2)  # both mid-generation
        replica_process("EngineDeployment").kill()  # SIGKILL
        await stream.task
        return stream, await whole

    stream, whole = run(scenario, base_url)
    # the stream in flight: an error event, then [DONE]
    assert stream.status == 200 and stream.payloads[-1] == "[DONE]"
    assert stream.error["code"] == "service_unavailable" and "error" in json.loads(stream.payloads[-2])
    assert_unavailable(whole)  # the non-streaming request in flight
    # Sent during the outage: the 503 comes from the Ingress's replica watch, not from a wait
    # for the replacement (which would have served it: a 200).
    assert NO_REPLICA in assert_unavailable(http.post("/v1/completions", json=greedy(PROMPTS[2], max_tokens=4)))
    status, health = health_of(http)
    assert status == 503 and NO_REPLICA in health["error"]["message"]
    assert set(wait_until_served(http)) <= {503}
    assert old_name not in replica_names("EngineDeployment")


def test_a_killed_tokenizer_replica_is_replaced_and_service_resumes(http: httpx.Client) -> None:
    killed = kill_the_replica("TokenizerDeployment")
    # short prompts never reach it: the ingress encodes them itself, outage or not
    assert http.post("/v1/completions", json=greedy(PROMPTS[0], max_tokens=4)).status_code == 200
    # a prompt too long for the ingress to encode itself: the tokenizer deployment's to encode
    assert set(wait_until_served(http, words(DEFAULT_LOCAL_MAX_CHARS // 4 + 1))) <= {503}
    assert killed not in replica_names("TokenizerDeployment")


def test_deleting_an_app_lets_its_live_streams_finish(tiny_gpt2_dir: Path, base_url: str) -> None:
    serve.run(faulty_app(app_args(tiny_gpt2_dir, api_keys=[])), name="draining", route_prefix="/draining")
    body = long_stream(PROMPTS[0], max_tokens=300) | {"stream_options": {"include_usage": True}}
    deleted: list[bool] = []

    def delete() -> None:
        serve.delete("draining")
        deleted.append(True)

    with httpx.stream("POST", f"{base_url}/draining/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        deleter = threading.Thread(target=delete)
        deleter.start()
        payloads = [first] + [line for line in lines if line]
    deleter.join(timeout=60)
    assert payloads[-1] == "data: [DONE]"
    assert json.loads(payloads[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 300
    assert deleted == [True]  # the delete returned once its streams had finished
    assert httpx.get(f"{base_url}/draining/health").status_code == 404


# ---- logs ----


def test_prompts_and_keys_never_reach_the_logs(base_url: str, http: httpx.Client) -> None:
    secret = f"secret-prompt-{uuid.uuid4().hex}"
    http.post("/v1/completions", json=greedy(secret, max_tokens=2))
    http.post("/v1/completions", json=greedy(secret, temperature=-1))
    http.post("/v1/completions", json=greedy(secret, max_tokens=5000))
    http.post("/v1/chat/completions", json={"messages": [{"role": secret, "content": secret}]})
    http.post("/v1/completions", content=b'{"prompt": "' + secret.encode() + b'", ')
    httpx.post(f"{base_url}/v1/completions", json=greedy(secret), headers={"Authorization": f"Bearer {secret}"})
    with http.stream("POST", "/v1/completions", json=long_stream(secret)) as response:
        next(response.iter_lines())
    wait_until_idle(http)
    time.sleep(1)  # log handlers flush
    logs_dir = ray_logs_dir()
    files = [f for f in logs_dir.rglob("*") if f.is_file()]
    assert any("serve" in f.parts for f in files)
    leaks = [str(f) for f in files if secret.encode() in f.read_bytes() or API_KEY.encode() in f.read_bytes()]
    assert leaks == []
