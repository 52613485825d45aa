from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransfer.allocator import BlockAllocator, OutOfBlocksError, block_hashes
from kvtransfer.leases import Lease, LeaseTable
from kvtransfer.read_plan import block_runs

OPS = st.sampled_from(["alloc", "fork", "free", "cache", "lookup"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(OPS, st.integers(0, 12)), max_size=80))
def test_every_block_is_free_xor_referenced(ops: list[tuple[str, int]]) -> None:
    """After any sequence of allocate / fork / free / register / lookup (which evicts when
    allocation reuses cached blocks), every block is free xor referenced and none is lost."""
    alloc = BlockAllocator(16)
    owners: list[list[int]] = []
    next_hash = 0
    hashes: list[bytes] = []
    for op, n in ops:
        if op == "alloc":
            if alloc.can_allocate(n):
                owners.append(alloc.allocate(n))
            else:
                with pytest.raises(OutOfBlocksError):
                    alloc.allocate(n)
        elif op == "fork" and owners:
            blocks = owners[n % len(owners)]
            alloc.fork(blocks)
            owners.append(list(blocks))
        elif op == "free" and owners:
            alloc.free(owners.pop(n % len(owners)))
        elif op == "cache" and owners and owners[n % len(owners)]:
            blocks = owners[n % len(owners)]
            next_hash += 1
            key = next_hash.to_bytes(16, "little")
            alloc.register(blocks[n % len(blocks)], key, [next_hash])
            hashes.append(key)
        elif op == "lookup" and hashes:
            keys = hashes[n % len(hashes) :]
            got = alloc.lookup(keys, [[int.from_bytes(k, "little")] for k in keys])
            if got:
                owners.append(got)
        alloc.check()
    for blocks in owners:
        alloc.free(blocks)
    alloc.check()
    assert alloc.num_free == 16


def test_prefix_is_shared_then_evicted_oldest_first() -> None:
    alloc = BlockAllocator(4)
    toks = list(range(40))
    hashes = block_hashes(toks, 16)
    assert len(hashes) == 2  # the partial third block gets no hash
    assert block_hashes(toks[:32] + [99] * 8, 16) == hashes  # chained over the prefix only
    assert block_hashes([7, *toks[1:32]], 16)[1] != hashes[1]  # a change upstream changes all

    blocks = [toks[:16], toks[16:32]]
    a = alloc.allocate(3)
    alloc.register(a[0], hashes[0], blocks[0])
    alloc.register(a[1], hashes[1], blocks[1])
    b = alloc.lookup(hashes, blocks)  # a second prompt shares both full blocks
    assert b == a[:2] and alloc.ref_count(a[0]) == 2
    alloc.free(a)
    alloc.free(b)
    assert alloc.num_free == 4 and alloc.num_cached == 2
    assert alloc.lookup(hashes, blocks) == a[:2]  # still cached while free
    alloc.free(a[:2])
    fresh = alloc.allocate(4)  # takes everything: both cached blocks are evicted
    assert sorted(fresh) == [0, 1, 2, 3] and alloc.num_cached == 0 and alloc.evictions == 2
    assert alloc.lookup(hashes, blocks) == []


def test_keys_are_digests_and_a_hit_checks_its_tokens() -> None:
    """Keys are 16-byte BLAKE2b digests chained over the blocks; a key whose cached block holds
    other tokens (what a collision would look like) is a miss, counted, and nothing leaks."""
    toks = list(range(1000, 1048))
    keys = block_hashes(toks, 16)
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys) and len(set(keys)) == 3
    assert block_hashes(toks, 16) == keys  # the same in every process (no hash seed)
    alloc = BlockAllocator(4)
    (a,) = alloc.allocate(1)
    alloc.register(a, keys[0], toks[:16])
    other = [7, *toks[1:16]]
    assert alloc.lookup(keys[:1], [other]) == [] and alloc.mismatches == 1
    assert alloc.lookup(keys[:1], [toks[:16]]) == [a] and alloc.ref_count(a) == 2
    alloc.free([a])
    alloc.free([a])
    alloc.check()
    assert alloc.num_free == 4


def test_double_free_is_an_error() -> None:
    alloc = BlockAllocator(4)
    b = alloc.allocate(2)
    alloc.free(b)
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(b)


def test_leases_expire_and_pop_once() -> None:
    t = LeaseTable()
    t.add(Lease("a", (1, 2), expires_at=10.0))
    t.add(Lease("b", (3,), expires_at=20.0))
    assert t.num_blocks == 3
    assert [lease.request_id for lease in t.pop_expired(15.0)] == ["a"]
    assert t.pop("a") is None
    assert t.pop("b") is not None and len(t) == 0


def test_a_handoff_gets_a_run_of_consecutive_blocks_where_one_is_free() -> None:
    """Allocations of several blocks take the first free run long enough (one NIXL descriptor
    per layer for the handoff), in ascending order, even when the pool is fragmented by
    sequences that grew a block at a time; without such a run, the lowest free blocks."""
    alloc = BlockAllocator(32)
    singles = [alloc.allocate(1)[0] for _ in range(32)]  # decode growth: one block at a time
    assert singles == list(range(32))
    alloc.free([b for b in singles[:16] if b % 2])  # holes of one block below 16
    alloc.free(singles[20:28])  # and one run of eight
    got = alloc.allocate(6)
    assert got == list(range(20, 26))
    starts, lengths = block_runs(np.array(got), np.arange(100, 106))
    assert len(starts) == 1 and int(lengths[0]) == 6
    assert alloc.allocate(3) == [1, 3, 5]  # no run of three left: the lowest free blocks
    alloc.check()


def test_cached_blocks_are_evicted_only_when_no_other_block_is_free() -> None:
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(4)
    toks = list(range(32))
    keys = block_hashes(toks, 16)
    alloc.register(blocks[0], keys[0], toks[:16])
    alloc.register(blocks[1], keys[1], toks[16:])
    alloc.free(blocks)
    assert alloc.num_free == 4 and alloc.num_cached == 2
    assert alloc.allocate(2) == [2, 3] and alloc.num_cached == 2 and alloc.evictions == 0
    assert alloc.lookup(keys, [toks[:16], toks[16:]]) == [0, 1]  # still hits
    alloc.free([0, 1])  # last-first: the prefix's first block is freed last, evicted last
    assert alloc.allocate(1) == [1] and alloc.evictions == 1 and alloc.num_cached == 1
    alloc.check()
