# The load-test client: SSE parsing, latency maths, exact-length prompts, bench.py end to end
# and a headless locust run. A small fake OpenAI SSE server stands in for rayinfer here
# because the client is what is under test; it can also inject a mid-stream error event.
from __future__ import annotations

import asyncio
import gc
import json
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from loadtest import bench
from bench.micro.ceiling import median_run
from bench.engine_bench import Result
from loadtest.client.headless import run_locust
from loadtest.client.http_target import BenchConfig, Target, heap_frozen, request_body, run_benchmark
from loadtest.client.offline_target import OfflineTarget, run_offline
from loadtest.client.prompts import WORDS, Distribution, make_prompt
from loadtest.client.results import BenchResult, Summary, percentile, summarize
from loadtest.client.sse_reader import SSEParser, StreamRecord, parse_chunk
from loadtest.client.tables import repeats_table
from loadtest.client.workload import Workload, arrival_gaps

REPO = Path(__file__).resolve().parent.parent
SERVER_TIMING = {"tokenize_ms": 1.5, "queue_wait_ms": 2.5, "prefill_ms": 3.5, "ttft_ms": 8.0}

# ---- the fake server ----


def _event(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


async def _openai_stream(body: dict, is_chat: bool, fail_after: int | None) -> AsyncIterator[bytes]:
    for index in range(body["max_tokens"]):
        if index == fail_after:
            yield _event({"error": {"message": "engine died", "type": "server_error", "param": None, "code": 500}})
            yield _event("[DONE]")
            return
        await asyncio.sleep(0.002)
        choice = {"index": 0, "delta": {"content": " tok"}} if is_chat else {"index": 0, "text": " tok"}
        yield _event({"choices": [choice]})
    usage = {"prompt_tokens": 0, "completion_tokens": body["max_tokens"], "total_tokens": body["max_tokens"]}
    final = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage}
    yield _event({**final, "server_timing": SERVER_TIMING})
    yield _event("[DONE]")


async def _plain_stream(body: dict) -> AsyncIterator[bytes]:
    for _ in range(body["max_new_tokens"]):
        await asyncio.sleep(0.002)
        yield b" tok"


def _fake_app(fail_after: int | None) -> Starlette:
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        is_chat = request.url.path.endswith("/chat/completions")
        return StreamingResponse(_openai_stream(body, is_chat, fail_after), media_type="text/event-stream")

    async def generate(request: Request) -> StreamingResponse:
        return StreamingResponse(_plain_stream(await request.json()), media_type="text/plain")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/generate", generate, methods=["POST"]),
    ]
    return Starlette(routes=routes)


@pytest.fixture(scope="module")
def serve_fake() -> Iterator[callable]:
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(fail_after: int | None = None) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(_fake_app(fail_after), log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append((server, thread))
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(5)


@pytest.fixture(scope="module")
def fake_url(serve_fake) -> str:
    return serve_fake()


@pytest.fixture(scope="module")
def failing_url(serve_fake) -> str:
    return serve_fake(fail_after=2)


# ---- SSE ----

CANNED = (
    b": keep-alive comment\r\n\r\n"
    b'data: {"choices":[{"index":0,"text":" caf\xc3\xa9"}]}\r\n\r\n'
    b"event: message\n"
    b'data: {"choices":[{"index":0,\n'
    b'data: "text":" two"}]}\n\n'
    b'data: {"choices":[],"usage":{"completion_tokens":2},"server_timing":{"prefill_ms":3.5}}\n\n'
    b"data: [DONE]\n\n"
)
EXPECTED_EVENTS = [
    '{"choices":[{"index":0,"text":" café"}]}',
    '{"choices":[{"index":0,\n"text":" two"}]}',
    '{"choices":[],"usage":{"completion_tokens":2},"server_timing":{"prefill_ms":3.5}}',
    "[DONE]",
]


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 7, 64, len(CANNED)])
def test_sse_parser_yields_the_same_events_however_the_bytes_are_split(piece: int) -> None:
    parser = SSEParser()
    events = [event for start in range(0, len(CANNED), piece) for event in parser.feed(CANNED[start : start + piece])]
    assert events + parser.flush() == EXPECTED_EVENTS


def test_sse_parser_splits_inside_a_multibyte_character() -> None:
    split_at = CANNED.index(b"\xa9")  # between the two bytes of "é"
    parser = SSEParser()
    assert parser.feed(CANNED[:split_at]) == []
    assert parser.feed(CANNED[split_at:])[0] == EXPECTED_EVENTS[0]


