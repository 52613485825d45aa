"""The decode Ray Serve deployment: a ``DecodeEngine`` on its own thread, streaming outputs."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, replace
from typing import Any

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from decode.loop import EngineLoop
from decode.metrics import SpecMetrics
from decode.outputs import StepOutput
from decode.stream import coalesced
from kvtransfer.handoff import KVHandoff
from kvtransfer.memory import process_memory
from kvtransfer.metrics import KVMetrics
from kvtransfer.path_check import read_from
from models.host_memory import onednn_cache_capacity
from models.request import Request, choice_id
from serving.autoscaling_metrics import (
    CAPACITY,
    CAPACITY_TOK_S,
    GOODPUT_TOK_S,
    HEADROOM_TOK_S,
    STREAMS,
)
from serving.health_board import BoardPublisher, pool_board
from serving.replica_identity import node_id, replica_id
from serving.replica_logs import route_to_serve
from serving.serving_metrics import ReplicaGauges
from serving.shared_priors import drafter_version, seed_from_pool
from speculation.capacity import capacity_within_slo


class DecodeServer:
    """One decode replica; cancelling a ``generate`` stream aborts the request and frees its KV."""

    def __init__(self, cfg: DecodeEngineConfig, capacity_slo_s: float | None = None) -> None:
        route_to_serve()
        self.cfg = cfg
        self.capacity_slo_s = capacity_slo_s
        self._delivered = 0
        self._reported = (0, time.monotonic())
        kv_metrics = KVMetrics("decode")
        self._queues: dict[str, asyncio.Queue[StepOutput]] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None
        self.metrics = SpecMetrics("decode", cfg.model_name)
        self.gauges = ReplicaGauges("decode", cfg.model_name)
        # built on the engine thread, so every torch op runs on one thread (decode.loop)
        self.loop = EngineLoop(lambda: DecodeEngine(cfg, kv_metrics), self._deliver)
        self.engine = self.loop.start()
        kv_metrics.fallback(self.engine.transport.name, self.engine.shard.fallback_reason)
        draft = cfg.draft.model.fingerprint() if cfg.draft.model is not None else None
        self.drafter_version = drafter_version(
            cfg.draft.kind.value, draft, cfg.target.fingerprint()
        )
        spec = self.engine.speculation
        # start from what the pool has learned, before serving (the engine thread is idle)
        in_serve = BoardPublisher.in_replica()
        self.seeded_tokens = (
            seed_from_pool(spec, self.drafter_version) if spec and in_serve else 0.0
        )
        self._publisher = BoardPublisher.start(self.snapshot)
        self.replica = replica_id()

    def _deliver(self, out: StepOutput) -> None:
        """Runs on the engine thread: hand the output to the request's asyncio queue."""
        if self._aloop is not None:
            self._aloop.call_soon_threadsafe(self._put, out)

    def _put(self, out: StepOutput) -> None:
        self.metrics.record(out.step_drafted, out.step_accepted, len(out.new_token_ids))
        self._delivered += len(out.new_token_ids)
        e = self.engine  # counts read beside the engine thread: a gauge may lag a step
        used = 1.0 - e.allocator.num_free / e.cfg.num_blocks
        waiting = len(e.waiting) + len(e.intake.pending)
        late = e.during_traffic()
        self.gauges.publish(
            len(e.running), waiting, used, e.take_queue_times(), late, force=out.finished
        )
        q = self._queues.get(out.request_id)
        if q is not None:
            q.put_nowait(out)

    async def generate(self, req: Request, handoff: KVHandoff | None) -> AsyncIterator[StepOutput]:
        """Each of the request's ``n`` choices' outputs until all finish or one fails."""
        self._aloop = asyncio.get_running_loop()
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        ids = [choice_id(req.request_id, i) for i in range(req.sampling.n)]
        for rid in ids:
            self._queues[rid] = q
        choice = {rid: i for i, rid in enumerate(ids)}
        await self.engine.grammars.prepare(req)
        self.loop.submit(req, handoff)
        ended: set[str] = set()
        try:
            async for out in coalesced(q, self.cfg.stream_interval_s, len(ids)):
                if out.finished:
                    ended.add(out.request_id)
                yield replace(out, choice=choice[out.request_id])
        finally:
            for rid in ids:
                self._queues.pop(rid, None)
            for rid in ids:  # choice 0 first: its choices not yet started end with it
                if rid not in ended:
                    self.loop.abort(rid)

    async def stats(self) -> dict[str, Any]:
        return self.snapshot()

    async def health_board(self) -> Any:
        return pool_board()

    def snapshot(self) -> dict[str, Any]:
        out = asdict(self.engine.stats())
        out["kv_pool_bytes"] = self.engine.pool.nbytes
        out.update(process_memory())
        out["onednn_cache_capacity"] = onednn_cache_capacity()
        out["switch_interval_s"] = sys.getswitchinterval()
        out["overlap"] = self.engine.overlap  # step n + 1 planned beside step n
        out.update(self.engine.target.describe())
        if self.engine.draft_bucketed is not None:
            out["draft_graphs"] = self.engine.draft_bucketed.describe()["graphs"]
            late = self.engine.during_traffic()
            out["compiles_during_traffic"], out["captures_during_traffic"] = late
        warmed, bucketed = self.engine.warmed, self.engine.bucketed
        out["warm_up"] = warmed.describe() if warmed else "off" if bucketed else "ragged steps"
        out["transport"] = self.engine.transport.name
        out["kv_path"] = self.engine.shard.kv_path()
        out["transport_fallback"] = self.engine.shard.fallback_reason
        out["transfer"] = asdict(self.engine.transport.counters)
        out["speculation"] = self.metrics.snapshot()
        spec = self.engine.speculation
        collapsed = spec.alarm.collapsed() if spec is not None else ()
        self.metrics.collapsed_cells(len(collapsed))
        # what the served loop adds to each step; capacity counts it (speculation.loop_cycle)
        out["cycle_overhead_ms"] = round(self.engine.cycle.seconds * 1e3, 3)
        drafter = self.engine.drafter
        out["draft_positions_stopped"] = drafter.positions_stopped if drafter else 0
        out["drafter"] = self.cfg.draft.kind.value
        out["acceptance_collapse"] = [c.to_dict() for c in collapsed]
        out["drafter_version"] = self.drafter_version
        out["seeded_tokens"] = round(self.seeded_tokens, 1)
        cells = spec.calibration.cells() if spec is not None else ()
        out["calibration"] = [
            [c.temperature_bin, c.probe_bin, c.drafted, c.accepted] for c in cells
        ]
        return out

    async def read_kv_path(self, payload: bytes, source: dict[str, str]) -> dict[str, Any]:
        """The cross-pool path check's reading end: pull a prefill replica's probe into a
        process on this node (never the engine's agent) and report the path."""
        fabric = self.engine.shard.fabric
        if fabric is None:
            raise ValueError(f"this replica's KV transport is {self.engine.transport.name}")
        report = await asyncio.to_thread(read_from, payload, fabric, self.cfg.device)
        to = {"replica": self.replica, "node": node_id()}
        return report.to_dict() | {
            "from": source,
            "to": to,
            "crosses_nodes": source["node"] != to["node"],
            "degraded": report.degraded(self.cfg.min_path_gbps),
        }

    async def record_routing_stats(self) -> dict[str, Any]:
        return self.engine.routing_stats().to_dict()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        stats = self.engine.routing_stats()
        now = time.monotonic()
        tokens, since = self._reported
        self._reported = (self._delivered, now)
        out = {
            STREAMS: float(stats.running + stats.queued),
            GOODPUT_TOK_S: (self._delivered - tokens) / max(now - since, 1e-6),
        }
        if self.capacity_slo_s is not None:
            cap = capacity_within_slo(stats, self.capacity_slo_s)
            if cap is not None:
                out[CAPACITY] = float(cap.streams)
                out[CAPACITY_TOK_S] = max(cap.capacity_goodput_tok_s, cap.single_goodput_tok_s)
                out[HEADROOM_TOK_S] = cap.headroom_tok_s
        return out

    async def check_health(self) -> None:
        """Fails (Serve restarts the replica) when the engine thread died, a TP rank went
        silent, or the engine has had work without finishing a step for ``watchdog_s``."""
        if not self.loop.alive:
            raise RuntimeError(f"decode engine thread is not running: {self.loop.error!r}")
        if self.loop.wedged is not None:
            raise RuntimeError(f"decode replica is wedged: {self.loop.wedged}")
        stalled = self.loop.stalled_s()
        if stalled > self.cfg.watchdog_s:
            raise RuntimeError(
                f"the decode engine has had work but finished no step for {stalled:.0f} s "
                f"(decode.watchdog_s = {self.cfg.watchdog_s:g})"
            )

    def __del__(self) -> None:
        publisher = getattr(self, "_publisher", None)
        if publisher is not None:
            publisher.stop()
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop(timeout_s=1.0)
