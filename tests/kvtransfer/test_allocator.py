from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransfer.allocator import BlockAllocator, OutOfBlocksError
from kvtransfer.leases import Lease, LeaseTable


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["alloc", "fork", "free"]), st.integers(0, 12)), max_size=60)
)
def test_every_block_is_free_xor_referenced(ops: list[tuple[str, int]]) -> None:
    alloc = BlockAllocator(16)
    owners: list[list[int]] = []
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
        alloc.check()
    for blocks in owners:
        alloc.free(blocks)
    alloc.check()
    assert alloc.num_free == 16


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
