"""The queue of requests waiting for KV blocks, first come, first served."""

from __future__ import annotations

import math
import time
from collections import deque
from typing import NamedTuple

from decode.lease_clock import LeaseClock
from kvtransfer.allocator import BlockAllocator
from kvtransfer.handoff import KVHandoff
from models.request import Request, RequestStatus


class Queued(NamedTuple):
    req: Request
    handoff: KVHandoff | None  # None: its known tokens are computed here
    lease_end: float  # the time.monotonic() by which the source's lease ends


class Admission:
    def __init__(
        self,
        allocator: BlockAllocator,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_stalled_preemptions: int,
    ) -> None:
        self.allocator = allocator
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_stalled_preemptions = max_stalled_preemptions
        self.waiting: deque[Queued] = deque()
        self.lease_clock = LeaseClock()
        self.queue_times: deque[float] = deque()
        self._queued_at: dict[str, float] = {}

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def most_tokens(self, r: Request) -> int:
        return min(len(r.prompt_token_ids) + r.sampling.max_tokens, self.max_model_len) + 1

    def refusal(self, r: Request) -> str | None:
        most = self.most_tokens(r)
        if self.blocks_for(most) <= self.num_blocks:
            return None
        need = len(r.prompt_token_ids) + r.sampling.max_tokens + 1
        return (
            f"the prompt ({len(r.prompt_token_ids)} tokens) and max_tokens "
            f"({r.sampling.max_tokens}) need {need} tokens of KV; one sequence can hold "
            f"at most {self.num_blocks * self.block_size} in this pool "
            "(decode.num_blocks x kv.block_size)"
        )

    def add(self, req: Request, handoff: KVHandoff | None) -> None:
        req.status = RequestStatus.WAITING
        left = 0.0
        if handoff is not None:
            waited = self.lease_clock.transit(handoff.lease_stamped_at, time.time())
            left = max(0.0, handoff.lease_seconds - waited)
        lease_end = time.monotonic() + left
        self.waiting.append(Queued(req, handoff, lease_end))
        self._queued_at[req.request_id] = time.monotonic()

    def requeue(self, r: Request) -> None:
        self.allocator.free(r.block_table)
        r.block_table = []
        r.num_computed = r.num_draft_computed = 0
        r.kv_moves = ()
        r.status = RequestStatus.WAITING
        self.waiting.appendleft(Queued(r, None, 0.0))

    def put_back(self, q: Queued) -> None:
        """``next``'s head back where it was, its blocks freed (its handoff kept)."""
        self.allocator.free(q.req.block_table)
        q.req.block_table = []
        self.waiting.appendleft(q)
        self._queued_at.setdefault(q.req.request_id, time.monotonic())

    def remove(self, request_id: str) -> bool:
        self._queued_at.pop(request_id, None)
        for i, q in enumerate(self.waiting):
            if q.req.request_id == request_id:
                del self.waiting[i]
                return True
        return False

    def _need(self, q: Queued, others_running: bool) -> int:
        tokens = q.handoff.num_tokens if q.handoff else q.req.num_tokens
        need = self.blocks_for(tokens + 1)
        if q.req.stalled_preemptions > 1 and others_running:
            # stalled: recomputing it into the others' leftover room would only repeat that
            need = max(need, self.blocks_for(self.most_tokens(q.req)))
        return need

    def head_fits(self, others_running: bool) -> bool:
        return bool(self.waiting) and self.allocator.can_allocate(
            self._need(self.waiting[0], others_running)
        )

    def next(self, others_running: bool) -> Queued | None:
        """The head of the queue with its blocks allocated, or None if the pool lacks room."""
        if not self.waiting:
            return None
        q = self.waiting[0]
        need = self._need(q, others_running)
        if not self.allocator.can_allocate(need):
            return None
        self.waiting.popleft()
        queued = self._queued_at.pop(q.req.request_id, None)
        if queued is not None:
            self.queue_times.append(time.monotonic() - queued)
        q.req.block_table = self.allocator.allocate(need)
        return q

    def preempted(self, r: Request) -> str | None:
        """An error once ``max_stalled_preemptions`` in a row brought no new token, else None."""
        outputs = len(r.output_token_ids)
        stalled = outputs == r.outputs_at_preemption
        r.stalled_preemptions = r.stalled_preemptions + 1 if stalled else 0
        r.outputs_at_preemption = outputs
        n = r.stalled_preemptions
        if n < self.max_stalled_preemptions:
            return None
        return (
            f"preempted {n} time{'s' * (n > 1)} in a row without producing a token "
            f"(decode.max_stalled_preemptions): the KV pool ({self.num_blocks} blocks "
            f"of {self.block_size} tokens, decode.num_blocks) cannot hold its "
            f"{r.num_tokens} tokens beside the running requests"
        )

    def overdue(self, now: float, max_wait_s: float) -> list[Request]:
        """Take the requests that have waited longer than ``max_wait_s`` since they arrived
        (a preempted one at the head is bounded by ``max_stalled_preemptions`` instead)."""
        late = [
            q.req
            for q in self.waiting
            if now - self._queued_at.get(q.req.request_id, now) > max_wait_s
        ]
        for r in late:
            self.remove(r.request_id)
        return late

    def take_queue_times(self) -> list[float]:
        """Queue waits of requests admitted since the last call (safe from another thread)."""
        out = []
        while self.queue_times:
            out.append(self.queue_times.popleft())
        return out
