# Structured outputs over real HTTP, against real Ray Serve serving the tiny checkpoint: every
# shape clients send (response_format, vLLM's structured_outputs, the guided_* aliases), on
# completions and chat, streamed and not, with n > 1; every output that ends by itself is
# valid (json.loads + jsonschema, re.fullmatch, one of the choices). A schema, regex or
# grammar that does not compile, and two constraints in one request, are 400s naming them;
# /metrics counts the constrained requests and the compiles.
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deployments.app import build_app
from tests.http_helpers import assert_openai_error, sse_payloads
from tests.serve_helpers import MODEL, running_app, tiny_app_args
from tests.structured_helpers import CHOICES, GRAMMAR, REGEX, SCHEMA, is_valid
from tests.test_observability import scrape_until

pytestmark = pytest.mark.serve

# (route, the request's constraint fields, what a complete output must be)
APP = "structured"
SHAPES = [
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}},
     "json_schema"),
    ("chat", {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}}, "json_schema"),
    ("chat", {"response_format": {"type": "json_object"}}, "json_object"),
    ("completions", {"structured_outputs": {"json": SCHEMA}}, "json_schema"),
    ("chat", {"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema"),
    ("completions", {"structured_outputs": {"regex": REGEX}}, "regex"),
    ("chat", {"structured_outputs": {"choice": CHOICES}}, "choice"),
    ("completions", {"structured_outputs": {"grammar": GRAMMAR}}, "grammar"),
    ("completions", {"structured_outputs": {"json_object": True}}, "json_object"),
    ("completions", {"guided_json": SCHEMA}, "json_schema"),
    ("chat", {"guided_regex": REGEX}, "regex"),
    ("completions", {"guided_choice": CHOICES}, "choice"),
    ("chat", {"guided_grammar": GRAMMAR}, "grammar"),
]


@pytest.fixture(scope="module")
def server(tiny_gpt2_dir: Path) -> Iterator[tuple[str, str]]:
    """(API base URL, metrics export URL)."""
    app = build_app(tiny_app_args(tiny_gpt2_dir, engine={"num_kv_blocks": 128, "max_num_seqs": 32}))
    with running_app(app, APP) as instance:
        yield instance.url, instance.metrics_url


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=120) as client:
        yield client


def body(route: str, fields: dict, **more) -> dict:
    prompt = {"prompt": "Answer:"} if route == "completions" else {"messages": [{"role": "user", "content": "Go"}]}
    return {"model": MODEL, "max_tokens": 48, "temperature": 1.0, "seed": 1, "n": 3, **prompt, **fields, **more}


def path(route: str) -> str:
    return "/v1/completions" if route == "completions" else "/v1/chat/completions"


def whole_choices(http: httpx.Client, route: str, request: dict) -> list[tuple[str, str]]:
    """(text, finish_reason) per choice."""
    response = http.post(path(route), json=request)
    assert response.status_code == 200, response.text
    pick = (lambda c: c["text"]) if route == "completions" else (lambda c: c["message"]["content"])
    return [(pick(c), c["finish_reason"]) for c in sorted(response.json()["choices"], key=lambda c: c["index"])]


def streamed_choices(http: httpx.Client, route: str, request: dict) -> list[tuple[str, str]]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    with http.stream("POST", path(route), json=request | {"stream": True}) as response:
        assert response.status_code == 200, response.read()
        payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    for payload in payloads[:-1]:
        for choice in json.loads(payload)["choices"]:
            piece = choice["text"] if route == "completions" else choice["delta"].get("content") or ""
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
            if choice["finish_reason"] is not None:
                reasons[choice["index"]] = choice["finish_reason"]
    return [(texts[i], reasons[i]) for i in sorted(texts)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("route", "fields", "kind"), SHAPES)
def test_every_output_that_ends_by_itself_is_valid(http, route, fields, kind, stream):
    read = streamed_choices if stream else whole_choices
    choices = read(http, route, body(route, fields))
    assert len(choices) == 3
    ended = [text for text, reason in choices if reason == "stop"]
    assert all(is_valid(kind, text) for text in ended), choices
    assert all(reason in ("stop", "length") for _, reason in choices)
    assert ended or kind == "json_object", choices  # random weights may write an object's keys on and on


def test_greedy_whole_and_streamed_agree_with_logprobs_and_a_stop_string(http):
    request = body("completions", {"guided_regex": REGEX}, temperature=0, n=1, logprobs=1)
    [(whole, reason)] = whole_choices(http, "completions", request)
    assert reason == "stop" and is_valid("regex", whole)
    assert streamed_choices(http, "completions", request) == [(whole, "stop")]
    response = http.post("/v1/completions", json=request)
    logprobs = response.json()["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == whole + "<|endoftext|>"  # the EOS that ended it, as any stop
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    cut = http.post("/v1/completions", json=request | {"stop": ["-"]}).json()["choices"][0]
    assert (cut["text"], cut["finish_reason"]) == (whole[:2], "stop")  # REGEX puts its "-" third


def test_text_response_format_constrains_nothing(http):
    request = {"model": MODEL, "prompt": "Hi", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    plain = http.post("/v1/completions", json=request).json()["choices"][0]["text"]
    text = http.post("/v1/completions", json=request | {"response_format": {"type": "text"}})
    assert text.status_code == 200 and text.json()["choices"][0]["text"] == plain


@pytest.mark.parametrize(("fields", "param", "why"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "objekt"}}}},
     "response_format", "objekt"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "compile"),
    ({"guided_regex": "[z-a]"}, "guided_regex", "compile"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar", "undefined_rule"),
    ({"guided_grammar": "this is not EBNF"}, "guided_grammar", "compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}}, "response_format", "json_schema"),
])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_constraint_that_does_not_compile_is_a_400_naming_its_field(http, fields, param, why, stream):
    response = http.post("/v1/completions", json=body("completions", fields, stream=stream))
    error = assert_openai_error(response, 400, "invalid_request_error", param)
    assert why in error["message"]


@pytest.mark.parametrize(("fields", "names"), [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, ("response_format", "guided_regex")),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, ("structured_outputs.regex", "structured_outputs.choice")),
    ({"structured_outputs": {"json_object": True}, "guided_json": SCHEMA},
     ("structured_outputs.json_object", "guided_json")),
])
def test_two_constraints_are_a_400_naming_both(http, fields, names):
    response = http.post("/v1/chat/completions", json=body("chat", fields))
    error = assert_openai_error(response, 400, "invalid_request_error", names[1])
    assert all(name in error["message"] for name in names)


def test_metrics_count_constrained_requests_compiles_and_mask_time(server, http):
    _, metrics_url = server
    for _ in range(2):  # the second compiles nothing: the replica's cache has it
        assert http.post("/v1/completions", json=body("completions", {"guided_choice": ["on", "off"]})).status_code == 200
    at_least = lambda n: lambda v: v >= n  # noqa: E731
    scrape_until(metrics_url, APP, {
        ("ray_rayinfer_constrained_requests_total",): at_least(6),  # n = 3, twice
        ("ray_rayinfer_grammar_compiles_total",): at_least(1),
        ("ray_rayinfer_grammar_compile_seconds_total",): lambda v: v > 0,
        ("ray_rayinfer_grammar_mask_seconds_count",): at_least(2),
    })
