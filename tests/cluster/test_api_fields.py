"""Every field the official ``openai`` SDK can send is implemented, inert or refused by name;
chat histories with tool calls are rendered where the template can, refused where it cannot."""

from __future__ import annotations

import json
import shutil
import typing
from pathlib import Path
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from openai.types import completion_create_params as completion_params
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionContentPartTextParam,
    ChatCompletionDeveloperMessageParam,
    ChatCompletionFunctionMessageParam,
    ChatCompletionMessageToolCallParam,
    ChatCompletionStreamOptionsParam,
    ChatCompletionSystemMessageParam,
    ChatCompletionToolMessageParam,
    ChatCompletionUserMessageParam,
)
from openai.types.chat import completion_create_params as chat_params
from pydantic import BaseModel, ValidationError

from cluster.errors import APIError, validation_error
from cluster.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    INERT,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    FunctionCall,
    StreamOptions,
    TextPart,
    ToolCall,
)
from cluster.service import chat_prompt
from models.tokenizer import Tokenizer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}

# A value that turns each refused field on (as the SDK, or a vLLM client, would send it).
ON: dict[str, Any] = {
    "best_of": 2,
    "echo": True,
    "suffix": " the end",
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": {"name": "f"},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
    "moderation": {"model": "omni-moderation-latest"},
    "store": True,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "truncate_prompt_tokens": 16,
    "prompt_logprobs": 1,
    "bad_words": ["x"],
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "spaces_between_special_tokens": False,
    "priority": 1,
    "logits_processors": ["mod.Cls"],
    "vllm_xargs": {"a": 1},
    "kv_transfer_params": {"do_remote_decode": True},
    "request_id": "r-1",
    "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}",
    "mm_processor_kwargs": {"a": 1},
}
# The same fields at the value that leaves them off: accepted.
OFF: dict[str, Any] = {
    "best_of": 1,
    "echo": False,
    "suffix": "",
    "functions": [],
    "function_call": "auto",
    "modalities": ["text"],
    "store": False,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "bad_words": [],
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "spaces_between_special_tokens": True,
    "priority": 0,
}
# Implemented since the agent API: each is accepted at a value that is on.
IMPLEMENTED: dict[str, Any] = {
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "logit_bias": {"42": 5},
    "min_p": 0.1,
    "repetition_penalty": 1.1,
    "min_tokens": 4,
    "stop_token_ids": [7],
    "allowed_token_ids": [7, 8],
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "cache_salt": "team-a",
    "response_format": {"type": "json_object"},
    "structured_outputs": {"choice": ["yes", "no"]},
}
CHAT_IMPLEMENTED: dict[str, Any] = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "chat_template_kwargs": {"enable_thinking": False},
    "add_generation_prompt": False,
    "add_special_tokens": True,
}
INERT_VALUES: dict[str, Any] = {
    "user": "u-1",
    "metadata": {"team": "a"},
    "safety_identifier": "s-1",
    "service_tier": "flex",
    "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "implicit"},
    "prompt_cache_retention": "24h",
    "prediction": {"type": "content", "content": "hello"},
}


def _sdk_fields(typed_dict: Any) -> set[str]:
    return set(typing.get_type_hints(typed_dict))


def _error(model: type[BaseModel], body: dict[str, Any]) -> APIError:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return validation_error(RequestValidationError(e.value.errors()))


def test_every_sdk_request_field_has_a_policy() -> None:
    """A field the SDK gains fails this test until it is implemented, inert or refused."""
    chat = _sdk_fields(chat_params.CompletionCreateParamsStreaming)
    completion = _sdk_fields(completion_params.CompletionCreateParamsStreaming)
    assert chat - set(CHAT_FIELDS) == set()
    assert completion - set(COMPLETION_FIELDS) == set()
    assert _sdk_fields(ChatCompletionStreamOptionsParam) <= set(StreamOptions.model_fields)
    assert _sdk_fields(ChatCompletionContentPartTextParam) <= set(TextPart.model_fields)
    assert _sdk_fields(ChatCompletionMessageToolCallParam) <= set(ToolCall.model_fields)
    for message in (
        ChatCompletionSystemMessageParam,
        ChatCompletionDeveloperMessageParam,
        ChatCompletionUserMessageParam,
        ChatCompletionAssistantMessageParam,
        ChatCompletionToolMessageParam,
        ChatCompletionFunctionMessageParam,
    ):
        assert _sdk_fields(message) <= set(ChatMessage.model_fields), message.__name__
    assert {"name", "arguments"} == set(FunctionCall.model_fields)


@pytest.mark.parametrize(
    ("model", "base", "fields"),
    [
        (ChatCompletionRequest, CHAT, CHAT_FIELDS),
        (CompletionRequest, COMPLETION, COMPLETION_FIELDS),
    ],
    ids=["chat", "completions"],
)
def test_refused_fields_are_refused_by_name_and_accepted_when_off(
    model: type[BaseModel], base: dict[str, Any], fields: dict[str, str]
) -> None:
    refused = {f for f, kind in fields.items() if kind == "refused"}
    assert refused <= set(ON)
    for name in sorted(refused):
        err = _error(model, {**base, name: ON[name]})
        assert (err.status, err.param, err.code) == (400, name, "unsupported_parameter"), name
        assert f"'{name}' is not supported" in err.message
        off = {name: OFF[name]} if name in OFF else {}
        model.model_validate({**base, **off})
    # True is not 1: a boolean where a count belongs does not pass as "off", nor as a count
    assert _error(model, {**base, "best_of": True}).param == "best_of"
    assert _error(model, {**base, "n": True}).param == "n"
    assert _error(model, {**base, "n": 0}).param == "n"


