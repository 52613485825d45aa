"""The block allocator: pure Python, no tensors.

Blocks are identified by integers ``0 .. num_blocks - 1``. A block is either on the free list or
referenced by one or more owners (reference count > 0), never both. Sequences own blocks through
their block tables; a lease (prefill side) owns the blocks it keeps alive for a transfer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with reference count 1."""
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} KV blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def fork(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block (a second owner shares them)."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._refs[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; blocks nobody references return to the free list."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def check(self) -> None:
        """Assert the invariant: every block is free xor referenced, and none is lost."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        for b in range(self.num_blocks):
            if (b in free) == (self._refs[b] > 0):
                raise AssertionError(f"block {b}: free={b in free} refs={self._refs[b]}")
