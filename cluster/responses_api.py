"""The Responses API's output: items (reasoning, message, function calls) built from one chat
choice's pieces, whole or as the stream of typed events the OpenAI SDK reads."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from cluster.chat_output import ChatOutput, ChatPiece, ChatPlan
from cluster.errors import APIError, generation_error
from cluster.generation import Delta, Final, Generation, GenerationError, TextOptions
from cluster.responses_protocol import ResponsesRequest
from models.request import Request


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class _Open:
    """The item a stream is writing into."""

    kind: str  # reasoning | message | function_call
    index: int
    item: dict[str, Any]
    text: str = ""


@dataclass
class ResponseShape:
    body: ResponsesRequest
    model: str
    plan: ChatPlan
    id: str = field(default_factory=lambda: _id("resp"))
    created: int = field(default_factory=lambda: int(time.time()))
    items: list[dict[str, Any]] = field(default_factory=list)
    seq: int = 0
    _open: _Open | None = None
    _calls: dict[int, _Open] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.out = ChatOutput(self.plan)

    def response(self, status: str, final: Final | None = None) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        usage = None
        if final is not None:
            usage = {
                "input_tokens": final.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": final.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": final.prompt_tokens + final.completion_tokens,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "completed_at": int(time.time()) if final is not None else None,
            "status": status,
            "model": self.model,
            "output": list(self.items),
            "usage": usage,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "tool_choice": b.tool_choice
            if isinstance(b.tool_choice, str)
            else "auto"
            if b.tool_choice is None
            else b.tool_choice.model_dump(exclude_none=True),
            "tools": [t.model_dump() for t in b.tools or ()],  # every field, null where unset
            "text": {
                "format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt
                else {"type": "text"}
            },
            "store": False,
            "metadata": b.metadata or {},
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "truncation": "disabled",
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "top_logprobs": 0,
            "max_tool_calls": None,
            "background": False,
            "service_tier": "default",
            "safety_identifier": b.safety_identifier,
            "prompt_cache_key": b.prompt_cache_key,
        }

    @staticmethod
    def status(final: Final) -> str:
        return "incomplete" if final.finish_reason == "length" else "completed"

    def whole(self, text: str, final: Final) -> dict[str, Any]:
        for event in self.stream_piece(text):  # the same items a stream builds
            del event
        for event in self.stream_end(final):
            del event
        return self.response(self.status(final), final)

    def start(self) -> list[dict[str, Any]]:
        created = self.response("in_progress")
        return [
            self._event("response.created", response=created),
            self._event("response.in_progress", response=created),
        ]

    def stream_piece(self, text: str) -> list[dict[str, Any]]:
        return self._piece(self.out.push(text))

    def stream_end(self, final: Final) -> list[dict[str, Any]]:
        events = self._piece(self.out.finish())
        events += self._close()
        for call in sorted(self._calls.values(), key=lambda c: c.index):
            events += self._close_call(call)
        self._calls.clear()
        kind = "response.incomplete" if self.status(final) == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=self.response(self.status(final), final))]

    def _piece(self, piece: ChatPiece) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if piece.reasoning:
            events += self._write("reasoning", piece.reasoning)
        if piece.content:
            events += self._write("message", piece.content)
        for entry in piece.tool_calls:
            events += self._call(entry)
        return events

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is not None and self._open.kind != kind:
            events += self._close()
        if self._open is None:
            events += self._open_item(kind)
        o = self._open
        assert o is not None
        o.text += text
        delta = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        events.append(
            self._event(
                delta,
                item_id=o.item["id"],
                output_index=o.index,
                content_index=0,
                delta=text,
                **extra,
            )
        )
        return events

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            item: dict[str, Any] = {
                "type": "reasoning",
                "id": _id("rs"),
                "summary": [],
                "content": [],
            }
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                "type": "message",
                "id": _id("msg"),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items.append(item)
        self._open = _Open(kind, len(self.items) - 1, item)
        return [
            self._event(
                "response.output_item.added", output_index=self._open.index, item=dict(item)
            ),
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=self._open.index,
                content_index=0,
                part=part,
            ),
        ]

    def _close(self) -> list[dict[str, Any]]:
        o, self._open = self._open, None
        if o is None:
            return []
        if o.kind == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": o.text}
            done = self._event(
                "response.reasoning_text.done",
                item_id=o.item["id"],
                output_index=o.index,
                content_index=0,
                text=o.text,
            )
        else:
            part = {"type": "output_text", "text": o.text, "annotations": [], "logprobs": []}
            o.item["status"] = "completed"
            done = self._event(
                "response.output_text.done",
                item_id=o.item["id"],
                output_index=o.index,
                content_index=0,
                text=o.text,
                logprobs=[],
            )
        o.item["content"] = [part]
        return [
            done,
            self._event(
                "response.content_part.done",
                item_id=o.item["id"],
                output_index=o.index,
                content_index=0,
                part=part,
            ),
            self._event("response.output_item.done", output_index=o.index, item=dict(o.item)),
        ]

    def _call(self, entry: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        fn = entry.get("function", {})
        call = self._calls.get(entry["index"])
        if call is None:
            item = {
                "type": "function_call",
                "id": _id("fc"),
                "call_id": entry["id"],
                "name": fn.get("name", ""),
                "arguments": "",
                "status": "in_progress",
            }
            self.items.append(item)
            call = _Open("function_call", len(self.items) - 1, item)
            self._calls[entry["index"]] = call
            events.append(
                self._event("response.output_item.added", output_index=call.index, item=dict(item))
            )
        args = fn.get("arguments", "")
        if args:
            call.text += args
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=call.item["id"],
                    output_index=call.index,
                    delta=args,
                )
            )
        return events

    def _close_call(self, call: _Open) -> list[dict[str, Any]]:
        call.item["arguments"] = call.text
        call.item["status"] = "completed"
        return [
            self._event(
                "response.function_call_arguments.done",
                item_id=call.item["id"],
                output_index=call.index,
                arguments=call.text,
                name=call.item["name"],
            ),
            self._event("response.output_item.done", output_index=call.index, item=dict(call.item)),
        ]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}


async def respond_responses(
    gen: Generation, req: Request, shape: ResponseShape, stream: bool, text: TextOptions
) -> Any:
    """One choice through the chat path, shaped as a response (whole, or typed SSE events)."""
    if not stream:
        parts: list[str] = []
        final: Final | None = None
        try:
            async for item in gen.run(req, (), text):
                if isinstance(item, Final):
                    final = item
                else:
                    parts.append(item.text)
        except GenerationError as e:
            raise generation_error(e) from e
        if final is None:
            raise APIError(500, "generation ended without a result")
        return JSONResponse(shape.whole("".join(parts), final))

    items = gen.run(req, (), text)
    try:
        first = await anext(items)
    except GenerationError as e:
        raise generation_error(e) from e

    async def events() -> AsyncIterator[str]:
        item: Delta | Final | None = first
        for e in shape.start():
            yield _sse(e)
        try:
            while item is not None:
                if isinstance(item, Final):
                    for e in shape.stream_end(item):
                        yield _sse(e)
                    break
                for e in shape.stream_piece(item.text):
                    yield _sse(e)
                item = await anext(items, None)
        except GenerationError as e:
            yield _sse(
                {
                    "type": "error",
                    "sequence_number": shape.seq,
                    **generation_error(e).body()["error"],
                }
            )
        finally:
            await items.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")


def _sse(obj: dict[str, Any]) -> str:
    return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n"
