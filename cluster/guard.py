"""Admission in front of the API (an ASGI middleware): API keys, body size and the in-flight
caps, refused before any work with an OpenAI error body naming the limit (401, 413, 429)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.auth import KeyRing
from cluster.errors import RETRY_AFTER_S, APIError

OPEN_PATHS = frozenset({"/health"})
TENANT = "tandem_tenant"  # the request's key name in the ASGI scope's state
# work per request (tokenizing at least): bodies bounded, counted against the in-flight caps
GENERATION_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
)


@dataclass(frozen=True)
class GuardPolicy:
    keys: KeyRing
    max_body_bytes: int
    body_timeout_s: float
    max_inflight: int
    max_concurrent_per_key: int  # 0: no per-key cap


@dataclass
class AdmissionState:
    """Counters of one ingress replica (shown in /health)."""

    inflight: int = 0
    per_key: Counter[str] = field(default_factory=Counter)
    rejected: Counter[int] = field(default_factory=Counter)  # by status code

    def snapshot(self) -> dict[str, Any]:
        rejected = {str(status): n for status, n in self.rejected.items()}
        return {"inflight": self.inflight, "rejected": rejected}


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return bytes(v).decode("latin-1")
    return None


@dataclass(frozen=True)
class Admission:
    """The admission rules of one ingress replica, shared by its HTTP guard and its gRPC API."""

    policy: GuardPolicy
    state: AdmissionState

    def identify(self, authorization: str | None) -> str:
        """The key's name ("open" when keys are off); a 401 when it is missing or wrong."""
        if not self.policy.keys.enabled:
            return "open"
        found = self.policy.keys.identify(authorization)
        if found is None:
            msg = "Missing or incorrect API key: send 'Authorization: Bearer <key>'"
            raise APIError(401, msg, code="invalid_api_key")
        return found

    def refusal(self, key: str) -> APIError | None:
        p, s = self.policy, self.state
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        if s.inflight >= p.max_inflight:
            return APIError(
                429,
                f"the server is at its limit of {p.max_inflight} requests in flight "
                "(limits.max_inflight); retry shortly",
                code="server_overloaded",
                type_="rate_limit_error",
                headers=retry,
            )
        if p.max_concurrent_per_key and s.per_key[key] >= p.max_concurrent_per_key:
            return APIError(
                429,
                f"this API key already has {p.max_concurrent_per_key} requests in flight, the "
                "most allowed (limits.max_concurrent_per_key)",
                code="rate_limit_exceeded",
                type_="rate_limit_error",
                headers=retry,
            )
        return None

    def too_large(self, size: int) -> APIError | None:
        return self.oversized() if size > self.policy.max_body_bytes else None

    def oversized(self) -> APIError:
        limit = self.policy.max_body_bytes
        msg = f"request body exceeds {limit} bytes (limits.max_body_bytes)"
        return APIError(413, msg, code="request_too_large")

    @contextmanager
    def held(self, key: str) -> Iterator[None]:
        """Count a request against the caps while it runs."""
        s = self.state
        s.inflight += 1
        s.per_key[key] += 1
        try:
            yield
        finally:
            s.inflight -= 1
            s.per_key[key] -= 1
            if not s.per_key[key]:
                del s.per_key[key]


class AdmissionGuard:
    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission
        self.policy = admission.policy
        self.state = admission.state

    async def _refuse(self, send: Send, err: APIError) -> None:
        self.state.rejected[err.status] += 1
        body = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            key = self.admission.identify(_header(scope, b"authorization"))
        except APIError as e:
            await self._refuse(send, e)
            return
        if scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        refusal = self.admission.refusal(key)
        if refusal is not None:
            await self._refuse(send, refusal)
            return
        try:
            body = await asyncio.wait_for(
                self._read_body(scope, receive), self.policy.body_timeout_s
            )
        except TimeoutError:
            await self._refuse(send, self._slow())
            return
        if body is None:
            await self._refuse(send, self.admission.oversized())
            return
        scope.setdefault("state", {})[TENANT] = key  # the handlers salt caches with it
        with self.admission.held(key):
            await self.app(scope, _replay(body, receive), send)

    def _slow(self) -> APIError:
        t = self.policy.body_timeout_s
        msg = f"the request body did not arrive within {t:g} s (limits.body_timeout_s)"
        return APIError(408, msg, code="request_timeout")

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as it exceeds the limit."""
        limit = self.policy.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return None
        parts: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                break  # the client went away; the app sees what arrived and answers no one
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            parts.append(chunk)
            if not msg.get("more_body", False):
                break
        return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the buffered body once, then the client's own events (so a
    disconnect still reaches a streaming response)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
