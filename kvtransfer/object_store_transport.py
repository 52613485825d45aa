from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray
import torch

from kvtransfer.handoff import KVHandoff, KVSource
from kvtransfer.pool import KVPool
from kvtransfer.transport import KVTransferError, KVTransport, PullHandle, PullState


class ObjectStoreTransport(KVTransport):
    name = "object_store"

    def __init__(self, pool: KVPool, role: str = "worker") -> None:
        super().__init__()
        self.pool = pool
        self.agent_name = f"tandem-{role}-objects-{uuid.uuid4().hex[:12]}"
        self.version = time.time_ns()
        self._exported: queue.SimpleQueue[str] = queue.SimpleQueue()

    def sources(self) -> tuple[KVSource, ...]:
        return (KVSource(self.name, self.agent_name, self.version, b"", ()),)

    def export(self, request_id: str, blocks: Sequence[int], groups: Sequence[str]) -> Any:
        idx = torch.tensor(list(blocks), dtype=torch.long, device=self.pool.device)
        data = {g: self.pool.tensor(g).index_select(1, idx).cpu() for g in groups}
        self._exported.put(request_id)
        return ray.put(data)

    def completed(self) -> list[str]:
        done = []
        while not self._exported.empty():
            done.append(self._exported.get_nowait())
        self.counters.exports_completed += len(done)
        return done

    def start_pull(self, handoff: KVHandoff, local_blocks: Sequence[int]) -> PullHandle:
        if handoff.sources[0].transport != self.name or handoff.payload is None:
            raise KVTransferError(
                f"the handoff came over {handoff.sources[0].transport!r}, this side only has "
                f"{self.name!r}"
            )
        self.counters.pulls_started += 1
        ref = handoff.payload
        return PullHandle(handoff.request_id, 0, time.perf_counter(), (ref, tuple(local_blocks)))

    def poll(self, pull: PullHandle) -> PullState:
        ref, blocks = pull.token
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return PullState.PENDING
        try:
            data: dict[str, torch.Tensor] = ray.get(ref)
        except Exception:
            self.counters.fail("object_lost")
            return PullState.FAILED
        idx = torch.tensor(list(blocks), dtype=torch.long, device=self.pool.device)
        nbytes = 0
        for g, t in data.items():
            self.pool.tensor(g).index_copy_(1, idx, t.to(self.pool.device))
            nbytes += t.numel() * t.element_size()
        self.counters.pulls_done += 1
        self.counters.bytes_pulled += nbytes
        self.counters.seconds_pulling += time.perf_counter() - pull.started_at
        return PullState.DONE

    def release(self, pull: PullHandle) -> bool:
        return True
