"""The gRPC API (``tandem.v1``) and ``grpc.health.v1``, served by the ingress through Ray Serve's
gRPC proxy: the same pydantic bodies, admission and ``Generation`` as the HTTP API."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, NoReturn

import grpc
from fastapi.exceptions import RequestValidationError
from grpc_health.v1 import health_pb2
from pydantic import ValidationError

from cluster.api import usage_body
from cluster.errors import APIError, generation_error, validation_error
from cluster.generation import Final, Generation, GenerationError
from cluster.guard import Admission
from cluster.proto import tandem_pb2 as pb
from cluster.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from cluster.service import OpenAIService
from models.logprobs import TokenLogprob

log = logging.getLogger(__name__)

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def grpc_code(status: int) -> grpc.StatusCode:
    return _CODES.get(status, grpc.StatusCode.INTERNAL)


def _sampling(s: Any) -> dict[str, Any]:
    """The fields ``SamplingOptions`` sets, under their HTTP names (unset: the HTTP defaults)."""
    out: dict[str, Any] = {
        name: getattr(s, name)
        for name in ("temperature", "top_p", "top_k", "seed", "max_tokens")
        if s.HasField(name)
    }
    if s.stop:
        out["stop"] = list(s.stop)
    if s.ignore_eos:
        out["ignore_eos"] = True
    return out


def _body(request: Any) -> tuple[SamplingFields, str]:
    """The HTTP body the request stands for, and the name of its prompt field."""
    fields = {"model": request.model, **_sampling(request.sampling)}
    logprobs = request.sampling.logprobs if request.sampling.HasField("logprobs") else None
    kind = request.WhichOneof("prompt")
    if kind == "chat":
        messages = []
        for m in request.chat.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.name:
                d["name"] = m.name
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            messages.append(d)
        if logprobs is not None:
            fields |= {"logprobs": True, "top_logprobs": logprobs}
        return ChatCompletionRequest.model_validate(fields | {"messages": messages}), "messages"
    if kind is None:
        raise APIError(400, "'prompt' is required: set text, token_ids or chat", param="prompt")
    prompt = request.text if kind == "text" else list(request.token_ids.ids)
    if logprobs is not None:
        fields["logprobs"] = logprobs
    return CompletionRequest.model_validate(fields | {"prompt": prompt}), "prompt"


def _metadata(context: Any, name: str) -> str | None:
    for key, value in context.invocation_metadata():
        if key.lower() == name:
            return str(value)
    return None


class GrpcStatusError(RuntimeError):
    """Raised to end a call whose status and details are set on its context."""


class GrpcAPI:
    """What the ingress answers on gRPC (its ``Generate``, ``ListModels`` and ``Check``)."""

    def __init__(
        self,
        service: OpenAIService,
        gen: Generation,
        admission: Admission,
        health: Callable[[], Awaitable[dict[str, Any]]],
    ) -> None:
        self.service = service
        self.gen = gen
        self.admission = admission
        self.health = health

    def _fail(self, context: Any, e: APIError) -> NoReturn:
        """End the call with ``e``'s status and message: Ray Serve's replica keeps a code set
        on the context when the method then raises, and the proxy answers with it."""
        context.set_code(grpc_code(e.status))
        context.set_details(e.message)
        raise GrpcStatusError(e.message) from e

    async def generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            key = self.admission.identify(_metadata(context, "authorization"))
            refusal = self.admission.refusal(key) or self.admission.too_large(request.ByteSize())
            if refusal is not None:
                raise refusal
        except APIError as e:
            self.admission.state.rejected[e.status] += 1
            self._fail(context, e)
        with self.admission.held(key):
            async for response in self._generate(request, context, key):
                yield response

    async def _generate(self, request: Any, context: Any, tenant: str) -> AsyncIterator[Any]:
        s = self.service
        try:
            try:
                body, param = _body(request)
            except ValidationError as e:
                raise validation_error(RequestValidationError(e.errors())) from e
            s.check_model(body.model)
            if isinstance(body, ChatCompletionRequest):
                ids = await s.off_loop(s.chat_prompt, body.messages)
                req = s.build_request(body, ids, body.requested_max_tokens, param, tenant)
            else:
                assert isinstance(body, CompletionRequest)
                ids = await s.off_loop(s.completion_prompt, body)
                req = s.build_request(body, ids, body.max_tokens, param, tenant)
        except APIError as e:
            self._fail(context, e)
        rid = "cmpl-" + req.request_id
        text: list[str] = []
        lps: list[TokenLogprob] = []
        try:
            async with aclosing(self.gen.run(req, body.stop_strings)) as items:
                async for item in items:
                    if isinstance(item, Final):
                        last = pb.GenerateResponse(
                            id=rid, finish_reason=item.finish_reason, usage=_usage(item)
                        )
                        if not request.stream:
                            last.text = "".join(text)
                            last.logprobs.extend(self._logprobs(lps))
                        yield last
                        return
                    if request.stream:
                        yield pb.GenerateResponse(
                            id=rid, text=item.text, logprobs=self._logprobs(item.logprobs)
                        )
                    else:
                        text.append(item.text)
                        lps += item.logprobs
        except GenerationError as e:
            self._fail(context, generation_error(e))

    def _logprobs(self, lps: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> list[Any]:
        if not lps:
            return []
        tok = self.service.tokenizer
        ids = [lp.token for lp in lps]
        alt_ids = [t for lp in lps for t, _ in lp.top]
        raw = tok.token_bytes(ids + alt_ids)
        mine, alts = raw[: len(ids)], iter(raw[len(ids) :])
        out = []
        for lp, b in zip(lps, mine, strict=True):
            top = [
                pb.TopLogprob(token_id=t, token=a.decode("utf-8", "replace"), logprob=v)
                for (t, v), a in zip(lp.top, alts, strict=False)
            ]
            out.append(
                pb.TokenLogprob(
                    token_id=lp.token,
                    token=b.decode("utf-8", "replace"),
                    logprob=lp.logprob,
                    token_bytes=b,
                    top=top,
                )
            )
        return out

    async def list_models(self, request: Any, context: Any) -> Any:
        try:
            self.admission.identify(_metadata(context, "authorization"))
        except APIError as e:
            self._fail(context, e)
        st = self.service.settings
        model = pb.Model(
            id=st.model_name, created=st.created, owned_by="tandem", max_model_len=st.max_model_len
        )
        return pb.ListModelsResponse(models=[model])

    async def check(self, request: Any, context: Any) -> Any:
        """``grpc.health.v1.Health/Check``: SERVING while ``/health`` says ok or degraded,
        NOT_SERVING when a pool cannot answer. Open, like ``/health``."""
        status = health_pb2.HealthCheckResponse.NOT_SERVING
        try:
            body = await self.health()
            if body.get("status") in ("ok", "degraded"):
                status = health_pb2.HealthCheckResponse.SERVING
        except Exception as e:
            log.warning("gRPC health check failed: %s", e)
        return health_pb2.HealthCheckResponse(status=status)


def _usage(final: Final) -> Any:
    u = usage_body([final])  # one choice per gRPC call
    spec = u.get("speculative")
    usage = pb.Usage(
        prompt_tokens=u["prompt_tokens"],
        completion_tokens=u["completion_tokens"],
        total_tokens=u["total_tokens"],
    )
    if spec is not None:
        usage.speculative.CopyFrom(pb.Speculative(**spec))
    return usage
