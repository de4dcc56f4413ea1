"""What an engine replica reports about its load, to the router and to the autoscaler.

Serve polls `record_routing_stats` (for the router, as `replica.routing_stats`) and
`record_autoscaling_stats` (for the autoscaling policy, as `ctx.aggregated_metrics`) on the
engine deployment; both read one EngineLoad.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine import AsyncEngine


@dataclass(frozen=True)
class EngineLoad:
    num_active: int  # admitted and not finished: what the bounded-load router counts
    num_waiting: int  # of those, no token yet (queued or prefilling)
    num_waiting_prompt_tokens: int
    kv_cache_usage: float  # 0..1
    block_size: int  # the prefix cache's block: routers key prompts with it
    num_requests: int  # totals since the replica started
    num_prefix_queried_tokens: int
    num_prefix_hit_tokens: int

    @classmethod
    def of(cls, engine: AsyncEngine, num_requests: int) -> EngineLoad:
        stats = engine.stats()
        num_waiting, num_waiting_tokens = engine.waiting_work()
        return cls(num_active=engine.num_active_requests(), num_waiting=num_waiting,
                   num_waiting_prompt_tokens=num_waiting_tokens, kv_cache_usage=stats.kv_cache_usage,
                   block_size=engine.config.block_size, num_requests=num_requests,
                   num_prefix_queried_tokens=stats.num_prefix_queried_tokens,
                   num_prefix_hit_tokens=stats.num_prefix_hit_tokens)

    def routing_stats(self) -> dict:
        return asdict(self)

    def autoscaling_stats(self) -> dict[str, float]:
        """The signals EngineLoadPolicy scales on (deployments/autoscaling.py)."""
        return {"engine_requests": float(self.num_active),
                "engine_waiting_prompt_tokens": float(self.num_waiting_prompt_tokens),
                "engine_kv_cache_usage": self.kv_cache_usage}
