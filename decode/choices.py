"""A request's further choices (``n`` > 1): sequences sharing its full prompt blocks, copy-on-write
by reference count (none writes a shared block), that compute the last partial block themselves."""

from __future__ import annotations

from collections.abc import Mapping

from kvtransfer.allocator import BlockAllocator
from models.request import Request, RequestStatus


class Choices:
    def __init__(self, allocator: BlockAllocator, block_size: int, drafter_kv: bool) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.drafter_kv = drafter_kv
        self._held: dict[str, list[Request]] = {}
        # requests whose own output ended before decode: they only bring their choices' KV
        self._sources: set[str] = set()

    def hold(self, req: Request, source: bool) -> None:
        self._held[req.request_id] = req.choices()
        if source:
            self._sources.add(req.request_id)

    def drop(self, request_id: str) -> list[Request]:
        self._sources.discard(request_id)
        return self._held.pop(request_id, [])

    def is_source(self, request_id: str) -> bool:
        return request_id in self._sources

    def ready(self, running: Mapping[str, Request]) -> list[Request]:
        return [running[rid] for rid in self._held if self._prompt_shared(running.get(rid))]

    def start(self, r: Request) -> list[Request]:
        self._sources.discard(r.request_id)
        choices = self._held.pop(r.request_id, [])
        if not choices:
            return []
        shared = self._shared_prefix(r)
        blocks = r.block_table[: shared // self.block_size]
        for c in choices:
            self.allocator.fork(blocks)
            c.block_table = list(blocks)
            c.num_computed = c.num_draft_computed = shared
            c.acceptance_probe = c.acceptance_estimate = r.acceptance_probe
            c.status = RequestStatus.RUNNING
        return choices

    def _shared_prefix(self, r: Request) -> int:
        """Whole blocks every KV group has computed, short of the prompt's last token (a choice
        computes it to sample its own first token; an EAGLE head's slot t holds token t + 1)."""
        done = r.num_computed
        if self.drafter_kv:
            done = min(done, r.num_draft_computed)
        done = min(done, len(r.prompt_token_ids) - 1, len(r.block_table) * self.block_size)
        return done // self.block_size * self.block_size

    def _prompt_shared(self, r: Request | None) -> bool:
        """Once every KV group holds its shareable part, or a step later (a laggard shares less)."""
        if r is None or r.num_computed < len(r.prompt_token_ids):
            return False
        most = (len(r.prompt_token_ids) - 1) // self.block_size * self.block_size
        return self._shared_prefix(r) == most or len(r.output_token_ids) > 1
