"""HTTP routes of the OpenAI-compatible API, built per ingress replica."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from cluster.chat_output import ChatOutput, ChatPiece, ChatPlan
from cluster.errors import APIError, generation_error, install_error_handlers, validation_error
from cluster.generation import Delta, Final, Generation, GenerationError, TextOptions
from cluster.guard import TENANT, Admission, AdmissionGuard
from cluster.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from cluster.responses_api import ResponseShape, respond_responses
from cluster.responses_protocol import ResponsesRequest
from cluster.service import ChatRender, OpenAIService
from cluster.vllm_metrics import scrape_local_exporter, translate
from decode.outputs import SpecUsage
from models.logprobs import TokenLogprob
from models.request import Request
from models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def total_spec(finals: Sequence[Final]) -> SpecUsage:
    """The request's speculation, every choice summed."""
    width = max((len(f.spec.histogram) for f in finals), default=0)
    hist = [
        sum(f.spec.histogram[j] for f in finals if j < len(f.spec.histogram)) for j in range(width)
    ]
    return SpecUsage(
        sum(f.spec.num_steps for f in finals),
        sum(f.spec.draft_tokens for f in finals),
        sum(f.spec.accepted_tokens for f in finals),
        sum(f.spec.emitted_tokens for f in finals),
        tuple(hist),
    )


def usage_body(finals: Sequence[Final]) -> dict[str, Any]:
    """A request's ``usage``: its prompt once, and every choice's tokens and speculation."""
    prompt = finals[0].prompt_tokens
    completion = sum(f.completion_tokens for f in finals)
    spec = total_spec(finals)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if spec.draft_tokens:
        usage["speculative"] = {
            "num_steps": spec.num_steps,
            "draft_tokens": spec.draft_tokens,
            "accepted_tokens": spec.accepted_tokens,
            "acceptance_rate": spec.accepted_tokens / spec.draft_tokens,
            "mean_accepted_length": spec.emitted_tokens / spec.num_steps,
        }
    return usage


