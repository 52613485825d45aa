"""KV transport over NIXL (UCX backend): one-sided READs of registered pool memory.

Each worker registers every group tensor of its pool with its NIXL agent once. A read is
described by block indices into *prepared descriptor lists* (``make_prepped_xfer``): one
descriptor per block (every layer of it: the pool is block-major, ``kvtransfer.pool``) when a
rank reads every head of a group from a source of the same TP size, and one per (block, layer,
K/V) over the run of heads it owns otherwise; each list is prepared once per peer and per head
run, on first use. Where a read of every head has blocks consecutive on both sides (a prompt's
blocks, taken from a pool that is not fragmented, usually are), each run of them is one
descriptor instead, built for that read (``initialize_xfer``): a long prompt's handoff is then
a few large descriptors, which UCX moves faster than many small ones.
Decode issues one READ per source rank it reads from (``make_prepped_xfer``)
carrying the request id as a NIXL notification; when the read completes the source receives that
notification and ends the lease. The source must call :meth:`completed` often: without NIXL's own
progress thread (which busy-polls a core, ruinous on small CPU hosts, so it is off unless asked
for) that call is what lets UCX serve the peer's reads. Agent metadata travels inside the handoff
(a few hundred bytes) through Ray, so no extra port is opened; a peer whose ``(agent name,
version)`` changed is re-added before any read, so a restarted prefill replica is never read
through stale descriptors.

**VRAM pools.** UCX turns a READ of another process's GPU memory into ``cuda_ipc`` zero-copy
gets only where it detects NVLink between the GPUs (its ``CUDA_IPC_ENABLE_GET_ZCOPY=auto``);
elsewhere, e.g. two processes on one GPU, or PCIe-only GPUs, it falls back to "software
emulation" through the host over TCP, far slower than a copy (``BENCHMARKS.md``, GPU
section). A worker with a VRAM pool therefore sets ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` before
its agent starts, unless the operator set it, and logs it.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtransfer.handoff import KVHandoff, KVRegion, KVSource
from kvtransfer.pool import KVPool
from kvtransfer.resharding import HeadRun, head_runs, readers
from kvtransfer.transport import KVTransferError, KVTransport, PullHandle, PullState

log = logging.getLogger(__name__)
LOCAL = "NIXL_INIT_AGENT"


@dataclass(frozen=True)
class _Slice:
    """What a read moves of every block of one group: heads ``first .. first + count`` of its K
    and V parts, in one descriptor per block when ``whole`` (every layer of every head), else
    two per layer (the K part and the V part of each)."""

    group: str
    first: int
    count: int
    whole: bool

    def rows_per_block(self, r: KVRegion) -> int:
        """Descriptors of one block over region ``r``."""
        return 1 if self.whole else 2 * r.num_layers


def _descs(r: KVRegion, sl: _Slice) -> np.ndarray:
    """The (address, length, device) rows of every block of ``sl`` over region ``r``: block
    ``b``'s are rows ``b * rows_per_block ..``, one for the whole block, or one per (layer,
    part), row ``(b * num_layers + layer) * 2 + part``."""
    if sl.whole:
        addrs = r.base_address + np.arange(r.num_blocks, dtype=np.int64) * r.block_bytes
        length = r.block_bytes
    else:  # per (block, layer) slab: the K part, then the V part, of the heads of the run
        n = r.num_blocks * r.num_layers
        slabs = r.base_address + np.arange(n, dtype=np.int64) * r.slab_bytes
        half = r.num_heads * r.chunk_bytes
        part = np.array([0, half], dtype=np.int64) + sl.first * r.chunk_bytes
        addrs, length = (slabs[:, None] + part[None, :]).reshape(-1), sl.count * r.chunk_bytes
    return np.stack([addrs, np.full_like(addrs, length), np.full_like(addrs, r.device_id)], 1)


def _dlist(
    regions: dict[str, KVRegion], slices: tuple[_Slice, ...]
) -> tuple[np.ndarray, dict[str, int]]:
    """The rows of every slice, end to end, and the first row of each slice's group."""
    rows, offsets, start = [], {}, 0
    for sl in slices:
        d = _descs(regions[sl.group], sl)
        rows.append(d)
        offsets[sl.group] = start
        start += len(d)
    return np.concatenate(rows).astype(np.int64), offsets


