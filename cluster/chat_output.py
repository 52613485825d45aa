"""One chat choice's text turned into what the API returns: reasoning split off, tool calls read
out (parsed from the model's format, or the forced JSON of ``required`` and a named function),
the rest as content; in a stream, piece by piece."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cluster.reasoning import ThinkStream
from cluster.tool_parsers import ParsedCall, ToolStream
from cluster.tools import ToolUse, call_id


@dataclass(frozen=True)
class ChatPlan:
    """How a request's chat output is read (built by the ingress with its prompt)."""

    reasoning: bool = False
    starts_inside: bool = False  # the prompt left a <think> open
    tools: ToolUse | None = None
    parser: str | None = None  # the model's tool-call format, for tool_choice "auto"


@dataclass(frozen=True)
class ChatPiece:
    content: str = ""
    reasoning: str = ""
    # stream entries of ``delta.tool_calls``, each sent in a chunk of its own
    tool_calls: tuple[dict[str, Any], ...] = ()


@dataclass
class ChatOutput:
    plan: ChatPlan
    calls: list[dict[str, Any]] = field(default_factory=list)  # whole calls, for the message
    _named_id: str | None = None
    _forced: str = ""

    def __post_init__(self) -> None:
        p = self.plan
        self._think = ThinkStream(p.starts_inside) if p.reasoning else None
        parsing = p.tools is not None and p.tools.mode == "parser" and p.parser is not None
        self._tools = ToolStream(p.parser) if parsing and p.parser is not None else None

    @property
    def mode(self) -> str | None:
        return self.plan.tools.mode if self.plan.tools is not None else None

    def push(self, text: str) -> ChatPiece:
        reasoning, content = self._think.push(text) if self._think is not None else ("", text)
        return self._route(reasoning, content)

    def finish(self) -> ChatPiece:
        reasoning, content = self._think.finish() if self._think is not None else ("", "")
        piece = self._route(reasoning, content)
        end = self._end()
        return ChatPiece(
            piece.content + end.content,
            piece.reasoning + end.reasoning,
            piece.tool_calls + end.tool_calls,
        )

    def finish_reason(self, reason: str) -> str:
        """OpenAI's: "tool_calls" when the model chose to call (not for a named function)."""
        return "tool_calls" if self.calls and self.mode != "named" else reason

    def _route(self, reasoning: str, content: str) -> ChatPiece:
        if self.mode == "named" and content:
            assert self.plan.tools is not None and self.plan.tools.name is not None
            entries: list[dict[str, Any]] = []
            if self._named_id is None:
                self._named_id = call_id()
                entries.append(_head(0, self._named_id, self.plan.tools.name))
            self._forced += content
            entries.append({"index": 0, "function": {"arguments": content}})
            return ChatPiece("", reasoning, tuple(entries))
        if self.mode == "required":
            self._forced += content
            return ChatPiece("", reasoning)
        if self._tools is not None:
            return ChatPiece(self._tools.push(content), reasoning)
        return ChatPiece(content, reasoning)

    def _end(self) -> ChatPiece:
        if self.mode == "named":
            assert self.plan.tools is not None and self.plan.tools.name is not None
            if self._named_id is None:
                self._named_id = call_id()
            self.calls = [_whole(self._named_id, self.plan.tools.name, self._forced)]
            return ChatPiece()
        found: tuple[ParsedCall, ...] = ()
        content = reasoning = ""
        if self.mode == "required":
            try:
                found = tuple(
                    ParsedCall(c["name"], json.dumps(c["parameters"]))
                    for c in json.loads(self._forced)
                )
            except (ValueError, KeyError, TypeError):  # cut short (length): left as text
                content = self._forced
        elif self._tools is not None:
            parsed = self._tools.finish()
            found, content, reasoning = parsed.calls, parsed.content, parsed.reasoning
            if self.plan.tools is not None and not self.plan.tools.parallel:
                found = found[:1]
        entries = []
        for i, c in enumerate(found):
            whole = _whole(call_id(), c.name, c.arguments)
            self.calls.append(whole)
            entries.append({"index": i, **whole})
        return ChatPiece(content, reasoning, tuple(entries))


def _head(index: int, cid: str, name: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": cid,
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }


def _whole(cid: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}
