"""The OpenAI-facing logic of the ingress: validate, tokenize, build the ``Request``."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from cluster.chat_output import ChatPlan
from cluster.errors import APIError
from cluster.generation import TextOptions
from cluster.guard import GuardPolicy
from cluster.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from cluster.reasoning import detect_reasoning, opens_thinking
from cluster.tool_parsers import detect_tool_parser, keeps_special_tokens
from cluster.tools import tool_grammar
from models.grammar import GrammarCompiler, GrammarError, GrammarSpec
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


@dataclass(frozen=True)
class ChatRender:
    """How a history becomes a prompt, beyond its messages."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI tool objects, passed to the template
    kwargs: tuple[tuple[str, Any], ...] = ()  # vLLM's chat_template_kwargs
    add_special_tokens: bool = False


def render_chat(tokenizer: Tokenizer, messages: Sequence[ChatMessage], how: ChatRender) -> str:
    """The prompt's text under the model's chat template; tool calls, results or tools the
    template would drop (found by a probe rendering) are a 400, not a silently shorter prompt."""
    try:
        if any(m.tool_calls or m.role == "tool" for m in messages) or how.tools:
            _check_renders(tokenizer, messages, how)
        return tokenizer.render_chat(
            [_template_message(m) for m in messages],
            how.add_generation_prompt,
            how.tools or None,
            how.continue_final_message,
            dict(how.kwargs),
        )
    except (ValueError, TypeError) as e:  # TypeError: text the tokenizer cannot take
        raise APIError(400, str(e), param="messages") from e


def chat_prompt(
    tokenizer: Tokenizer, messages: Sequence[ChatMessage], how: ChatRender | None = None
) -> list[int]:
    how = how if how is not None else ChatRender()
    text = render_chat(tokenizer, messages, how)
    try:
        return tokenizer.encode(text, how.add_special_tokens)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param="messages") from e


