"""The ingress Ray Serve deployment: the OpenAI HTTP API in front of prefill and decode."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from ray import serve

from cluster.api import build_api
from cluster.generation import Generation
from cluster.service import OpenAIService, ServiceSettings
from models.tokenizer import Tokenizer

HEALTH_TIMEOUT_S = 5.0


@serve.ingress()
class OpenAIIngress:
    """Tokenizes, validates and routes each request: prefill (if any), then a decode stream."""

    def __init__(self, settings: ServiceSettings, prefill: Any | None, decode: Any) -> None:
        self.settings = settings
        self.tokenizer = Tokenizer(Path(settings.model_folder))
        self.service = OpenAIService(settings, self.tokenizer)
        self.prefill = prefill
        self.decode = decode
        self.generation = Generation(self.tokenizer, prefill, decode)

    async def health(self) -> dict[str, Any]:
        """Ask every pool for its stats; any failure makes the app unhealthy (503)."""
        decode = await asyncio.wait_for(self.decode.stats.remote(), HEALTH_TIMEOUT_S)
        body: dict[str, Any] = {
            "status": "ok",
            "mode": self.settings.mode,
            "model": self.settings.model_name,
            "draft": self.settings.draft_kind,
            "decode": decode,
        }
        if self.prefill is not None:
            body["prefill"] = await asyncio.wait_for(self.prefill.stats.remote(), HEALTH_TIMEOUT_S)
            body["kv_transport"] = body["prefill"]["transport"]
        return body

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self.service, self.generation, self.health)
