"""The ingress Ray Serve deployment: the OpenAI HTTP API and the gRPC API in front of prefill
and decode."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayActorError

from cluster.api import build_api
from cluster.generation import Generation
from cluster.grpc_api import GrpcAPI
from cluster.guard import Admission, AdmissionState
from cluster.kv_path_check import CrossPoolPathCheck
from cluster.service import OpenAIService, ServiceSettings
from models.tokenizer import Tokenizer
from serving.health_board import pool_health
from serving.replica_logs import route_to_serve
from serving.serving_metrics import RequestMetrics

HEALTH_TIMEOUT_S = 5.0
HEALTH_CACHE_S = 1.0


@serve.ingress()
class OpenAIIngress:
    """Tokenizes, validates and routes each request: prefill (if any), then a decode stream."""

    def __init__(self, settings: ServiceSettings, prefill: Any | None, decode: Any) -> None:
        route_to_serve()
        self.settings = settings
        self.replica = str(serve.get_replica_context().replica_id.unique_id)
        self.tokenizer = Tokenizer(Path(settings.model_folder))
        if settings.chat_template is not None:
            self.tokenizer.set_chat_template(settings.chat_template)
        self.service = OpenAIService(settings, self.tokenizer)
        self.prefill = prefill
        self.decode = decode
        self.generation = Generation(
            self.tokenizer,
            prefill,
            decode,
            settings.retries,
            RequestMetrics("ingress", settings.model_name),
            log_requests=settings.log_requests,
            timeout_s=settings.request_timeout_s,
        )
        self._boards: dict[str, Any] = {}
        self._health_task: tuple[float, asyncio.Future[dict[str, Any]]] | None = None
        self.admission = Admission(settings.guard, AdmissionState())
        self.grpc = GrpcAPI(self.service, self.generation, self.admission, self.health)
        self.path_check = (
            CrossPoolPathCheck(prefill, decode) if settings.path_check and prefill else None
        )
        with contextlib.suppress(RuntimeError):  # no loop yet: the first /health starts it
            self._start_path_check()

    def _start_path_check(self) -> None:
        if self.path_check is not None:
            self.path_check.start()

    # Ray Serve's gRPC proxy calls the ingress method named like the RPC
    async def Generate(self, request: Any, grpc_context: Any) -> AsyncIterator[Any]:  # noqa: N802
        async for response in self.grpc.generate(request, grpc_context):
            yield response

    async def ListModels(self, request: Any, grpc_context: Any) -> Any:  # noqa: N802
        return await self.grpc.list_models(request, grpc_context)

    async def Check(self, request: Any, grpc_context: Any) -> Any:  # noqa: N802
        return await self.grpc.check(request, grpc_context)

    async def health(self, fresh: bool = False) -> dict[str, Any]:
        """``_health``, shared by every caller within ``HEALTH_CACHE_S`` unless ``fresh`` (a
        caller shown the counters: one with an API key, or anyone where no keys are set):
        anonymous probes by the thousand cost the pools one round of stats calls a second."""
        now = time.monotonic()
        cached = self._health_task
        if fresh or cached is None or now - cached[0] > HEALTH_CACHE_S:
            cached = self._health_task = (now, asyncio.ensure_future(self._health()))
        return dict(await asyncio.shield(cached[1]))

    async def _health(self) -> dict[str, Any]:
        """The answering replica's stats per pool and every replica's summary; a pool that
        cannot answer raises (503), one past ``kv.degraded_fraction`` makes it ``degraded``."""
        decode = await asyncio.wait_for(self.decode.stats.remote(), HEALTH_TIMEOUT_S)
        body: dict[str, Any] = {
            "status": "ok",
            "mode": self.settings.mode,
            "model": self.settings.model_name,
            "draft": self.settings.draft_kind,
            "ingress_replica": self.replica,
            "decode": decode,
        }
        pools = {"decode": self.decode}
        if self.prefill is not None:
            body["prefill"] = await asyncio.wait_for(self.prefill.stats.remote(), HEALTH_TIMEOUT_S)
            body["kv_transport"] = body["prefill"]["transport"]
            pools["prefill"] = self.prefill
        cross: dict[str, Any] = {}
        if self.path_check is not None:
            self._start_path_check()
            body["kv_path_cross_pool"] = cross = self.path_check.snapshot()
        body["pools"] = {}
        degraded = []
        for name, handle in pools.items():
            try:
                entries = await asyncio.wait_for(self._board(name, handle), HEALTH_TIMEOUT_S)
            except Exception as e:  # board being recreated; the pool answered above, so serve
                body["pools"][name] = {"error": f"the pool's health board is unavailable: {e}"}
                continue
            ph = pool_health(name, entries, self.settings.degraded_fraction)
            body["pools"][name] = ph.to_dict()
            if ph.degraded:
                degraded.append(ph.degraded)
        if cross.get("degraded"):
            degraded.append(f"prefill -> decode: {cross['degraded']}")
        body["retries"] = self.generation.retried.snapshot()
        body["dropped_handoffs"] = self.generation.dropped_handoffs
        if degraded:
            body["status"] = "degraded"
            body["degraded"] = degraded
        return body

    async def _board(self, pool: str, handle: Any) -> dict[str, dict[str, Any]]:
        """Every live replica's entry on ``pool``'s board (its handle cached until recreated)."""
        board = self._boards.get(pool)
        if board is not None:
            try:
                entries: dict[str, dict[str, Any]] = await board.snapshot.remote()
                return entries
            except RayActorError:
                pass  # recreated since: ask again
        board = self._boards[pool] = await handle.health_board.remote()
        entries = await board.snapshot.remote()
        return entries

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self.service, self.generation, self.health, self.admission)