def _check_renders(tokenizer: Tokenizer, messages: Sequence[ChatMessage], how: ChatRender) -> None:
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
    tools = None
    if how.tools:
        tools = [{"type": "function", "function": {"name": "tandemprobetool", "parameters": {}}}]
        wanted.append(("tandemprobetool", "tools", "tools"))
    text = tokenizer.render_chat(probe, True, tools, False, dict(how.kwargs))
    for marker, param, what in wanted:
        if marker not in text:
            raise APIError(
                400,
                f"this model's chat template does not render {what}: '{param}' would be "
                "dropped from the prompt (serve a template that does: model.chat_template)",
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
    chat_template: str | None = None  # model.chat_template's text, served instead
    tool_parser: str = "auto"  # model.tool_parser
    reasoning_parser: str = "auto"  # model.reasoning_parser
    path_check: bool = False  # kv.path_check: a prefill replica's probe read by a decode one


class OpenAIService:
    def __init__(self, settings: ServiceSettings, tokenizer: Tokenizer) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        # tokenizing and template rendering: a huge prompt must not stall the replica's streams
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tandem-tokenize")
        self._grammars: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()

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

    @property
    def tool_parser(self) -> str | None:
        p = self.settings.tool_parser
        if p == "auto":
            return detect_tool_parser(self.tokenizer.chat_template)
        return None if p == "none" else p

    @property
    def reasoning_parser(self) -> str | None:
        p = self.settings.reasoning_parser
        if p == "auto":
            return detect_reasoning(self.tokenizer.chat_template)
        return None if p == "none" else p

    def chat_render(self, body: ChatCompletionRequest) -> ChatRender:
        tools = tuple(t.model_dump(exclude_none=True) for t in body.tools or ())
        return ChatRender(
            body.add_generation_prompt,
            body.continue_final_message,
            tools,
            tuple(sorted((body.chat_template_kwargs or {}).items())),
            body.add_special_tokens,
        )

    def chat_grammar(self, body: ChatCompletionRequest) -> tuple[GrammarSpec | None, str]:
        """The grammar a chat request samples under, and the field it comes from."""
        use = body.tool_use
        fmt = body.grammar_format
        # a forced call's turn has no text answer for response_format to shape: the call wins
        forced = use is not None and use.mode != "parser"
        if use is not None and use.mode == "parser" and self.tool_parser is None:
            raise APIError(
                400,
                "tool_choice 'auto' needs a tool-call parser, and this model's chat template "
                "shows no format tandem reads (set model.tool_parser), or use tool_choice "
                "'required' or a named function",
                param="tool_choice",
                code="unsupported_parameter",
            )
        if forced and use is not None:
            return tool_grammar(use, list(body.tools or ())), "tools"
        param = "structured_outputs" if body.structured_outputs is not None else "response_format"
        return fmt, param

    def chat_plan(self, body: ChatCompletionRequest, prompt_text: str) -> ChatPlan:
        reasoning = self.reasoning_parser is not None
        use = body.tool_use
        return ChatPlan(
            reasoning=reasoning,
            starts_inside=reasoning and opens_thinking(prompt_text),
            tools=use,
            parser=self.tool_parser if use is not None and use.mode == "parser" else None,
        )

    @staticmethod
    def text_options(body: SamplingFields, plan: ChatPlan | None = None) -> TextOptions:
        # a parser whose markers are special tokens reads the text with them
        keep = plan is not None and plan.parser is not None and keeps_special_tokens(plan.parser)
        return TextOptions(body.include_stop_str_in_output, body.skip_special_tokens and not keep)

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
        self, messages: Sequence[ChatMessage], how: ChatRender | None = None
    ) -> list[int]:
        return chat_prompt(self.tokenizer, messages, how)

    def chat_text(self, messages: Sequence[ChatMessage], how: ChatRender) -> str:
        return render_chat(self.tokenizer, messages, how)

    def encode_chat(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens)
        except (ValueError, TypeError) as e:  # TypeError: text the tokenizer cannot take
            raise APIError(400, str(e), param="messages") from e

    def build_request(
        self,
        body: SamplingFields,
        prompt_ids: list[int],
        requested_max_tokens: int | None,
        prompt_param: str,
        tenant: str = "",
        grammar: GrammarSpec | None = None,
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
        if body.min_tokens > max_tokens:
            raise APIError(
                400,
                f"min_tokens is {body.min_tokens}, more than the {max_tokens} max_tokens allows",
                param="min_tokens",
            )
        bias = body.logit_bias_pairs
        self.check_token_ids([t for t, _ in bias], "logit_bias")
        self.check_token_ids(body.stop_token_ids or [], "stop_token_ids")
        self.check_token_ids(body.allowed_token_ids or [], "allowed_token_ids")
        # below the floor, logits / temperature overflow float32: the limit of sampling is greedy
        greedy = body.temperature < TEMPERATURE_FLOOR
        eos = () if body.ignore_eos else s.eos_token_ids
        sampling = SamplingParams(
            temperature=0.0 if greedy else body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            max_tokens=max_tokens,
            seed=body.seed if body.seed is not None else secrets.randbits(63),
            stop_token_ids=tuple(dict.fromkeys((*eos, *(body.stop_token_ids or ())))),
            seeded=body.seed is not None,
            logprobs=body.requested_logprobs,
            n=body.num_choices,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=bias,
            min_tokens=body.min_tokens,
            min_p=body.min_p,
            allowed_token_ids=tuple(body.allowed_token_ids or ()),
            grammar=grammar,
        )
        salt = "" if s.shared_cache else tenant
        if body.cache_salt is not None:
            salt = f"{salt}\x00{body.cache_salt}"
        return Request(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            arrival_time=time.time(),
            cache_salt=salt,
        )

    @property
    def grammars(self) -> GrammarCompiler:
        """Validates grammars at the ingress (built on first use, on a tokenizer thread)."""
        with self._grammar_lock:
            if self._grammars is None:
                tok = self.tokenizer
                self._grammars = GrammarCompiler(
                    tok.hf, tok.vocab_size, self.settings.eos_token_ids
                )
            return self._grammars

    async def check_grammar(self, spec: GrammarSpec | None, param: str) -> None:
        """A grammar llguidance refuses is a 400 naming ``param``, before any replica sees it."""
        if spec is None:
            return
        try:
            await self.off_loop(self.grammars.compile, spec)
        except GrammarError as e:
            raise APIError(400, f"invalid {param}: {e}", param=param) from e
