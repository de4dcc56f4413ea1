"""rayinfer's own metrics, recorded with Ray's metrics API from inside the replicas.

Ray exports them (prefixed `ray_`) on every node's metrics endpoint, so they appear in
Prometheus, the Ray dashboard's Metrics view and configs/grafana/rayinfer.json. Each replica
records its own series, labelled with its Serve application, deployment and replica as
Serve's own metrics are (ray.serve.metrics), so two apps on one cluster stay apart;
Prometheus sums them across replicas.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ray.serve import metrics as serve_metrics
from ray.serve.metrics import Counter, Gauge, Histogram

from engine.request.outputs import EngineStats
from engine.core.step_log import StepRecord

if TYPE_CHECKING:  # the Ingress imports this file and no torch: only the engine replica holds LoraStats
    from engine.lora.registry import LoraStats

_LATENCY_BUCKETS_S = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60]
_TPOT_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28]
_BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]
# Ray rebuilds a histogram's observations from its buckets' midpoints (its OpenTelemetry
# recorder), so `_sum / _count` is only as fine as the buckets: these are close (1.25-1.5x
# apart) over the range a step's time falls in.
_STEP_BUCKETS_S = [0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.0175,
                   0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5]
_STEP_TOKEN_BUCKETS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048, 4096, 8192]
_ENGINE_METRICS_PERIOD_S = 1.0


class RequestMetrics:
    """Per-request figures, recorded by the ingress as each request ends. Tokens served,
    queue wait and the engine's 429s are labelled by tenant: its name, or a short hash of its
    API key or `user` (deployments/api/security.py), never a key."""

    def __init__(self) -> None:
        self.requests = Counter("rayinfer_requests", "HTTP requests by endpoint and status code.",
                                tag_keys=("endpoint", "status"))
        self.ttft = Histogram("rayinfer_ttft_seconds", "Time to first token, from request receipt.",
                              boundaries=_LATENCY_BUCKETS_S)
        self.tpot = Histogram("rayinfer_tpot_seconds", "Time per output token after the first.",
                              boundaries=_TPOT_BUCKETS_S)
        self.e2e = Histogram("rayinfer_e2e_seconds", "End-to-end request latency.", boundaries=_LATENCY_BUCKETS_S)
        tenant = ("tenant",)
        self.queue_wait = Histogram("rayinfer_queue_wait_seconds", "Time waiting for the engine's scheduler.",
                                    boundaries=_LATENCY_BUCKETS_S, tag_keys=tenant)
        self.prompt_tokens = Counter("rayinfer_prompt_tokens", "Prompt tokens processed.", tag_keys=tenant)
        self.completion_tokens = Counter("rayinfer_completion_tokens", "Completion tokens generated.",
                                         tag_keys=tenant)
        self.rejected = Counter("rayinfer_rejected_requests", "Requests the engine's waiting bounds refused (429).",
                                tag_keys=tenant)

    def record_request(self, endpoint: str, status: int) -> None:
        self.requests.inc(1, tags={"endpoint": endpoint, "status": str(status)})

    def record_rejected(self, tenant: str) -> None:
        self.rejected.inc(1, tags={"tenant": tenant})

    def record_completion(self, *, ttft_s: float | None, e2e_s: float, queue_wait_s: float | None,
                          num_prompt_tokens: int, num_completion_tokens: int, tenant: str) -> None:
        tags = {"tenant": tenant}
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if num_completion_tokens > 1:
                self.tpot.observe((e2e_s - ttft_s) / (num_completion_tokens - 1))
        if queue_wait_s is not None:
            self.queue_wait.observe(queue_wait_s, tags=tags)
        if num_prompt_tokens > 0:
            self.prompt_tokens.inc(num_prompt_tokens, tags=tags)
        if num_completion_tokens > 0:
            self.completion_tokens.inc(num_completion_tokens, tags=tags)


class EngineMetrics:
    """The engine's state, sampled by the engine replica."""

    def __init__(self) -> None:
        self.running = Gauge("rayinfer_running_requests", "Requests in the running batch.")
        self.waiting = Gauge("rayinfer_waiting_requests", "Requests waiting to be scheduled.")
        self.kv_usage = Gauge("rayinfer_kv_cache_usage", "Fraction of KV cache blocks in use (0..1).")
        self.kv_blocks_used = Gauge("rayinfer_kv_blocks_used", "KV cache blocks in use.")
        self.kv_blocks_total = Gauge("rayinfer_kv_blocks_total", "KV cache blocks in the pool.")
        self.prefix_hit_rate = Gauge("rayinfer_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache (0..1).")
        self.preemptions = Counter("rayinfer_preemptions", "Sequences preempted for lack of KV blocks.")
        self.step_time = Histogram("rayinfer_engine_step_seconds",
                                   "Time of one engine step (schedule, forward, sample), by kind: prefill "
                                   "if it computed any prompt tokens, else decode.",
                                   boundaries=_STEP_BUCKETS_S, tag_keys=("kind",))
        self.step_tokens = Histogram("rayinfer_iteration_tokens", "Tokens computed per engine step.",
                                     boundaries=_STEP_TOKEN_BUCKETS)
        self.constrained = Counter("rayinfer_constrained_requests",
                                   "Requests with a structured output constraint (JSON schema, regex, choice, grammar).")
        self.grammar_compiles = Counter("rayinfer_grammar_compiles",
                                        "Structured output grammars compiled (constraints not in the replica's cache).")
        self.grammar_compile_time = Counter("rayinfer_grammar_compile_seconds",
                                            "Time spent compiling structured output grammars, in total.")
        self.mask_time = Histogram("rayinfer_grammar_mask_seconds",
                                   "Time per engine step filling and applying structured output token masks "
                                   "(steps with a constrained row only).", boundaries=_STEP_BUCKETS_S)
        self.spec_proposed = Counter("rayinfer_spec_proposed_tokens",
                                     "Speculative decoding: proposed tokens verified (acceptance rate: accepted / proposed).")
        self.spec_accepted = Counter("rayinfer_spec_accepted_tokens", "Speculative decoding: proposed tokens kept.")
        self._last_preemptions = 0
        self._spec_totals = (0, 0)  # as last counted
        self._structured_totals: tuple[float, ...] = (0, 0, 0.0)  # as last counted

    def update(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.kv_blocks_used.set(stats.num_kv_blocks_used)
        self.kv_blocks_total.set(stats.num_kv_blocks_total)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        if stats.num_preemptions > self._last_preemptions:
            self.preemptions.inc(stats.num_preemptions - self._last_preemptions)
            self._last_preemptions = stats.num_preemptions
        self._count_structured(stats)
        self._count_speculative(stats)

    def _count_speculative(self, stats: EngineStats) -> None:
        totals = (stats.num_spec_proposed_tokens, stats.num_spec_accepted_tokens)
        for counter, now, before in zip((self.spec_proposed, self.spec_accepted), totals, self._spec_totals):
            if now > before:
                counter.inc(now - before)
        self._spec_totals = totals

    def _count_structured(self, stats: EngineStats) -> None:
        """The structured output totals' growth since the last sample."""
        totals = (stats.num_constrained_requests, stats.num_grammar_compiles, stats.grammar_compile_s)
        counters = (self.constrained, self.grammar_compiles, self.grammar_compile_time)
        for counter, now, before in zip(counters, totals, self._structured_totals):
            if now > before:
                counter.inc(now - before)
        self._structured_totals = totals

    def record_steps(self, steps: list[StepRecord]) -> None:
        for step in steps:
            self.step_time.observe(step.duration_s, tags={"kind": step.kind})
            self.step_tokens.observe(step.num_tokens)
            if step.mask_s is not None:
                self.mask_time.observe(step.mask_s)


class RouterMetrics:
    """The engine router's decisions and the engine replicas it sees, recorded by each
    handle's PrefixAffinityRouter (in the ingress replicas). Spills are the routed requests
    with decision="spill"."""

    def __init__(self) -> None:
        tags = ("engine_replica",)
        self.routed = serve_metrics.Counter(
            "rayinfer_router_routed_requests", "Engine requests routed, by replica and decision "
            "(affinity: the prefix's first choice; spill: it was over the load bound; least_loaded: no prefix).",
            tag_keys=("engine_replica", "decision"))
        self.replicas = serve_metrics.Gauge("rayinfer_router_engine_replicas", "Engine replicas the router sees.")
        self.hit_rate = serve_metrics.Gauge("rayinfer_engine_replica_prefix_cache_hit_rate",
                                            "Prompt tokens served from each engine replica's prefix cache (0..1).",
                                            tag_keys=tags)
        self.active = serve_metrics.Gauge("rayinfer_engine_replica_active_requests",
                                          "Requests in each engine replica, as it last reported.", tag_keys=tags)

    def record_routed(self, replica_id: str, decision: str) -> None:
        self.routed.inc(1, tags={"engine_replica": replica_id, "decision": decision})

    def record_replicas(self, routing_stats: dict[str, dict]) -> None:
        self.replicas.set(len(routing_stats))
        for replica_id, stats in routing_stats.items():
            if "num_prefix_queried_tokens" in stats:
                rate = stats["num_prefix_hit_tokens"] / max(stats["num_prefix_queried_tokens"], 1)
                self.hit_rate.set(rate, tags={"engine_replica": replica_id})
                self.active.set(stats["num_active"], tags={"engine_replica": replica_id})


class LoraMetrics:
    """LoRA adapters on an engine replica (where max_loras > 0): requests and tokens by
    adapter, the adapters it holds, slot loads, their time and evictions (the engine's
    LoraStats, sampled), and each request's adapter where it found it (record_arrival): the
    router's aim is that it is resident."""

    def __init__(self) -> None:
        adapter = ("adapter",)
        self.requests = Counter("rayinfer_lora_requests", "Requests by LoRA adapter and where the replica held "
                                "the adapter when the request arrived (resident: in an engine slot; read: in "
                                "memory, a slot write to come; none: read from disk first).",
                                tag_keys=("adapter", "holding"))
        self.prompt_tokens = Counter("rayinfer_lora_prompt_tokens", "Prompt tokens by LoRA adapter.", tag_keys=adapter)
        self.generation_tokens = Counter("rayinfer_lora_generation_tokens", "Generated tokens by LoRA adapter.",
                                         tag_keys=adapter)
        self.resident = Gauge("rayinfer_lora_adapters_resident", "LoRA adapters in the engine's slots (max_loras).")
        self.loaded = Gauge("rayinfer_lora_adapters_loaded",
                            "LoRA adapters read into the replica's memory (max_cpu_loras, but those in use).")
        self.slot_loads = Counter("rayinfer_lora_slot_loads", "LoRA adapters written into an engine slot.")
        self.load_time = Counter("rayinfer_lora_load_seconds",
                                 "Time reading LoRA adapters from disk and writing them into slots, in total.")
        self.evictions = Counter("rayinfer_lora_evictions", "LoRA adapters evicted from a slot for another.")
        self._totals: dict[tuple[str, ...], float] = {}  # as last counted, by counter (and adapter)

    def record_arrival(self, adapter: str, holding: str) -> None:
        self.requests.inc(1, tags={"adapter": adapter, "holding": holding})

    def update(self, stats: LoraStats) -> None:
        self.resident.set(stats.num_resident)
        self.loaded.set(stats.num_adapters)
        for name, counter, now in (("loads", self.slot_loads, stats.num_loads), ("load_s", self.load_time, stats.load_s),
                                   ("evictions", self.evictions, stats.num_evictions)):
            self._count((name,), counter, now, None)
        for name, counter, by_adapter in (("prompt", self.prompt_tokens, stats.prompt_tokens),
                                          ("generated", self.generation_tokens, stats.generated_tokens)):
            for adapter, now in by_adapter.items():
                self._count((name, adapter), counter, now, {"adapter": adapter})

    def _count(self, key: tuple[str, ...], counter: Counter, now: float, tags: dict[str, str] | None) -> None:
        """The total's growth since the last sample (the engine's counters only grow)."""
        before = self._totals.get(key, 0)
        if now > before:
            counter.inc(now - before, tags=tags)
            self._totals[key] = now


class EngineMetricsReporter:
    """Samples the engine's stats into EngineMetrics once a second, from its own thread, and
    records the steps taken since (off the step loop's thread: a step only appends a record);
    with LoRA on, the adapters' counters into LoraMetrics too."""

    def __init__(self, stats: Callable[[], EngineStats], steps: Callable[[], list[StepRecord]],
                 lora_stats: Callable[[], LoraStats | None] | None = None,
                 lora_metrics: LoraMetrics | None = None) -> None:
        self._stats = stats
        self._steps = steps
        self._metrics = EngineMetrics()
        self._lora_stats, self._lora_metrics = lora_stats, lora_metrics
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rayinfer-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(_ENGINE_METRICS_PERIOD_S):
            self._metrics.update(self._stats())
            self._metrics.record_steps(self._steps())
            if self._lora_stats is not None and (lora := self._lora_stats()) is not None:
                self._lora_metrics.update(lora)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class TokenizerMetrics:
    """Prompts encoded `where`: "deployment" (the tokenizer deployment's batches) or "ingress"
    (short prompts the ingress encodes itself, a request's prompts a batch)."""

    def __init__(self, where: str) -> None:
        self.batch_size = Histogram("rayinfer_tokenizer_batch_size", "Requests encoded per batched call.",
                                    boundaries=_BATCH_BUCKETS, tag_keys=("where",))
        self.latency = Histogram("rayinfer_tokenizer_latency_seconds", "Time to encode one batch.",
                                 boundaries=_LATENCY_BUCKETS_S, tag_keys=("where",))
        for metric in (self.batch_size, self.latency):
            metric.set_default_tags({"where": where})

    def record_batch(self, size: int, latency_s: float) -> None:
        self.batch_size.observe(size)
        self.latency.observe(latency_s)


@functools.cache
def request_metrics() -> RequestMetrics:
    """This process's RequestMetrics, made on first use inside the replica (Ray metrics
    register with the worker they are created in)."""
    return RequestMetrics()


_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/models", "/health")


class RequestCounterMiddleware:
    """Counts HTTP requests by endpoint and final status (pure ASGI, so streaming responses
    and client disconnects pass through untouched)."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_and_note_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            endpoint = scope["path"] if scope["path"] in _ENDPOINTS else "other"
            request_metrics().record_request(endpoint, status)
