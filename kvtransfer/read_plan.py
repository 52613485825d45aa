"""Which bytes a pull reads from each source rank, named by rows of prepared descriptor lists or,
where every head moves and blocks run consecutively on both sides, one descriptor per run."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvtransfer.handoff import KVHandoff, KVRegion
from kvtransfer.resharding import HeadRun, head_runs, readers
from kvtransfer.transport import KVTransferError


@dataclass(frozen=True)
class Slice:
    """Heads ``first .. first + count`` of a group's K and V parts in every block: one descriptor
    per block when ``whole`` (every head), else two per layer."""

    group: str
    first: int
    count: int
    whole: bool

    def rows_per_block(self, r: KVRegion) -> int:
        return 1 if self.whole else 2 * r.num_layers

    def bytes_per_block(self, r: KVRegion) -> int:
        return r.num_layers * 2 * self.count * r.chunk_bytes


def slice_descs(r: KVRegion, sl: Slice) -> np.ndarray:
    """[num_blocks * rows_per_block, 3] (address, length, device) rows of ``sl``, block-major."""
    if sl.whole:
        addrs = r.base_address + np.arange(r.num_blocks, dtype=np.int64) * r.block_bytes
        length = r.block_bytes
    else:  # per (block, layer) slab: the run's K part, then its V part
        n = r.num_blocks * r.num_layers
        slabs = r.base_address + np.arange(n, dtype=np.int64) * r.slab_bytes
        half = r.num_heads * r.chunk_bytes
        part = np.array([0, half], dtype=np.int64) + sl.first * r.chunk_bytes
        addrs, length = (slabs[:, None] + part[None, :]).reshape(-1), sl.count * r.chunk_bytes
    return np.stack([addrs, np.full_like(addrs, length), np.full_like(addrs, r.device_id)], 1)


def prepared_descs(regions: Mapping[str, KVRegion], slices: Sequence[Slice]) -> np.ndarray:
    return np.concatenate([slice_descs(regions[sl.group], sl) for sl in slices]).astype(np.int64)


def list_offsets(regions: Mapping[str, KVRegion], slices: Sequence[Slice]) -> dict[str, int]:
    offsets, start = {}, 0
    for sl in slices:
        offsets[sl.group] = start
        r = regions[sl.group]
        start += r.num_blocks * sl.rows_per_block(r)
    return offsets


def slice_rows(r: KVRegion, sl: Slice, blocks: np.ndarray, offset: int) -> np.ndarray:
    n = sl.rows_per_block(r)
    each = np.arange(n, dtype=np.int64)
    rows: np.ndarray = (offset + blocks[:, None] * n + each[None, :]).reshape(-1)
    return rows


def block_runs(theirs: np.ndarray, ours: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start index, length) of each run of blocks consecutive on both sides."""
    n = len(theirs)
    jumps = (np.diff(theirs) != 1) | (np.diff(ours) != 1)
    starts = np.concatenate([[0], np.flatnonzero(jumps) + 1]).astype(np.int64)
    return starts, np.diff(np.append(starts, n))


def run_descs(
    r: KVRegion, blocks: np.ndarray, starts: np.ndarray, lengths: np.ndarray
) -> np.ndarray:
    """One (address, length, device) row per run of whole blocks over region ``r``."""
    addrs = r.base_address + blocks[starts] * r.block_bytes
    sizes = lengths.astype(np.int64) * r.block_bytes
    return np.stack([addrs, sizes, np.full(addrs.size, r.device_id, np.int64)], 1)


class Descriptors(enum.Enum):
    PREPARED = "prepared"
    RUNS = "runs"


@dataclass(frozen=True, eq=False)
class SourceRead:
    src_rank: int
    remote: tuple[Slice, ...]  # what is read of each group on the source rank
    local: tuple[Slice, ...]  # where each lands on this rank
    readers: int  # destination ranks reading from this source rank (its notice names them)
    nbytes: int
    kind: Descriptors
    # RUNS: [R, 3] (address, length, device); PREPARED: [R] prepared-list rows; paired by row
    remote_descs: np.ndarray
    local_descs: np.ndarray


