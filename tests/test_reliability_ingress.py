# test_reliability.py's overload, disconnects and faults again, with the HTTP routes in an
# Ingress deployment of their own (`ingress: deployment`, as configs/scale-out.yaml runs):
# here the engine's chunks, errors and cancels cross a Ray handle between two replicas, and
# the proxy's queue is the Ingress's, and a dead engine replica leaves the Ingress alive to
# say so (the chaos test below). What the routes do with a request's body and keys, the
# tokenizer's outage and the logs are the same either way: test_reliability.py checks them once.
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.http_helpers import PROMPTS, Stream, assert_openai_error, greedy, health_of, until
from tests.serve_helpers import replica_process
from tests.test_reliability import (  # noqa: F401 - the fixtures and tests this module runs again
    LONG, base_url, http_headers, kill_the_replica, long_stream, offline, replica_names, run,
    the_serving_engine_is_idle_and_intact_after_each_test,
    test_a_client_that_leaves_mid_stream_is_aborted_and_the_others_are_unaffected,
    test_a_client_that_leaves_while_queued_is_aborted_and_the_others_are_unaffected,
    test_a_dead_engine_makes_health_and_requests_a_503_with_retry_after,
    test_a_non_streaming_client_that_leaves_is_aborted,
    test_an_engine_crash_ends_live_streams_with_an_error_event_and_serve_replaces_the_engine,
    test_past_the_waiting_bound_requests_get_429_with_retry_after_and_queued_ones_complete,
    test_the_proxy_sheds_requests_past_the_ingress_queue_with_429,
    wait_until_served,
)

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def ingress() -> str:
    return "deployment"


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
