"""KV intake: pulls of prompts' KV from prefill replicas, polled from the engine loop."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvtransfer.handoff import KVHandoff
from kvtransfer.metrics import TransferObserver
from kvtransfer.transport import KVTransferError, KVTransport, PullHandle, PullState
from models.request import Request, RequestStatus


@dataclass(frozen=True)
class Quarantined:
    """Blocks a read may still land in, held out of the pool until the transport releases it."""

    request_id: str
    blocks: tuple[int, ...]
    pull: PullHandle


class KVIntake:
    """Starts one pull per handoff into the request's blocks and reports when each lands.

    A pull whose lease ends before it starts (or before it completes) fails: the source may
    already have reused the blocks, so the bytes could belong to another prompt.

    Every pull that ends other than by landing (it failed on some rank, timed out, or its
    request was cancelled) is released at once where its reads have ended; where a read is
    still running (a read cannot be cancelled: ``KVTransport.release``), the request gives its
    blocks up to the quarantine and goes on without them (recomputed into other blocks, or
    ended). ``settled`` retries the release of quarantined pulls each step and hands back the
    blocks of those the transport has released on every rank: only then may they be reused.
    """

    def __init__(
        self,
        transport: KVTransport,
        margin_s: float,
        timeout_s: float = 10.0,
        observer: TransferObserver | None = None,
    ) -> None:
        self.transport = transport
        self.margin_s = margin_s
        self.timeout_s = timeout_s
        self.observer = observer or TransferObserver()
        # request id -> (request, handoff, pull, the time.monotonic() its lease ends)
        self.pending: dict[str, tuple[Request, KVHandoff, PullHandle, float]] = {}
        self.quarantine: list[Quarantined] = []  # reads that may still land in these blocks
        self.cancelled: dict[str, Request] = {}  # cancelled mid-pull, not yet handed back

    def start(self, req: Request, handoff: KVHandoff, lease_end: float) -> str | None:
        """Begin the pull; returns an error message instead when it cannot start.

        ``lease_end``: the ``time.monotonic()`` of this host by which the source's lease ends,
        counted from when the handoff arrived (``KVHandoff.lease_seconds``)."""
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
        """Requests whose pull ended since the last call (with their handoff), and an error
        message if it failed (the request's blocks may then have gone to the quarantine).

        A landed request has its counters set: the prompt is computed (for every shipped KV
        group) and the first token, sampled by prefill, is its first output.
        """
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
        """Release ``pull``; if a read of it may still land, its blocks leave ``req``."""
        if not self.transport.release(pull):
            self.quarantine.append(Quarantined(req.request_id, tuple(req.block_table), pull))
            req.block_table = []

    def _fail(self, cause: str) -> None:
        self.transport.counters.fail(cause)
        self.observer.failed(self.transport.name, cause)

    def cancel(self, request_id: str) -> bool:
        """Stop a pull's request (False: no pull of that id). It returns at once: the pull is
        released if its reads have ended, else its blocks are quarantined until they have;
        ``settled`` hands the request back either way, never blocking the engine thread."""
        entry = self.pending.pop(request_id, None)
        if entry is None:
            return False
        req, _, pull, _ = entry
        self._release(req, pull)
        self.cancelled[request_id] = req
        return True

    def settled(self) -> tuple[list[Request], list[int]]:
        """Cancelled requests to release (their blocks, if still theirs, free to reuse), and
        the blocks of quarantined pulls the transport has now released on every rank."""
        done, self.cancelled = list(self.cancelled.values()), {}
        blocks: list[int] = []
        if self.quarantine:
            held = []
            for q in self.quarantine:
                if self.transport.release(q.pull):
                    blocks.extend(q.blocks)
                else:
                    held.append(q)
            self.quarantine = held
        return done, blocks

    @property
    def quarantined_blocks(self) -> int:
        return sum(len(q.blocks) for q in self.quarantine)
