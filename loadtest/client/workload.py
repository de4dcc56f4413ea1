"""What a benchmark sends: how many requests, how long, how fast they arrive, which prompts."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from loadtest.client.prompts import make_prompt

Arrival = Literal["fixed", "poisson"]


@dataclass(frozen=True)
class Workload:
    """`concurrency` bounds requests in flight; with `request_rate` set, requests also arrive
    open loop at that rate (per second) and `concurrency` may be None (no bound)."""

    num_requests: int = 64
    prompt_tokens: int = 128
    max_tokens: int = 64
    temperature: float = 1.0  # sent with every request (OpenAI's default); 0 is greedy
    concurrency: int | None = 8
    request_rate: float | None = None
    arrival: Arrival = "poisson"
    warmup: int = 1
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError("num_requests, prompt_tokens and max_tokens must be at least 1")
        if self.concurrency is None and self.request_rate is None:
            raise ValueError("set a concurrency (closed loop) or a request rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request rate must be positive, got {self.request_rate}")

    def prompts(self, count: int, seed: int) -> list[str]:
        rng = random.Random(seed)
        return [make_prompt(self.prompt_tokens, rng) for _ in range(count)]


def arrival_gaps(count: int, rate: float, arrival: Arrival, rng: random.Random) -> list[float]:
    """Seconds to wait before each request; the first request goes at once."""
    gaps = [rng.expovariate(rate) if arrival == "poisson" else 1 / rate for _ in range(count - 1)]
    return [0.0, *gaps]
