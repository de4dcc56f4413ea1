"""Prompts of an exact GPT-2 token length, and the length distributions load tests draw from.

Every word in WORDS is one GPT-2 BPE token when preceded by a space, and GPT-2's
pre-tokenizer splits at each space before a letter, so a prompt of n such words is n
tokens. Words are drawn at random so that requests do not share prefixes (a shared prefix
would turn a prefill benchmark into a prefix-cache benchmark).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

WORDS: tuple[str, ...] = tuple(
    """time year people way day man thing woman life child world school state family student
    group country problem hand part place case week company system program question work
    government number night point home water room mother area money story fact month lot right
    study book eye job word business issue side kind head house service friend father power
    hour game line end member law car city community name president team minute idea kid body
    information back parent face others level office door health person art war history party
    result change morning reason research girl guy moment air teacher force education foot boy
    age policy music market sense nation plan college interest death experience effect class
    control care field development role effort rate heart drug show leader light voice wife
    police mind price report decision son view relationship town road arm difference value
    building action model season society tax director position player record paper space
    ground form event official matter center couple site project activity star table need
    court oil situation cost industry figure street image phone data picture practice piece
    land product doctor wall patient worker news test movie north love support technology step
    baby computer type attention film tree source organization hair window evidence population
    truth song river summer garden bird green blue red small large happy quick bright dark cold
    warm open simple early""".split()
)

DistributionKind = Literal["fixed", "uniform", "normal"]


def make_prompt(num_tokens: int, rng: random.Random) -> str:
    """A prompt of exactly `num_tokens` GPT-2 tokens (it starts with a space)."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be at least 1, got {num_tokens}")
    return "".join(" " + rng.choice(WORDS) for _ in range(num_tokens))


@dataclass(frozen=True)
class Distribution:
    """An integer length: `mean` exactly (fixed), mean ± spread (uniform), or a normal with
    standard deviation `spread`; draws are rounded and clamped to [minimum, maximum]."""

    kind: DistributionKind
    mean: int
    spread: float | None = None  # None: a quarter of the mean
    minimum: int = 1
    maximum: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "normal"):
            raise ValueError(f"distribution must be fixed, uniform or normal, got {self.kind!r}")
        if self.mean < self.minimum:
            raise ValueError(f"mean {self.mean} is below the minimum {self.minimum}")

    @property
    def width(self) -> float:
        return self.mean / 4 if self.spread is None else self.spread

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = float(self.mean)
        elif self.kind == "uniform":
            value = rng.uniform(self.mean - self.width, self.mean + self.width)
        else:
            value = rng.gauss(self.mean, self.width)
        return self._clamp(round(value))

    def _clamp(self, value: int) -> int:
        upper = self.maximum if self.maximum is not None else value
        return max(self.minimum, min(value, upper))
