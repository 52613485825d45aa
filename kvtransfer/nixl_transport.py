"""KV transport over NIXL (UCX backend): one-sided READs of registered pool memory.

Each worker registers every group tensor of its pool with its NIXL agent once, and prepares a
descriptor list with one entry per block per group, so a handoff is described by block indices
alone. Decode issues one READ per handoff (``make_prepped_xfer``) carrying the request id as a NIXL
notification; when the read completes the source receives that notification and ends the lease. The
source must call :meth:`completed` often: without NIXL's own progress thread (which busy-polls a
core, ruinous on small CPU hosts, so it is off unless asked for) that call is what lets UCX serve
the peer's reads. Agent metadata travels inside the handoff (a few hundred bytes) through Ray, so
no extra port is opened; a peer whose ``(agent name, version)`` changed is re-added before any
read, so a restarted prefill replica is never read through stale descriptors.
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


def _block_descs(regions: Sequence[KVRegion]) -> tuple[np.ndarray, dict[str, int]]:
    """One (address, length, device) row per block per region; and each region's first row."""
    rows, offsets, start = [], {}, 0
    for r in regions:
        addrs = r.base_address + np.arange(r.num_blocks, dtype=np.int64) * r.block_bytes
        rows.append(
            np.stack(
                [addrs, np.full_like(addrs, r.block_bytes), np.full_like(addrs, r.device_id)], 1
            )
        )
        offsets[r.group] = start
        start += r.num_blocks
    return np.concatenate(rows).astype(np.int64), offsets


@dataclass(frozen=True)
class _Peer:
    version: int
    prepped: Any
    offsets: dict[str, int]
    block_bytes: dict[str, int]


class NixlTransport(KVTransport):
    name = "nixl"

    def __init__(self, pool: KVPool, role: str = "worker", progress_thread: bool = False) -> None:
        super().__init__()
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent_name = f"tandem-{role}-{uuid.uuid4().hex[:12]}"
        self.version = time.time_ns()
        self.mem_type = pool.mem_type
        self.agent = nixl_agent(
            self.agent_name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        )
        tensors = list(pool.tensors.items())
        self._registrations = [self.agent.register_memory(t) for _, t in tensors]
        self.regions = tuple(
            KVRegion(
                group=name,
                base_address=t.data_ptr(),
                block_bytes=t[0].numel() * t.element_size(),
                num_blocks=t.shape[0],
                mem_type=pool.mem_type,
                device_id=pool.device_id,
            )
            for name, t in tensors
        )
        descs, self._offsets = _block_descs(self.regions)
        self._local = self.agent.prep_xfer_dlist(LOCAL, descs, self.mem_type)
        self._block_bytes = {r.group: r.block_bytes for r in self.regions}
        self._peers: dict[str, _Peer] = {}
        self._metadata: bytes = self.agent.get_agent_metadata()
        log.info("NIXL agent %s registered %d bytes of KV", self.agent_name, pool.nbytes)

    def source(self) -> KVSource:
        return KVSource(
            transport=self.name,
            agent_name=self.agent_name,
            version=self.version,
            metadata=self._metadata,
            regions=self.regions,
        )

    def completed(self) -> list[str]:
        done = [m.decode() for msgs in self.agent.get_new_notifs().values() for m in msgs]
        self.counters.exports_completed += len(done)
        return done

    def _peer(self, src: KVSource) -> _Peer:
        peer = self._peers.get(src.agent_name)
        if peer is not None and peer.version == src.version:
            return peer
        if peer is not None:  # same name, new incarnation: forget the old descriptors first
            self.agent.remove_remote_agent(src.agent_name)
            del self._peers[src.agent_name]
        self.agent.add_remote_agent(src.metadata)
        descs, offsets = _block_descs(src.regions)
        prepped = self.agent.prep_xfer_dlist(src.agent_name, descs, src.regions[0].mem_type)
        peer = _Peer(src.version, prepped, offsets, {r.group: r.block_bytes for r in src.regions})
        self._peers[src.agent_name] = peer
        return peer

    def start_pull(self, handoff: KVHandoff, local_blocks: Sequence[int]) -> PullHandle:
        if len(local_blocks) != len(handoff.block_ids):
            raise KVTransferError("local and remote block counts differ")
        peer = self._peer(handoff.source)
        remote_idx: list[int] = []
        local_idx: list[int] = []
        nbytes = 0
        for g in handoff.groups:
            if peer.block_bytes[g] != self._block_bytes[g]:
                raise KVTransferError(
                    f"group {g}: source blocks are {peer.block_bytes[g]} bytes, "
                    f"local blocks {self._block_bytes[g]}"
                )
            remote_idx.extend(peer.offsets[g] + b for b in handoff.block_ids)
            local_idx.extend(self._offsets[g] + b for b in local_blocks)
            nbytes += self._block_bytes[g] * len(local_blocks)
        handle = self.agent.make_prepped_xfer(
            "READ",
            self._local,
            np.asarray(local_idx, dtype=np.int64),
            peer.prepped,
            np.asarray(remote_idx, dtype=np.int64),
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
