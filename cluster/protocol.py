"""OpenAI-compatible request bodies. Each is an allow-list (``extra="forbid"``): every field is
implemented, accepted as inert (:data:`INERT`: it cannot change the output), or refused with a
reason (:data:`REFUSED`) unless at its "off" value; see :data:`CHAT_FIELDS`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from cluster.body_checks import MAX_DEPTH, BodyError, check_body, json_depth
from models.logprobs import MAX_TOP_LOGPROBS

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


_TOOLS = "tool calling is not implemented"
REFUSED: dict[str, Refusal] = {
    "best_of": Refusal("only one candidate per request is implemented", (None, 1)),
    "presence_penalty": Refusal("penalties are not implemented; leave it at 0", (None, 0)),
    "frequency_penalty": Refusal("penalties are not implemented; leave it at 0", (None, 0)),
    "logit_bias": Refusal("logit bias is not implemented", (None, {})),
    "min_p": Refusal("min-p sampling is not implemented; use top_p or top_k", (None, 0)),
    "repetition_penalty": Refusal("penalties are not implemented; leave it at 1", (None, 1)),
    "min_tokens": Refusal("a minimum output length is not implemented", (None, 0)),
    "echo": Refusal("echoing the prompt is not implemented", (None, False)),
    "suffix": Refusal("insertion (a suffix after the completion) is not implemented", (None, "")),
    "tools": Refusal(_TOOLS, (None, [])),
    "tool_choice": Refusal(_TOOLS, (None, "none", "auto")),
    "functions": Refusal(_TOOLS, (None, [])),
    "function_call": Refusal(_TOOLS, (None, "none", "auto")),
    "response_format": Refusal(
        "structured outputs are not implemented; only free text",
        (None, {"type": "text"}),
    ),
    "audio": Refusal("this server produces text only"),
    "modalities": Refusal("this server produces text only", (None, ["text"])),
    "reasoning_effort": Refusal("the served model has no reasoning-effort setting"),
    "verbosity": Refusal("the served model has no verbosity setting"),
    "web_search_options": Refusal("web search is not available"),
    "moderation": Refusal("moderation is not available on this server"),
    "store": Refusal("this server stores no completions", (None, False)),
    "include_obfuscation": Refusal("stream obfuscation is not implemented", (None, False)),
}

# Accepted and ignored: none of them can change which tokens come out or how they are sent.
INERT: dict[str, str] = {
    "user": "an end-user id for the client's own tracking",
    "metadata": "tags for the client's own tracking",
    "safety_identifier": "an end-user id for the client's own tracking",
    "service_tier": "a scheduling hint; one tier is served",
    "prompt_cache_key": "a caching hint; prefix caching is automatic",
    "prompt_cache_options": "a caching hint; prefix caching is automatic",
    "prompt_cache_retention": "a caching hint; prefix caching is automatic",
    "prediction": "a hint of the expected output; it cannot change the output",
    "parallel_tool_calls": "meaningful only with tools, which are refused when given",
}


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


class _Body(BaseModel):
    """A request body or part of one: unknown fields are refused by name."""

    model_config = ConfigDict(extra="forbid")


class _Request(_Body):
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


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="Send a final chunk carrying usage.")
    include_obfuscation: Any = Field(None, description="Refused when true.")

    @field_validator("include_obfuscation")
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        return refuse(str(info.field_name), v, REFUSED["include_obfuscation"])


_COMMON_REFUSED = (
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "min_p",
    "repetition_penalty",
    "min_tokens",
)


class SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str = Field(..., description="Model id, as listed by GET /v1/models.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(
        -1,
        ge=-1,
        le=MAX_COUNT,
        description="Keep the k most likely tokens; -1 or 0 disables; at most the vocabulary.",
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Makes sampling reproducible.")
    stop: str | list[str] | None = Field(None, description="Strings that end the output.")
    stream: bool = Field(False, description="Stream server-sent events.")
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(
        False, description="vLLM's extension: keep generating past end-of-sequence tokens."
    )
    n: StrictInt | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description="Independent choices to generate for the prompt (default 1; one prefill, "
        "the choices share the prompt's KV on decode). Capped by limits.max_choices.",
    )
    # refused unless off (see REFUSED); min_p, repetition_penalty, min_tokens are vLLM's
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    # inert (see INERT)
    user: Any = None
    metadata: Any = None
    safety_identifier: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None

    @field_validator(*_COMMON_REFUSED)
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        return refuse(str(info.field_name), v, REFUSED[str(info.field_name)])

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            # a stop string's length is text held back from a stream until it cannot match
            raise ValueError(f"a stop string may be at most {MAX_STOP_CHARS} characters")
        return v

    @property
    def requested_logprobs(self) -> int | None:
        """Alternatives per token to report with each token's log-probability; None: none."""
        return None

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


_COMPLETION_REFUSED = ("best_of", "echo", "suffix")


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] = Field(
        ..., description="The prompt: a string, or a list of token ids."
    )
    max_tokens: int | None = Field(16, ge=1, le=MAX_COUNT, description="Most tokens to generate.")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Report each token's log-probability and this many alternatives.",
    )
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    @field_validator(*_COMPLETION_REFUSED)
    @classmethod
    def _refused_here(cls, v: Any, info: ValidationInfo) -> Any:
        return refuse(str(info.field_name), v, REFUSED[str(info.field_name)])

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], str) and len(v) != 1:
                raise ValueError("only one prompt per request is supported")
        elif not v:
            raise ValueError("prompt must not be empty")
        return v


