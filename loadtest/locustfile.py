"""Locust users streaming from rayinfer (or any OpenAI-compatible server).

    locust -f loadtest/locustfile.py --headless -u 32 -r 8 -t 60s --host http://127.0.0.1:8000 \
        --csv bench_out/locust --prompt-tokens 128 --max-tokens 64

Each request is one entry under its path ("POST /v1/completions", whole-stream time). Parsed
from the stream as it arrives, as their own entries (ms):

    METRIC ttft / itl / tpot / e2e          first content, gaps between content chunks,
                                            time per output token after the first, whole request
    METRIC server_tokenize / server_queue_wait / server_prefill / server_ttft
                                            the server's own `server_timing`, where it sends one
    TOKENS output_tokens                    one sample per output token: its "Requests/s" is tokens/s

/generate streams plain text, so it reports under METRIC-GENERATE with one "token" per HTTP
chunk received. A non-200 answer, a broken stream or an error event in the stream is a
failure of the request's entry. Workload options (also LOCUST_<NAME> environment variables):
--prompt-tokens/--max-tokens with --*-dist fixed|uniform|normal and --*-spread, --endpoint-weights
"completions=1,chat=0,generate=0", --model, --ignore-eos.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

from locust import HttpUser, constant, events, task
from locust.env import Environment

if __package__ in (None, ""):  # locust imports this file by path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.client.prompts import Distribution, make_prompt
from loadtest.client.sse_reader import SSEParser, StreamRecord

logger = logging.getLogger(__name__)

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "generate": "/generate"}
TOKENS_ENTRY = ("output_tokens", "TOKENS")


@events.init_command_line_parser.add_listener
def add_workload_arguments(parser: Any) -> None:
    group = parser.add_argument_group("rayinfer workload")
    for name, default in (("prompt-tokens", 128), ("max-tokens", 64)):
        env = "LOCUST_" + name.upper().replace("-", "_")
        group.add_argument(f"--{name}", type=int, default=default, env_var=env, help="mean length in tokens")
        group.add_argument(
            f"--{name}-dist", choices=["fixed", "uniform", "normal"], default="fixed", env_var=env + "_DIST"
        )
        group.add_argument(
            f"--{name}-spread", type=float, default=None, env_var=env + "_SPREAD",
            help="uniform: half-width; normal: standard deviation (default: a quarter of the mean)",
        )
    group.add_argument(
        "--endpoint-weights", default="completions=1", env_var="LOCUST_ENDPOINT_WEIGHTS",
        help="relative weights of completions, chat and generate, e.g. completions=3,generate=1",
    )
    group.add_argument("--model", default=None, env_var="LOCUST_MODEL", help="model field (omitted if unset)")
    group.add_argument("--ignore-eos", action="store_true", env_var="LOCUST_IGNORE_EOS")


def parse_weights(text: str) -> dict[str, float]:
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in PATHS:
            raise ValueError(f"unknown endpoint {name!r} in --endpoint-weights; known: {sorted(PATHS)}")
        weights[name] = float(value or 1)
    if not any(weight > 0 for weight in weights.values()):
        raise ValueError(f"--endpoint-weights {text!r} gives no endpoint a positive weight")
    return weights


class LLMUser(HttpUser):
    """Closed loop: each user sends its next request as soon as the last one finished."""

    wait_time = constant(0)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.rng = random.Random()
        self.prompt_tokens = _distribution(options, "prompt_tokens")
        self.max_tokens = _distribution(options, "max_tokens")
        weights = parse_weights(options.endpoint_weights)
        self.endpoints, self.weights = list(weights), list(weights.values())
        self.model, self.ignore_eos = options.model, options.ignore_eos

    @task
    def send(self) -> None:
        endpoint = self.rng.choices(self.endpoints, self.weights)[0]
        prompt = make_prompt(self.prompt_tokens.sample(self.rng), self.rng)
        record = self._stream(endpoint, self._body(endpoint, prompt, self.max_tokens.sample(self.rng)))
        report_stream(self.environment, record, "METRIC-GENERATE" if endpoint == "generate" else "METRIC")

    def _body(self, endpoint: str, prompt: str, max_tokens: int) -> dict[str, Any]:
        if endpoint == "generate":
            return {"prompt": prompt, "max_new_tokens": max_tokens, "stream": True}
        body: dict[str, Any] = {"max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        body.update({"messages": [{"role": "user", "content": prompt}]} if endpoint == "chat" else {"prompt": prompt})
        if self.model is not None:
            body["model"] = self.model
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    def _stream(self, endpoint: str, body: dict[str, Any]) -> StreamRecord:
        record = StreamRecord(start=time.perf_counter(), api="chat" if endpoint == "chat" else "completions")
        path = PATHS[endpoint]
        with self.client.post(path, json=body, stream=True, catch_response=True, name=path) as response:
            if response.status_code != 200:
                record.fail(_http_error(response))
            else:
                _read(response, record, is_sse=endpoint != "generate")
            record.end = time.perf_counter()
            response.request_meta["response_time"] = record.e2e_s * 1000
            if record.error is not None:
                response.failure(record.error)
            else:
                response.success()
        return record


def _distribution(options: Any, name: str) -> Distribution:
    return Distribution(getattr(options, f"{name}_dist"), getattr(options, name), getattr(options, f"{name}_spread"))


def _http_error(response: Any) -> str:
    if response.status_code == 0:  # no answer at all: refused, reset, timed out
        return f"connection failed: {response.error}"
    return f"HTTP {response.status_code}: {(response.text or '')[:300]}"


def _read(response: Any, record: StreamRecord, is_sse: bool) -> None:
    parser = SSEParser()
    try:
        # chunk_size=None: each piece as it arrives, not after filling a buffer.
        for chunk in response.iter_content(chunk_size=None):
            now = time.perf_counter()
            if not is_sse:
                if chunk:
                    record.add_content(now)
                continue
            for data in parser.feed(chunk):
                record.add_event(data, now)
    except Exception as error:  # the stream broke mid-way: a failed request, not a crashed user
        record.fail(f"stream broken: {type(error).__name__}: {error}")


def report_stream(environment: Environment, record: StreamRecord, request_type: str) -> None:
    """Fire the stream's timings as their own entries; failed streams only count as failures."""
    if not record.is_ok:
        return
    samples = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2e": record.e2e_s}
    for name, seconds in samples.items():
        if seconds is not None:
            _fire(environment, request_type, name, seconds * 1000)
    for gap in record.itl_s:
        _fire(environment, request_type, "itl", gap * 1000)
    for key, milliseconds in record.server_timing.items():
        _fire(environment, request_type, "server_" + key.removesuffix("_ms"), milliseconds)
    for _ in range(record.output_tokens):
        _fire(environment, TOKENS_ENTRY[1], TOKENS_ENTRY[0], 0.0)


def _fire(environment: Environment, request_type: str, name: str, milliseconds: float) -> None:
    environment.events.request.fire(
        request_type=request_type, name=name, response_time=milliseconds, response_length=0,
        exception=None, context={},
    )


@events.test_stop.add_listener
def log_summary(environment: Environment, **_: Any) -> None:
    stats = environment.stats
    tokens = stats.entries.get(TOKENS_ENTRY)
    duration = stats.total.last_request_timestamp - stats.total.start_time if stats.total.last_request_timestamp else 0
    if tokens is None or duration <= 0:
        logger.info("no output tokens recorded")
        return
    ttft = stats.entries.get(("ttft", "METRIC"))
    ttft_text = f", TTFT p50 {ttft.get_response_time_percentile(0.5):.0f} ms" if ttft else ""
    logger.info(
        "output tokens: %d in %.1f s = %.1f tok/s%s",
        tokens.num_requests, duration, tokens.num_requests / duration, ttft_text,
    )
