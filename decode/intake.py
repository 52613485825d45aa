"""KV intake: pulls of prompts' KV from prefill replicas, polled from the engine loop."""

from __future__ import annotations

import time

from kvtransfer.handoff import KVHandoff
from kvtransfer.metrics import TransferObserver
from kvtransfer.transport import KVTransferError, KVTransport, PullHandle, PullState
from models.request import Request, RequestStatus


class KVIntake:
    """Starts one pull per handoff into the request's blocks and reports when each lands.

    A pull whose lease ends before it starts (or before it completes) fails: the source may
    already have reused the blocks, so the bytes could belong to another prompt.
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
        # cancelled requests whose read may still be landing in their blocks
        self.cancelled: dict[str, tuple[Request, PullHandle]] = {}

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
        message if it failed.

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
            self.transport.finish(pull)
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

    def _fail(self, cause: str) -> None:
        self.transport.counters.fail(cause)
        self.observer.failed(self.transport.name, cause)

    def cancel(self, request_id: str) -> bool:
        """Stop a pull's request (False: no pull of that id). It returns at once: the read may
        still be landing in the request's blocks, so they stay quarantined until the transport
        says it ended (``settled``), never blocking the engine thread meanwhile."""
        entry = self.pending.pop(request_id, None)
        if entry is None:
            return False
        req, _, pull, _ = entry
        self.cancelled[request_id] = (req, pull)
        return True

    def settled(self) -> list[Request]:
        """Cancelled requests whose read has ended (done or failed): their blocks may be reused."""
        if not self.cancelled:
            return []
        entries = list(self.cancelled.items())
        states = self.transport.poll_many([pull for _, (_, pull) in entries])
        out = []
        for (rid, (req, pull)), state in zip(entries, states, strict=True):
            if state is PullState.PENDING:
                continue
            del self.cancelled[rid]
            self.transport.finish(pull)
            out.append(req)
        return out