def metrics_body(finals: Sequence[Final]) -> dict[str, Any]:
    """vLLM's per-request ``metrics.speculative_decoding`` (its PR 48915's summary shape)."""
    spec = total_spec(finals)
    if not spec.draft_tokens:
        return {}
    return {
        "speculative_decoding": {
            "mean_acceptance_length": spec.emitted_tokens / spec.num_steps,
            "draft_acceptance_rate": spec.accepted_tokens / spec.draft_tokens,
            "acceptance_histogram": list(spec.histogram),
            "num_spec_steps": spec.num_steps,
            "num_accepted_draft_tokens": spec.accepted_tokens,
            "num_draft_tokens": spec.draft_tokens,
            "num_spec_tokens": max(len(spec.histogram) - 1, 0),
        }
    }


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Shape:
    """How one endpoint shapes its bodies: completions and chat differ only here."""

    def __init__(
        self,
        chat: bool,
        rid: str,
        model: str,
        tokenizer: Tokenizer,
        plan: ChatPlan | None = None,
        n: int = 1,
    ) -> None:
        self.chat = chat
        self.plan = plan if plan is not None else ChatPlan()
        self.outputs = [ChatOutput(self.plan) for _ in range(n)]  # per choice
        self.id = ("chatcmpl-" if chat else "cmpl-") + rid
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.text_offset: dict[int, int] = {}  # per choice, completions' next text_offset

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _pieces(self, ids: list[int]) -> list[tuple[str, bytes]]:
        """Each token's text and bytes (a token may hold part of a character: its text then
        has a replacement character, its bytes are exact)."""
        raw = self.tokenizer.token_bytes(ids)
        return [(b.decode("utf-8", errors="replace"), b) for b in raw]

    def logprobs(self, lps: Sequence[TokenLogprob] | None, index: int) -> dict[str, Any] | None:
        """Choice ``index``'s ``logprobs`` object (None when the request did not ask)."""
        if lps is None:
            return None
        ids = [lp.token for lp in lps]
        tops = [[t for t, _ in lp.top] for lp in lps]
        pieces = self._pieces(ids + [t for top in tops for t in top])
        mine, alts = pieces[: len(ids)], iter(pieces[len(ids) :])
        if self.chat:
            content = []
            for lp, (text, raw) in zip(lps, mine, strict=True):
                top = [
                    {"token": t, "logprob": v, "bytes": list(b)}
                    for (_, v), (t, b) in zip(lp.top, alts, strict=False)
                ]
                content.append(
                    {"token": text, "logprob": lp.logprob, "bytes": list(raw), "top_logprobs": top}
                )
            return {"content": content, "refusal": None}
        offsets = []
        for text, _ in mine:
            offsets.append(self.text_offset.get(index, 0))
            self.text_offset[index] = offsets[-1] + len(text)
        return {
            "tokens": [text for text, _ in mine],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [
                {t: v for (_, v), (t, _) in zip(lp.top, alts, strict=False)} for lp in lps
            ],
            "text_offset": offsets,
        }

    def whole(
        self,
        texts: Sequence[str],
        finals: Sequence[Final],
        lps: Sequence[list[TokenLogprob]] | None,
    ) -> dict[str, Any]:
        """The response body: one choice per Final (``finals`` in index order)."""
        choices = []
        for f, text in zip(finals, texts, strict=True):
            logprobs = self.logprobs(lps[f.index] if lps is not None else None, f.index)
            if self.chat:
                out = self.outputs[f.index]
                first, last = out.push(text), out.finish()
                content = first.content + last.content
                message: dict[str, Any] = {
                    "role": "assistant",
                    "content": content if content or not out.calls else None,
                    "refusal": None,
                    "annotations": [],
                }
                reasoning = first.reasoning + last.reasoning
                if self.plan.reasoning or reasoning:
                    message["reasoning_content"] = reasoning or None
                if out.calls:
                    message["tool_calls"] = out.calls
                choices.append(
                    {
                        "index": f.index,
                        "message": message,
                        "finish_reason": out.finish_reason(f.finish_reason),
                        "logprobs": logprobs,
                    }
                )
            else:
                choices.append(
                    {
                        "index": f.index,
                        "text": text,
                        "finish_reason": f.finish_reason,
                        "logprobs": logprobs,
                    }
                )
        body = self._base("chat.completion" if self.chat else "text_completion") | {
            "choices": choices,
            "usage": usage_body(finals),
        }
        metrics = metrics_body(finals)
        return body | {"metrics": metrics} if metrics else body

    def chat_chunks(
        self, index: int, text: str, lps: Sequence[TokenLogprob] | None, end: bool
    ) -> list[dict[str, Any]]:
        """A chat choice's chunks for ``text`` (and, at its ``end``, what its output held)."""
        out = self.outputs[index]
        piece = out.push(text)
        if end:
            last = out.finish()
            piece = ChatPiece(
                piece.content + last.content,
                piece.reasoning + last.reasoning,
                piece.tool_calls + last.tool_calls,
            )
        chunks = []
        if piece.reasoning:
            chunks.append(
                self.chunk(index, None, None, delta={"reasoning_content": piece.reasoning})
            )
        if piece.content or lps:
            chunks.append(self.chunk(index, piece.content, None, lps=lps))
        for entry in piece.tool_calls:
            chunks.append(self.chunk(index, None, None, delta={"tool_calls": [entry]}))
        return chunks

    def chunk(
        self,
        index: int,
        text: str | None,
        finish: str | None,
        role: bool = False,
        lps: Sequence[TokenLogprob] | None = None,
        delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            delta = dict(delta or {})
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if finish is not None:
                finish = self.outputs[index].finish_reason(finish)
            choice: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "finish_reason": finish,
                "logprobs": self.logprobs(lps, index),
            }
        else:
            choice = {
                "index": index,
                "text": text or "",
                "finish_reason": finish,
                "logprobs": self.logprobs(lps, index),
            }
        return self._base("chat.completion.chunk" if self.chat else "text_completion") | {
            "choices": [choice]
        }

    def usage_chunk(self, finals: Sequence[Final]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        metrics = metrics_body(finals)
        body = self._base(obj) | {"choices": [], "usage": usage_body(finals)}
        return body | {"metrics": metrics} if metrics else body


def _in_order(finals: Sequence[Final]) -> list[Final]:
    return sorted(finals, key=lambda f: f.index)


async def _respond(
    gen: Generation,
    req: Request,
    stops: list[str],
    shape: _Shape,
    stream: bool,
    usage: bool,
    text: TextOptions | None = None,
) -> Any:
    wants = req.sampling.logprobs is not None
    n = req.sampling.n
    finals: list[Final] = []
    if not stream:
        parts: list[list[str]] = [[] for _ in range(n)]
        lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
        try:
            async for item in gen.run(req, stops, text):
                if isinstance(item, Final):
                    finals.append(item)
                    continue
                parts[item.index].append(item.text)
                lps[item.index] += item.logprobs
        except GenerationError as e:
            raise generation_error(e) from e
        if len(finals) < n:
            raise APIError(500, "generation ended without a result")
        texts = ["".join(p) for p in parts]
        return JSONResponse(shape.whole(texts, _in_order(finals), lps if wants else None))

    items = gen.run(req, stops, text)
    # Surface failures that happen before the first token as a proper HTTP error.
    try:
        first = await anext(items)
    except GenerationError as e:
        raise generation_error(e) from e

    async def events() -> AsyncIterator[str]:
        item: Delta | Final | None = first
        if shape.chat:
            for i in range(n):
                yield _sse(shape.chunk(i, None, None, role=True))
        try:
            while item is not None:
                if isinstance(item, Final):
                    finals.append(item)
                    ending = None if shape.chat else ""
                    if shape.chat:
                        for c in shape.chat_chunks(item.index, "", None, end=True):
                            yield _sse(c)
                    yield _sse(shape.chunk(item.index, ending, item.finish_reason))
                    if len(finals) == n:
                        if usage:
                            yield _sse(shape.usage_chunk(_in_order(finals)))
                        break
                else:
                    lps = item.logprobs if wants else None
                    if shape.chat:
                        for c in shape.chat_chunks(item.index, item.text, lps, end=False):
                            yield _sse(c)
                    else:
                        yield _sse(shape.chunk(item.index, item.text, None, lps=lps))
                item = await anext(items, None)
        except GenerationError as e:
            yield _sse(generation_error(e).body())
        finally:
            await items.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _tenant(http: HTTPRequest) -> str:
    return str(http.scope.get("state", {}).get(TENANT, ""))


def build_api(
    service: OpenAIService,
    gen: Generation,
    health: Callable[[bool], Awaitable[dict[str, Any]]],
    admission: Admission,
) -> FastAPI:
    app = FastAPI(title="tandem", description="OpenAI-compatible API of a tandem cluster")
    install_error_handlers(app)
    settings = service.settings
    app.add_middleware(AdmissionGuard, admission=admission)

    @app.get("/health")
    async def get_health(http: HTTPRequest) -> JSONResponse:
        """Open for probes; without a valid key (when keys are set) it says only the status."""
        keys = admission.policy.keys
        full = not keys.enabled or keys.identify(http.headers.get("authorization")) is not None
        try:
            body = await health(full)  # whoever reads the counters reads them fresh
        except Exception as e:
            log.warning("health check failed: %s", e)
            detail = {"error": str(e)} if full else {}
            return JSONResponse({"status": "unhealthy", **detail}, status_code=503)
        if not full:
            return JSONResponse({"status": body["status"]})
        return JSONResponse(body | {"admission": admission.state.snapshot()})

    card = {
        "id": settings.model_name,
        "object": "model",
        "created": settings.created,
        "owned_by": "tandem",
        "max_model_len": settings.max_model_len,
    }

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        """vLLM's metric names, from this node's exporter (cluster/vllm_metrics.py)."""
        text = translate(await scrape_local_exporter())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        service.check_model(model_id)
        return card

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            service.check_model(body.model)
        if body.messages is not None:
            how = ChatRender(add_generation_prompt=body.add_generation_prompt)
            ids = await service.off_loop(service.chat_prompt, body.messages, how)
        else:
            assert body.prompt is not None
            ids = await service.off_loop(
                service.tokenizer.encode, body.prompt, body.add_special_tokens
            )
        strs = service.tokenizer.token_strs(ids) if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": settings.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            service.check_model(body.model)
        service.check_token_ids(body.tokens, "tokens")
        text = await service.off_loop(service.tokenizer.decode, body.tokens, False)
        return {"prompt": text}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest) -> Any:
        service.check_model(body.model)
        ids = await service.off_loop(service.completion_prompt, body)
        grammar = body.grammar_format
        param = "structured_outputs" if body.structured_outputs is not None else "response_format"
        await service.check_grammar(grammar, param)
        req = service.build_request(body, ids, body.max_tokens, "prompt", _tenant(http), grammar)
        shape = _Shape(False, req.request_id, settings.model_name, service.tokenizer)
        text = service.text_options(body)
        return await _respond(
            gen, req, body.stop_strings, shape, body.stream, body.include_usage, text
        )

    async def chat_request(
        body: ChatCompletionRequest, http: HTTPRequest
    ) -> tuple[Request, ChatPlan, TextOptions]:
        service.check_model(body.model)
        grammar, param = service.chat_grammar(body)
        await service.check_grammar(grammar, param)
        how = service.chat_render(body)
        prompt = await service.off_loop(service.chat_text, body.messages, how)
        ids = await service.off_loop(service.encode_chat, prompt, how.add_special_tokens)
        req = service.build_request(
            body, ids, body.requested_max_tokens, "messages", _tenant(http), grammar
        )
        plan = service.chat_plan(body, prompt)
        return req, plan, service.text_options(body, plan)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest) -> Any:
        req, plan, text = await chat_request(body, http)
        n = req.sampling.n
        shape = _Shape(True, req.request_id, settings.model_name, service.tokenizer, plan, n)
        return await _respond(
            gen, req, body.stop_strings, shape, body.stream, body.include_usage, text
        )

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, http: HTTPRequest) -> Any:
        """Stateless: the conversation comes whole in ``input`` (docs/api.md)."""
        try:
            chat = body.to_chat()
        except ValidationError as e:
            raise validation_error(RequestValidationError(e.errors())) from e
        req, plan, text = await chat_request(chat, http)
        shape = ResponseShape(body, settings.model_name, plan)
        return await respond_responses(gen, req, shape, body.stream, text)

    return app
