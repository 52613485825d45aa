"""The prefill Ray Serve deployment: a ``PrefillWorker`` stepped on one dedicated thread."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from typing import Any

from kvtransfer.handoff import KVHandoff, LeaseRelease
from kvtransfer.memory import process_memory
from kvtransfer.metrics import KVMetrics
from kvtransfer.path_check import ProbeSource
from models.host_memory import onednn_cache_capacity
from models.request import Request
from prefill.config import PrefillWorkerConfig
from prefill.worker import PrefillWorker
from serving.health_board import BoardPublisher, pool_board
from serving.replica_identity import node_id, replica_id
from serving.replica_logs import route_to_serve


class PrefillServer:
    """Steps the worker while there is work; reaps leases between steps and every
    ``REAP_PERIOD_S``; a caller that goes away cancels its prompt or ends its lease."""

    REAP_PERIOD_S = 0.05
    RELEASE_PERIOD_S = 1.0

    def __init__(self, cfg: PrefillWorkerConfig) -> None:
        route_to_serve()
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="tandem-prefill")
        # built on the thread that steps it: one thread, one OpenMP team (see ``decode.loop``)
        self.worker = self._exec.submit(PrefillWorker, cfg).result()
        KVMetrics("prefill").fallback(self.worker.transport.name, self.worker.shard.fallback_reason)
        self._released_at = time.monotonic()
        self._stepper: asyncio.Task[None] | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._publisher = BoardPublisher.start(self.snapshot)
        self.replica = replica_id()

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    def _kick(self) -> None:
        loop = asyncio.get_running_loop()
        if self._stepper is None or self._stepper.done():
            self._stepper = loop.create_task(self._step_while_busy())
        if self._reaper is None or self._reaper.done():
            self._reaper = loop.create_task(self._reap_forever())

    async def _step_while_busy(self) -> None:
        while self.worker.has_work:
            await self._run(self.worker.step)

    async def _reap_forever(self) -> None:
        while True:
            await self._run(self._housekeep)
            await asyncio.sleep(self.REAP_PERIOD_S)

    def _housekeep(self) -> None:
        self.worker.reap()
        now = time.monotonic()
        idle = not self.worker.has_work
        if idle and now - self._released_at >= self.RELEASE_PERIOD_S:
            self.worker.release_memory()
            self._released_at = now

    async def prefill(self, req: Request) -> KVHandoff:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[KVHandoff] = loop.create_future()

        def done(result: KVHandoff | BaseException) -> None:  # runs on the worker thread
            loop.call_soon_threadsafe(_settle, fut, result)

        await self.worker.grammars.prepare(req)
        self.worker.submit(req, done)
        self._kick()
        try:
            handoff = await fut
        except asyncio.CancelledError:
            self.worker.cancel(req.request_id)
            self._kick()
            raise
        return replace(handoff, source_replica=self.replica)

    async def check_kv_path(self, decode: Any) -> dict[str, Any]:
        """The cross-pool path check: serve a probe of a handoff's size from this replica's
        node while a replica of ``decode`` (its handle) reads it, as its pulls will."""
        fabric = self.worker.shard.fabric
        if fabric is None:
            raise ValueError(f"this replica's KV transport is {self.worker.transport.name}")
        source = await asyncio.to_thread(ProbeSource, fabric, self.worker.cfg.device)
        try:
            here = {"replica": self.replica, "node": node_id()}
            report: dict[str, Any] = await decode.read_kv_path.remote(source.payload(), here)
        finally:
            await asyncio.to_thread(source.close)
        return report

    async def release(self, release: LeaseRelease) -> None:
        """Free a handoff's blocks at once: the ingress dropped it before any decode read it
        (or the reader is gone); the prefill router sends this to ``release.replica``."""
        self.worker.cancel(release.request_id)
        self._kick()

    async def stats(self) -> dict[str, Any]:
        self._kick()
        await self._run(self.worker.reap)
        return self.snapshot()

    async def health_board(self) -> Any:
        return pool_board()

    def snapshot(self) -> dict[str, Any]:
        """This replica's stats (copies: safe beside the worker's thread)."""
        out = asdict(self.worker.stats())
        out["kv_pool_bytes"] = self.worker.pool.nbytes
        out.update(process_memory())
        out["onednn_cache_capacity"] = onednn_cache_capacity()
        out["switch_interval_s"] = sys.getswitchinterval()
        out["transport"] = self.worker.transport.name
        out["kv_path"] = self.worker.shard.kv_path()
        out["transport_fallback"] = self.worker.shard.fallback_reason
        out["transfer"] = asdict(self.worker.transport.counters)
        return out

    def __del__(self) -> None:
        publisher = getattr(self, "_publisher", None)
        if publisher is not None:
            publisher.stop()
        for task in (self._stepper, self._reaper):
            if task is not None:
                task.cancel()
        with contextlib.suppress(Exception):
            self._exec.shutdown(wait=False)


def _settle(fut: asyncio.Future[KVHandoff], result: KVHandoff | BaseException) -> None:
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)
