"""OpenAI-compatible request bodies. Each is an allow-list (``extra="forbid"``): every field is
implemented, accepted as inert (:data:`INERT`: it cannot change the output), or refused with a
reason (:data:`REFUSED`) unless at its "off" value; see :data:`CHAT_FIELDS`."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from cluster.body_checks import MAX_DEPTH, json_depth
from cluster.formats import ResponseFormat, StructuredOutputs, response_format_grammar
from cluster.protocol_base import (
    MAX_COUNT,
    MAX_SEED,
    MAX_STOP_CHARS,
    UNSUPPORTED,
    Body,
    Refusal,
    RequestBody,
    field_error,
    refuse,
)
from cluster.tools import MAX_TOOLS, FunctionTool, ToolChoice, ToolUse
from models.grammar import GrammarSpec
from models.logprobs import MAX_TOP_LOGPROBS

_FUNCTIONS = "the deprecated function-calling fields are not supported; use tools"
_VLLM = "not implemented by this server"
REFUSED: dict[str, Refusal] = {
    "best_of": Refusal("only one candidate per request is implemented", (None, 1)),
    "echo": Refusal("echoing the prompt is not implemented", (None, False)),
    "suffix": Refusal("insertion (a suffix after the completion) is not implemented", (None, "")),
    "functions": Refusal(_FUNCTIONS, (None, [])),
    "function_call": Refusal(_FUNCTIONS, (None, "none", "auto")),
    "audio": Refusal("this server produces text only"),
    "modalities": Refusal("this server produces text only", (None, ["text"])),
    "reasoning_effort": Refusal(
        "the served model has no reasoning-effort setting; switch thinking with "
        "chat_template_kwargs where its template has one"
    ),
    "verbosity": Refusal("the served model has no verbosity setting"),
    "web_search_options": Refusal("web search is not available"),
    "moderation": Refusal("moderation is not available on this server"),
    "store": Refusal("this server stores no completions", (None, False)),
    "include_obfuscation": Refusal("stream obfuscation is not implemented", (None, False)),
    # vLLM's request extensions this server does not implement
    "use_beam_search": Refusal(f"beam search is {_VLLM}", (None, False)),
    "length_penalty": Refusal(f"beam search (its length penalty) is {_VLLM}", (None, 1)),
    "truncate_prompt_tokens": Refusal(f"prompt truncation is {_VLLM}; send a shorter prompt"),
    "prompt_logprobs": Refusal(f"prompt log-probabilities are {_VLLM}"),
    "bad_words": Refusal(f"banned words are {_VLLM}; use logit_bias", (None, [])),
    "return_tokens_as_token_ids": Refusal(f"token-id strings are {_VLLM}", (None, False)),
    "return_token_ids": Refusal(f"returning token ids is {_VLLM}; use /tokenize", (None, False)),
    "spaces_between_special_tokens": Refusal(
        "special tokens are joined as the tokenizer decodes them", (None, True)
    ),
    "priority": Refusal(f"request priorities are {_VLLM}; one queue serves all", (None, 0)),
    "logits_processors": Refusal(f"custom logits processors are {_VLLM}"),
    "vllm_xargs": Refusal(f"extra engine arguments are {_VLLM}"),
    "kv_transfer_params": Refusal("KV transfer is tandem's own business, not the client's"),
    "request_id": Refusal(f"a client-chosen request id is {_VLLM}"),
    "documents": Refusal(f"documents for RAG templates are {_VLLM}"),
    "chat_template": Refusal(
        "a per-request chat template is not accepted; the server's (model.chat_template) applies"
    ),
    "mm_processor_kwargs": Refusal("this server serves a text-only model"),
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
}


class StreamOptions(Body):
    include_usage: bool = Field(False, description="Send a final chunk carrying usage.")
    include_obfuscation: Any = Field(None, description="Refused when true.")

    @field_validator("include_obfuscation")
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        return refuse(str(info.field_name), v, REFUSED["include_obfuscation"])


_COMMON_REFUSED = (
    "use_beam_search",
    "length_penalty",
    "truncate_prompt_tokens",
    "prompt_logprobs",
    "bad_words",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "spaces_between_special_tokens",
    "priority",
    "logits_processors",
    "vllm_xargs",
    "kv_transfer_params",
    "request_id",
)
MAX_LOGIT_BIAS = 1024  # entries; OpenAI's own limit is lower
MAX_TOKEN_LISTS = 1024  # stop_token_ids, allowed_token_ids
MAX_REPETITION_PENALTY = 10.0


class SamplingFields(RequestBody):
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
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted from each token already in the output."
    )
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted per occurrence in the output."
    )
    logit_bias: dict[str, float] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="Token id (as a string) -> added to its logit."
    )
    # vLLM's sampling extensions, with vLLM's meaning
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=MAX_REPETITION_PENALTY,
        description="Divides positive (multiplies negative) logits of prompt and output tokens.",
    )
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens under min_p x the top.")
    min_tokens: int = Field(0, ge=0, le=MAX_COUNT, description="No stop token before this many.")
    stop_token_ids: list[int] | None = Field(
        None, max_length=MAX_TOKEN_LISTS, description="Token ids that end the output."
    )
    allowed_token_ids: list[int] | None = Field(
        None, min_length=1, max_length=MAX_TOKEN_LISTS, description="Sample only these ids."
    )
    include_stop_str_in_output: bool = Field(False, description="Keep the matched stop string.")
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    cache_salt: str | None = Field(
        None, min_length=1, max_length=256, description="Partitions the prefix cache further."
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # refused unless off (see REFUSED)
    use_beam_search: Any = None
    length_penalty: Any = None
    truncate_prompt_tokens: Any = None
    prompt_logprobs: Any = None
    bad_words: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    spaces_between_special_tokens: Any = None
    priority: Any = None
    logits_processors: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None
    request_id: Any = None
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

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids, not {key[:32]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values lie in [-100, 100], not {bias}")
        return v

    @model_validator(mode="after")
    def _one_format(self) -> SamplingFields:
        both = response_format_grammar(self.response_format) is not None
        if self.structured_outputs is not None and both:
            raise field_error(
                "structured_outputs", "give response_format or structured_outputs, not both"
            )
        return self

    @property
    def grammar_format(self) -> GrammarSpec | None:
        """The grammar ``response_format`` or ``structured_outputs`` asks for, if any."""
        if self.structured_outputs is not None:
            return self.structured_outputs.grammar_spec()
        return response_format_grammar(self.response_format)

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items())

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


class TextPart(Body):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: Any = None  # inert: a caching hint


class RefusalPart(Body):
    """An assistant's earlier refusal, replayed in the history; rendered as its text."""

    type: Literal["refusal"]
    refusal: str


