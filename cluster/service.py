"""The OpenAI-facing logic of the ingress: validate, tokenize, build the ``Request``."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from cluster.errors import APIError
from cluster.guard import GuardPolicy
from cluster.protocol import ChatMessage, CompletionRequest, SamplingFields
from models.request import Request
from models.sampling import SamplingParams
from models.tokenizer import Tokenizer

TOKENIZER_THREADS = 2
T = TypeVar("T")
TEMPERATURE_FLOOR = 1e-5  # temperatures below it are served as greedy (0), as vLLM does


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """``m`` as chat templates take it: text content, tool-call arguments as data."""
    d: dict[str, Any] = {"role": m.role, "content": m.text}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_calls:
        d["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments_value()},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    return d


def chat_prompt(
    tokenizer: Tokenizer, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    """The prompt's token ids under the model's chat template; tool calls or results the
    template would drop (found by a probe rendering) are a 400, not a silently shorter prompt."""
    try:
        if any(m.tool_calls or m.role == "tool" for m in messages):
            _check_renders(tokenizer, messages)
        return tokenizer.apply_chat_template(
            [_template_message(m) for m in messages], add_generation_prompt
        )
    except (ValueError, TypeError) as e:  # TypeError: text the tokenizer cannot take
        raise APIError(400, str(e), param="messages") from e


def _check_renders(tokenizer: Tokenizer, messages: Sequence[ChatMessage]) -> None:
    probe: list[dict[str, Any]] = []
    wanted: list[tuple[str, str, str]] = []  # (marker, param, what)
    for i, m in enumerate(messages):
        d = _template_message(m)
        if m.role == "tool":
            marker = f"tandem-probe-{i}-result"
            d["content"] = marker
            wanted.append((marker, f"messages.{i}.content", "tool results"))
        for j, call in enumerate(d.get("tool_calls", [])):
            name, arg = f"tandemprobe{i}x{j}", f"tandem-probe-{i}-{j}-args"
            call["function"] = {"name": name, "arguments": {"probe": arg}}
            wanted += [(marker, f"messages.{i}.tool_calls", "tool calls") for marker in (name, arg)]
        probe.append(d)
    text = tokenizer.render_chat(probe)
    for marker, param, what in wanted:
        if marker not in text:
            raise APIError(
                400,
                f"this model's chat template does not render {what}: '{param}' would be "
                "dropped from the prompt",
                param=param,
                code="unsupported_parameter",
            )


@dataclass(frozen=True)
class ServiceSettings:
    """What the ingress needs to know about the app (built by ``cluster.builder``)."""

    model_name: str
    model_folder: str
    mode: str
    max_model_len: int
    max_prompt_tokens: int
    default_max_tokens: int
    max_stop_sequences: int
    eos_token_ids: tuple[int, ...]
    draft_kind: str
    created: int
    guard: GuardPolicy
    max_tokens: int | None = None  # limits.max_tokens: the most one request may ask for
    # prompt plus output one sequence can hold: decode.num_blocks x kv.block_size, less one
    max_sequence_tokens: int | None = None
    degraded_fraction: float = 0.2  # kv.degraded_fraction: failed share of recent handoffs
    retries: int = 1  # limits.retries: resends of a request that has streamed no token
    log_requests: bool = False
    max_choices: int = 16
    request_timeout_s: float = 600.0  # limits.request_timeout_s
    shared_cache: bool = False  # auth.shared_cache: one prefix cache across API keys


class OpenAIService:
    def __init__(self, settings: ServiceSettings, tokenizer: Tokenizer) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        # tokenizing and template rendering: a huge prompt must not stall the replica's streams
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tandem-tokenize")

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the tokenizer threads, the event loop free meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves "
                f"'{self.settings.model_name}'",
                param="model",
                code="model_not_found",
            )

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        p = body.prompt
        if isinstance(p, str):
            return self.tokenizer.encode(p)
        if isinstance(p[0], str):
            return self.tokenizer.encode(str(p[0]))
        ids = [int(t) for t in p]
        self.check_token_ids(ids, "prompt")
        return ids

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400,
                f"{param} token id {bad[0]} is outside the vocabulary [0, {vocab})",
                param=param,
            )

    def chat_prompt(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
    ) -> list[int]:
        return chat_prompt(self.tokenizer, messages, add_generation_prompt)

    def build_request(
        self,
        body: SamplingFields,
        prompt_ids: list[int],
        requested_max_tokens: int | None,
        prompt_param: str,
        tenant: str = "",
    ) -> Request:
        """``tenant``: the API key's name; its requests share cached prompt KV only with each
        other unless ``auth.shared_cache`` is set."""
        s = self.settings
        n = len(prompt_ids)
        if n == 0:
            raise APIError(400, f"'{prompt_param}' encodes to no tokens", param=prompt_param)
        if n > s.max_prompt_tokens:
            raise APIError(
                400,
                f"This model's maximum context length is {s.max_model_len} tokens and prompts may "
                f"use at most {s.max_prompt_tokens}; the prompt has {n} tokens",
                param=prompt_param,
                code="context_length_exceeded",
            )
        room = s.max_model_len - n
        pool_room = None if s.max_sequence_tokens is None else s.max_sequence_tokens - n
        cap = s.max_tokens
        if requested_max_tokens is not None and cap is not None and requested_max_tokens > cap:
            raise APIError(
                400,
                f"max_tokens is {requested_max_tokens}; this server allows at most "
                f"{cap} (limits.max_tokens)",
                param="max_tokens",
                code="max_tokens_exceeded",
            )
        if requested_max_tokens is None:
            fits = room if pool_room is None else min(room, pool_room)
            max_tokens = min(s.default_max_tokens, fits, cap or fits)
        elif pool_room is not None and requested_max_tokens > pool_room and pool_room < room:
            raise APIError(
                400,
                f"the prompt has {n} tokens and max_tokens asks for {requested_max_tokens} more, "
                f"but one sequence can hold at most {s.max_sequence_tokens} tokens in the decode "
                f"pool (decode.num_blocks x kv.block_size): at most {pool_room} fit",
                param="max_tokens",
                code="context_length_exceeded",
            )
        elif requested_max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {s.max_model_len} tokens; the prompt has "
                f"{n} tokens and max_tokens asks for {requested_max_tokens} more "
                f"(at most {room} fit)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        else:
            max_tokens = requested_max_tokens
        stops = body.stop_strings
        if len(stops) > s.max_stop_sequences:
            raise APIError(
                400,
                f"at most {s.max_stop_sequences} stop sequences are allowed, got {len(stops)}",
                param="stop",
            )
        if body.num_choices > s.max_choices:
            raise APIError(
                400,
                f"n is {body.n}; this server allows at most {s.max_choices} choices per request "
                "(limits.max_choices)",
                param="n",
            )
        vocab = self.tokenizer.vocab_size
        if body.top_k > vocab:
            raise APIError(
                400,
                f"top_k is {body.top_k}; it may be at most the vocabulary size, {vocab}",
                param="top_k",
            )
        # below the floor, logits / temperature overflow float32: the limit of sampling is greedy
        greedy = body.temperature < TEMPERATURE_FLOOR
        sampling = SamplingParams(
            temperature=0.0 if greedy else body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            max_tokens=max_tokens,
            seed=body.seed if body.seed is not None else secrets.randbits(63),
            stop_token_ids=() if body.ignore_eos else s.eos_token_ids,
            seeded=body.seed is not None,
            logprobs=body.requested_logprobs,
            n=body.num_choices,
        )
        return Request(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            arrival_time=time.time(),
            cache_salt="" if s.shared_cache else tenant,
        )
