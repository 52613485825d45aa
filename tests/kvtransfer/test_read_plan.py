"""Read planning (``kvtransfer.read_plan``): which bytes a pull reads, and how it describes them.

Each plan is checked against the pool layout written out by hand (``KVRegion``: block ``b`` of
layer ``l`` at ``base + (b * layers + l) * slab``, its K part then its V part, head after head):
both sides must cover exactly the bytes of the heads they move in the blocks named, no more.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import pytest

from kvtransfer.handoff import KVCompat, KVHandoff, KVRegion, KVSource
from kvtransfer.read_plan import Descriptors, Slice, SourceRead, plan_reads, prepared_descs
from kvtransfer.transport import KVTransferError

BLOCKS = 16
COMPAT = KVCompat("m", "float32", 16, "layout", 1, "draft", "nixl")


def _region(group: str, base: int, heads: int, layers: int = 2) -> KVRegion:
    return KVRegion(group, base, 64, BLOCKS, layers, heads, "DRAM", 0)


def _pool(side: int, heads: int, draft: bool = True) -> dict[str, KVRegion]:
    """One rank's regions: ``heads`` target heads (2 layers) and the whole draft (1 layer)."""
    regions = {"target": _region("target", side * 10**7, heads)}
    if draft:
        regions["draft"] = _region("draft", side * 10**7 + 10**6, 2, layers=1)
    return regions


def _handoff(sources: Sequence[Mapping[str, KVRegion]], blocks: Sequence[int]) -> KVHandoff:
    srcs = tuple(
        KVSource("nixl", f"src{i}", 1, b"", tuple(regions.values()))
        for i, regions in enumerate(sources)
    )
    return KVHandoff("r", srcs, tuple(blocks), ("target", "draft"), 40, 7, COMPAT, 30.0)


def _merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _covered(
    read: SourceRead, regions: Mapping[str, KVRegion], remote: bool
) -> list[tuple[int, int]]:
    """The byte ranges one side of ``read`` describes."""
    slices, descs = (read.remote, read.remote_descs) if remote else (read.local, read.local_descs)
    rows = descs if read.kind is Descriptors.RUNS else prepared_descs(regions, slices)[descs]
    return _merged((int(a), int(a) + int(n)) for a, n, _dev in rows)


def _expected(
    regions: Mapping[str, KVRegion], slices: Sequence[Slice], blocks: Sequence[int]
) -> list[tuple[int, int]]:
    """The bytes of ``slices``' heads in ``blocks``, from the layout alone."""
    ranges = []
    for sl in slices:
        r = regions[sl.group]
        for b in blocks:
            for layer in range(r.num_layers):
                slab = r.base_address + (b * r.num_layers + layer) * r.slab_bytes
                for part in (0, 1):  # K, then V
                    lo = slab + (part * r.num_heads + sl.first) * r.chunk_bytes
                    ranges.append((lo, lo + sl.count * r.chunk_bytes))
    return _merged(ranges)


def _check_bytes(
    read: SourceRead,
    theirs: Mapping[str, KVRegion],
    ours: Mapping[str, KVRegion],
    remote_blocks: Sequence[int],
    local_blocks: Sequence[int],
) -> None:
    assert _covered(read, theirs, True) == _expected(theirs, read.remote, remote_blocks)
    local = _covered(read, ours, False)
    assert local == _expected(ours, read.local, local_blocks)
    assert read.nbytes == sum(hi - lo for lo, hi in local)


def test_blocks_consecutive_on_both_sides_are_one_descriptor_per_run() -> None:
    theirs, ours = _pool(1, 4), _pool(2, 4)
    remote_blocks, local_blocks = [3, 4, 5, 9, 10, 12], [12, 13, 14, 0, 1, 7]
    (read,) = plan_reads(_handoff([theirs], remote_blocks), local_blocks, ours, 0, 1)
    assert read.kind is Descriptors.RUNS and read.src_rank == 0 and read.readers == 1
    assert read.remote == read.local == (Slice("target", 0, 4, True), Slice("draft", 0, 2, True))
    # three runs in each group: 3 blocks, 2 blocks, 1 block
    block = theirs["target"].block_bytes
    assert read.remote_descs[:3].tolist() == [
        [theirs["target"].base_address + 3 * block, 3 * block, 0],
        [theirs["target"].base_address + 9 * block, 2 * block, 0],
        [theirs["target"].base_address + 12 * block, 1 * block, 0],
    ]
    assert len(read.remote_descs) == len(read.local_descs) == 6
    _check_bytes(read, theirs, ours, remote_blocks, local_blocks)


def test_blocks_that_never_run_on_both_sides_read_through_the_prepared_lists() -> None:
    """Consecutive on one side only is no run: one prepared row per block and group, the
    draft's rows after all of the target's."""
    theirs, ours = _pool(1, 4), _pool(2, 4)
    remote_blocks, local_blocks = [1, 2, 3], [2, 4, 6]
    (read,) = plan_reads(_handoff([theirs], remote_blocks), local_blocks, ours, 0, 1)
    assert read.kind is Descriptors.PREPARED
    assert read.remote_descs.tolist() == [1, 2, 3, BLOCKS + 1, BLOCKS + 2, BLOCKS + 3]
    assert read.local_descs.tolist() == [2, 4, 6, BLOCKS + 2, BLOCKS + 4, BLOCKS + 6]
    _check_bytes(read, theirs, ours, remote_blocks, local_blocks)