class FunctionCall(Body):
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


class ToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


_PART_TYPES = ("text", "refusal")
_MEDIA = "this server serves a text-only model; '{kind}' content parts are not supported"


class ChatMessage(Body):
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
    "functions",
    "function_call",
    "audio",
    "modalities",
    "reasoning_effort",
    "verbosity",
    "web_search_options",
    "moderation",
    "store",
    "documents",
    "chat_template",
    "mm_processor_kwargs",
)
# variables a request may not set through chat_template_kwargs: the server sets them
_TEMPLATE_RESERVED = frozenset(
    {"messages", "tools", "add_generation_prompt", "continue_final_message"}
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
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="More than one call per turn.")
    # vLLM's chat extensions
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template (e.g. enable_thinking)."
    )
    continue_final_message: bool = Field(
        False, description="Continue the last (assistant) message instead of starting one."
    )
    add_generation_prompt: bool = Field(True, description="Open an assistant turn.")
    add_special_tokens: bool = Field(False, description="Let the tokenizer add BOS and the like.")
    documents: Any = None
    chat_template: Any = None
    mm_processor_kwargs: Any = None
    functions: Any = None
    function_call: Any = None
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

    @field_validator(*_CHAT_REFUSED)
    @classmethod
    def _refused_here(cls, v: Any, info: ValidationInfo) -> Any:
        return refuse(str(info.field_name), v, REFUSED[str(info.field_name)])

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        clash = sorted(set(v or {}) & _TEMPLATE_RESERVED)
        if clash:
            raise ValueError(f"'{clash[0]}' is set by the server, not by chat_template_kwargs")
        return v

    @model_validator(mode="after")
    def _tools_agree(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or () if t.function is not None]
        if len(set(names)) != len(names):
            raise field_error("tools", "tools: function names must be unique")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise field_error("tool_choice", "tool_choice needs tools")
        if not isinstance(choice, str) and choice is not None:
            name = choice.function.name if choice.function is not None else None
            if name not in names:
                raise field_error(
                    "tool_choice", f"tool_choice names {name!r}, which is not among the tools"
                )
        if self.continue_final_message and self.add_generation_prompt:
            if "add_generation_prompt" in self.model_fields_set:
                raise field_error(
                    "continue_final_message",
                    "continue_final_message and add_generation_prompt exclude each other",
                )
            self.add_generation_prompt = False
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise field_error(
                "continue_final_message", "continue_final_message needs an assistant message last"
            )
        return self

    @property
    def tool_use(self) -> ToolUse | None:
        """What the tools ask of generation (None: no tools, or tool_choice "none")."""
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        if not self.tools or choice == "none":
            return None
        parallel = self.parallel_tool_calls is not False
        if choice == "auto":
            return ToolUse("parser", parallel=parallel)
        if choice == "required":
            return ToolUse("required", parallel=parallel)
        assert not isinstance(choice, str) and choice.function is not None
        return ToolUse("named", choice.function.name, parallel)

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


class TokenizeRequest(RequestBody):
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


class DetokenizeRequest(RequestBody):
    """``POST /detokenize``, in vLLM's shape."""

    model: str | None = None
    tokens: list[int] = Field(..., description="Token ids to turn back into text.")