def plan_reads(
    handoff: KVHandoff,
    local_blocks: Sequence[int],
    regions: Mapping[str, KVRegion],
    rank: int,
    tp_size: int,
) -> list[SourceRead]:
    """One READ per source rank holding heads this rank owns; ``KVTransferError`` where the
    sides cannot match."""
    if len(local_blocks) != len(handoff.block_ids):
        raise KVTransferError("local and remote block counts differ")
    src_tp = len(handoff.sources)
    theirs_blocks = np.asarray(handoff.block_ids, dtype=np.int64)
    ours_blocks = np.asarray(local_blocks, dtype=np.int64)
    runs = block_runs(theirs_blocks, ours_blocks)
    total_heads = regions["target"].num_heads * tp_size
    reads = []
    for src_rank, (rem, loc) in _shapes(handoff, regions, rank, tp_size).items():
        remote = {r.group: r for r in handoff.sources[src_rank].regions}
        chunked = all(sl.whole for sl in rem) and len(runs[0]) < len(ours_blocks)
        kind = Descriptors.RUNS if chunked else Descriptors.PREPARED
        reads.append(
            SourceRead(
                src_rank,
                tuple(rem),
                tuple(loc),
                readers(src_rank, src_tp, tp_size, total_heads),
                len(ours_blocks) * sum(sl.bytes_per_block(regions[sl.group]) for sl in loc),
                kind,
                _describe(kind, remote, rem, theirs_blocks, runs),
                _describe(kind, regions, loc, ours_blocks, runs),
            )
        )
    return reads


def _shapes(
    handoff: KVHandoff, regions: Mapping[str, KVRegion], rank: int, tp_size: int
) -> dict[int, tuple[list[Slice], list[Slice]]]:
    shapes: dict[int, tuple[list[Slice], list[Slice]]] = {}
    for g in handoff.groups:
        ours = regions.get(g)
        if ours is None:
            continue  # a group another rank holds (the draft lives on rank 0)
        for run in _head_runs(g, ours, rank, tp_size, len(handoff.sources)):
            theirs = _source_region(handoff, run.src_rank, ours)
            whole = run.count == theirs.num_heads == ours.num_heads
            rem, loc = shapes.setdefault(run.src_rank, ([], []))
            rem.append(Slice(g, run.src_head, run.count, whole))
            loc.append(Slice(g, run.dst_head, run.count, whole))
    return shapes


def _describe(
    kind: Descriptors,
    regions: Mapping[str, KVRegion],
    slices: Sequence[Slice],
    blocks: np.ndarray,
    runs: tuple[np.ndarray, np.ndarray],
) -> np.ndarray:
    if kind is Descriptors.RUNS:
        starts, lengths = runs
        return np.concatenate(
            [run_descs(regions[sl.group], blocks, starts, lengths) for sl in slices]
        )
    offsets = list_offsets(regions, slices)
    return np.concatenate(
        [slice_rows(regions[sl.group], sl, blocks, offsets[sl.group]) for sl in slices]
    )


def _head_runs(group: str, ours: KVRegion, rank: int, tp_size: int, src_tp: int) -> list[HeadRun]:
    if group != "target":  # the draft is not split: rank 0 holds it whole on both sides
        return [HeadRun(0, 0, 0, ours.num_heads)] if rank == 0 else []
    try:
        return head_runs(rank, tp_size, src_tp, ours.num_heads * tp_size)
    except ValueError as e:
        raise KVTransferError(str(e)) from e


def _source_region(handoff: KVHandoff, src_rank: int, ours: KVRegion) -> KVRegion:
    g = ours.group
    theirs = next((r for r in handoff.sources[src_rank].regions if r.group == g), None)
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
            f"group {g}: source rank {src_rank} has {what}, this rank "
            f"{ours.num_layers} layers of {ours.chunk_bytes}-byte chunks"
        )
    return theirs
