"""The limits on sampling fields, each stated once.

SamplingParams checks a value against them (`Bound.check`); the HTTP bodies
(deployments/api/protocol.py) hand the same bounds to pydantic (`Bound.constraints`), so a bad
field is a 400 naming it before a request is built, and the two can never disagree. The
engine checks them again when it admits a request (engine/request/request_rules.py), whoever sent it.

Every number ends up in a tensor the sampler builds per step, so every bound lies within
what that tensor holds: an integer within int64 (top_k, token ids, seeds), a float finite
and within float32 (temperature, penalties, biases). A bound that states no narrower range
gets that one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.request.invalid_request import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # top alternatives per position, as vLLM's default max_logprobs
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
# Below this temperature a request samples greedily, as vLLM's (_SAMPLING_EPS): sampling there
# is the argmax in all but name, and logits / temperature would overflow float32 into NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Bound:
    """A number's range: lower bound ge or gt, upper bound le or lt; where neither side is
    given, int64's (integers) or float32's (floats). NaN and infinities are never in it."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    is_integer: bool = False

    def __post_init__(self) -> None:
        low, high = (INT64_MIN, INT64_MAX) if self.is_integer else (-FLOAT32_MAX, FLOAT32_MAX)
        if self.ge is None and self.gt is None:
            object.__setattr__(self, "ge", low)
        if self.le is None and self.lt is None:
            object.__setattr__(self, "le", high)

    def contains(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.is_integer else (int, float)):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def check(self, name: str, value: object) -> None:
        if not self.contains(value):
            raise InvalidRequestError(f"{name} must be {self.describe()}, got {value!r}", name)

    def describe(self) -> str:
        kind = "an integer" if self.is_integer else "a finite number"
        low = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}"
        high = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})"
        return f"{kind} in {low}, {high}"

    def constraints(self) -> dict[str, Any]:
        """The bound as pydantic's Field keywords."""
        found = {k: getattr(self, k) for k in ("ge", "gt", "le", "lt") if getattr(self, k) is not None}
        return found if self.is_integer else {**found, "allow_inf_nan": False}


MAX_TOKENS = Bound(ge=0, is_integer=True)  # 0 only to score the prompt alone
NEW_TOKENS = Bound(ge=1, is_integer=True)  # where something must be generated
TEMPERATURE = Bound(ge=0)  # 0 (or below GREEDY_BELOW_TEMPERATURE) means greedy
TOP_P = Bound(gt=0, le=1)
TOP_K = Bound(ge=-1, is_integer=True)  # 0 or -1 disables top-k; past the vocabulary, all of it
MIN_P = Bound(ge=0, le=1)
SEED = Bound(is_integer=True)  # torch seeds are 64-bit
TOKEN_ID = Bound(ge=0, is_integer=True)  # the vocabulary's size is the model's: engine/request/request_rules.py
MIN_TOKENS = Bound(ge=0, is_integer=True)  # and <= max_tokens
PENALTY = Bound(ge=-2, le=2)  # OpenAI: presence and frequency penalties in [-2, 2]
# Logits are divided (or multiplied) by it in float32: far from 1 they overflow into NaN rows.
REPETITION_PENALTY = Bound(ge=0.01, le=100)
LOGIT_BIAS = Bound(ge=-100, le=100)  # OpenAI: each bias in [-100, 100]
LOGPROBS = Bound(ge=0, le=MAX_LOGPROBS, is_integer=True)
NUM_SEQUENCES = Bound(ge=1, is_integer=True)  # n, and best_of (>= n)


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"
