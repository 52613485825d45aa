"""OpenAI-compatible request bodies (the part of the API tandem implements).

Constraints live on the fields, so a bad value is rejected with the field's name before any
work is done. The options declared here but not implemented (``n`` above 1, penalties,
``echo``, ``logprobs``) are refused by name when set. Fields not declared at all are ignored
(``extra="ignore"``): a client sending e.g. ``tools`` or ``response_format`` gets no error.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_SEED = 2**63 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = Field(False, description="Send a final chunk carrying usage.")


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(..., description="Model id, as listed by GET /v1/models.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Keep the k most likely tokens; -1 or 0 disables.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Makes sampling reproducible.")
    stop: str | list[str] | None = Field(None, description="Strings that end the output.")
    stream: bool = Field(False, description="Stream server-sent events.")
    stream_options: StreamOptions | None = None
    n: int = Field(1, description="Choices per request; only 1 is supported.")
    presence_penalty: float = Field(0.0, description="Not supported: must be 0.")
    frequency_penalty: float = Field(0.0, description="Not supported: must be 0.")
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("penalties are not supported; leave them at 0")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] = Field(
        ..., description="The prompt: a string, or a list of token ids."
    )
    max_tokens: int | None = Field(16, ge=1, description="Most tokens to generate.")
    echo: bool = Field(False, description="Not supported: must be false.")
    logprobs: int | None = Field(None, description="Not supported.")

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

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.logprobs is not None:
            raise ValueError("logprobs are not supported")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation so far.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens.")
    logprobs: bool = Field(False, description="Not supported: must be false.")

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
