"""``tools`` and ``tool_choice``: the bodies, and what each choice asks of generation. As in
vLLM, ``required`` and a named function are forced by a grammar (a JSON list of calls; the named
function's arguments), so they work with any model; ``auto`` reads calls out of the model's own
format with a parser (cluster/tool_parsers.py)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from cluster.formats import MAX_SCHEMA_CHARS
from cluster.protocol_base import UNSUPPORTED, Body
from models.grammar import GrammarSpec

MAX_TOOLS = 128


def function_kind(kind: str, refusal: str) -> str:
    """``kind`` if it is "function", else the refusal (a 400 naming the field)."""
    if kind != "function":
        raise PydanticCustomError(UNSUPPORTED, refusal, {"kind": kind})
    return kind


class FunctionDef(Body):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _small(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and len(json.dumps(v)) > MAX_SCHEMA_CHARS:
            raise ValueError(f"a function's parameters may be at most {MAX_SCHEMA_CHARS} chars")
        return v

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters else {"type": "object"}


class FunctionTool(Body):
    type: str
    function: FunctionDef | None = None
    custom: Any = None

    @field_validator("type")
    @classmethod
    def _function_only(cls, v: str) -> str:
        return function_kind(v, "'{kind}' tools are not supported: only function tools")


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: str
    function: NamedFunction | None = None
    allowed_tools: Any = None
    custom: Any = None

    @field_validator("type")
    @classmethod
    def _function_only(cls, v: str) -> str:
        return function_kind(v, "tool_choice of type '{kind}' is not supported: name a function")


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools ask of generation: ``mode`` is "parser" (auto, read from the
    model's format), "required" (a forced list of calls) or "named" (one forced call)."""

    mode: Literal["parser", "required", "named"]
    name: str | None = None  # the named function
    parallel: bool = True


def tool_grammar(use: ToolUse, tools: list[FunctionTool]) -> GrammarSpec | None:
    fns = [t.function for t in tools if t.function is not None]
    if use.mode == "named":
        fn = next(f for f in fns if f.name == use.name)
        return GrammarSpec("json_schema", json.dumps(fn.parameters_schema), compact=True)
    if use.mode != "required":
        return None
    one = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "parameters": f.parameters_schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in fns
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one}}
    if not use.parallel:
        schema["maxItems"] = 1
    return GrammarSpec("json_schema", json.dumps(schema), compact=True)


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """A whole call, as a message's ``tool_calls`` carries it."""
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
