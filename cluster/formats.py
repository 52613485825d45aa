"""``response_format`` (OpenAI) and ``structured_outputs`` (vLLM) bodies, and the grammar each
asks for. The grammar is validated at the ingress (a bad schema is a 400 naming the field);
replicas compile the same spec again from their cache."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from cluster.body_checks import MAX_DEPTH, json_depth
from cluster.protocol_base import UNSUPPORTED, Body, field_error
from models.grammar import GrammarSpec

MAX_SCHEMA_CHARS = 64 * 1024  # a schema's JSON text; llguidance's own limits bound the rest
MAX_CHOICES = 1024
ANY_OBJECT = json.dumps({"type": "object"})


def _schema_text(schema: Any) -> str:
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"the schema's JSON may be at most {MAX_SCHEMA_CHARS} characters")
    if json_depth(text, MAX_DEPTH) > MAX_DEPTH:
        raise ValueError(f"the schema nests deeper than {MAX_DEPTH} levels")
    return text


class JSONSchemaFormat(Body):
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextFormat(Body):
    type: Literal["text"]


class JSONObjectFormat(Body):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(Body):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaResponseFormat, Field(discriminator="type")
]


def response_format_grammar(fmt: Any) -> GrammarSpec | None:
    """``strict`` or not, the output follows the schema: tandem always constrains (OpenAI's
    non-strict mode only asks the model nicely)."""
    if isinstance(fmt, JSONObjectFormat):
        return GrammarSpec("json_schema", ANY_OBJECT)
    if isinstance(fmt, JSONSchemaResponseFormat):
        schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}
        return GrammarSpec("json_schema", _schema_text(schema))
    return None


_NOT_HERE = {
    "structural_tag": "structural tags are not implemented; use 'grammar' (Lark or GBNF)",
    "whitespace_pattern": "a custom whitespace pattern is not implemented",
    "disable_fallback": "there is one backend (llguidance) and no fallback to disable",
    "disable_any_whitespace": "whitespace inside JSON is left to the model",
    "disable_additional_properties": "set additionalProperties in the schema itself",
}


class StructuredOutputs(Body):
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, max_length=MAX_SCHEMA_CHARS)
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(None, max_length=MAX_SCHEMA_CHARS)
    json_object: bool | None = None
    backend: str | None = None
    structural_tag: Any = None
    whitespace_pattern: Any = None
    disable_fallback: Any = None
    disable_any_whitespace: Any = None
    disable_additional_properties: Any = None

    @field_validator(*_NOT_HERE)
    @classmethod
    def _refused(cls, v: Any, info: Any) -> Any:
        if v in (None, False):
            return v
        raise PydanticCustomError(
            UNSUPPORTED,
            "'{name}' is not supported: {reason}",
            {"name": info.field_name, "reason": _NOT_HERE[info.field_name]},
        )

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str | None) -> str | None:
        if v not in (None, "auto", "guidance", "llguidance"):
            raise ValueError(f"this server constrains with llguidance only, not {v!r}")
        return v

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = [self.json_, self.regex, self.choice, self.grammar, self.json_object or None]
        if sum(g is not None for g in given) != 1:
            raise field_error(
                "structured_outputs",
                "give exactly one of json, regex, choice, grammar, json_object",
            )
        return self

    def grammar_spec(self) -> GrammarSpec:
        if self.json_ is not None:
            raw = json.loads(self.json_) if isinstance(self.json_, str) else self.json_
            return GrammarSpec("json_schema", _schema_text(raw))
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        if self.choice is not None:
            return GrammarSpec("choice", json.dumps(self.choice))
        if self.grammar is not None:
            return GrammarSpec("lark", self.grammar)
        return GrammarSpec("json_schema", ANY_OBJECT)
