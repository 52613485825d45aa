"""A tensor-parallel group: rank 0 in the replica's process, ranks 1.. as Ray actors.

Every rank holds its shard of the target's weights (``models.parallel`` layers load their own
rows or columns) and of the KV pool (its KV heads), and a NIXL agent over that pool. The ranks
form a torch.distributed process group of their own (gloo on CPU, NCCL on CUDA) through a
TCP store on rank 0's node; layers issue the collectives. Rank 0 drives: for each forward it
sends the step's batch to the other ranks and runs its own part, and for each KV pull it asks
every rank to read its heads from the matching source rank. The draft model stays on rank 0.

Actors go into the replica's placement group (bundle ``r`` for rank ``r``) when there is one,
so Ray Serve places a whole group on one node.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvtransfer.handoff import KVHandoff, KVSource
from kvtransfer.nixl_transport import NixlTransport
from kvtransfer.pool import KVPool, pool_spec_for
from kvtransfer.shard import Shard, ShardSpec, draft_shape, load_draft, target_shape
from kvtransfer.transport import KVTransferError, KVTransport, PullHandle, PullState
from models.parallel import TPContext
from models.runner import LocalRunner, ModelRunner, SeqInput, StepResult

log = logging.getLogger(__name__)
REMOTE_COMPLETIONS_PERIOD_S = 0.01


def _process_group(spec: ShardSpec, rank: int, host: str, port: int) -> Any:
    """A process group of the TP ranks only, independent of any default group."""
    store = dist.TCPStore(  # type: ignore[attr-defined]
        host, port, spec.tp_size, is_master=rank == 0, use_libuv=False
    )
    if spec.device.startswith("cuda"):
        nccl: Any = dist.ProcessGroupNCCL  # absent from CPU builds of torch
        return nccl(store, rank, spec.tp_size)
    return dist.ProcessGroupGloo(store, rank, spec.tp_size, timedelta(minutes=5))


def _rank_pool(spec: ShardSpec, rank: int) -> KVPool:
    draft = draft_shape(spec.draft.model) if rank == 0 else None
    layout = pool_spec_for(
        spec.num_blocks, spec.block_size, target_shape(spec.target), draft, spec.tp_size
    )
    return KVPool(layout, spec.device)


class RankWorker:
    """Rank ``r >= 1`` of a TP group (run as a Ray actor)."""

    def __init__(self, spec: ShardSpec, rank: int, host: str, port: int) -> None:
        if spec.num_threads > 0:
            torch.set_num_threads(spec.num_threads)
        self.group = _process_group(spec, rank, host, port)
        tp = TPContext(rank, spec.tp_size, self.group)
        self.pool = _rank_pool(spec, rank)
        self.runner = LocalRunner(
            spec.target.load(spec.device, tp), self.pool.tensor("target"), spec.block_size
        )
        self.transport = NixlTransport(self.pool, role=spec.role, rank=rank, tp_size=spec.tp_size)
        self.pulls: dict[str, PullHandle] = {}
        self.failed: set[str] = set()
        self._done: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the transport is touched by calls and the progress loop
        threading.Thread(target=self._progress, daemon=True).start()

    def _progress(self) -> None:
        while True:
            try:
                with self._lock:
                    for rid in self.transport.completed():
                        self._done.put(rid)
            except Exception:
                log.exception("rank transport progress failed")
                time.sleep(0.1)
            time.sleep(0.0005)

    def source(self) -> KVSource:
        return self.transport.source()

    def run(self, batch: Sequence[SeqInput]) -> None:
        self.runner.run(batch)

    def start_pull(self, handoff: KVHandoff, blocks: Sequence[int]) -> int:
        with self._lock:
            try:
                pull = self.transport.start_pull(handoff, blocks)
            except KVTransferError as e:
                log.warning("rank pull of %s failed: %s", handoff.request_id, e)
                self.failed.add(handoff.request_id)
                return 0
            self.pulls[handoff.request_id] = pull
            return pull.nbytes

    def poll(self, request_ids: Sequence[str]) -> dict[str, str]:
        out = {}
        with self._lock:
            for rid in request_ids:
                if rid in self.failed:
                    self.failed.discard(rid)
                    out[rid] = PullState.FAILED.value
                    continue
                pull = self.pulls.get(rid)
                if pull is None:
                    continue
                state = self.transport.poll(pull)
                if state is not PullState.PENDING:
                    self.transport.finish(pull)
                    del self.pulls[rid]
                out[rid] = state.value
        return out

    def completed(self) -> list[str]:
        out = []
        while not self._done.empty():
            out.append(self._done.get_nowait())
        return out


@dataclass(frozen=True)
class _Token:
    local: PullHandle
    remote_bytes: int


class TPRunner(ModelRunner):
    """Runs a step on every rank: the batch goes to ranks 1.. while rank 0 computes."""

    def __init__(self, local: LocalRunner, actors: Sequence[Any]) -> None:
        self.local = local
        self.actors = list(actors)

    def run(self, batch: Sequence[SeqInput]) -> StepResult:
        refs = [a.run.remote(list(batch)) for a in self.actors]
        out = self.local.run(batch)
        ray.get(refs)
        return out


class GroupTransport(KVTransport):
    """NIXL over every rank: a handoff's sources are the ranks' agents; each rank reads its own
    heads; a pull is done when every rank's read is; a lease ends when every rank was read."""

    name = "nixl"

    def __init__(self, local: NixlTransport, actors: Sequence[Any]) -> None:
        super().__init__()
        self.local = local
        self.actors = list(actors)
        self._sources = (local.source(), *ray.get([a.source.remote() for a in self.actors]))
        self._reported: dict[str, set[int]] = {}  # request id -> ranks whose read was reported
        self._last_remote = 0.0
        self._pending: dict[str, dict[int, str]] = {}

    def sources(self) -> tuple[KVSource, ...]:
        return self._sources

    def completed(self) -> list[str]:
        for rid in self.local.completed():
            self._reported.setdefault(rid, set()).add(0)
        now = time.monotonic()
        if now - self._last_remote >= REMOTE_COMPLETIONS_PERIOD_S:
            self._last_remote = now
            for rank, got in enumerate(ray.get([a.completed.remote() for a in self.actors]), 1):
                for rid in got:
                    self._reported.setdefault(rid, set()).add(rank)
        done = [rid for rid, ranks in self._reported.items() if len(ranks) == len(self.actors) + 1]
        for rid in done:
            del self._reported[rid]
        self.counters.exports_completed += len(done)
        return done

    def start_pull(self, handoff: KVHandoff, local_blocks: Sequence[int]) -> PullHandle:
        remote = ray.get([a.start_pull.remote(handoff, list(local_blocks)) for a in self.actors])
        local = self.local.start_pull(handoff, local_blocks)
        self._pending[handoff.request_id] = {}
        self.counters.pulls_started += 1
        token = _Token(local, sum(remote))
        return PullHandle(handoff.request_id, local.nbytes + sum(remote), local.started_at, token)

    def poll(self, pull: PullHandle) -> PullState:
        return self.poll_many([pull])[0]

    def poll_many(self, pulls: Sequence[PullHandle]) -> list[PullState]:
        if not pulls:
            return []
        ids = [p.request_id for p in pulls]
        answers = ray.get([a.poll.remote(ids) for a in self.actors])
        out = []
        for p in pulls:
            states = self._pending.setdefault(p.request_id, {})
            for rank, answer in enumerate(answers, start=1):
                if p.request_id in answer:
                    states[rank] = answer[p.request_id]
            if states.get(0) != PullState.DONE.value:  # rank 0 polled until it lands, once
                states[0] = self.local.poll(p.token.local).value
            every_rank_done = all(
                states.get(r) == PullState.DONE.value for r in range(len(self.actors) + 1)
            )
            if PullState.FAILED.value in states.values():
                out.append(PullState.FAILED)
            elif every_rank_done:
                out.append(PullState.DONE)
                self.counters.pulls_done += 1
                self.counters.bytes_pulled += p.nbytes
                self.counters.seconds_pulling += time.perf_counter() - p.started_at
            else:
                out.append(PullState.PENDING)
        return out

    def finish(self, pull: PullHandle) -> None:
        self._pending.pop(pull.request_id, None)
        self.local.finish(pull.token.local)

    def progress(self) -> None:
        self.local.progress()

    def close(self) -> None:
        self.local.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def build_tp_shard(spec: ShardSpec) -> Shard:
    host = ray.util.get_node_ip_address()
    port = _free_port()
    pg = ray.util.get_current_placement_group()
    actors: list[Any] = []
    for rank in range(1, spec.tp_size):
        opts: dict[str, Any] = {"num_cpus": 0}
        if pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, rank)
        if spec.device.startswith("cuda"):
            opts["num_gpus"] = 1
        actor_cls = ray.remote(RankWorker)
        actors.append(actor_cls.options(**opts).remote(spec, rank, host, port))
    group = _process_group(spec, 0, host, port)  # waits for every rank to join
    tp = TPContext(0, spec.tp_size, group)
    ray.get([a.source.remote() for a in actors])  # every rank loaded and registered
    pool = _rank_pool(spec, 0)
    local = LocalRunner(spec.target.load(spec.device, tp), pool.tensor("target"), spec.block_size)
    draft = load_draft(spec, pool)
    rank0 = NixlTransport(pool, role=spec.role, rank=0, tp_size=spec.tp_size)
    transport = GroupTransport(rank0, actors)
    shard = Shard(TPRunner(local, actors), draft, pool, transport, spec.tp_size)
    shard.closers.append(lambda: _kill(actors))
    return shard


def _kill(actors: Sequence[Any]) -> None:
    for a in actors:
        ray.kill(a)
