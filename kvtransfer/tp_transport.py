"""KV transfer over a tensor-parallel group: every rank pulls its own KV heads.

Each rank of a TP group holds its heads of the KV pool and a NIXL agent over them. A handoff's
sources are the prefill group's rank agents; each decode rank reads its heads from the matching
source rank (``kvtransfer.resharding`` when the TP sizes differ). ``RankPulls`` is one rank's
side: its transport, the pulls it has started and their outcomes, and a progress thread that
collects the exports read from it (leases to end). ``GroupTransport`` is rank 0's view of the
whole group behind the one ``KVTransport`` interface: a pull is done when every rank's read is,
and an export is complete when every rank was read. Ranks 1.. are remote (Ray actor handles
whose methods are ``RankPulls``'): the TP group (``runtime.tp_group``) owns them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from kvtransfer.handoff import KVHandoff, KVSource
from kvtransfer.nixl_transport import NixlTransport
from kvtransfer.transport import KVTransport, PullHandle, PullState

log = logging.getLogger(__name__)
REMOTE_COMPLETIONS_PERIOD_S = 0.01  # how often rank 0 asks the other ranks for completed exports


class RankPulls:
    """One TP rank's pulls and exports over its own NIXL transport (thread-safe)."""

    def __init__(self, transport: NixlTransport) -> None:
        self.transport = transport
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

    def start_pull(self, handoff: KVHandoff, blocks: Sequence[int]) -> int:
        """Start reading this rank's heads of ``handoff`` into ``blocks``; the bytes it reads
        (0 when it could not start: ``poll`` then reports the pull failed)."""
        with self._lock:
            try:
                pull = self.transport.start_pull(handoff, blocks)
            except Exception as e:  # KVTransferError, or anything else: this rank posted nothing
                log.warning("rank pull of %s failed: %s", handoff.request_id, e)
                self.failed.add(handoff.request_id)
                return 0
            self.pulls[handoff.request_id] = pull
            return pull.nbytes

    def poll(self, request_ids: Sequence[str]) -> dict[str, str]:
        """The ``PullState`` value of each pull that has one (released by ``release``)."""
        out = {}
        with self._lock:
            for rid in request_ids:
                if rid in self.failed:
                    out[rid] = PullState.FAILED.value
                    continue
                pull = self.pulls.get(rid)
                if pull is not None:
                    out[rid] = self.transport.poll(pull).value
        return out

    def release(self, request_ids: Sequence[str]) -> list[str]:
        """Release these requests' pulls on this rank where their reads have ended; the ids of
        those whose read is still running (to be released again later)."""
        held = []
        with self._lock:
            for rid in request_ids:
                self.failed.discard(rid)
                pull = self.pulls.get(rid)
                if pull is None:
                    continue
                if self.transport.release(pull):
                    del self.pulls[rid]
                else:
                    held.append(rid)
        return held

    def outstanding(self) -> int:
        """Pulls this rank still holds (a leak check: 0 when the engine is idle)."""
        with self._lock:
            return len(self.pulls) + len(self.failed)

    def completed(self) -> list[str]:
        """Request ids whose export from this rank was read since the last call."""
        out = []
        while not self._done.empty():
            out.append(self._done.get_nowait())
        return out


@dataclass
class _Token:
    local: PullHandle | None  # None: rank 0 could not post (the other ranks may have)
    remote_bytes: int
    held: set[int]  # ranks whose read may still land (not yet released)


class GroupTransport(KVTransport):
    """NIXL over every rank: a handoff's sources are the ranks' agents; each rank reads its own
    heads; a pull is done when every rank's read is; a lease ends when every rank was read."""

    name = "nixl"

    def __init__(self, local: NixlTransport, ranks: Sequence[Any]) -> None:
        """``local``: rank 0's transport; ``ranks``: handles of ranks 1.. (``RankPulls``)."""
        super().__init__()
        self.local = local
        self.actors = list(ranks)
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
        """Every rank posts its read. Once ranks 1.. have posted, a failure of rank 0's post
        does not raise: the others' reads are running into the blocks, so the pull is handed
        back failed and its blocks stay quarantined until every rank has released its read."""
        remote = ray.get([a.start_pull.remote(handoff, list(local_blocks)) for a in self.actors])
        ranks = set(range(len(self.actors) + 1))
        try:
            local: PullHandle | None = self.local.start_pull(handoff, local_blocks)
        except Exception as e:  # KVTransferError or not: rank 0 posted nothing
            log.warning("rank 0 could not post the read of %s: %s", handoff.request_id, e)
            local = None
            ranks.discard(0)
        self._pending[handoff.request_id] = {}
        self.counters.pulls_started += 1
        token = _Token(local, sum(remote), ranks)
        nbytes = (local.nbytes if local else 0) + sum(remote)
        return PullHandle(
            handoff.request_id, nbytes, time.perf_counter(), token, failed=local is None
        )

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
            if p.token.local is None:
                states[0] = PullState.FAILED.value
            elif states.get(0) != PullState.DONE.value:  # rank 0 polled until it lands, once
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

    def release(self, pull: PullHandle) -> bool:
        """Release the pull on every rank still holding it; True once no rank's read can land
        (a rank whose read is still running is asked again on the next call)."""
        token: _Token = pull.token
        remote = [r for r in token.held if r > 0]
        if remote:
            held = ray.get([self.actors[r - 1].release.remote([pull.request_id]) for r in remote])
            for r, ids in zip(remote, held, strict=True):
                if not ids:
                    token.held.discard(r)
        if 0 in token.held and (token.local is None or self.local.release(token.local)):
            token.held.discard(0)
        if token.held:
            return False
        self._pending.pop(pull.request_id, None)
        return True

    def outstanding(self) -> int:
        """Pulls the ranks 1.. still hold (a leak check)."""
        return sum(ray.get([a.outstanding.remote() for a in self.actors]))

    def progress(self) -> None:
        self.local.progress()

    def close(self) -> None:
        self.local.close()
