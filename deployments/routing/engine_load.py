"""What an engine replica reports about its load, to the router and to the autoscaler.

Serve polls `record_routing_stats` (for the router, as `replica.routing_stats`) and
`record_autoscaling_stats` (for the autoscaling policy, as `ctx.aggregated_metrics`) on the
engine deployment; both read one EngineLoad.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine import AsyncEngine


@dataclass(frozen=True)
class EngineLoad:
    num_active: int  # admitted and not finished: what the bounded-load router counts
    reported_at: float  # time.time() when num_active was counted (this report)
    num_waiting: int  # of those, no token yet (queued or prefilling)
    num_waiting_prompt_tokens: int
    kv_cache_usage: float  # 0..1
    block_size: int  # the prefix cache's block: routers key prompts with it
    num_kv_blocks: int  # the pool: as many blocks as a router's shadow of this cache keeps
    num_pending_prompt_tokens: int  # not yet computed, of every live request
    num_pending_decode_tokens: int  # still to decode (up to max_tokens), of every live request
    pending_at: float  # time.time() when the engine counted those two (its last step)
    num_prefix_queried_tokens: int  # totals since the replica started
    num_prefix_hit_tokens: int

    @classmethod
    def of(cls, engine: AsyncEngine) -> EngineLoad:
        stats, num_active, now = engine.stats(), engine.num_active_requests(), time.time()
        num_waiting, num_waiting_tokens = engine.waiting_work()
        # The pending counts are as of the engine's last step; with no request open they are
        # zero now, and say so: an idle replica's report never ages into "unknown", where a
        # router would fall back on Serve's queue-length cache, which lags completions.
        if num_active:
            pending_prompt, pending_decode, pending_at = (stats.num_pending_prompt_tokens,
                                                          stats.num_pending_decode_tokens, stats.taken_at)
        else:
            pending_prompt, pending_decode, pending_at = 0, 0, now
        return cls(num_active=num_active, reported_at=now, num_waiting=num_waiting,
                   num_waiting_prompt_tokens=num_waiting_tokens, kv_cache_usage=stats.kv_cache_usage,
                   block_size=engine.config.block_size, num_kv_blocks=stats.num_kv_blocks_total,
                   num_pending_prompt_tokens=pending_prompt, num_pending_decode_tokens=pending_decode,
                   pending_at=pending_at,
                   num_prefix_queried_tokens=stats.num_prefix_queried_tokens,
                   num_prefix_hit_tokens=stats.num_prefix_hit_tokens)

    def routing_stats(self) -> dict:
        return asdict(self)

    def autoscaling_stats(self) -> dict[str, float]:
        """The signals EngineLoadPolicy scales on (deployments/routing/autoscaling.py)."""
        return {"engine_requests": float(self.num_active),
                "engine_waiting_prompt_tokens": float(self.num_waiting_prompt_tokens),
                "engine_kv_cache_usage": self.kv_cache_usage}