def _rows(r: KVRegion, sl: _Slice, blocks: np.ndarray, offset: int) -> np.ndarray:
    """Rows of ``_dlist`` for ``blocks``: each block's rows in turn."""
    n = sl.rows_per_block(r)
    each = np.arange(n, dtype=np.int64)
    rows: np.ndarray = (offset + blocks[:, None] * n + each[None, :]).reshape(-1)
    return rows


def block_runs(theirs: np.ndarray, ours: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The runs of a read's blocks that are consecutive on both sides: each run's index into
    the blocks and its length (a run of one where either side jumps)."""
    n = len(theirs)
    jumps = (np.diff(theirs) != 1) | (np.diff(ours) != 1)
    starts = np.concatenate([[0], np.flatnonzero(jumps) + 1]).astype(np.int64)
    return starts, np.diff(np.append(starts, n))


def run_descs(
    r: KVRegion, blocks: np.ndarray, starts: np.ndarray, lengths: np.ndarray
) -> np.ndarray:
    """One (address, length, device) row per run of whole blocks over region ``r``: blocks
    ``b .. b + n - 1``, every layer of them, are one contiguous range of ``n`` blocks."""
    addrs = r.base_address + blocks[starts] * r.block_bytes
    sizes = lengths.astype(np.int64) * r.block_bytes
    return np.stack([addrs, sizes, np.full(addrs.size, r.device_id, np.int64)], 1)


_Prepared = tuple[Any, dict[str, int]]  # a prepared descriptor list and each group's first row


@dataclass
class _Peer:
    version: int
    regions: dict[str, KVRegion]
    lists: dict[tuple[_Slice, ...], _Prepared]  # per read shape


class NixlTransport(KVTransport):
    name = "nixl"

    def __init__(
        self,
        pool: KVPool,
        role: str = "worker",
        rank: int = 0,
        tp_size: int = 1,
        progress_thread: bool = False,
    ) -> None:
        super().__init__()
        from nixl._api import nixl_agent, nixl_agent_config

        self.rank = rank
        self.tp_size = tp_size
        self._notice_counts: dict[str, int] = {}  # source side: reads reported per request
        self.agent_name = f"tandem-{role}{rank}-{uuid.uuid4().hex[:12]}"
        self.version = time.time_ns()
        self.mem_type = pool.mem_type
        if pool.mem_type == "VRAM" and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in os.environ:
            os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "y"  # read before the agent's UCX
            log.info("UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y: VRAM reads may take cuda_ipc without NVLink")
        self.agent = nixl_agent(
            self.agent_name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
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
        self._local_lists: dict[tuple[_Slice, ...], _Prepared] = {}
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
        """Drive UCX (serve peers' reads, send and receive notices).

        Each reader's notice is ``"<request id>|<readers>"``: a request's blocks are released
        once as many destination ranks as it names have read them."""
        notes = self.agent.get_new_notifs()
        for msg in (m.decode() for msgs in notes.values() for m in msgs):
            rid, _, expected = msg.partition("|")
            seen = self._notice_counts.get(rid, 0) + 1
            if seen >= int(expected or 1):
                self._notice_counts.pop(rid, None)
                self._notices.append(rid)
            else:
                self._notice_counts[rid] = seen

    def _peer(self, src: KVSource) -> _Peer:
        peer = self._peers.get(src.agent_name)
        if peer is not None and peer.version == src.version:
            return peer
        if peer is not None:  # same name, new incarnation: forget the old descriptors first
            self.agent.remove_remote_agent(src.agent_name)
            del self._peers[src.agent_name]
        self.agent.add_remote_agent(src.metadata)
        peer = _Peer(src.version, {r.group: r for r in src.regions}, {})
        self._peers[src.agent_name] = peer
        return peer

    def _lists(
        self, src: KVSource, theirs: tuple[_Slice, ...], ours: tuple[_Slice, ...]
    ) -> tuple[_Prepared, _Prepared]:
        """The prepared lists (remote, local) of a read shape, made on first use."""
        peer = self._peers[src.agent_name]
        remote = peer.lists.get(theirs)
        if remote is None:
            descs, offsets = _dlist(peer.regions, theirs)
            remote = (
                self.agent.prep_xfer_dlist(src.agent_name, descs, src.regions[0].mem_type),
                offsets,
            )
            peer.lists[theirs] = remote
        local = self._local_lists.get(ours)
        if local is None:
            descs, offsets = _dlist(self._by_group, ours)
            local = (self.agent.prep_xfer_dlist(LOCAL, descs, self.mem_type), offsets)
            self._local_lists[ours] = local
        return remote, local

    def start_pull(self, handoff: KVHandoff, local_blocks: Sequence[int]) -> PullHandle:
        """One READ per source rank that holds heads this rank owns (one in all when both
        sides have the same TP size), each carrying its completion notice."""
        if len(local_blocks) != len(handoff.block_ids):
            raise KVTransferError("local and remote block counts differ")
        src_tp = len(handoff.sources)
        remote_blocks = np.asarray(handoff.block_ids, dtype=np.int64)
        ours_blocks = np.asarray(local_blocks, dtype=np.int64)
        # per source rank: what to read of each group, on their side and on ours
        plan: dict[int, tuple[list[_Slice], list[_Slice]]] = {}
        for g in handoff.groups:
            ours = self._by_group.get(g)
            if ours is None:
                continue  # a group another rank holds (the draft lives on rank 0)
            for run in self._runs(g, ours, src_tp):
                try:
                    peer = self._peer(handoff.sources[run.src_rank])
                except Exception as e:  # bad or stale agent metadata: nothing posted yet
                    self.counters.fail("post")
                    raise KVTransferError(
                        f"cannot reach source rank {run.src_rank} of {handoff.request_id}: {e}"
                    ) from e
                theirs = peer.regions.get(g)
                if theirs is None or (theirs.chunk_bytes, theirs.num_layers) != (
                    ours.chunk_bytes,
                    ours.num_layers,
                ):
                    what = (
                        "no such group"
                        if theirs is None
                        else f"{theirs.num_layers} layers of {theirs.chunk_bytes}-byte chunks"
                    )
                    raise KVTransferError(
                        f"group {g}: source rank {run.src_rank} has {what}, this rank "
                        f"{ours.num_layers} layers of {ours.chunk_bytes}-byte chunks"
                    )
                whole = run.count == theirs.num_heads == ours.num_heads
                rem, loc = plan.setdefault(run.src_rank, ([], []))
                rem.append(_Slice(g, run.src_head, run.count, whole))
                loc.append(_Slice(g, run.dst_head, run.count, whole))
        handles: list[Any] = []
        nbytes = 0
        total_heads = self._by_group["target"].num_heads * self.tp_size
        for src_rank, (rem_sl, loc_sl) in plan.items():
            src = handoff.sources[src_rank]
            peer = self._peers[src.agent_name]
            nbytes += sum(
                len(ours_blocks)
                * self._by_group[sl.group].num_layers
                * 2
                * sl.count
                * self._by_group[sl.group].chunk_bytes
                for sl in loc_sl
            )
            n = readers(src_rank, src_tp, self.tp_size, total_heads)
            handle = None
            notice = f"{handoff.request_id}|{n}".encode()
            starts, lengths = block_runs(remote_blocks, ours_blocks)
            try:
                if all(sl.whole for sl in rem_sl) and len(starts) < len(ours_blocks):
                    # blocks consecutive on both sides: a descriptor per run, built for this
                    # read, where the prepared lists would give one per block
                    remote_rows = [
                        run_descs(peer.regions[sl.group], remote_blocks, starts, lengths)
                        for sl in rem_sl
                    ]
                    local_rows = [
                        run_descs(self._by_group[sl.group], ours_blocks, starts, lengths)
                        for sl in loc_sl
                    ]
                    handle = self.agent.initialize_xfer(
                        "READ",
                        self.agent.get_xfer_descs(np.concatenate(local_rows), self.mem_type),
                        self.agent.get_xfer_descs(
                            np.concatenate(remote_rows), src.regions[0].mem_type
                        ),
                        src.agent_name,
                        notice,
                    )
                else:
                    (rlist, roff), (llist, loff) = self._lists(src, tuple(rem_sl), tuple(loc_sl))
                    remote = [
                        _rows(peer.regions[sl.group], sl, remote_blocks, roff[sl.group])
                        for sl in rem_sl
                    ]
                    local = [
                        _rows(self._by_group[sl.group], sl, ours_blocks, loff[sl.group])
                        for sl in loc_sl
                    ]
                    handle = self.agent.make_prepped_xfer(
                        "READ",
                        llist,
                        np.concatenate(local),
                        rlist,
                        np.concatenate(remote),
                        notif_msg=notice,
                    )
                posted = self.agent.transfer(handle)
                why = "NIXL refused the read" if posted == "ERR" else None
            except Exception as e:  # e.g. NIXL_ERR_REMOTE_DISCONNECT: the source just died
                why = f"NIXL could not post the read ({e})"
            if why is not None:
                if handle is not None:  # this read never ran
                    self._release([handle])
                self.counters.fail("post")
                if not handles:
                    raise KVTransferError(f"{why} for {handoff.request_id}")
                # the reads from earlier source ranks are running: hand them back as a failed
                # pull, whose blocks stay quarantined until those reads have ended
                log.warning("%s for %s; earlier reads still run", why, handoff.request_id)
                return PullHandle(handoff.request_id, 0, time.perf_counter(), handles, failed=True)
            handles.append(handle)
        self.counters.pulls_started += 1
        return PullHandle(handoff.request_id, nbytes, time.perf_counter(), handles)

    def _runs(self, group: str, ours: KVRegion, src_tp: int) -> list[HeadRun]:
        if group != "target":  # the draft is not split: rank 0 holds it whole on both sides
            return [HeadRun(0, 0, 0, ours.num_heads)] if self.rank == 0 else []
        try:
            return head_runs(self.rank, self.tp_size, src_tp, ours.num_heads * self.tp_size)
        except ValueError as e:
            raise KVTransferError(str(e)) from e

    def _xfer_state(self, handle: Any, request_id: str) -> str:
        try:
            state: str = self.agent.check_xfer_state(handle)
        except Exception as e:  # NIXL raises (e.g. NIXL_ERR_REMOTE_DISCONNECT) when the source died
            log.warning("NIXL read for %s failed: %s", request_id, e)
            return "ERR"
        return state

    def poll(self, pull: PullHandle) -> PullState:
        self.progress()
        if pull.failed:
            return PullState.FAILED
        states = [self._xfer_state(h, pull.request_id) for h in pull.token]
        state = "ERR" if "ERR" in states else ("DONE" if all(x == "DONE" for x in states) else "")
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
        """Release each READ of ``pull`` that has ended (NIXL reports it done or failed); a READ
        still in progress is left running and held in the pull's token for a later call.

        Releasing a running READ is not a cancel: NIXL's UCX backend frees the handle and
        reports success, yet the read goes on and lands once the source makes progress
        (``BENCHMARKS.md``, "Overload and faults"). So the only proof that no byte can land
        is the transfer's own end state."""
        left: list[Any] = pull.token
        running = [h for h in left if self._xfer_state(h, pull.request_id) == "PROC"]
        self._release([h for h in left if all(h is not r for r in running)])
        left[:] = running
        return not left

    def _release(self, handles: Sequence[Any]) -> None:
        """Release ``handles`` (reads that ended, or never ran)."""
        for handle in handles:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as e:  # a handle of a dead peer's read: nothing left to free
                log.warning("releasing a NIXL read handle: %s", e)

    def close(self) -> None:
        for reg in self._registrations:
            self.agent.deregister_memory(reg)
        self._registrations = []
