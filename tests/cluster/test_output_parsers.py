"""Tool-call and reasoning parsers: each format read whole, and streamed character by character
to the same result with no marker leaking into the content."""

from __future__ import annotations

import json

import pytest

from cluster.chat_output import ChatOutput, ChatPlan
from cluster.reasoning import ThinkStream, detect_reasoning, opens_thinking
from cluster.tool_parsers import ToolStream, detect_tool_parser, parse_tool_calls
from cluster.tools import ToolUse

CASES = {
    "hermes": (
        'Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>',
        "Let me look.",
        [("a", {"x": 1}), ("b", {})],
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
        "",
        [("a", {"x": 1}), ("b", {})],
    ),
    "mistral": (
        'Sure.[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}]',
        "Sure.",
        [("a", {"x": 1})],
    ),
    "gpt_oss": (
        "<|channel|>analysis<|message|>need a<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.a <|constrain|>json<|message|>{"x": 1}<|call|>',
        "",
        [("a", {"x": 1})],
    ),
}


@pytest.mark.parametrize("parser", list(CASES))
def test_each_format_parses_whole_and_streamed(parser: str) -> None:
    text, content, calls = CASES[parser]
    got = parse_tool_calls(parser, text)
    assert got.content.strip() == content
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls
    stream = ToolStream(parser)
    sent = "".join(stream.push(ch) for ch in text)
    end = stream.finish()
    assert (sent + end.content).strip() == content
    assert end.calls == got.calls
    for marker in ("<tool_call", "[TOOL_CALLS", "<|python_tag", "<|channel"):
        assert marker not in sent


def test_harmony_reasoning_and_mistral_v11() -> None:
    assert parse_tool_calls("gpt_oss", CASES["gpt_oss"][0]).reasoning == "need a"
    final = parse_tool_calls("gpt_oss", "<|channel|>final<|message|>hi there<|return|>")
    assert (final.content, final.calls) == ("hi there", ())
    v11 = parse_tool_calls("mistral", '[TOOL_CALLS]a[ARGS]{"x": 2}[TOOL_CALLS]b[ARGS]{}')
    assert [(c.name, json.loads(c.arguments)) for c in v11.calls] == [("a", {"x": 2}), ("b", {})]


def test_text_that_is_no_call_stays_content() -> None:
    for parser, text in [
        ("hermes", "<tool_call>{not json</tool_call>"),
        ("llama3_json", "Just words {here}"),
        ("mistral", "no calls at all"),
    ]:
        got = parse_tool_calls(parser, text)
        assert (got.content, got.calls) == (text, ()), parser
    stream = ToolStream("hermes")
    assert "".join(stream.push(c) for c in "a <tool_ b") + stream.finish().content == "a <tool_ b"


def test_parsers_are_found_in_templates() -> None:
    assert detect_tool_parser("... <tool_call> ...") == "hermes"
    assert detect_tool_parser("[TOOL_CALLS]") == "mistral"
    assert detect_tool_parser("<|python_tag|>") == "llama3_json"
    assert detect_tool_parser("<|channel|>") == "gpt_oss"
    assert detect_tool_parser("{{ message.content }}") is None
    assert detect_reasoning("{{ '</think>' }}") == "think" and detect_reasoning("x") is None


@pytest.mark.parametrize(
    ("text", "inside", "want"),
    [
        ("<think>plan it</think>\n\nThe answer.", False, ("plan it", "\n\nThe answer.")),
        ("plan it</think>The answer.", True, ("plan it", "The answer.")),
        ("No thinking here.", False, ("", "No thinking here.")),
        ("<think>cut short", False, ("cut short", "")),
    ],
)
def test_think_blocks_split_whole_and_streamed(
    text: str, inside: bool, want: tuple[str, str]
) -> None:
    for pieces in ([text], list(text)):
        s = ThinkStream(inside)
        got = [s.push(p) for p in pieces] + [s.finish()]
        assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == want


def test_prompts_that_open_thinking() -> None:
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_named_and_required_outputs_become_calls() -> None:
    named = ChatOutput(ChatPlan(tools=ToolUse("named", "f")))
    pieces = [named.push('{"a"'), named.push(": 1}"), named.finish()]
    entries = [e for p in pieces for e in p.tool_calls]
    assert entries[0]["function"] == {"name": "f", "arguments": ""}
    assert "".join(e["function"]["arguments"] for e in entries) == '{"a": 1}'
    assert named.finish_reason("stop") == "stop"
    required = ChatOutput(ChatPlan(tools=ToolUse("required")))
    required.push('[{"name": "g", "parameters": {"b": 2}}]')
    end = required.finish()
    assert [c["function"]["name"] for c in required.calls] == ["g"]
    assert end.tool_calls[0]["index"] == 0 and required.finish_reason("stop") == "tool_calls"
    cut = ChatOutput(ChatPlan(tools=ToolUse("required")))
    cut.push('[{"name": "g", "param')
    assert cut.finish().content == '[{"name": "g", "param' and not cut.calls
