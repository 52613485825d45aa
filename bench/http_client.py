"""Timing one streamed request through the OpenAI API (shared by the HTTP benchmarks)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import openai


@dataclass(frozen=True)
class Timing:
    ttft_s: float  # request sent -> first content token
    total_s: float  # request sent -> last chunk
    completion_tokens: int
    draft_tokens: int
    accepted_tokens: int
    text: str = ""  # the streamed content

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second after the first arrived."""
        span = self.total_s - self.ttft_s
        return (self.completion_tokens - 1) / span if span > 0 else 0.0


def timed_chat(
    client: openai.OpenAI, model: str, prompt: str, max_tokens: int, **kw: Any
) -> Timing:
    t0 = time.perf_counter()
    first: float | None = None
    usage: Any = None
    parts: list[str] = []
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            if first is None:
                first = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    spec = (getattr(usage, "model_extra", None) or {}).get("speculative") or {}
    return Timing(
        ttft_s=(first or end) - t0,
        total_s=end - t0,
        completion_tokens=int(usage.completion_tokens) if usage else 0,
        draft_tokens=int(spec.get("draft_tokens", 0)),
        accepted_tokens=int(spec.get("accepted_tokens", 0)),
        text="".join(parts),
    )
