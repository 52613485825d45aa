"""KV transport over NIXL (UCX backend): one-sided READs of registered pool memory.

Each worker registers every group tensor of its pool with its NIXL agent once, and prepares a
descriptor list with one entry per chunk (block of one layer, K/V and head; see
``kvtransfer.pool``), so a handoff is described by block indices alone; NIXL merges the chunks of
consecutive blocks into larger reads. Decode issues one READ per handoff (``make_prepped_xfer``)
carrying the request id as a NIXL notification; when the read completes the source receives that
notification and ends the lease. The source must call :meth:`completed` often: without NIXL's own
progress thread (which busy-polls a core, ruinous on small CPU hosts, so it is off unless asked
for) that call is what lets UCX serve the peer's reads. Agent metadata travels inside the handoff
(a few hundred bytes) through Ray, so no extra port is opened; a peer whose ``(agent name,
version)`` changed is re-added before any read, so a restarted prefill replica is never read
through stale descriptors.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtransfer.handoff import KVHandoff, KVRegion, KVSource
from kvtransfer.pool import KVPool
from kvtransfer.transport import KVTransferError, KVTransport, PullHandle, PullState

log = logging.getLogger(__name__)
LOCAL = "NIXL_INIT_AGENT"


def _chunk_descs(regions: Sequence[KVRegion]) -> tuple[np.ndarray, dict[str, int]]:
    """One (address, length, device) row per chunk (block of one region) of every group, in
    ``[group][region][block]`` order; and the first row of each group."""
    rows, offsets, start = [], {}, 0
    for r in regions:
        n = r.num_regions * r.num_blocks
        addrs = r.base_address + np.arange(n, dtype=np.int64) * r.chunk_bytes
        rows.append(
            np.stack(
                [addrs, np.full_like(addrs, r.chunk_bytes), np.full_like(addrs, r.device_id)], 1
            )
        )
        offsets[r.group] = start
        start += n
    return np.concatenate(rows).astype(np.int64), offsets


def _chunk_indices(offset: int, region: KVRegion, blocks: Sequence[int]) -> np.ndarray:
    """Indices of ``blocks`` in every region of a group, region-major (runs stay adjacent)."""
    b = np.asarray(blocks, dtype=np.int64)
    regions = np.arange(region.num_regions, dtype=np.int64) * region.num_blocks
    return (offset + regions[:, None] + b[None, :]).reshape(-1)


@dataclass(frozen=True)
class _Peer:
    version: int
    prepped: Any
    offsets: dict[str, int]
    regions: dict[str, KVRegion]


class NixlTransport(KVTransport):
    name = "nixl"

    def __init__(
        self, pool: KVPool, role: str = "worker", rank: int = 0, progress_thread: bool = False
    ) -> None:
        super().__init__()
        from nixl._api import nixl_agent, nixl_agent_config

        self.rank = rank
        self.agent_name = f"tandem-{role}{rank}-{uuid.uuid4().hex[:12]}"
        self.version = time.time_ns()
        self.mem_type = pool.mem_type
        self.agent = nixl_agent(
            self.agent_name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        )
        tensors = list(pool.tensors.items())
        self._registrations = [self.agent.register_memory(t) for _, t in tensors]
        spec = pool.spec
        self.regions = tuple(
            KVRegion(
                group=name,
                base_address=t.data_ptr(),
                chunk_bytes=spec.group(name).chunk_bytes(spec.block_size),
                num_blocks=spec.num_blocks,
                num_regions=spec.group(name).num_regions,
                mem_type=pool.mem_type,
                device_id=pool.device_id,
            )
            for name, t in tensors
        )
        descs, self._offsets = _chunk_descs(self.regions)
        self._local = self.agent.prep_xfer_dlist(LOCAL, descs, self.mem_type)
        self._by_group = {r.group: r for r in self.regions}
        self._peers: dict[str, _Peer] = {}
        self._notices: list[str] = []
        self._metadata: bytes = self.agent.get_agent_metadata()
        log.info("NIXL agent %s registered %d bytes of KV", self.agent_name, pool.nbytes)

    def sources(self) -> tuple[KVSource, ...]:
        return (self.source(),)

    def source(self) -> KVSource:
        """This rank's pool."""
        return KVSource(
            transport=self.name,
            agent_name=self.agent_name,
            version=self.version,
            metadata=self._metadata,
            regions=self.regions,
        )

    def completed(self) -> list[str]:
        self.progress()
        done, self._notices = self._notices, []
        self.counters.exports_completed += len(done)
        return done

    def progress(self) -> None:
        """Drive UCX (serve peers' reads, send and receive notices); release retired reads."""
        notes = self.agent.get_new_notifs()
        self._notices.extend(m.decode() for msgs in notes.values() for m in msgs)

    def _peer(self, src: KVSource) -> _Peer:
        peer = self._peers.get(src.agent_name)
        if peer is not None and peer.version == src.version:
            return peer
        if peer is not None:  # same name, new incarnation: forget the old descriptors first
            self.agent.remove_remote_agent(src.agent_name)
            del self._peers[src.agent_name]
        self.agent.add_remote_agent(src.metadata)
        descs, offsets = _chunk_descs(src.regions)
        prepped = self.agent.prep_xfer_dlist(src.agent_name, descs, src.regions[0].mem_type)
        peer = _Peer(src.version, prepped, offsets, {r.group: r for r in src.regions})
        self._peers[src.agent_name] = peer
        return peer

    def start_pull(self, handoff: KVHandoff, local_blocks: Sequence[int]) -> PullHandle:
        if len(local_blocks) != len(handoff.block_ids):
            raise KVTransferError("local and remote block counts differ")
        if len(handoff.sources) <= self.rank:
            raise KVTransferError(
                f"the source has {len(handoff.sources)} ranks; rank {self.rank} has none to read"
            )
        peer = self._peer(handoff.sources[self.rank])
        remote_idx: list[np.ndarray] = []
        local_idx: list[np.ndarray] = []
        nbytes = 0
        for g in handoff.groups:
            if g not in self._by_group:
                continue  # a group another rank holds (the draft lives on rank 0)
            theirs, ours = peer.regions[g], self._by_group[g]
            if (theirs.chunk_bytes, theirs.num_regions) != (ours.chunk_bytes, ours.num_regions):
                raise KVTransferError(
                    f"group {g}: source blocks are {theirs.num_regions} x {theirs.chunk_bytes} "
                    f"bytes, local blocks {ours.num_regions} x {ours.chunk_bytes}"
                )
            remote_idx.append(_chunk_indices(peer.offsets[g], theirs, handoff.block_ids))
            local_idx.append(_chunk_indices(self._offsets[g], ours, local_blocks))
            nbytes += ours.block_bytes * len(local_blocks)
        handle = self.agent.make_prepped_xfer(
            "READ",
            self._local,
            np.concatenate(local_idx),
            peer.prepped,
            np.concatenate(remote_idx),
            notif_msg=handoff.request_id.encode(),
        )
        state = self.agent.transfer(handle)
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            self.counters.fail("post")
            raise KVTransferError(f"NIXL refused the read for {handoff.request_id}")
        self.counters.pulls_started += 1
        return PullHandle(handoff.request_id, nbytes, time.perf_counter(), handle)

    def poll(self, pull: PullHandle) -> PullState:
        self.progress()
        state = self.agent.check_xfer_state(pull.token)
        if state == "DONE":
            self.counters.pulls_done += 1
            self.counters.bytes_pulled += pull.nbytes
            self.counters.seconds_pulling += time.perf_counter() - pull.started_at
            return PullState.DONE
        if state == "ERR":
            self.counters.fail("read")
            return PullState.FAILED
        return PullState.PENDING

    def finish(self, pull: PullHandle) -> None:
        self.agent.release_xfer_handle(pull.token)

    def close(self) -> None:
        for reg in self._registrations:
            self.agent.deregister_memory(reg)
        self._registrations = []
