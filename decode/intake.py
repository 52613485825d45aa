"""Pulls of prompts' KV from prefill replicas, polled from the engine loop."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvtransfer.handoff import KVHandoff
from kvtransfer.metrics import TransferObserver
from kvtransfer.transport import KVTransferError, KVTransport, PullHandle, PullState
from models.request import Request, RequestStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Quarantined:
    request_id: str
    blocks: tuple[int, ...]
    pull: PullHandle
    since: float  # time.monotonic()


class KVIntake:
    """A pull past its lease fails (the source may reuse the blocks). One ending unlanded while a
    read still runs (reads cannot be cancelled) quarantines its blocks until it is released, or
    for ``quarantine_s`` at most: then its blocks are retired, never reused (counted)."""

    def __init__(
        self,
        transport: KVTransport,
        margin_s: float,
        timeout_s: float = 10.0,
        observer: TransferObserver | None = None,
        quarantine_s: float = 60.0,
    ) -> None:
        self.transport = transport
        self.margin_s = margin_s
        self.timeout_s = timeout_s
        self.quarantine_s = quarantine_s
        self.retired_blocks = 0
        self.observer = observer or TransferObserver()
        # request id -> (request, handoff, pull, the time.monotonic() its lease ends)
        self.pending: dict[str, tuple[Request, KVHandoff, PullHandle, float]] = {}
        self.quarantine: list[Quarantined] = []
        self.cancelled: dict[str, Request] = {}

    def start(self, req: Request, handoff: KVHandoff, lease_end: float) -> str | None:
        """Begin the pull, or return why it cannot; ``lease_end``: this host's monotonic clock."""
        if lease_end - time.monotonic() < self.margin_s:
            self._fail("lease_expired")
            return "the prefill lease expired before decode could pull"
        try:
            pull = self.transport.start_pull(handoff, req.block_table[: len(handoff.block_ids)])
        except KVTransferError as e:
            self.observer.failed(self.transport.name, "post")
            return f"KV transfer failed: {e}"
        req.status = RequestStatus.WAITING_FOR_KV
        self.pending[req.request_id] = (req, handoff, pull, lease_end)
        return None

    def poll(self) -> list[tuple[Request, KVHandoff, str | None]]:
        out: list[tuple[Request, KVHandoff, str | None]] = []
        entries = list(self.pending.items())
        states = self.transport.poll_many([pull for _, (_, _, pull, _) in entries])
        now = time.perf_counter()
        for (rid, (req, handoff, pull, lease_end)), polled in zip(entries, states, strict=True):
            state = polled
            if state is PullState.PENDING and now - pull.started_at > self.timeout_s:
                self._fail("timeout")
                state = PullState.FAILED
            if state is PullState.PENDING:
                continue
            del self.pending[rid]
            self._release(req, pull)
            if state is PullState.FAILED:
                self.observer.failed(self.transport.name, "read")
                out.append((req, handoff, "KV transfer failed"))
            elif time.monotonic() > lease_end:
                self._fail("lease_expired")
                out.append((req, handoff, "the prefill lease expired during the pull"))
            else:
                self.observer.pulled(self.transport.name, pull.nbytes, now - pull.started_at)
                req.num_computed = handoff.num_tokens
                req.num_draft_computed = handoff.draft_computed
                req.output_token_ids = [handoff.first_token]
                req.acceptance_probe = req.acceptance_estimate = handoff.acceptance_probe
                req.status = RequestStatus.RUNNING
                out.append((req, handoff, None))
        return out

    def _release(self, req: Request, pull: PullHandle) -> None:
        if not self.transport.release(pull):
            held = Quarantined(req.request_id, tuple(req.block_table), pull, time.monotonic())
            self.quarantine.append(held)
            req.block_table = []

    def _fail(self, cause: str) -> None:
        self.transport.counters.fail(cause)
        self.observer.failed(self.transport.name, cause)

    def cancel(self, request_id: str) -> bool:
        """Stop a pull's request, never blocking (False: no such pull); ``settled`` returns it."""
        entry = self.pending.pop(request_id, None)
        if entry is None:
            return False
        req, _, pull, _ = entry
        self._release(req, pull)
        self.cancelled[request_id] = req
        return True

    def settled(self) -> tuple[list[Request], list[int]]:
        done, self.cancelled = list(self.cancelled.values()), {}
        blocks: list[int] = []
        if self.quarantine:
            held = []
            now = time.monotonic()
            for q in self.quarantine:
                if self.transport.release(q.pull):
                    blocks.extend(q.blocks)
                elif now - q.since > self.quarantine_s:
                    log.error(
                        "a read into %d blocks for %s has not ended in %.0f s: the blocks are "
                        "retired (never reused)",
                        len(q.blocks),
                        q.request_id,
                        self.quarantine_s,
                    )
                    self.retired_blocks += len(q.blocks)
                else:
                    held.append(q)
            self.quarantine = held
        return done, blocks

    @property
    def quarantined_blocks(self) -> int:
        return sum(len(q.blocks) for q in self.quarantine)
