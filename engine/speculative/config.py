"""The speculative-decoding section of EngineConfig (`speculative:`), in vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SpeculativeMethod = Literal["ngram"]


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpeculativeMethod = "ngram"
    num_speculative_tokens: int = 4  # proposals per sequence and step, at most
    prompt_lookup_max: int = 3  # the longest suffix looked up earlier in the sequence
    prompt_lookup_min: int = 1  # the shortest
    # Speculation stops adding rows once a step holds this many (decodes and proposals):
    # past it a step's time grows with its rows, and a rejected proposal costs a full row.
    max_step_rows: int = 16

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative.method must be ngram, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "max_step_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative.{name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative.prompt_lookup_min must be <= prompt_lookup_max")

    @classmethod
    def of(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """A config file's dict (or None: no speculation) as the dataclass, validated."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative must be a mapping or null, got {value!r}")
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"speculative: unknown keys {sorted(unknown)}")
        return cls(**value)
