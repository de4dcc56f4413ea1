# test_reliability.py's overload, disconnects and faults again, with the HTTP routes in an
# Ingress deployment of their own (`ingress: deployment`, as configs/scale-out.yaml runs):
# here the engine's chunks, errors and cancels cross a Ray handle between two replicas, and
# the proxy's queue is the Ingress's. What the routes do with a request's body and keys, the
# tokenizer's outage and the logs are the same either way: test_reliability.py checks them once.
from __future__ import annotations

import httpx
import pytest

from tests.test_reliability import (  # noqa: F401 - the fixtures and tests this module runs again
    base_url, http_headers, kill_the_replica, offline, replica_names, the_serving_engine_is_idle_and_intact_after_each_test,
    test_a_client_that_leaves_mid_stream_is_aborted_and_the_others_are_unaffected,
    test_a_client_that_leaves_while_queued_is_aborted_and_the_others_are_unaffected,
    test_a_dead_engine_makes_health_and_requests_a_503_with_retry_after,
    test_a_killed_engine_replica_is_replaced_and_service_resumes,
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