class TextPart(_Body):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: Any = None  # inert: a caching hint


class RefusalPart(_Body):
    """An assistant's earlier refusal, replayed in the history; rendered as its text."""

    type: Literal["refusal"]
    refusal: str


class FunctionCall(_Body):
    name: str = Field(..., min_length=1)
    arguments: str = Field(..., description="The arguments as JSON text, as the model wrote it.")

    @field_validator("arguments")
    @classmethod
    def _shallow(cls, v: str) -> str:
        if json_depth(v, MAX_DEPTH) > MAX_DEPTH:
            raise ValueError(f"the arguments' JSON nests deeper than {MAX_DEPTH} levels")
        return v

    def arguments_value(self) -> Any:
        """The arguments as data where they are JSON (what chat templates render), else text."""
        try:
            return json.loads(self.arguments)
        except (ValueError, RecursionError):
            return self.arguments


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


_PART_TYPES = ("text", "refusal")
_MEDIA = "this server serves a text-only model; '{kind}' content parts are not supported"


class ChatMessage(_Body):
    """One message of the history, in any role a client replays.

    Which fields a role may carry follows the OpenAI API; whether the model's chat template can
    render what is given (tool calls, tool results) is checked when the prompt is built."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[Annotated[TextPart | RefusalPart, Field(discriminator="type")]] | None = (
        None
    )
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    function_call: Any = None
    audio: Any = None

    @field_validator("content", mode="before")
    @classmethod
    def _media(cls, v: Any) -> Any:
        """Image, audio and file parts are refused by kind before the parts are parsed."""
        for part in v if isinstance(v, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind not in _PART_TYPES:
                raise PydanticCustomError(UNSUPPORTED, _MEDIA, {"kind": kind})
        return v

    @model_validator(mode="after")
    def _role_fields(self) -> ChatMessage:
        role = self.role
        if role == "function" or self.function_call is not None:
            raise PydanticCustomError(
                UNSUPPORTED,
                "function calling (the 'function' role, 'function_call') is not supported; "
                "replay tool calls as 'tool_calls' and 'tool' messages",
            )
        if self.audio is not None:
            raise PydanticCustomError(UNSUPPORTED, "this server produces text only ('audio')")
        if role != "assistant" and (self.tool_calls is not None or self.refusal is not None):
            raise ValueError(f"only assistant messages carry tool_calls or refusal, not {role}")
        if role == "tool":
            if self.tool_call_id is None:
                raise ValueError("a tool message needs tool_call_id")
        elif self.tool_call_id is not None:
            raise ValueError(f"only tool messages carry tool_call_id, not {role}")
        if self.content is None and not (
            role == "assistant" and (self.tool_calls or self.refusal is not None)
        ):
            raise ValueError(
                f"content is required in {role!r} messages (only an assistant message with "
                "tool_calls may leave it null)"
            )
        return self

    @property
    def text(self) -> str:
        """The message's text as the chat template sees it ("" for tool calls alone)."""
        if isinstance(self.content, str):
            return self.content
        if self.content is None:
            return self.refusal or ""
        return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in self.content)


_CHAT_REFUSED = (
    "best_of",
    "echo",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "audio",
    "modalities",
    "reasoning_effort",
    "verbosity",
    "web_search_options",
    "moderation",
    "store",
)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation so far.")
    max_tokens: int | None = Field(None, ge=1, le=MAX_COUNT, description="Most tokens to generate.")
    max_completion_tokens: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="Alias of max_tokens."
    )
    logprobs: bool = Field(False, description="Report each output token's log-probability.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="Alternatives reported per token."
    )
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    store: Any = None
    best_of: Any = None
    echo: Any = None
    # inert (see INERT)
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    prediction: Any = None
    parallel_tool_calls: Any = None

    @field_validator(*_CHAT_REFUSED)
    @classmethod
    def _refused_here(cls, v: Any, info: ValidationInfo) -> Any:
        return refuse(str(info.field_name), v, REFUSED[str(info.field_name)])

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return v

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


def _fields(
    model: type[BaseModel], refused: tuple[str, ...]
) -> dict[str, Literal["implemented", "inert", "refused"]]:
    out: dict[str, Literal["implemented", "inert", "refused"]] = {}
    for name in model.model_fields:
        out[name] = "inert" if name in INERT else "refused" if name in refused else "implemented"
    return out


CHAT_FIELDS = _fields(ChatCompletionRequest, _COMMON_REFUSED + _CHAT_REFUSED)
COMPLETION_FIELDS = _fields(CompletionRequest, _COMMON_REFUSED + _COMPLETION_REFUSED)


class TokenizeRequest(_Request):
    """``POST /tokenize``, in vLLM's shape: a ``prompt`` or chat ``messages``.

    ``add_special_tokens`` defaults to what ``/v1/completions`` does with a text prompt (none
    added), so the count is the count the server would see."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    """``POST /detokenize``, in vLLM's shape."""

    model: str | None = None
    tokens: list[int] = Field(..., description="Token ids to turn back into text.")
