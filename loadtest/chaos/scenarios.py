"""What a chaos run sends and what it records of each request."""

from __future__ import annotations

import enum
from collections import Counter, defaultdict
from dataclasses import dataclass, field


class Scenario(enum.StrEnum):
    # Valid requests: each must be served, or refused with 429 and a Retry-After.
    STREAM = "stream"
    COMPLETE = "complete"
    CHAT = "chat"
    BURST = "burst"  # many long requests at once, past the engine's waiting bounds
    # Mistakes: each must get its 4xx.
    BAD_INPUT = "bad_input"
    TOO_LARGE = "too_large"
    BAD_KEY = "bad_key"  # only when the server has API keys
    # Clients that leave: the server must abort their requests.
    DROP_MID_STREAM = "drop_mid_stream"
    DROP_QUEUED = "drop_queued"
    DROP_NON_STREAM = "drop_non_stream"

    @property
    def is_valid(self) -> bool:
        return self in (Scenario.STREAM, Scenario.COMPLETE, Scenario.CHAT, Scenario.BURST)


# How often each worker picks each scenario (bursts come on their own timer).
WEIGHTS: dict[Scenario, int] = {
    Scenario.STREAM: 30, Scenario.COMPLETE: 15, Scenario.CHAT: 10, Scenario.BAD_INPUT: 15, Scenario.TOO_LARGE: 3,
    Scenario.BAD_KEY: 4, Scenario.DROP_MID_STREAM: 10, Scenario.DROP_QUEUED: 7, Scenario.DROP_NON_STREAM: 6,
}


@dataclass
class Outcome:
    kind: Scenario
    status: int | None  # None: the client left before a status, on purpose
    problem: str | None = None  # a valid request that failed, a bad input with the wrong status


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)

    def add(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    def requests_by_kind(self) -> dict[str, int]:
        return {str(kind): n for kind, n in Counter(o.kind for o in self.outcomes).items()}

    def statuses_by_kind(self) -> dict[str, dict[str, int]]:
        table: dict[Scenario, Counter] = defaultdict(Counter)
        for o in self.outcomes:
            table[o.kind][str(o.status) if o.status is not None else "client_left"] += 1
        return {str(kind): dict(counts) for kind, counts in sorted(table.items())}

    def problems(self) -> list[str]:
        return [f"{o.kind}: {o.problem}" for o in self.outcomes if o.problem]

    def num_valid_5xx(self) -> int:
        return sum(o.kind.is_valid and o.status is not None and o.status >= 500 for o in self.outcomes)
