"""What every request body shares: unknown fields refused by name, refusals of declared fields
unless at their "off" value, and the checks for text no tokenizer takes and for deep nesting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from cluster.body_checks import BodyError, check_body

MAX_SEED = 2**63 - 1
MAX_COUNT = 2**31 - 1
MAX_STOP_CHARS = 1024  # the bound of every count a client sends (n, max_tokens, top_k, ...)
UNSUPPORTED = "unsupported"  # the pydantic error type of a refused field (see cluster.errors)
INVALID_TEXT = "invalid_body"  # a lone surrogate or too deep a nesting, with its path


@dataclass(frozen=True)
class Refusal:
    """Why a declared field is not served, and the values that leave it off (accepted)."""

    reason: str
    off: tuple[Any, ...] = (None,)


def _is_off(value: Any, rule: Refusal) -> bool:
    """Whether ``value`` is one of the rule's off values (``True`` is not ``1`` here)."""
    return any(value is off or (value == off and type(value) is not bool) for off in rule.off)


def refuse(name: str, value: Any, rule: Refusal) -> Any:
    """``value`` if it leaves the field off, else the refusal naming ``name``."""
    if _is_off(value, rule):
        return value
    raise PydanticCustomError(
        UNSUPPORTED,
        "'{name}' is not supported: {reason}",
        {
            "name": name,
            "reason": rule.reason,
        },
    )


class Body(BaseModel):
    """A request body or part of one: unknown fields are refused by name."""

    model_config = ConfigDict(extra="forbid")


class RequestBody(Body):
    """A whole request body: checked for text no tokenizer takes and for deep nesting first."""

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, data: Any) -> Any:
        try:
            check_body(data)
        except BodyError as e:
            raise PydanticCustomError(
                INVALID_TEXT, "{reason}", {"reason": str(e), "path": e.path}
            ) from None
        return data


def field_error(path: str, message: str) -> PydanticCustomError:
    """An error a model-level check raises for one field (its ``path`` becomes ``param``)."""
    return PydanticCustomError(INVALID_TEXT, "{reason}", {"reason": message, "path": path})
