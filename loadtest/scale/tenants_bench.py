"""Two tenants on one server (issue 55's goals): does a flood from one API key push the other's
first token out, does an urgent request jump the queue, and what does the flood keep?

Against a server already up with two keys, e.g.

    RAYINFER_API_KEYS="sk-heavy name=heavy,sk-light name=light" serve run configs/gpt2.yaml
    python -m loadtest.scale.tenants_bench --heavy-key sk-heavy --light-key sk-light

Phases, each for --duration-s:
    light alone     the light tenant sends one request at a time: its TTFT yardstick
    heavy alone     the heavy tenant keeps --heavy-streams streams of --max-tokens open
    flood           both at once, and a `priority: -10` probe from the light key, one at a time
    both saturate   each tenant keeps --heavy-streams streams open: Jain's index of their tokens/s

A phase's tokens/s counts the tokens received inside its window, a stream's spread evenly from
its first token to its last (streams still open when the window closes end after it, and their
tokens past it are not the phase's). The light tenant's and the probe's TTFT come with the
server's account of it (`server_timing`: tokenize, queue wait, prefill, and its own TTFT).
A 429 is the tenant's own waiting bound; any other failure is counted apart (the goal is none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx

from loadtest.client.http_target import Target, send_request
from loadtest.client.sse_reader import StreamRecord
from loadtest.client.workload import Workload

PROMPT = "The history of the city begins with"
PROBE_PRIORITY = -10
RETRY_AFTER_S = 1.0  # what rayinfer's 429s say (Retry-After: 1); vLLM's server queues instead


@dataclass
class TenantRun:
    """What one tenant's loop saw in one phase."""

    start: float  # the phase's window, perf_counter seconds
    until: float
    records: list[StreamRecord] = field(default_factory=list)

    def ttft_p50_s(self) -> float | None:
        ttfts = [r.ttft_s for r in self.records if r.is_ok and r.ttft_s is not None]
        return statistics.median(ttfts) if ttfts else None

    def server_timing_p50_ms(self) -> dict[str, float]:
        """The median of each of the server's TTFT parts, over the streams that reported them."""
        timings = [r.server_timing for r in self.records if r.is_ok and r.server_timing]
        keys = sorted({key for timing in timings for key in timing})
        return {key: round(statistics.median(t[key] for t in timings if key in t), 1) for key in keys}

    def tokens_per_s(self) -> float:
        return sum(_tokens_within(r, self.start, self.until) for r in self.records if r.is_ok) / (self.until - self.start)

    def num_429(self) -> int:
        return sum(1 for r in self.records if _refused(r))

    def num_failed(self) -> int:
        return sum(1 for r in self.records if r.error and not _refused(r))


def _refused(record: StreamRecord) -> bool:
    """A 429: the tenant's own waiting bound."""
    return bool(record.error) and record.error.startswith("HTTP 429")


def _tokens_within(record: StreamRecord, start: float, until: float) -> float:
    """record's tokens received inside [start, until], spread evenly from its first to its last."""
    first, last = record.first_content_at, record.last_content_at
    if first is None or last is None:
        return 0.0
    if last == first:
        return record.output_tokens if start <= first <= until else 0.0
    overlap = max(0.0, min(last, until) - max(first, start))
    return record.output_tokens * overlap / (last - first)


@dataclass(frozen=True)
class Tenant:
    target: Target
    client: httpx.AsyncClient
    workload: Workload

    async def send(self) -> StreamRecord:
        return await send_request(self.client, self.target, PROMPT, self.workload)


async def closed_loop(tenant: Tenant, num_streams: int, until: float, run: TenantRun) -> None:
    """num_streams streams kept open until `until` (perf_counter), each sending again as it
    ends, or after RETRY_AFTER_S where it was refused with a 429, as clients do (the openai
    SDK waits what Retry-After says): a client resending at once spends the server's CPU on
    refusals."""
    async def stream() -> None:
        while time.perf_counter() < until:
            record = await tenant.send()
            run.records.append(record)
            if _refused(record):
                await asyncio.sleep(RETRY_AFTER_S)
    await asyncio.gather(*(stream() for _ in range(num_streams)))


