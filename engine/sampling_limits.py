"""The limits on sampling fields, each stated once.

SamplingParams checks a value against them (`Bound.check`); the HTTP bodies
(deployments/protocol.py) hand the same bounds to pydantic (`Bound.constraints`), so a bad
field is a 400 naming it before a request is built, and the two can never disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.invalid_request import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # top alternatives per position, as vLLM's default max_logprobs


@dataclass(frozen=True)
class Bound:
    """A number's range: lower bound ge or gt, upper bound le or lt (None: unbounded)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    is_integer: bool = False
    is_finite: bool = False  # nan and +-inf refused even where the bounds would let them pass

    def contains(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.is_integer else (int, float)):
            return False
        if self.is_finite and not math.isfinite(value):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def check(self, name: str, value: object) -> None:
        if not self.contains(value):
            raise InvalidRequestError(f"{name} must be {self.describe()}, got {value!r}", name)

    def describe(self) -> str:
        kind = "an integer" if self.is_integer else "a finite number" if self.is_finite else "a number"
        low = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else ""
        high = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else ""
        if low and high:
            return f"{kind} in {low}, {high}"
        if low:
            return f"{kind} {'>=' if low[0] == '[' else '>'} {low[1:]}"
        return f"{kind} {'<=' if high[-1] == ']' else '<'} {high[:-1]}" if high else kind

    def constraints(self) -> dict[str, Any]:
        """The bound as pydantic's Field keywords."""
        found = {k: getattr(self, k) for k in ("ge", "gt", "le", "lt") if getattr(self, k) is not None}
        return {**found, "allow_inf_nan": False} if self.is_finite else found


MAX_TOKENS = Bound(ge=0, is_integer=True)  # 0 only to score the prompt alone
NEW_TOKENS = Bound(ge=1, is_integer=True)  # where something must be generated
TEMPERATURE = Bound(ge=0, is_finite=True)  # 0 means greedy
TOP_P = Bound(gt=0, le=1)
TOP_K = Bound(ge=-1, is_integer=True)  # 0 or -1 disables top-k
MIN_P = Bound(ge=0, le=1)
SEED = Bound(ge=-(2**63), lt=2**63, is_integer=True)  # torch seeds are 64-bit
TOKEN_ID = Bound(ge=0, is_integer=True)  # the vocabulary's size is the model's: engine/request_rules.py
MIN_TOKENS = Bound(ge=0, is_integer=True)  # and <= max_tokens
PENALTY = Bound(ge=-2, le=2)  # OpenAI: presence and frequency penalties in [-2, 2]
REPETITION_PENALTY = Bound(gt=0, is_finite=True)
LOGIT_BIAS = Bound(ge=-100, le=100)  # OpenAI: each bias in [-100, 100]
LOGPROBS = Bound(ge=0, le=MAX_LOGPROBS, is_integer=True)
NUM_SEQUENCES = Bound(ge=1, is_integer=True)  # n, and best_of (>= n)


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"