@pytest.mark.parametrize(
    ("remote_blocks", "local_blocks", "kind", "runs"),
    [
        ([5], [9], Descriptors.PREPARED, None),  # one block: a run of one is no gain
        ([1, 3, 7], [4, 6, 9], Descriptors.PREPARED, None),
        # a single pair is enough; the run ends at the block where one side jumps
        ([1, 2, 7], [4, 5, 9], Descriptors.RUNS, [(1, 4, 2), (7, 9, 1)]),
        ([1, 2, 3], [4, 5, 7], Descriptors.RUNS, [(1, 4, 2), (3, 7, 1)]),
        ([0, 1], [14, 15], Descriptors.RUNS, [(0, 14, 2)]),  # up to the pool's last block
    ],
)
def test_runs_start_and_end_where_either_side_jumps(
    remote_blocks: list[int],
    local_blocks: list[int],
    kind: Descriptors,
    runs: list[tuple[int, int, int]] | None,
) -> None:
    theirs, ours = _pool(1, 4), _pool(2, 4)
    (read,) = plan_reads(_handoff([theirs], remote_blocks), local_blocks, ours, 0, 1)
    assert read.kind is kind
    if runs is not None:
        block = theirs["target"].block_bytes
        got = [
            (
                (int(rem[0]) - theirs["target"].base_address) // block,
                (int(loc[0]) - ours["target"].base_address) // block,
                int(rem[1]) // block,
            )
            for rem, loc in zip(
                read.remote_descs[: len(runs)], read.local_descs[: len(runs)], strict=True
            )
        ]
        assert got == runs
    _check_bytes(read, theirs, ours, remote_blocks, local_blocks)


def test_a_rank_of_a_wider_tp_group_reads_its_heads_of_every_block() -> None:
    """Decode TP 2 from prefill TP 1: rank 1 reads heads 2..3 of the source's 4, K and V apart
    in every layer (prepared rows, even over consecutive blocks), and no draft (rank 0 holds
    it); both decode ranks read from the one source rank."""
    theirs, ours = _pool(1, 4), _pool(2, 2, draft=False)
    remote_blocks, local_blocks = [3, 4, 5], [0, 1, 2]
    (read,) = plan_reads(_handoff([theirs], remote_blocks), local_blocks, ours, 1, 2)
    assert read.kind is Descriptors.PREPARED and read.readers == 2
    assert read.remote == (Slice("target", 2, 2, False),)
    assert read.local == (Slice("target", 0, 2, False),)
    assert len(read.local_descs) == 3 * 2 * 2  # blocks x layers x (K, V)
    _check_bytes(read, theirs, ours, remote_blocks, local_blocks)


def test_a_rank_of_a_narrower_tp_group_reads_from_every_source_rank() -> None:
    """Decode TP 1 from prefill TP 2: one READ per source rank, each rank's heads landing
    side by side here; the draft comes whole from source rank 0, after its part of the
    target in that rank's prepared lists."""
    src0, src1, ours = _pool(1, 2), _pool(3, 2, draft=False), _pool(2, 4)
    remote_blocks, local_blocks = [6, 7], [1, 2]
    reads = plan_reads(_handoff([src0, src1], remote_blocks), local_blocks, ours, 0, 1)
    assert [r.src_rank for r in reads] == [0, 1] and all(r.readers == 1 for r in reads)
    assert reads[0].remote == (Slice("target", 0, 2, False), Slice("draft", 0, 2, True))
    assert reads[0].local == (Slice("target", 0, 2, False), Slice("draft", 0, 2, True))
    assert reads[1].remote == (Slice("target", 0, 2, False),)
    assert reads[1].local == (Slice("target", 2, 2, False),)
    for read, theirs in zip(reads, (src0, src1), strict=True):
        assert read.kind is Descriptors.PREPARED
        _check_bytes(read, theirs, ours, remote_blocks, local_blocks)
    # the draft's rows start after the target's in the prepared list of that shape
    target_rows = BLOCKS * 2 * 2  # blocks x layers x (K, V)
    assert reads[0].local_descs[-2:].tolist() == [target_rows + 1, target_rows + 2]


def test_layouts_that_differ_and_uneven_counts_are_refused() -> None:
    theirs, ours = _pool(1, 4), _pool(2, 4)
    with pytest.raises(KVTransferError, match="block counts differ"):
        plan_reads(_handoff([theirs], [1, 2]), [1], ours, 0, 1)
    other = dict(theirs, target=_region("target", 10**7, 4, layers=3))
    with pytest.raises(KVTransferError, match="group target: source rank 0 has 3 layers"):
        plan_reads(_handoff([other], [1]), [1], ours, 0, 1)
    with pytest.raises(KVTransferError, match="cannot be split"):
        plan_reads(_handoff([_pool(1, 1)] * 3, [1]), [1], _pool(2, 1, draft=False), 0, 2)