def jain_index(rates: list[float]) -> float:
    """(sum x)^2 / (n sum x^2): 1 when every tenant gets the same, 1/n when one gets all."""
    squares = sum(x * x for x in rates)
    return sum(rates) ** 2 / (len(rates) * squares) if squares else 0.0


def make_tenant(args: argparse.Namespace, key: str, max_tokens: int, priority: int | None = None) -> Tenant:
    target = Target(args.url, "tenant", model=args.model, ignore_eos=True, priority=priority)
    client = httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=None,
                               limits=httpx.Limits(max_connections=None))
    return Tenant(target, client, Workload(max_tokens=max_tokens, temperature=0.0))


async def run_phases(args: argparse.Namespace) -> dict:
    heavy = make_tenant(args, args.heavy_key, args.max_tokens)
    light = make_tenant(args, args.light_key, args.light_max_tokens)
    probe = make_tenant(args, args.light_key, args.light_max_tokens, PROBE_PRIORITY)
    n, d = args.heavy_streams, args.duration_s
    phases: dict[str, dict[str, TenantRun]] = {}
    phases["light alone"] = await _phase(d, {"light": (light, 1)})
    phases["heavy alone"] = await _phase(d, {"heavy": (heavy, n)})
    phases["flood"] = await _phase(d, {"heavy": (heavy, n), "light": (light, 1), "probe": (probe, 1)})
    light_saturating = make_tenant(args, args.light_key, args.max_tokens)
    phases["both saturate"] = await _phase(d, {"heavy": (heavy, n), "light": (light_saturating, n)})
    for tenant in (heavy, light, probe, light_saturating):
        await tenant.client.aclose()
    return summarize(phases)


async def _phase(duration_s: float, loops: dict[str, tuple[Tenant, int]]) -> dict[str, TenantRun]:
    start = time.perf_counter()
    until = start + duration_s
    runs = {name: TenantRun(start, until) for name in loops}
    await asyncio.gather(*(closed_loop(tenant, n, until, runs[name]) for name, (tenant, n) in loops.items()))
    return runs


def summarize(phases: dict[str, dict[str, TenantRun]]) -> dict:
    light_alone = phases["light alone"]["light"]
    flood = phases["flood"]
    saturated = {name: run.tokens_per_s() for name, run in phases["both saturate"].items()}
    return {
        "light_ttft_p50_alone_s": light_alone.ttft_p50_s(),
        "light_ttft_p50_flood_s": flood["light"].ttft_p50_s(),
        "probe_ttft_p50_flood_s": flood["probe"].ttft_p50_s(),
        "server_timing_p50_ms": {"light alone": light_alone.server_timing_p50_ms(),
                                 "light flood": flood["light"].server_timing_p50_ms(),
                                 "probe flood": flood["probe"].server_timing_p50_ms()},
        "heavy_tok_s_alone": phases["heavy alone"]["heavy"].tokens_per_s(),
        "heavy_tok_s_flood": flood["heavy"].tokens_per_s(),
        "tok_s_saturated": saturated,
        "jain_index_saturated": jain_index(list(saturated.values())),
        "num_429": {f"{p}/{t}": run.num_429() for p, runs in phases.items() for t, run in runs.items()},
        "num_failed_not_429": sum(run.num_failed() for runs in phases.values() for run in runs.values()),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="the served model's name, where the server wants one")
    parser.add_argument("--heavy-key", required=True)
    parser.add_argument("--light-key", required=True)
    parser.add_argument("--heavy-streams", type=int, default=160)
    parser.add_argument("--max-tokens", type=int, default=256, help="of each heavy stream")
    parser.add_argument("--light-max-tokens", type=int, default=16)
    parser.add_argument("--duration-s", type=float, default=60.0, help="of each phase")
    parser.add_argument("--out", default=None, help="write the summary here as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    summary = asyncio.run(run_phases(args))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")
    return summary


if __name__ == "__main__":
    main()
