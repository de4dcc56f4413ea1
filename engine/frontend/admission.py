"""Admission: the overload bounds on requests admitted but not yet past their first token.

Past EngineConfig.max_waiting_requests or max_waiting_tokens a new request is refused at
once with EngineOverloadedError, carrying how long the waiting work takes to start. A
request that could never fit under them (a prompt longer than max_waiting_tokens) is an
InvalidRequestError instead: a retry would meet the same refusal.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.request.outputs import EngineOverloadedError
from engine.request.request_rules import check_fits_waiting_bounds


def has_waiting_bounds(config: EngineConfig) -> bool:
    return config.max_waiting_requests is not None or config.max_waiting_tokens is not None


def check_waiting_bounds(config: EngineConfig, num_waiting: int, num_waiting_tokens: int, num_prompt_tokens: int,
                         retry_after_s: float) -> None:
    """Raise EngineOverloadedError if a prompt of num_prompt_tokens may not join the
    num_waiting requests (of num_waiting_tokens prompt tokens) waiting now, and
    InvalidRequestError if it may never."""
    max_requests, max_tokens = config.max_waiting_requests, config.max_waiting_tokens
    check_fits_waiting_bounds(1, num_prompt_tokens, max_requests, max_tokens)
    if max_requests is not None and num_waiting >= max_requests:
        raise EngineOverloadedError(f"{num_waiting} requests are already waiting (limit {max_requests})",
                                    retry_after_s)
    if max_tokens is not None and num_waiting_tokens + num_prompt_tokens > max_tokens:
        raise EngineOverloadedError(f"{num_waiting_tokens} prompt tokens are already waiting (limit {max_tokens})",
                                    retry_after_s)


def retry_after_s(num_waiting: int, steps_per_s: float) -> float:
    """Roughly how long the waiting work takes to start: a step per waiting request's prefill."""
    if steps_per_s <= 0:
        return 1.0
    return max(1.0, num_waiting / steps_per_s)
