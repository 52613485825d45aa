"""Checks on a request body as parsed JSON, before its fields are read: text a tokenizer cannot
take (lone UTF-16 surrogates, which JSON's ``\\ud800`` escapes allow) and nesting deep enough to
exhaust a recursive parser, each refused naming where it was found."""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 32  # a chat body nests about 6 deep; JSON in tool-call arguments counts from there
_SURROGATES = range(0xD800, 0xE000)


class BodyError(ValueError):
    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path


def has_lone_surrogate(text: str) -> bool:
    # encoding fails exactly on surrogates; the scan runs only on the rare failure
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return any(ord(c) in _SURROGATES for c in text)
    return False


def check_body(data: Any, path: str = "", depth: int = 0) -> None:
    """Raises BodyError naming the first string with a lone surrogate or the first value
    nested deeper than :data:`MAX_DEPTH` (iteratively bounded: the walk stops at the limit)."""
    if depth > MAX_DEPTH:
        raise BodyError(path, f"'{path}' nests deeper than {MAX_DEPTH} levels")
    if isinstance(data, str):
        if has_lone_surrogate(data):
            raise BodyError(path, f"'{path}' holds a lone UTF-16 surrogate (not valid Unicode)")
    elif isinstance(data, dict):
        for k, v in data.items():
            key = str(k)
            if has_lone_surrogate(key):
                raise BodyError(path, f"a key in '{path or 'body'}' is not valid Unicode")
            check_body(v, f"{path}.{key}" if path else key, depth + 1)
    elif isinstance(data, list):
        for i, v in enumerate(data):
            check_body(v, f"{path}.{i}" if path else str(i), depth + 1)


def json_depth(text: str, limit: int) -> int:
    """How deep the arrays and objects of JSON ``text`` nest, counted up to ``limit + 1``
    without parsing (so ``"[" * 100000`` costs one pass, not a recursion per bracket)."""
    depth = most = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            if depth > most:
                most = depth
                if most > limit:
                    return most
        elif c in "]}":
            depth -= 1
    return most
