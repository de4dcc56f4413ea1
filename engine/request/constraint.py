"""What a structured-output request constrains its output to, as the engine receives it.

Plain data, no torch and no xgrammar: the HTTP layer builds it from response_format,
structured_outputs or guided_* (deployments/api/structured_outputs.py), and the engine
compiles it against the model's tokenizer when the request arrives (engine/sampling/grammar.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from engine.request.invalid_request import InvalidRequestError

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[ConstraintKind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """kind and spec say what the output must be; param names the request field it came
    from, for the 400 when the spec does not compile.

    spec: json_schema, the schema as JSON text; regex, the pattern; grammar, the EBNF (GBNF)
    text; choice, the choices as a JSON list of strings; json_object, empty."""

    kind: ConstraintKind
    spec: str = ""
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"{self.param}: unknown constraint kind {self.kind!r}", self.param)
        if not isinstance(self.spec, str):
            raise InvalidRequestError(f"{self.param}: the constraint must be text", self.param)

    @property
    def key(self) -> tuple[str, str]:
        """What its compiled grammar is cached by: the same text compiles to the same grammar."""
        return self.kind, self.spec

    @classmethod
    def choice(cls, choices: list[str], param: str) -> Constraint:
        return cls("choice", json.dumps(choices, ensure_ascii=False), param)

    @property
    def choices(self) -> list[str]:
        return json.loads(self.spec)
