"""A chaos run's settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChaosConfig:
    url: str
    duration_s: float = 120.0
    max_requests: int = 20_000
    concurrency: int = 8
    burst_every_s: float = 15.0
    burst_size: int = 64
    burst_prompt_tokens: int = 320  # 64 x 320 = 20,480 tokens: past gpt2.yaml's max_waiting_tokens
    warmup_s: float = 10.0
    api_key: str | None = None
    model: str | None = None
    max_body_bytes: int = 1 << 20
    max_rss_growth_mb: float = 64.0
    request_timeout_s: float = 120.0
    seed: int = 0
