"""The prefill Ray Serve deployment: one ``PrefillWorker`` behind a single worker thread."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from kvtransfer.handoff import KVHandoff
from models.request import Request
from prefill.config import PrefillWorkerConfig
from prefill.worker import PrefillWorker


class PrefillServer:
    """Serializes prefills and lease upkeep on one thread (the worker is not thread-safe)."""

    REAP_PERIOD_S = 0.05

    def __init__(self, cfg: PrefillWorkerConfig) -> None:
        self.worker = PrefillWorker(cfg)
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="tandem-prefill")
        self._reaper: asyncio.Task[None] | None = None

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        while True:
            await self._run(self.worker.reap)
            await asyncio.sleep(self.REAP_PERIOD_S)

    async def prefill(self, req: Request) -> KVHandoff:
        self._ensure_reaper()
        handoff: KVHandoff = await self._run(self.worker.prefill, req)
        return handoff

    async def stats(self) -> dict[str, Any]:
        self._ensure_reaper()
        await self._run(self.worker.reap)
        out = asdict(self.worker.stats())
        out["transport"] = self.worker.transport.name
        out["transfer"] = asdict(self.worker.transport.counters)
        return out

    def __del__(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        with contextlib.suppress(Exception):
            self._exec.shutdown(wait=False)