def test_sse_parser_flushes_an_event_left_open_at_the_end_of_the_stream() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: [DONE]") == []
    assert parser.flush() == ["[DONE]"]


def test_parse_chunk_reads_completion_text_and_chat_deltas() -> None:
    assert parse_chunk('{"choices":[{"text":" a"}]}').text == " a"
    assert parse_chunk('{"choices":[{"delta":{"content":" b"}}]}', api="chat").text == " b"
    assert parse_chunk('{"choices":[{"delta":{"role":"assistant"}}]}', api="chat").text == ""
    assert parse_chunk("[DONE]").is_done


def test_parse_chunk_reads_server_timing_and_usage() -> None:
    chunk = parse_chunk(json.dumps({"choices": [], "usage": {"completion_tokens": 7}, "server_timing": SERVER_TIMING}))
    assert chunk.usage == {"completion_tokens": 7}
    assert chunk.server_timing == SERVER_TIMING


@pytest.mark.parametrize(
    "data", ['{"error": {"message": "engine died", "type": "server_error"}}', '{"error": "engine died"}']
)
def test_parse_chunk_reads_error_events_in_both_shapes(data: str) -> None:
    assert parse_chunk(data).error == "engine died"


def test_stream_record_times_first_token_gaps_and_tokens_per_output_token() -> None:
    record = StreamRecord(start=10.0)
    record.add_event('{"choices":[{"text":""}]}', 10.05)  # empty text is not a token
    record.add_event('{"choices":[{"text":" a"}]}', 10.1)
    record.add_event('{"choices":[{"text":" b"}]}', 10.3)
    record.add_event('{"choices":[{"text":" c"}]}', 10.4)
    record.add_event('{"choices":[],"usage":{"completion_tokens":5}}', 10.4)
    record.end = 10.5
    assert record.is_ok
    assert record.ttft_s == pytest.approx(0.1)
    assert record.itl_s == pytest.approx([0.2, 0.1])
    assert record.output_tokens == 5  # usage wins over the 3 content chunks
    assert record.tpot_s == pytest.approx((0.5 - 0.1) / 4)
    assert record.e2e_s == pytest.approx(0.5)


def test_stream_record_counts_content_chunks_without_usage() -> None:
    record = StreamRecord(start=0.0)
    for now in (0.1, 0.2, 0.3):
        record.add_event('{"choices":[{"text":" a"}]}', now)
    record.end = 0.3
    assert record.output_tokens == 3


def test_stream_record_with_an_error_event_is_a_failure() -> None:
    record = StreamRecord(start=0.0)
    record.add_event('{"choices":[{"text":" a"}]}', 0.1)
    record.add_event('{"error": {"message": "engine died"}}', 0.2)
    record.add_event("[DONE]", 0.2)
    record.end = 0.2
    assert not record.is_ok
    assert record.error == "engine died"


# ---- maths ----


SAMPLES = [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0], list(np.random.default_rng(0).exponential(size=101))]