def test_implemented_extensions_are_accepted_when_on() -> None:
    for name, value in IMPLEMENTED.items():
        ChatCompletionRequest.model_validate({**CHAT, name: value})
        CompletionRequest.model_validate({**COMPLETION, name: value})
    ChatCompletionRequest.model_validate({**CHAT, **CHAT_IMPLEMENTED})
    for name in (*IMPLEMENTED, *CHAT_IMPLEMENTED):
        assert CHAT_FIELDS[name] == "implemented", name
    for name in IMPLEMENTED:
        assert COMPLETION_FIELDS[name] == "implemented", name
    err = _error(ChatCompletionRequest, {**CHAT, "presence_penalty": 3})
    assert err.param == "presence_penalty" and "2" in err.message


def test_inert_fields_are_accepted_and_unknown_ones_refused() -> None:
    assert set(INERT_VALUES) == set(INERT)
    chat_inert = {f for f, k in CHAT_FIELDS.items() if k == "inert"}
    assert chat_inert == set(INERT)
    ChatCompletionRequest.model_validate({**CHAT, **INERT_VALUES})
    completion_inert = {k: v for k, v in INERT_VALUES.items() if k in COMPLETION_FIELDS}
    CompletionRequest.model_validate({**COMPLETION, **completion_inert})
    for body, model in ((CHAT, ChatCompletionRequest), (COMPLETION, CompletionRequest)):
        err = _error(model, {**body, "temprature": 0.5})
        assert (err.param, err.code) == ("temprature", "unknown_parameter")
        assert "'temprature'" in err.message
    err = _error(
        ChatCompletionRequest,
        {**CHAT, "messages": [{"role": "user", "content": "hi", "colour": "red"}]},
    )
    assert err.param == "messages.0.colour"
    err = _error(ChatCompletionRequest, {**CHAT, "stream_options": {"include_obfuscation": True}})
    assert (err.param, err.code) == ("stream_options.include_obfuscation", "unsupported_parameter")


@pytest.mark.parametrize(
    ("message", "param", "words"),
    [
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "messages.0.content",
            "'image_url' content parts",
        ),
        ({"role": "user", "content": [{"type": "text"}]}, "messages.0.content.0.text", "required"),
        ({"role": "assistant", "content": None}, "messages.0", "content is required"),
        ({"role": "user", "content": None}, "messages.0", "content is required"),
        ({"role": "tool", "content": "42"}, "messages.0", "tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "a"}, "messages.0", "tool_call_id"),
        ({"role": "function", "name": "f", "content": "1"}, "messages.0", "function calling"),
    ],
    ids=["image part", "text part", "assistant null", "user null", "tool id", "stray id", "fn"],
)
def test_malformed_history_names_the_message(
    message: dict[str, Any], param: str, words: str
) -> None:
    err = _error(ChatCompletionRequest, {**CHAT, "messages": [message]})
    assert err.status == 400 and err.param == param and words in err.message, err.message


def _history(arguments: str = '{"city": "Paris"}') -> list[ChatMessage]:
    raw = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    return [ChatMessage.model_validate(m) for m in raw]


# A template that renders tool calls and results (in the style of the tool-aware templates).
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tool_tokenizer(embedded_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tool_template")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (embedded_folder / name).exists():
            shutil.copy(embedded_folder / name, folder / name)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return Tokenizer(folder)


def test_tool_history_renders_where_the_template_renders_it(tool_tokenizer: Tokenizer) -> None:
    ids = chat_prompt(tool_tokenizer, _history())
    text = tool_tokenizer.decode(ids, skip_special_tokens=False)
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in text
    assert "<|im_start|>tool\n18 degrees, sunny<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # arguments that are not JSON are passed on as the text the model wrote
    assert "not json" in tool_tokenizer.decode(chat_prompt(tool_tokenizer, _history("not json")))


def test_tool_calls_the_template_would_drop_are_refused(embedded_folder: Path) -> None:
    """SmolLM2's template renders each message's content only: the tool result is kept, the
    assistant's tool call would vanish, so the history is refused naming it."""
    tok = Tokenizer(embedded_folder)
    with pytest.raises(APIError) as e:
        chat_prompt(tok, _history())
    assert e.value.status == 400 and e.value.param == "messages.1.tool_calls"
    assert "does not render tool calls" in e.value.message
    history = _history()
    tool_only = [history[0], ChatMessage(role="assistant", content="checking"), history[2]]
    text = tok.decode(chat_prompt(tok, tool_only), skip_special_tokens=False)
    assert "<|im_start|>tool\n18 degrees, sunny<|im_end|>" in text
