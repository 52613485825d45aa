"""Reading tool calls out of a model's text, per format: Hermes/Qwen ``<tool_call>`` JSON,
Llama 3.x JSON (``<|python_tag|>`` or a bare object), Mistral ``[TOOL_CALLS]`` and gpt-oss's
harmony channels (which carry the reasoning too). ``ToolStream`` streams the text before a call
and holds back from the first call marker on, so no client sees half a call as content."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "llama3_json", "mistral", "gpt_oss")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: tuple[ParsedCall, ...] = ()
    reasoning: str = ""


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a call is an object with a name")
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    text = args if isinstance(args, str) else json.dumps(args)
    return ParsedCall(obj["name"], text)


def _json_values(text: str) -> list[Any]:
    """Consecutive JSON values separated by whitespace, commas or semicolons."""
    dec, i = json.JSONDecoder(), 0
    out: list[Any] = []
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            return out
        value, i = dec.raw_decode(text, i)
        out.append(value)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_HARMONY = re.compile(
    r"<\|channel\|>(\w+)(?:\s+to=functions\.([\w.\-]+))?[^<]*(?:<\|constrain\|>\w+)?"
    r"<\|message\|>(.*?)(?=<\|end\|>|<\|call\|>|<\|return\|>|<\|start\|>|$)",
    re.DOTALL,
)


def parse_tool_calls(parser: str, text: str) -> Parsed:
    """Text that does not parse as calls stays content (as vLLM's parsers leave it)."""
    try:
        if parser == "hermes":
            calls = tuple(_call(json.loads(m.group(1))) for m in _HERMES.finditer(text))
            return Parsed(_HERMES.sub("", text).strip() if calls else text, calls)
        if parser == "llama3_json":
            body = text.strip().removeprefix("<|python_tag|>")
            if not body.startswith("{"):
                return Parsed(text)
            return Parsed("", tuple(_call(v) for v in _json_values(body)))
        if parser == "mistral":
            head, sep, body = text.partition("[TOOL_CALLS]")
            if not sep:
                return Parsed(text)
            return Parsed(head.strip(), _mistral(body))
        if parser == "gpt_oss":
            return _harmony(text)
    except (ValueError, KeyError, TypeError):
        return Parsed(text)
    raise ValueError(f"unknown tool parser {parser!r}")


def _mistral(body: str) -> tuple[ParsedCall, ...]:
    body = body.strip()
    if body.startswith("["):  # [{"name": ..., "arguments": {...}}, ...]
        return tuple(_call(v) for v in json.loads(body))
    calls = []  # v11+: name[ARGS]{...}, one per [TOOL_CALLS]
    for part in body.split("[TOOL_CALLS]"):
        name, _, args = part.partition("[ARGS]")
        calls.append(ParsedCall(name.strip(), json.dumps(json.loads(args))))
    return tuple(calls)


def _harmony(text: str) -> Parsed:
    content, reasoning, calls = [], [], []
    for m in _HARMONY.finditer(text):
        channel, fn, body = m.group(1), m.group(2), m.group(3)
        if fn:
            calls.append(ParsedCall(fn, json.dumps(json.loads(body))))
        elif channel == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
    if not (content or reasoning or calls):
        return Parsed(text)
    return Parsed("".join(content), tuple(calls), "".join(reasoning))


def detect_tool_parser(template: str) -> str | None:
    """The format a chat template teaches its model, or None."""
    if "<|channel|>" in template:
        return "gpt_oss"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return "llama3_json"
    return None


def keeps_special_tokens(parser: str) -> bool:
    """Its markers are special tokens, which plain detokenizing would drop."""
    return parser in ("mistral", "gpt_oss", "llama3_json")


_STARTS = {
    "hermes": ("<tool_call>",),
    "llama3_json": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]",),
}


class ToolStream:
    """One choice's text: content is passed on until a call marker, the rest parsed at the end."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.pending = ""
        self.calling = parser == "gpt_oss"  # harmony text is all markup: read it whole
        self.sent_text = False

    def push(self, text: str) -> str:
        if self.calling:
            self.pending += text
            return ""
        self.pending += text
        if self.parser == "llama3_json" and not self.sent_text:
            lead = self.pending.lstrip()
            if lead.startswith("{"):  # a bare JSON object opens the answer: a call
                self.calling = True
                return ""
            if not lead:
                return ""
        markers = _STARTS[self.parser]
        hits = [i for i in (self.pending.find(m) for m in markers) if i >= 0]
        if hits:
            cut = min(hits)
            out, self.pending, self.calling = self.pending[:cut], self.pending[cut:], True
        else:
            keep = _partial_marker(self.pending, markers)
            out, self.pending = (
                self.pending[: len(self.pending) - keep],
                self.pending[len(self.pending) - keep :],
            )
        self.sent_text = self.sent_text or bool(out.strip())
        return out

    def finish(self) -> Parsed:
        rest, self.pending = self.pending, ""
        if not self.calling:
            return Parsed(rest)
        return parse_tool_calls(self.parser, rest)


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could begin a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:n]):
                best = max(best, n)
                break
    return best
