"""What each engine step was: its time and its tokens, kept for a reader on another thread.

The engine replica's metrics reporter drains it once a second into the step-time and
tokens-per-step histograms (deployments/observability/metrics.py), the view that tells an operator
whether slow streams come from slow steps or from what lies between them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

STEP_LOG_SIZE = 4096  # steps kept undrained: several seconds at any step rate, a few hundred KB


@dataclass(frozen=True)
class StepRecord:
    duration_s: float  # schedule, forward, sample and bookkeeping
    num_tokens: int  # tokens computed: one per decoding row, a chunk per prefilling row
    num_prompt_tokens: int  # of those, prompt tokens (0 in a decode-only step)
    mask_s: float | None = None  # filling and applying structured outputs' token masks; None: no row had one

    @property
    def kind(self) -> str:
        return "prefill" if self.num_prompt_tokens else "decode"


class StepLog:
    """Bounded: with no reader (an offline engine) the oldest records go. The engine's
    thread appends and any thread drains; deque's append and popleft are atomic."""

    def __init__(self, size: int = STEP_LOG_SIZE) -> None:
        self._records: deque[StepRecord] = deque(maxlen=size)

    def append(self, record: StepRecord) -> None:
        self._records.append(record)

    def drain(self) -> list[StepRecord]:
        """Every record not drained before, oldest first."""
        drained = []
        while True:
            try:
                drained.append(self._records.popleft())
            except IndexError:
                return drained
