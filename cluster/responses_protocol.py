"""``POST /v1/responses`` request bodies (OpenAI's Responses API, stateless) and their translation
into a chat completion request, which the chat path then serves: one template, one grammar
and parser path for both APIs."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from cluster.formats import JSONSchemaFormat
from cluster.protocol import ChatCompletionRequest, StreamOptions
from cluster.protocol_base import MAX_COUNT, MAX_SEED, Body, Refusal, RequestBody, refuse

_STATELESS = "this server is stateless: replay the conversation in 'input'"
REFUSED_HERE: dict[str, Refusal] = {
    "store": Refusal("this server stores no responses", (None, False)),
    "previous_response_id": Refusal(_STATELESS),
    "conversation": Refusal(_STATELESS),
    "background": Refusal(
        "background responses need storage, which this server has not", (None, False)
    ),
    "include": Refusal("no extra output data is available", (None, [])),
    "reasoning": Refusal("the served model has no reasoning settings"),
    "truncation": Refusal("the input is never truncated: send what fits", (None, "disabled")),
    "top_logprobs": Refusal("log-probabilities are served by /v1/chat/completions", (None, 0)),
    "max_tool_calls": Refusal("a cap on tool calls is not implemented"),
    "prompt": Refusal("stored prompt templates need storage, which this server has not"),
    "context_management": Refusal("context management is not implemented"),
}
INERT_HERE = (
    "metadata",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "service_tier",
)


class InputText(Body):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: Any = None  # inert: output_text's citations
    logprobs: Any = None  # inert: replayed output_text's


class RefusalText(Body):
    type: Literal["refusal"]
    refusal: str


def _media(v: Any) -> Any:
    for part in v if isinstance(v, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in (None, "input_text", "output_text", "refusal"):
            raise ValueError(f"this server serves a text-only model: '{kind}' parts are refused")
    return v


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Annotated[InputText | RefusalText, Field(discriminator="type")]]
    id: str | None = None
    status: str | None = None
    phase: str | None = None  # inert: an assistant turn's label (commentary, final_answer)

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v: Any) -> Any:
        return _media(v)

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, InputText) else p.refusal for p in self.content)


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(Body):
    """Reasoning an earlier response returned: accepted, and not rendered (as chat templates
    drop earlier turns' thinking)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: Any = None
    content: Any = None
    encrypted_content: Any = None
    status: str | None = None


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(discriminator="type"),
]


class FunctionToolDef(Body):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _function_only(cls, v: str) -> str:
        if v != "function":
            raise ValueError(f"'{v}' tools are not available on this server: only function tools")
        return v


class NamedChoice(Body):
    type: str
    name: str | None = None

    @field_validator("type")
    @classmethod
    def _function_only(cls, v: str) -> str:
        if v != "function":
            raise ValueError(f"tool_choice of type '{v}' is not supported: name a function")
        return v


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: Any = None

    @field_validator("verbosity")
    @classmethod
    def _verbosity(cls, v: Any) -> Any:
        return refuse("text.verbosity", v, Refusal("the served model has no verbosity setting"))


class ResponsesRequest(RequestBody):
    model: str
    input: str | list[InputItem] = Field(..., min_length=1)
    instructions: str | None = None
    tools: list[FunctionToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="tandem's: reproducible.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    text: TextConfig | None = None
    store: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    include: Any = None
    reasoning: Any = None
    truncation: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    context_management: Any = None
    metadata: Any = None
    user: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    service_tier: Any = None

    @field_validator(*REFUSED_HERE)
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        return refuse(str(info.field_name), v, REFUSED_HERE[str(info.field_name)])

    @field_validator("input", mode="before")
    @classmethod
    def _typed(cls, v: Any) -> Any:
        """Items without a type are messages (as OpenAI's easy input form)."""
        if isinstance(v, list):
            return [
                {**i, "type": "message"} if isinstance(i, dict) and "type" not in i else i
                for i in v
            ]
        return v

    def items(self) -> list[Any]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def to_chat(self) -> ChatCompletionRequest:
        """The same request as a chat completion; raises pydantic's ValidationError."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        for item in self.items():
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.text}
                )
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "max_tokens": self.max_output_tokens,
        }
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        k: v
                        for k, v in {
                            "name": t.name,
                            "description": t.description,
                            "parameters": t.parameters,
                            "strict": t.strict,
                        }.items()
                        if v is not None
                    },
                }
                for t in self.tools
            ]
        if self.tool_choice is not None:
            c = self.tool_choice
            body["tool_choice"] = (
                c if isinstance(c, str) else {"type": "function", "function": {"name": c.name}}
            )
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = (
                {"type": "json_object"}
                if fmt.type == "json_object"
                else {
                    "type": "json_schema",
                    "json_schema": JSONSchemaFormat.model_validate(
                        {"name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}
                    ).model_dump(by_alias=True, exclude_none=True),
                }
            )
        return ChatCompletionRequest.model_validate(body)
