"""KV transport over NIXL (UCX): one-sided READs of registered pool memory, each carrying a notice
that ends the source's lease (docs/structure.md, "KV blocks and their handoff")."""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtransfer.handoff import KVHandoff, KVRegion, KVSource
from kvtransfer.pool import KVPool
from kvtransfer.read_plan import (
    Descriptors,
    Slice,
    SourceRead,
    plan_reads,
    prepared_descs,
)
from kvtransfer.transport import KVTransferError, KVTransport, PullHandle, PullState

log = logging.getLogger(__name__)
UNKNOWN = "UNKNOWN"
# longer than any read can run (pull timeout, then quarantine): a peer idle this long has none
PEER_IDLE_S = 600.0
PARTIAL_TTL_S = 600.0
ENDED = ("DONE", "ERR")  # the states that prove a READ no longer writes into its blocks
LOCAL = "NIXL_INIT_AGENT"


@dataclass
class _Peer:
    version: int
    regions: dict[str, KVRegion]
    lists: dict[tuple[Slice, ...], Any]  # prepared descriptor lists, per read shape
    used_at: float = 0.0  # time.monotonic() of the last read posted from it


@dataclass
class _Partial:
    seen: int
    since: float  # time.monotonic() of the first notice


class NixlTransport(KVTransport):
    name = "nixl"

    def __init__(
        self,
        pool: KVPool,
        role: str = "worker",
        rank: int = 0,
        tp_size: int = 1,
        progress_thread: bool = False,
        backend: str = "UCX",
    ) -> None:
        super().__init__()
        from nixl._api import nixl_agent, nixl_agent_config

        self.backend = backend  # NIXL's plugin, chosen by kv.fabric (kvtransfer/fabric.py)
        self.rank = rank
        self.tp_size = tp_size
        self._partial: dict[str, _Partial] = {}  # source side: reads reported per request
        self.malformed_notices = 0
        self.agent_name = f"tandem-{role}{rank}-{uuid.uuid4().hex[:12]}"
        self.version = time.time_ns()
        self.mem_type = pool.mem_type
        if pool.mem_type == "VRAM" and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in os.environ:
            os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "y"  # before the agent's UCX reads it
            log.info("UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y: VRAM reads may take cuda_ipc without NVLink")
        self.agent = nixl_agent(
            self.agent_name,
            nixl_agent_config(enable_prog_thread=progress_thread, backends=[backend]),
        )
        tensors = [(name, pool.memory(name)) for name in pool.tensors]
        self._registrations = [self.agent.register_memory(t) for _, t in tensors]
        spec = pool.spec
        self.regions = tuple(
            KVRegion(
                group=name,
                base_address=t.data_ptr(),
                chunk_bytes=spec.group(name).chunk_bytes(spec.block_size),
                num_blocks=spec.num_blocks,
                num_layers=spec.group(name).num_layers,
                num_heads=spec.group(name).num_kv_heads,
                mem_type=pool.mem_type,
                device_id=pool.device_id,
            )
            for name, t in tensors
        )
        self._by_group = {r.group: r for r in self.regions}
        self._local_lists: dict[tuple[Slice, ...], Any] = {}
        self._peers: dict[str, _Peer] = {}
        self.peers_evicted = 0
        self._notices: list[str] = []
        self._metadata: bytes = self.agent.get_agent_metadata()
        log.info("NIXL agent %s registered %d bytes of KV", self.agent_name, pool.nbytes)

    @property
    def wire(self) -> str:
        return f"nixl/{self.backend.lower()}"

    def sources(self) -> tuple[KVSource, ...]:
        return (self.source(),)

    def source(self) -> KVSource:
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
        """Drive UCX; a notice ``"<request id>|<readers>"`` ends a lease once that many read.
        A malformed notice is logged and counted, the rest of its batch still read; a request
        some of whose readers never reported is forgotten after ``PARTIAL_TTL_S`` (its lease
        ended by expiry long before)."""
        now = time.monotonic()
        for msgs in self.agent.get_new_notifs().values():
            for raw in msgs:
                try:
                    rid, _, expected = raw.decode().partition("|")
                    readers = int(expected or 1)
                except ValueError:  # UnicodeDecodeError included
                    self.malformed_notices += 1
                    log.warning("malformed NIXL notice %r ignored", raw[:80])
                    continue
                part = self._partial.setdefault(rid, _Partial(0, now))
                part.seen += 1
                if part.seen >= readers:
                    del self._partial[rid]
                    self._notices.append(rid)
        stale = [rid for rid, part in self._partial.items() if now - part.since > PARTIAL_TTL_S]
        for rid in stale:
            del self._partial[rid]

    def _peer(self, src: KVSource) -> _Peer:
        now = time.monotonic()
        peer = self._peers.get(src.agent_name)
        if peer is not None and peer.version == src.version:
            peer.used_at = now
            return peer
        if peer is not None:  # same name, new incarnation: forget the old descriptors first
            self._evict(src.agent_name)
        for name in [n for n, p in self._peers.items() if now - p.used_at > PEER_IDLE_S]:
            self._evict(name)  # a source gone (restarted under a new name, scaled down)
        self.agent.add_remote_agent(src.metadata)
        peer = _Peer(src.version, {r.group: r for r in src.regions}, {}, now)
        self._peers[src.agent_name] = peer
        return peer

    def _evict(self, name: str) -> None:
        peer = self._peers.pop(name)
        for dlist in peer.lists.values():
            with contextlib.suppress(Exception):
                self.agent.release_dlist_handle(dlist)
        try:
            self.agent.remove_remote_agent(name)
        except Exception as e:  # already gone on NIXL's side
            log.warning("forgetting NIXL peer %s: %s", name, e)
        self.peers_evicted += 1

    def _reach(self, handoff: KVHandoff, src_rank: int) -> None:
        try:
            self._peer(handoff.sources[src_rank])
        except Exception as e:  # bad or stale agent metadata: nothing posted yet
            self.counters.fail("post")
            raise KVTransferError(
                f"cannot reach source rank {src_rank} of {handoff.request_id}: {e}"
            ) from e

    def _lists(
        self, src: KVSource, theirs: tuple[Slice, ...], ours: tuple[Slice, ...]
    ) -> tuple[Any, Any]:
        peer = self._peers[src.agent_name]
        remote = peer.lists.get(theirs)
        if remote is None:
            descs = prepared_descs(peer.regions, theirs)
            remote = self.agent.prep_xfer_dlist(src.agent_name, descs, src.regions[0].mem_type)
            peer.lists[theirs] = remote
        local = self._local_lists.get(ours)
        if local is None:
            descs = prepared_descs(self._by_group, ours)
            local = self.agent.prep_xfer_dlist(LOCAL, descs, self.mem_type)
            self._local_lists[ours] = local
        return remote, local

    def start_pull(self, handoff: KVHandoff, local_blocks: Sequence[int]) -> PullHandle:
        """One READ per source rank holding heads this rank owns, each carrying its notice."""
        reads = plan_reads(handoff, local_blocks, self._by_group, self.rank, self.tp_size)
        for read in reads:
            self._reach(handoff, read.src_rank)
        handles: list[Any] = []
        for read in reads:
            handle = None
            try:
                handle = self._xfer(handoff, read)
                posted = self.agent.transfer(handle)
                why = "NIXL refused the read" if posted == "ERR" else None
            except Exception as e:  # e.g. NIXL_ERR_REMOTE_DISCONNECT: the source just died
                why = f"NIXL could not post the read ({e})"
            if why is not None:
                return self._post_failed(handoff, why, handle, handles)
            handles.append(handle)
        self.counters.pulls_started += 1
        nbytes = sum(read.nbytes for read in reads)
        return PullHandle(handoff.request_id, nbytes, time.perf_counter(), handles)

    def _xfer(self, handoff: KVHandoff, read: SourceRead) -> Any:
        src = handoff.sources[read.src_rank]
        notice = f"{handoff.request_id}|{read.readers}".encode()
        if read.kind is Descriptors.RUNS:
            return self.agent.initialize_xfer(
                "READ",
                self.agent.get_xfer_descs(read.local_descs, self.mem_type),
                self.agent.get_xfer_descs(read.remote_descs, src.regions[0].mem_type),
                src.agent_name,
                notice,
            )
        remote, local = self._lists(src, read.remote, read.local)
        return self.agent.make_prepped_xfer(
            "READ", local, read.local_descs, remote, read.remote_descs, notif_msg=notice
        )

    def _post_failed(
        self, handoff: KVHandoff, why: str, handle: Any, posted: list[Any]
    ) -> PullHandle:
        """Raise if no READ was posted, else hand the posted ones back as a failed pull."""
        if handle is not None:  # this read never ran
            self._release([handle])
        self.counters.fail("post")
        if not posted:
            raise KVTransferError(f"{why} for {handoff.request_id}")
        log.warning("%s for %s; earlier reads still run", why, handoff.request_id)
        return PullHandle(handoff.request_id, 0, time.perf_counter(), posted, failed=True)

    def _xfer_state(self, handle: Any, request_id: str) -> str:
        """NIXL's state of one READ: ``ERR`` when its source disconnected (nothing more can
        land), ``UNKNOWN`` when asking raised anything else, which does not prove the read
        ended, so its blocks stay held."""
        try:
            state: str = self.agent.check_xfer_state(handle)
        except Exception as e:
            if type(e).__name__ == "nixlRemoteDisconnectError":  # the source died: nothing lands
                log.warning("NIXL read for %s failed: %s", request_id, e)
                return "ERR"
            log.warning("NIXL read for %s: its state is unknown: %s", request_id, e)
            self.counters.state_unknown += 1
            return UNKNOWN
        return state

    def poll(self, pull: PullHandle) -> PullState:
        self.progress()
        if pull.failed:
            return PullState.FAILED
        states = [self._xfer_state(h, pull.request_id) for h in pull.token]
        failed = "ERR" in states or UNKNOWN in states
        state = "ERR" if failed else ("DONE" if all(x == "DONE" for x in states) else "")
        if state == "DONE":
            self.counters.pulls_done += 1
            self.counters.bytes_pulled += pull.nbytes
            self.counters.seconds_pulling += time.perf_counter() - pull.started_at
            return PullState.DONE
        if state == "ERR":
            self.counters.fail("read")
            return PullState.FAILED
        return PullState.PENDING

    def release(self, pull: PullHandle) -> bool:
        """Release each ended READ of ``pull``; a running one stays in its token for a later call
        (releasing it would not cancel it: the read still lands)."""
        left: list[Any] = pull.token
        running = [h for h in left if self._xfer_state(h, pull.request_id) not in ENDED]
        self._release([h for h in left if all(h is not r for r in running)])
        left[:] = running
        return not left

    def _release(self, handles: Sequence[Any]) -> None:
        for handle in handles:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as e:  # a handle of a dead peer's read: nothing left to free
                log.warning("releasing a NIXL read handle: %s", e)

    def close(self) -> None:
        for reg in self._registrations:
            self.agent.deregister_memory(reg)
        self._registrations = []
