"""The block allocator, with optional prefix caching: pure Python, no tensors.

Blocks are integers ``0 .. num_blocks - 1``. A block is either on the free list or referenced
by one or more owners (reference count > 0), never both. Sequences own blocks through their
block tables; a lease (prefill side) owns the blocks it keeps alive for a transfer.

**Prefix caching.** A full block of a prompt is identified by a *key*, a cryptographic hash
(BLAKE2b) of its parent block's key and its own tokens, so a key names every token up to the
block's end (:func:`block_hashes`). Once its KV is computed, :meth:`BlockAllocator.register`
records it with its tokens; a later prompt sharing those full blocks gets the same blocks back
from :meth:`BlockAllocator.lookup`, which compares the tokens of every hit (a key that matched
different tokens would be a hash collision: it is counted and treated as a miss), and skips
their compute. A cached block whose last owner frees it
stays cached on the free list (least recently freed first) until an allocation reuses it, which
evicts its hash.

**Contiguous runs.** A KV handoff reads one NIXL descriptor per run of blocks that are
consecutive on both sides (``kvtransfer.nixl_transport.block_runs``), so an allocation of
several blocks takes the first run of that many consecutive free blocks holding no cached
prefix, where there is one (else the lowest such blocks); cached blocks are evicted only when
no other free block is left. Without this the free list, ordered by when blocks were freed and
interleaved by decode sequences growing a block at a time, gave a steady state of one run per
block (``bench.block_runs``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

BlockKey = bytes  # a full block's prefix-cache key (16 bytes)


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


def block_hashes(tokens: Sequence[int], block_size: int, salt: bytes = b"") -> list[BlockKey]:
    """Keys of the full blocks of ``tokens`` (a partial last block gets none): each the
    BLAKE2b digest of the previous key and the block's tokens as 64-bit integers."""
    out: list[BlockKey] = []
    prev = salt
    ids = np.asarray(tokens, dtype=np.int64)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(ids[start : start + block_size].tobytes())
        prev = h.digest()
        out.append(prev)
    return out


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        # free blocks that hold no cached prefix: True where free (first-fit runs come from it)
        self._plain = np.ones(num_blocks, dtype=bool)
        self._num_plain = num_blocks
        # free blocks that hold a cached prefix, least recently freed first (evicted in order)
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, BlockKey] = {}
        self._block_of: dict[BlockKey, int] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # what each cached block holds
        self.evictions = 0
        self.mismatches = 0  # hits whose tokens differed (a key collision): served as misses

    @property
    def num_free(self) -> int:
        return self._num_plain + len(self._cached_free)

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with one reference, in ascending order: a run of ``n``
        consecutive uncached blocks where one is free (the first), else the lowest uncached
        ones, then cached ones evicted least recently freed first."""
        if n > self.num_free:
            raise OutOfBlocksError(f"need {n} KV blocks, {self.num_free} free")
        out = self._take_plain(min(n, self._num_plain))
        while len(out) < n:
            b, _ = self._cached_free.popitem(last=False)
            h = self._hash_of.pop(b)
            del self._block_of[h]
            del self._tokens_of[b]
            self.evictions += 1
            out.append(b)
        for b in out:
            self._refs[b] = 1
        out.sort()
        return out

    def _take_plain(self, k: int) -> list[int]:
        """``k`` uncached free blocks off the bitmap: the first run of ``k`` consecutive ones,
        else the lowest ``k`` (vectorised: an allocation scans the pool once, not block by
        block)."""
        if k == 0:
            return []
        free = self._plain
        taken: np.ndarray | None = None
        if k > 1:
            edges = np.diff(free.astype(np.int8), prepend=0, append=0)  # +1 run start, -1 end
            starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
            fits = np.flatnonzero(ends - starts >= k)
            if fits.size:
                first = int(starts[fits[0]])
                taken = np.arange(first, first + k)
        if taken is None:
            taken = np.flatnonzero(free)[:k] if k > 1 else np.array([np.argmax(free)])
        free[taken] = False
        self._num_plain -= k
        return [int(b) for b in taken]

    def fork(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block (a second owner shares them)."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._refs[b] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; unreferenced blocks return to the free list.

        A sequence's blocks are released last-first, so its prefix blocks are evicted last.
        """
        for b in reversed(blocks):
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._cached_free[b] = None
                else:
                    self._plain[b] = True
                    self._num_plain += 1

    def lookup(self, keys: Sequence[BlockKey], contents: Sequence[Sequence[int]]) -> list[int]:
        """The blocks of the longest cached prefix of ``keys`` whose tokens are ``contents``
        (one sequence of ``block_size`` tokens per key), one reference taken on each."""
        out: list[int] = []
        for h, tokens in zip(keys, contents, strict=True):
            b = self._block_of.get(h)
            if b is None:
                break
            if self._tokens_of[b] != tuple(tokens):
                self.mismatches += 1
                break
            if self._refs[b] == 0:
                del self._cached_free[b]
            self._refs[b] += 1
            out.append(b)
        return out

    def register(self, block: int, h: BlockKey, tokens: Sequence[int]) -> None:
        """Record that referenced ``block`` holds the computed KV of the full block keyed ``h``,
        whose tokens are ``tokens``."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is free; only owned blocks can be cached")
        if h in self._block_of or block in self._hash_of:
            return  # the same content is cached already, or this block already has its hash
        self._hash_of[block] = h
        self._block_of[h] = block
        self._tokens_of[block] = tuple(tokens)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def check(self) -> None:
        """Assert the invariants: free xor referenced, nothing lost, the cache maps consistent."""
        for b in range(self.num_blocks):
            plain, cached = bool(self._plain[b]), b in self._cached_free
            if plain and cached:
                raise AssertionError(f"block {b} is on both free lists")
            if (plain or cached) == (self._refs[b] > 0):
                raise AssertionError(f"block {b}: free={plain or cached} refs={self._refs[b]}")
            if cached != (b in self._hash_of and self._refs[b] == 0):
                raise AssertionError(f"block {b}: cached-free={cached} hashed={b in self._hash_of}")
        if int(self._plain.sum()) != self._num_plain:
            raise AssertionError("the count of uncached free blocks is off")
        if self.num_free + sum(r > 0 for r in self._refs) != self.num_blocks:
            raise AssertionError("a block is lost")
        for b, h in self._hash_of.items():
            if self._block_of.get(h) != b:
                raise AssertionError(f"cache maps disagree on block {b}")
        if not len(self._hash_of) == len(self._block_of) == len(self._tokens_of):
            raise AssertionError("cache maps differ in size")
