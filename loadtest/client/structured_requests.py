"""Structured output requests for the benchmarks: JSON-schema, JSON-object, regex and choice
constraints in turn, the same for every target, and what makes an output valid.

A target gets each request's constraint as the engine's Constraint (in-process) or as the
`structured_outputs` body field (rayinfer's and vLLM's HTTP servers, and vLLM's
`StructuredOutputsParams` offline, which takes the same keys).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import jsonschema

from engine.request.constraint import Constraint

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 120},
                         "member": {"type": "boolean"}},
          "required": ["name", "age", "member"]}
REGEX = r"[A-Z]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]
KINDS = ("json_schema", "json_object", "regex", "choice")


@dataclass(frozen=True)
class StructuredRequest:
    kind: str  # one of KINDS

    @property
    def constraint(self) -> Constraint:
        return {"json_schema": Constraint("json_schema", json.dumps(SCHEMA)), "json_object": Constraint("json_object"),
                "regex": Constraint("regex", REGEX), "choice": Constraint.choice(CHOICES, "structured_outputs.choice"),
                }[self.kind]

    @property
    def structured_outputs(self) -> dict:
        """The `structured_outputs` body field (vLLM's keys)."""
        return {"json_schema": {"json": SCHEMA}, "json_object": {"json_object": True}, "regex": {"regex": REGEX},
                "choice": {"choice": CHOICES}}[self.kind]

    def is_valid(self, text: str) -> bool:
        """Whether a complete output is one the constraint allows."""
        if self.kind == "regex":
            return re.fullmatch(REGEX, text) is not None
        if self.kind == "choice":
            return text in CHOICES
        try:
            value = json.loads(text)
            if self.kind == "json_schema":
                jsonschema.validate(value, SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return isinstance(value, dict)


def structured_mix(num_requests: int) -> list[StructuredRequest]:
    return [StructuredRequest(KINDS[i % len(KINDS)]) for i in range(num_requests)]


@dataclass(frozen=True)
class StructuredTally:
    """One run of the mix: how many ended by themselves ("stop"), how many of those are valid,
    and the tokens generated in the run's time."""

    name: str
    num_requests: int
    num_ended: int
    num_valid: int
    num_tokens: int
    seconds: float

    @property
    def ended_share(self) -> float:
        return self.num_ended / max(self.num_requests, 1)

    @property
    def valid_share(self) -> float:
        """Of the outputs that ended by themselves."""
        return self.num_valid / max(self.num_ended, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds

    @classmethod
    def of_outputs(cls, name: str, requests: list[StructuredRequest], texts: list[str], ended: list[bool],
                   num_tokens: int, seconds: float) -> StructuredTally:
        """The tally of one run's outputs, each request's text and whether it ended by itself."""
        num_valid = sum(request.is_valid(text) for request, text, is_ended in zip(requests, texts, ended) if is_ended)
        return cls(name, len(requests), sum(ended), num_valid, num_tokens, seconds)

    def line(self) -> str:
        return (f"{self.name:34s} ended by itself {self.ended_share:6.1%}, valid {self.valid_share:6.1%} of those, "
                f"{self.num_tokens:6d} tokens in {self.seconds:6.2f} s = {self.tokens_per_s:7.1f} tok/s")
