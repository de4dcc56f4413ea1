"""What the structured output tests share: one constraint of each kind, and what makes an
output valid under it (json.loads + jsonschema, re.fullmatch, one of the choices)."""

from __future__ import annotations

import json
import re

import jsonschema

from engine.request.constraint import Constraint

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"]}
REGEX = r"[A-Z]{2}-\d{3}( [a-z]{1,6})?"
CHOICES = ["yes", "no", "it depends"]
# Bounded, as the regex: random weights might otherwise never draw the end.
GRAMMAR = 'root ::= "(" item (", " item)? (", " item)? ")"\nitem ::= [a-c] [a-c]? | "nil"'
_GRAMMAR_AS_REGEX = r"\(([a-c]{1,2}|nil)(, ([a-c]{1,2}|nil)){0,2}\)"
CONSTRAINTS = {
    "json_schema": Constraint("json_schema", json.dumps(SCHEMA)),
    "json_object": Constraint("json_object"),
    "regex": Constraint("regex", REGEX),
    "choice": Constraint.choice(CHOICES, "guided_choice"),
    "grammar": Constraint("grammar", GRAMMAR),
}


def is_valid(kind: str, text: str) -> bool:
    """Whether a complete output is one the constraint of `kind` (a CONSTRAINTS key) allows."""
    if kind in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
            if kind == "json_schema":
                jsonschema.validate(value, SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return isinstance(value, dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(_GRAMMAR_AS_REGEX, text) is not None
