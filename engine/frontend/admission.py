"""Admission: the overload bounds on requests admitted but not yet past their first token.

Past EngineConfig.max_waiting_requests or max_waiting_tokens a new request is refused at
once with EngineOverloadedError, carrying how long the waiting work takes to start. A
request that could never fit under them (a prompt longer than max_waiting_tokens) is an
InvalidRequestError instead: a retry would meet the same refusal.

Under the fair policy the bounds hold per tenant too. A tenant's share of each is its weight
over the weights of the tenants with work waiting (itself included), and a tenant with
nothing waiting always has room for one request. Within its share a tenant is admitted even
where the whole is full, so one tenant's flood cannot take every place in the line: past its
share it meets the whole's bounds, and once they are full it gets the 429s while the others
are admitted. The line can then hold up to twice the bounds: the flood's, and the others'
shares beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.request.outputs import EngineOverloadedError
from engine.request.request_rules import check_fits_waiting_bounds


@dataclass(frozen=True)
class TenantWork:
    """A tenant's work waiting now and its share of the bounds."""

    tenant: str  # a label, never a key
    num_waiting: int
    num_waiting_tokens: int
    share: float  # 0 < share <= 1

    def has_room(self, config: EngineConfig, num_prompt_tokens: int) -> bool:
        if self.num_waiting == 0:
            return True
        max_requests, max_tokens = config.max_waiting_requests, config.max_waiting_tokens
        if max_requests is not None and self.num_waiting + 1 > self.share * max_requests:
            return False
        return max_tokens is None or self.num_waiting_tokens + num_prompt_tokens <= self.share * max_tokens


def has_waiting_bounds(config: EngineConfig) -> bool:
    return config.max_waiting_requests is not None or config.max_waiting_tokens is not None


def check_waiting_bounds(config: EngineConfig, num_waiting: int, num_waiting_tokens: int, num_prompt_tokens: int,
                         retry_after_s: float, tenant: TenantWork | None = None) -> None:
    """Raise EngineOverloadedError if a prompt of num_prompt_tokens may not join the
    num_waiting requests (of num_waiting_tokens prompt tokens) waiting now, and
    InvalidRequestError if it may never. `tenant`: the request's tenant, where the bounds
    hold per tenant (the fair policy)."""
    max_requests, max_tokens = config.max_waiting_requests, config.max_waiting_tokens
    check_fits_waiting_bounds(1, num_prompt_tokens, max_requests, max_tokens)
    if tenant is not None and tenant.has_room(config, num_prompt_tokens):
        return
    over_share = "" if tenant is None else (f"; tenant {tenant.tenant} has {tenant.num_waiting} waiting, "
                                            f"past its share ({tenant.share:.0%})")
    if max_requests is not None and num_waiting >= max_requests:
        raise EngineOverloadedError(f"{num_waiting} requests are already waiting (limit {max_requests}){over_share}",
                                    retry_after_s)
    if max_tokens is not None and num_waiting_tokens + num_prompt_tokens > max_tokens:
        raise EngineOverloadedError(f"{num_waiting_tokens} prompt tokens are already waiting (limit {max_tokens})"
                                    f"{over_share}", retry_after_s)


def retry_after_s(num_waiting: int, steps_per_s: float) -> float:
    """Roughly how long the waiting work takes to start: a step per waiting request's prefill."""
    if steps_per_s <= 0:
        return 1.0
    return max(1.0, num_waiting / steps_per_s)
