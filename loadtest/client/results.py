"""A run's records summarised: latency percentiles, throughput, the server's own timing."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from loadtest.client.sse_reader import SERVER_TIMING_KEYS, StreamRecord
from loadtest.client.workload import Workload

MAX_ERRORS_KEPT = 5


@dataclass(frozen=True)
class Summary:
    """Milliseconds (or whatever unit the values came in); None where there were no values."""

    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None


@dataclass(frozen=True)
class RunInfo:
    """What a result is labelled with: where the workload went and how."""

    label: str
    url: str
    api: str = "completions"


@dataclass(frozen=True)
class RequestTimes:
    """One request as the client saw it, in Unix seconds, to set beside a server's own logs
    (Serve's proxy logs each request's end and latency): sent, first content, end; None
    where that never came."""

    sent: float
    first_content: float | None
    end: float | None
    output_tokens: int
    ok: bool


@dataclass
class BenchResult:
    label: str
    url: str
    api: str
    concurrency: int | None
    request_rate: float | None
    num_requests: int
    prompt_tokens: int
    max_tokens: int
    successes: int
    failures: int
    duration_s: float
    total_output_tokens: int
    mean_output_tokens: float
    request_throughput: float
    output_throughput: float
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    e2e_ms: Summary
    server_timing_ms: dict[str, Summary]
    errors: list[str] = field(default_factory=list)
    round: int = 1  # of --repeats
    requests: list[RequestTimes] = field(default_factory=list)  # in the order they were sent


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float], scale: float = 1.0) -> Summary:
    if not values:
        return Summary(None, None, None, None)
    scaled = [value * scale for value in values]
    return Summary(sum(scaled) / len(scaled), *(percentile(scaled, q) for q in (50, 95, 99)))


def summarize_run(info: RunInfo, workload: Workload, records: list[StreamRecord], duration_s: float) -> BenchResult:
    ok = [record for record in records if record.is_ok]
    tokens = sum(record.output_tokens for record in ok)
    duration_s = max(duration_s, 1e-9)
    return BenchResult(
        label=info.label,
        url=info.url,
        api=info.api,
        concurrency=workload.concurrency,
        request_rate=workload.request_rate,
        num_requests=len(records),
        prompt_tokens=workload.prompt_tokens,
        max_tokens=workload.max_tokens,
        successes=len(ok),
        failures=len(records) - len(ok),
        duration_s=duration_s,
        total_output_tokens=tokens,
        mean_output_tokens=tokens / len(ok) if ok else 0.0,
        request_throughput=len(ok) / duration_s,
        output_throughput=tokens / duration_s,
        ttft_ms=summarize(_present(record.ttft_s for record in ok), 1000),
        tpot_ms=summarize(_present(record.tpot_s for record in ok), 1000),
        itl_ms=summarize([gap for record in ok for gap in record.itl_s], 1000),
        e2e_ms=summarize(_present(record.e2e_s for record in ok), 1000),
        server_timing_ms=_server_timing(ok),
        errors=_distinct_errors(records),
        requests=request_times(records),
    )


def request_times(records: list[StreamRecord]) -> list[RequestTimes]:
    """The records' times (time.perf_counter()) as Unix times, in the order they were sent."""
    to_unix = time.time() - time.perf_counter()
    unix = lambda t: None if t is None else t + to_unix  # noqa: E731
    return [RequestTimes(r.start + to_unix, unix(r.first_content_at), unix(r.end), r.output_tokens, r.is_ok)
            for r in sorted(records, key=lambda r: r.start)]


def _present(values: Iterator[float | None]) -> list[float]:
    return [value for value in values if value is not None]


def _server_timing(records: list[StreamRecord]) -> dict[str, Summary]:
    """tokenize / queue_wait / prefill / ttft, from the server's own `server_timing`, in ms."""
    return {
        key.removesuffix("_ms"): summarize([r.server_timing[key] for r in records if key in r.server_timing])
        for key in SERVER_TIMING_KEYS
    }


def _distinct_errors(records: list[StreamRecord]) -> list[str]:
    errors = dict.fromkeys(record.error for record in records if record.error is not None)
    return list(errors)[:MAX_ERRORS_KEPT]
