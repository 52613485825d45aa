"""Sixty JSON schemas of varied shape (nested objects, arrays, enums, bounded numbers, optional
fields, patterns, unions), built from a seed, for the structured-output tests and benchmarks."""

from __future__ import annotations

import random
from typing import Any

_WORDS = (
    "name",
    "city",
    "color",
    "status",
    "level",
    "kind",
    "title",
    "owner",
    "region",
    "price",
    "count",
    "score",
    "tags",
    "items",
    "user",
    "order",
    "address",
    "email",
    "phone",
    "rating",
    "genre",
    "year",
    "month",
    "day",
    "label",
    "code",
    "unit",
    "stock",
)


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.randrange(8)
    if kind == 0:
        return {"type": "string", "maxLength": rng.choice((8, 16, 32))}
    if kind == 1:
        lo = rng.randrange(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randrange(1, 500)}
    if kind == 2:
        return {"type": "number", "minimum": 0, "maximum": rng.choice((1, 100, 1000))}
    if kind == 3:
        return {"type": "boolean"}
    if kind == 4:
        return {"enum": rng.sample(["red", "green", "blue", "amber", "north", "south", "x"], 3)}
    if kind == 5:
        return {"type": "string", "pattern": rng.choice(("^[a-z]{2,6}$", "^[0-9]{3}-[0-9]{4}$"))}
    if kind == 6:
        return {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4}
    return {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(_WORDS, rng.randrange(1, 5))
    props: dict[str, Any] = {}
    for n in names:
        if depth > 0 and rng.random() < 0.3:
            props[n] = _object(rng, depth - 1)
        elif depth > 0 and rng.random() < 0.2:
            props[n] = {"type": "array", "items": _object(rng, depth - 1), "maxItems": 3}
        else:
            props[n] = _leaf(rng)
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


def json_schemas(count: int = 60, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` schemas, each a JSON object at the top (what ``response_format`` takes)."""
    rng = random.Random(seed)
    return [_object(rng, depth=i % 3) for i in range(count)]
