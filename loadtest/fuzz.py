"""The HTTP API fuzzed as a property: bodies generated from the app's own /openapi.json
(schemathesis, over hypothesis), valid ones and invalid ones, for every POST route.

For every body: no 5xx; every 4xx in OpenAI's error shape (but the proxy's own 429); no
stream that ends in a server error. A 503 with Retry-After is the deliberate answer of an
engine that is down or restarting, and in a fuzz run nothing but a body can have taken it
down: it fails the property too, as "the engine went down". After the run the engine is up
and idle, with every KV block back in the pool.

    python -m loadtest.fuzz --minutes 10 [--url http://127.0.0.1:8000] [--api-key KEY]

against a running server (`serve run configs/gpt2.yaml`) prints the bodies sent by route
and status, and every failure; tests/test_fuzz.py runs a short one in the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import hypothesis
import requests
import schemathesis
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode

TIMEOUT_S = 120.0


@dataclass
class Tally:
    """What a run sent and what broke the property."""

    sent: Counter[tuple[str, int]] = field(default_factory=Counter)  # (route, status) -> bodies
    failures: list[str] = field(default_factory=list)

    @property
    def num_bodies(self) -> int:
        return sum(self.sent.values())

    def summary(self) -> dict:
        routes: dict[str, dict[int, int]] = {}
        for (route, status), count in sorted(self.sent.items()):
            routes.setdefault(route, {})[status] = count
        return {"bodies_sent": self.num_bodies, "routes": routes, "failures": self.failures}


def post_cases(base_url: str, headers: dict[str, str]) -> st.SearchStrategy[Case]:
    """Cases for every POST route the app documents, in both of schemathesis' modes."""
    document = httpx.get(f"{base_url}/openapi.json", headers=headers, timeout=30).raise_for_status().json()
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]
    return st.one_of(*(op.as_strategy(mode) for op in operations if op.method.upper() == "POST"
                       for mode in GenerationMode))


def violation(response: schemathesis.Response) -> str | None:
    """What the response breaks of the property, or None."""
    status, kind = response.status_code, _header(response, "content-type")
    if status == 503 and _header(response, "retry-after"):
        return f"the engine went down: {response.text[:200]}"
    if status >= 500:
        return f"{status} without Retry-After: {response.text[:200]}"
    if status == 429 and not kind.startswith("application/json"):
        return None  # the proxy's own shedding, plain text by Serve's design
    if status >= 400 and not _is_openai_error(response):
        return f"{status} not in OpenAI's error shape: {response.text[:200]}"
    if kind.startswith("text/event-stream") and '"server_error"' in response.text:
        return f"a stream ended in a server error: {response.text[-300:]}"
    return None


def _header(response: schemathesis.Response, name: str) -> str:
    """A header's value: schemathesis keeps each as a list, under its name as sent."""
    values = next((v for k, v in response.headers.items() if k.lower() == name), [])
    return values[0] if values else ""


def _is_openai_error(response: schemathesis.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}


def fuzz(base_url: str, headers: dict[str, str], max_examples: int, tally: Tally, derandomize: bool = False) -> None:
    """max_examples bodies; raises AssertionError naming the first that breaks the property.
    Not shrunk: once a body has taken the engine down, every smaller one meets the 503 too,
    and the smallest would be an innocent one."""

    def send(case: Case) -> None:
        try:
            response = case.call(base_url=base_url, headers=headers, timeout=TIMEOUT_S)
        except requests.RequestException as exc:  # no answer at all: as much a failure as a 500
            raise AssertionError(f"{case.method} {case.path} {_shown(case.body)}: no answer ({type(exc).__name__})")
        tally.sent[(f"{case.method} {case.path}", response.status_code)] += 1
        broken = violation(response)
        assert broken is None, f"{case.method} {case.path} {_shown(case.body)}: {broken}"

    settings = hypothesis.settings(max_examples=max_examples, deadline=None, derandomize=derandomize,
                                   database=None, suppress_health_check=list(hypothesis.HealthCheck),
                                   phases=[hypothesis.Phase.generate])
    settings(hypothesis.given(post_cases(base_url, headers))(send))()


def _shown(body: object) -> str:
    try:
        text = json.dumps(body)
    except (TypeError, ValueError):
        text = repr(body)
    return text if len(text) <= 400 else text[:400] + "..."


def engine_at_rest(base_url: str, headers: dict[str, str], timeout_s: float = 90) -> str | None:
    """None once /health says 200, nothing running or waiting and no KV block used; else
    what /health said last."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.get(f"{base_url}/health", headers=headers, timeout=30)
        health = response.json()
        stats = health.get("stats", {})
        if response.status_code == 200 and health.get("num_active_requests") == 0 and stats.get("num_running") == 0 \
                and stats.get("num_waiting") == 0 and stats.get("num_kv_blocks_used") == 0:
            return None
        if time.monotonic() > deadline:
            return f"/health {response.status_code}: {json.dumps(health)[:400]}"
        time.sleep(0.2)


def run(base_url: str, headers: dict[str, str], minutes: float, round_examples: int = 200) -> Tally:
    """Rounds of round_examples fresh random bodies until `minutes` are up; a round stops at
    its first failure, which is kept, and the next round goes on."""
    tally, deadline = Tally(), time.monotonic() + 60 * minutes
    while time.monotonic() < deadline:
        try:
            fuzz(base_url, headers, round_examples, tally)
        except AssertionError as failure:
            tally.failures.append(str(failure).splitlines()[0])
        print(f"{tally.num_bodies} bodies sent, {len(tally.failures)} failures", file=sys.stderr, flush=True)
    at_rest = engine_at_rest(base_url, headers)
    if at_rest is not None:
        tally.failures.append(f"engine not at rest after the run: {at_rest}")
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--api-key", default=os.environ.get("RAYINFER_API_KEYS", "").split(",")[0] or None)
    args = parser.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    summary = run(args.url.rstrip("/"), headers, args.minutes).summary()
    print(json.dumps({"url": args.url, "minutes": args.minutes, **summary}, indent=2))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
