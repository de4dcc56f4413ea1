"""EngineLoadPolicy: Serve autoscaling for the engine deployment on what the engine knows.

Serve's default policy scales on ongoing requests per replica. An engine's capacity is not a
request count: it is its batch, the prompt tokens waiting for prefill and its KV pool. Each
engine replica reports those (EngineDeployment.record_autoscaling_stats); this policy asks
for enough replicas that every signal is at or under its per-replica target:

    replicas = max over signals of ceil(sum over replicas / target per replica)

Serve applies min/max_replicas, upscale/downscale_delay_s and the scaling factors from the
deployment's autoscaling_config around it. Set in a config file:

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      upscale_delay_s: 5
      downscale_delay_s: 60
      policy:
        policy_function: deployments.routing.autoscaling:EngineLoadPolicy
        policy_kwargs: {target_requests: 32, target_waiting_prompt_tokens: 2048, target_kv_cache_usage: 0.7}
"""

from __future__ import annotations

import math
from typing import Any

from ray.serve.config import AutoscalingContext


class EngineLoadPolicy:
    def __init__(self, target_requests: float = 32, target_waiting_prompt_tokens: float = 2048,
                 target_kv_cache_usage: float = 0.7) -> None:
        self.targets = {"engine_requests": target_requests,
                        "engine_waiting_prompt_tokens": target_waiting_prompt_tokens,
                        "engine_kv_cache_usage": target_kv_cache_usage}
        for name, target in self.targets.items():
            if not target > 0:
                raise ValueError(f"the target for {name} must be > 0, got {target!r}")

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        if not any(metrics.get(name) for name in self.targets):
            return ctx.target_num_replicas, ctx.policy_state  # no report yet: hold
        needed = {name: math.ceil(sum(metrics.get(name, {}).values()) / target - 1e-9)
                  for name, target in self.targets.items()}
        desired = max(max(needed.values()), 1)
        bounded = min(max(desired, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
        return bounded, {**ctx.policy_state, "needed": needed}
