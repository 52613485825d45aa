"""The OpenAI-facing logic of the ingress: validate, tokenize, build the ``Request``."""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass

from cluster.errors import APIError
from cluster.guard import GuardPolicy
from cluster.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from models.request import Request
from models.sampling import SamplingParams
from models.tokenizer import Tokenizer


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
    # prompt plus output tokens one sequence can hold in the decode (or colocated) pool: its
    # decode.num_blocks x kv.block_size slots, less the one a step writes ahead
    max_sequence_tokens: int | None = None
    degraded_fraction: float = 0.2  # kv.degraded_fraction: failed share of recent handoffs
    retries: int = 1  # limits.retries: resends of a request that has streamed no token


class OpenAIService:
    def __init__(self, settings: ServiceSettings, tokenizer: Tokenizer) -> None:
        self.settings = settings
        self.tokenizer = tokenizer

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
        vocab = self.tokenizer.vocab_size
        ids = [int(t) for t in p]
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400,
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})",
                param="prompt",
            )
        return ids

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        try:
            return self.tokenizer.apply_chat_template(messages)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e

    def build_request(
        self,
        body: SamplingFields,
        prompt_ids: list[int],
        requested_max_tokens: int | None,
        prompt_param: str,
    ) -> Request:
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
        sampling = SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            max_tokens=max_tokens,
            seed=body.seed if body.seed is not None else secrets.randbits(63),
            stop_token_ids=s.eos_token_ids,
            seeded=body.seed is not None,
        )
        return Request(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            arrival_time=time.time(),
        )
