from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError

from kvtransfer.handoff import KVHandoff, KVSource
from kvtransfer.nixl_transport import NixlTransport
from kvtransfer.transport import KVTransport, PullHandle, PullState

log = logging.getLogger(__name__)
REMOTE_COMPLETIONS_PERIOD_S = 0.01


class RankPulls:
    def __init__(self, transport: NixlTransport) -> None:
        self.transport = transport
        self.pulls: dict[str, PullHandle] = {}
        self.failed: set[str] = set()
        self._done: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._lock = threading.Lock()
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
        with self._lock:
            try:
                pull = self.transport.start_pull(handoff, blocks)
            except Exception as e:
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
                    out[rid] = PullState.FAILED.value
                    continue
                pull = self.pulls.get(rid)
                if pull is not None:
                    out[rid] = self.transport.poll(pull).value
        return out

    def release(self, request_ids: Sequence[str]) -> list[str]:
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
        with self._lock:
            return len(self.pulls) + len(self.failed)

    def completed(self) -> list[str]:
        out = []
        while not self._done.empty():
            out.append(self._done.get_nowait())
        return out


@dataclass
class _Token:
    local: PullHandle | None
    remote_bytes: int
    held: set[int]


RANK_CALL_TIMEOUT_S = 30.0


class RankTimeoutError(RuntimeError):
    """A TP rank did not answer in time: the replica is wedged, not one request."""


def _ranks(refs: list[Any], call: str, timeout_s: float = RANK_CALL_TIMEOUT_S) -> list[Any]:
    try:
        out: list[Any] = ray.get(refs, timeout=timeout_s)
    except GetTimeoutError as e:
        raise RankTimeoutError(f"a TP rank did not answer {call} within {timeout_s:g} s") from e
    return out


class GroupTransport(KVTransport):
    name = "nixl"

    def __init__(
        self,
        local: NixlTransport,
        ranks: Sequence[Any],
        call_timeout_s: float = RANK_CALL_TIMEOUT_S,
    ) -> None:
        super().__init__()
        self.local = local
        self.actors = list(ranks)
        self.call_timeout_s = call_timeout_s  # a rank silent this long wedges the replica
        self._sources = (
            local.source(),
            *_ranks([a.source.remote() for a in self.actors], "source"),
        )
        self._reported: dict[str, set[int]] = {}
        self._last_remote = 0.0
        self._pending: dict[str, dict[int, str]] = {}

    @property
    def wire(self) -> str:
        return self.local.wire

    def _call(self, refs: list[Any], call: str) -> list[Any]:
        return _ranks(refs, call, self.call_timeout_s)

    def sources(self) -> tuple[KVSource, ...]:
        return self._sources

    def completed(self) -> list[str]:
        for rid in self.local.completed():
            self._reported.setdefault(rid, set()).add(0)
        now = time.monotonic()
        if now - self._last_remote >= REMOTE_COMPLETIONS_PERIOD_S:
            self._last_remote = now
            for rank, got in enumerate(
                self._call([a.completed.remote() for a in self.actors], "completed"), 1
            ):
                for rid in got:
                    self._reported.setdefault(rid, set()).add(rank)
        done = [rid for rid, ranks in self._reported.items() if len(ranks) == len(self.actors) + 1]
        for rid in done:
            del self._reported[rid]
        self.counters.exports_completed += len(done)
        return done

    def start_pull(self, handoff: KVHandoff, local_blocks: Sequence[int]) -> PullHandle:
        """If rank 0 cannot post after the others did, the pull comes back failed, not raised."""
        remote = self._call(
            [a.start_pull.remote(handoff, list(local_blocks)) for a in self.actors], "start_pull"
        )
        ranks = set(range(len(self.actors) + 1))
        try:
            local: PullHandle | None = self.local.start_pull(handoff, local_blocks)
        except Exception as e:
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
        answers = self._call([a.poll.remote(ids) for a in self.actors], "poll")
        out = []
        for p in pulls:
            states = self._pending.setdefault(p.request_id, {})
            for rank, answer in enumerate(answers, start=1):
                if p.request_id in answer:
                    states[rank] = answer[p.request_id]
            if p.token.local is None:
                states[0] = PullState.FAILED.value
            elif states.get(0) != PullState.DONE.value:
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
        token: _Token = pull.token
        remote = [r for r in token.held if r > 0]
        if remote:
            refs = [self.actors[r - 1].release.remote([pull.request_id]) for r in remote]
            held = self._call(refs, "release")
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
        return sum(self._call([a.outstanding.remote() for a in self.actors], "outstanding"))

    def progress(self) -> None:
        self.local.progress()

    def close(self) -> None:
        self.local.close()
