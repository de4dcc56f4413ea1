"""Who a request is for and how urgent it is: what the scheduler orders the waiting line by
(engine/core/queue_policy.py), apart from what the request asks the model for (SamplingParams).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DEFAULT_TENANT = "default"
# Who goes next from the waiting line: EngineConfig.scheduling_policy (engine/core/queue_policy.py).
SchedulingPolicy = Literal["fcfs", "priority", "fair"]


@dataclass(frozen=True)
class Scheduling:
    priority: int = 0  # vLLM's: lower runs earlier
    # The tenant's label (a name or a hash, never an API key) and its weight: under the fair
    # policy a tenant's share of service is its weight over the backlogged tenants' weights.
    tenant: str = DEFAULT_TENANT
    weight: float = 1.0
