"""Structured outputs on the wire: every shape clients send, read into one engine Constraint.

- OpenAI's `response_format`: {"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}, {"type": "json_object"}, {"type": "text"} (no constraint);
- vLLM's `structured_outputs`: {"json": schema or its text}, {"regex"}, {"choice"},
  {"grammar": EBNF/GBNF}, {"json_object": true};
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

A request holds at most one constraint: two are a 400 naming both. Whether a schema, regex or
grammar compiles is the engine's to say (it compiles them against the model's tokenizer:
engine/sampling/grammar.py), and where one does not, a 400 names the field it came from.
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.api.errors import ApiError
from engine.request.constraint import Constraint

Choices = Annotated[list[str], Field(min_length=1)]
Schema = dict[str, Any] | str  # a JSON schema, or its JSON text


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class JsonSchemaFormat(_Strict):
    """OpenAI's: the output is JSON valid under `schema`. xgrammar's strict mode is always on
    (an object has only the properties its schema lists), so `strict` changes nothing."""

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's StructuredOutputsParams, the constraint fields: set one."""

    json_: Schema | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredOutputFields(_Strict):
    """Mixed into the completions and chat bodies."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Schema | None = None
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None

    @cached_property
    def constraint(self) -> Constraint | None:
        """The request's one constraint, or None; a 400 where it holds two."""
        found = [c for c in (*self._response_format(), *self._structured_outputs(), *self._guided()) if c]
        if len(found) > 1:
            first, second = found[0].param, found[1].param
            raise ApiError(400, f"{first} and {second}: a request takes one structured output constraint, "
                                f"got both", param=second)
        return found[0] if found else None

    def _response_format(self) -> list[Constraint]:
        fmt, param = self.response_format, "response_format"
        if fmt is None or fmt.type == "text":
            return []
        if fmt.type == "json_object":
            return [Constraint("json_object", "", param)]
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ApiError(400, f"{param}: type json_schema needs json_schema.schema", param=param)
        return [Constraint("json_schema", schema_text(fmt.json_schema.schema_, param), param)]

    def _structured_outputs(self) -> list[Constraint]:
        given = self.structured_outputs
        if given is None:
            return []
        return _constraints(given.json_, given.regex, given.choice, given.grammar, bool(given.json_object),
                            prefix="structured_outputs.")

    def _guided(self) -> list[Constraint]:
        return _constraints(self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar, False,
                            prefix="guided_")


def _constraints(schema: Schema | None, regex: str | None, choice: list[str] | None, grammar: str | None,
                 json_object: bool, prefix: str) -> list[Constraint]:
    found = []
    if schema is not None:
        found.append(Constraint("json_schema", schema_text(schema, prefix + "json"), prefix + "json"))
    if regex is not None:
        found.append(Constraint("regex", regex, prefix + "regex"))
    if choice is not None:
        found.append(Constraint.choice(choice, prefix + "choice"))
    if grammar is not None:
        found.append(Constraint("grammar", grammar, prefix + "grammar"))
    if json_object:
        found.append(Constraint("json_object", "", prefix + "json_object"))
    return found


def schema_text(schema: Schema, param: str) -> str:
    """The schema as JSON text, its keys in the client's order (properties are generated in it)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"{param}: not valid JSON: {exc}", param=param) from exc
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param}: a JSON schema must be an object", param=param)
    return json.dumps(schema, ensure_ascii=False)