@pytest.mark.parametrize("values", SAMPLES)
@pytest.mark.parametrize("q", [0, 50, 95, 99, 100])
def test_percentile_interpolates_linearly_like_numpy(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_summarize_scales_values_and_reports_mean_and_percentiles() -> None:
    summary = summarize([0.001 * v for v in range(1, 101)], scale=1000)
    assert summary.mean == pytest.approx(50.5)
    assert summary.p50 == pytest.approx(50.5)
    assert summary.p95 == pytest.approx(95.05)
    assert summary.p99 == pytest.approx(99.01)


def test_summarize_of_no_values_is_all_none() -> None:
    assert summarize([]) == Summary(None, None, None, None)


def test_fixed_arrivals_are_evenly_spaced_and_poisson_arrivals_average_the_rate() -> None:
    assert arrival_gaps(4, 2.0, "fixed", random.Random(0)) == [0.0, 0.5, 0.5, 0.5]
    gaps = arrival_gaps(20001, 4.0, "poisson", random.Random(0))
    assert gaps[0] == 0.0
    assert sum(gaps[1:]) / 20000 == pytest.approx(0.25, rel=0.03)


# ---- prompts ----


def test_every_prompt_word_is_one_gpt2_token(gpt2_tokenizer) -> None:
    assert all(len(gpt2_tokenizer.encode(" " + word)) == 1 for word in WORDS)


@pytest.mark.parametrize("num_tokens", [1, 2, 16, 128, 1000])
def test_prompts_have_exactly_the_requested_gpt2_token_count(gpt2_tokenizer, num_tokens: int) -> None:
    rng = random.Random(num_tokens)
    for _ in range(5):
        assert len(gpt2_tokenizer.encode(make_prompt(num_tokens, rng))) == num_tokens


def test_prompts_differ_from_request_to_request() -> None:
    rng = random.Random(0)
    assert len({make_prompt(16, rng) for _ in range(50)}) == 50


def test_fixed_distribution_always_gives_the_mean() -> None:
    assert {Distribution("fixed", 16).sample(random.Random(s)) for s in range(20)} == {16}


def test_uniform_distribution_stays_within_the_spread() -> None:
    rng = random.Random(0)
    draws = [Distribution("uniform", 100, spread=20).sample(rng) for _ in range(2000)]
    assert min(draws) >= 80 and max(draws) <= 120
    assert sum(draws) / len(draws) == pytest.approx(100, rel=0.02)


def test_normal_distribution_is_clamped_to_at_least_one_token() -> None:
    rng = random.Random(0)
    draws = [Distribution("normal", 4, spread=10).sample(rng) for _ in range(2000)]
    assert min(draws) == 1


# ---- bench.py ----

RESULT_FIELDS = {
    "label", "url", "api", "concurrency", "request_rate", "num_requests", "prompt_tokens", "max_tokens",
    "successes", "failures", "duration_s", "total_output_tokens", "mean_output_tokens",
    "request_throughput", "output_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "server_timing_ms", "errors",
    "round", "requests",
}  # fmt: skip


def _bench(url: str, out: Path, *extra: str) -> tuple[int, dict]:
    argv = ["--url", url, "--num-requests", "6", "--prompt-tokens", "8", "--max-tokens", "5"]
    code = bench.main([*argv, "--warmup", "1", "--no-progress", "--out", str(out), *extra])
    return code, json.loads((out / "bench.json").read_text())


def test_bench_json_has_every_field_with_percentiles_and_the_server_breakdown(fake_url: str, tmp_path: Path) -> None:
    code, document = _bench(fake_url, tmp_path, "--concurrency", "3")
    [result] = document["results"]
    assert code == 0
    assert set(result) == RESULT_FIELDS
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(result[metric]) == {"mean", "p50", "p95", "p99"}
        assert 0 < result[metric]["p50"] <= result[metric]["p95"] <= result[metric]["p99"]
    assert {key: value["p50"] for key, value in result["server_timing_ms"].items()} == {
        "tokenize": 1.5, "queue_wait": 2.5, "prefill": 3.5, "ttft": 8.0,
    }  # fmt: skip
    assert (result["successes"], result["failures"], result["total_output_tokens"]) == (6, 0, 30)
    assert result["output_throughput"] > 0 and result["request_throughput"] > 0
    assert document["workload"]["prompt_tokens"] == 8
    assert "server prefill p50 (ms) | 3.5" in (tmp_path / "bench.md").read_text()


def test_bench_counts_error_events_in_the_stream_as_failures(failing_url: str, tmp_path: Path) -> None:
    code, document = _bench(failing_url, tmp_path, "--concurrency", "2")
    [result] = document["results"]
    assert code == 1
    assert (result["successes"], result["failures"]) == (0, 6)
    assert result["errors"] == ["engine died"]


def test_bench_counts_http_errors_as_failures(fake_url: str, tmp_path: Path) -> None:
    code, document = _bench(fake_url + "/no-such-prefix", tmp_path, "--concurrency", "2")
    assert code == 1
    assert document["results"][0]["failures"] == 6
    assert document["results"][0]["errors"][0].startswith("HTTP 404")


def test_bench_compare_runs_the_same_workload_on_both_servers(fake_url: str, failing_url: str, tmp_path: Path) -> None:
    extra = ("--compare-url", failing_url, "--label", "good", "--compare-label", "bad", "--concurrency", "2")
    _, document = _bench(fake_url, tmp_path, *extra)
    assert [(r["label"], r["successes"], r["failures"]) for r in document["results"]] == [("good", 6, 0), ("bad", 0, 6)]
    assert (tmp_path / "bench.md").read_text().startswith("| metric | good | bad |")


def test_bench_open_loop_sends_every_request(fake_url: str, tmp_path: Path) -> None:
    _, document = _bench(fake_url, tmp_path, "--request-rate", "50", "--arrival", "poisson")
    [result] = document["results"]
    assert (result["successes"], result["request_rate"], result["concurrency"]) == (6, 50.0, None)


def test_bench_drives_the_chat_api(fake_url: str, tmp_path: Path) -> None:
    _, document = _bench(fake_url, tmp_path, "--api", "chat", "--concurrency", "2")
    assert document["results"][0]["total_output_tokens"] == 30


def test_bench_sweep_writes_one_result_per_level_and_server_and_a_plot(fake_url: str, tmp_path: Path) -> None:
    _, document = _bench(fake_url, tmp_path, "--sweep", "1,4", "--compare-url", fake_url)
    levels = [(r["concurrency"], r["label"]) for r in document["results"]]
    assert levels == [(1, "rayinfer"), (1, "baseline"), (4, "rayinfer"), (4, "baseline")]
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")


def test_bench_repeats_alternate_the_servers_and_report_each_round_and_the_medians(
    fake_url: str, tmp_path: Path
) -> None:
    extra = ("--repeats", "3", "--compare-url", fake_url, "--label", "a", "--compare-label", "b", "--concurrency", "2")
    code, document = _bench(fake_url, tmp_path, *extra)
    assert code == 0
    assert [(r["round"], r["label"]) for r in document["results"]] == [
        (1, "a"), (1, "b"), (2, "a"), (2, "b"), (3, "a"), (3, "b"),
    ]  # fmt: skip
    lines = (tmp_path / "bench.md").read_text().splitlines()
    assert lines[0] == "| round | a: tok/s, TTFT p50 (ms) | b: tok/s, TTFT p50 (ms) | a / b |"
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| 1", "| 2", "| 3", "| median"]
    throughputs = sorted(r["output_throughput"] for r in document["results"] if r["label"] == "a")
    assert lines[-1].startswith(f"| median | **{throughputs[1]:.1f}**, ")


def test_repeats_table_shares_are_the_first_server_over_the_last() -> None:
    def result(label: str, round_: int, tok_s: float) -> BenchResult:
        summary = Summary(1.0, 10.0 * round_, 2.0, 3.0)
        return BenchResult(label, "u", "completions", 1, None, 1, 1, 1, 1, 0, 1.0, 1, 1.0, 1.0, tok_s,
                                 summary, summary, summary, summary, {}, round=round_)

    table = repeats_table([result("http", 1, 90.0), result("offline", 1, 100.0),
                                 result("http", 2, 60.0), result("offline", 2, 50.0),
                                 result("http", 3, 70.0), result("offline", 3, 100.0)])
    rows = table.splitlines()
    assert [row.rsplit(" | ", 1)[-1] for row in rows[2:]] == ["90% |", "120% |", "70% |", "**90%** |"]
    assert rows[-1] == "| median | **70.0**, 20.0 | **100.0**, 20.0 | **90%** |"


def test_bench_refuses_repeats_with_a_sweep(fake_url: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--repeats"):
        _bench(fake_url, tmp_path, "--repeats", "2", "--sweep", "1,2")


def test_run_benchmark_is_callable_from_code(fake_url: str) -> None:
    workload = Workload(num_requests=4, prompt_tokens=4, max_tokens=3, concurrency=2, warmup=0)
    result = run_benchmark(BenchConfig(Target(fake_url, "fake"), workload, show_progress=False))
    assert (result.successes, result.total_output_tokens) == (4, 12)


def test_a_run_keeps_each_requests_unix_times_in_the_order_sent_never_more_in_flight_than_the_bound(
    fake_url: str,
) -> None:
    workload = Workload(num_requests=6, prompt_tokens=4, max_tokens=3, concurrency=2, warmup=1)
    before = time.time()
    result = run_benchmark(BenchConfig(Target(fake_url, "fake"), workload, show_progress=False))
    after = time.time()
    times = result.requests  # the warm-up's request is not the run's
    assert len(times) == 6 and all(t.ok and t.output_tokens == 3 for t in times)
    assert [t.sent for t in times] == sorted(t.sent for t in times)
    assert all(before <= t.sent < t.first_content <= t.end <= after for t in times)
    in_flight = [sum(other.sent <= t.sent < other.end for other in times) for t in times]
    assert max(in_flight) == 2


def test_request_body_sends_model_and_ignore_eos_only_when_asked() -> None:
    workload = Workload(max_tokens=4, temperature=0.5)
    plain = request_body(Target("http://x", "x"), " hi", workload)
    assert plain == {"max_tokens": 4, "temperature": 0.5, "stream": True,
                     "stream_options": {"include_usage": True}, "prompt": " hi"}
    extended = request_body(Target("http://x", "x", model="gpt2", ignore_eos=True), " hi", workload)
    assert (extended["model"], extended["ignore_eos"]) == ("gpt2", True)


@pytest.mark.parametrize("command", [[sys.executable, "-m", "loadtest.bench"], [sys.executable, "loadtest/bench.py"]])
def test_bench_runs_as_a_module_and_as_a_script(command: list[str]) -> None:
    done = subprocess.run([*command, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--compare-url" in done.stdout


# ---- locust ----


def test_locust_headless_run_reports_stream_metrics_for_both_endpoints(fake_url: str, tmp_path: Path) -> None:
    extra = ("--prompt-tokens", "8", "--max-tokens", "5", "--max-tokens-dist", "uniform")
    extra += ("--endpoint-weights", "completions=1,generate=1")
    run = run_locust(fake_url, tmp_path / "locust", users=2, run_time="4s", extra_args=extra)
    assert run.returncode == 0, run.output
    assert run.num_failures == 0
    for request_type in ("METRIC", "METRIC-GENERATE"):
        for name in ("ttft", "itl", "tpot", "e2e"):
            assert run.entries[(request_type, name)].num_requests > 0, (request_type, name)
    assert run.entries[("METRIC", "server_prefill")].median_ms == pytest.approx(3.5, abs=1)
    assert run.entries[("TOKENS", "output_tokens")].num_requests > 0
    assert "tok/s" in run.output


def test_locust_counts_error_events_in_the_stream_as_failures(failing_url: str, tmp_path: Path) -> None:
    run = run_locust(failing_url, tmp_path / "locust", users=1, run_time="2s", extra_args=("--max-tokens", "5"))
    assert run.returncode == 1
    assert run.entries[("POST", "/v1/completions")].num_failures > 0
    assert ("METRIC", "ttft") not in run.entries


def test_the_offline_target_runs_the_workload_on_an_in_process_engine(tiny_gpt2_dir: Path) -> None:
    workload = Workload(num_requests=4, prompt_tokens=8, max_tokens=5, temperature=0.0, concurrency=2, warmup=1)
    result = run_offline(OfflineTarget(str(tiny_gpt2_dir), weights="pretrained", dtype="float32",
                                       engine={"compile_decode": False}), workload)
    assert (result.successes, result.failures) == (4, 0), result.errors
    assert result.total_output_tokens == 4 * 5
    assert (result.label, result.url) == ("offline engine", "in-process")
    assert result.ttft_ms.p50 > 0 and result.tpot_ms.p50 > 0


def test_the_ceiling_reports_the_median_run_with_every_runs_figure():
    runs = [Result("engine", 100, 1.0), Result("engine", 100, 0.5), Result("engine", 100, 2.0)]
    median = median_run(runs)
    assert median.seconds == 1.0
    assert median.name == "engine (median of 100, 200, 50)"
    assert median_run(runs[:1]) is runs[0]


def test_a_timed_run_keeps_the_harness_heap_out_of_the_collectors_passes_and_gives_it_back() -> None:
    held = [object() for _ in range(1000)]  # the harness's own objects, made before the run
    with heap_frozen():
        assert gc.get_freeze_count() >= len(held)
        gc.collect()
        assert gc.get_freeze_count() >= len(held)  # a pass during the run leaves them frozen
    assert gc.get_freeze_count() == 0


def test_jains_index_is_one_for_equal_rates_and_one_over_n_when_one_tenant_gets_all():
    from loadtest.scale.tenants_bench import jain_index

    assert jain_index([100.0, 100.0]) == pytest.approx(1.0)
    assert jain_index([100.0, 0.0]) == pytest.approx(0.5)
    assert jain_index([300.0, 100.0]) == pytest.approx(0.8)


def test_a_target_with_a_priority_sends_it():
    from loadtest.client.http_target import Target, request_body
    from loadtest.client.workload import Workload

    assert request_body(Target("http://x", "x", priority=-10), "hi", Workload())["priority"] == -10
    assert "priority" not in request_body(Target("http://x", "x"), "hi", Workload())
