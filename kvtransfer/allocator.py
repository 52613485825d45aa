from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

BlockKey = bytes


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


def block_hashes(tokens: Sequence[int], block_size: int, salt: bytes = b"") -> list[BlockKey]:
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
        self._plain = np.ones(num_blocks, dtype=bool)
        self._num_plain = num_blocks
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, BlockKey] = {}
        self._block_of: dict[BlockKey, int] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self.evictions = 0
        self.mismatches = 0

    @property
    def num_free(self) -> int:
        return self._num_plain + len(self._cached_free)

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
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
        if k == 0:
            return []
        free = self._plain
        taken: np.ndarray | None = None
        if k > 1:
            edges = np.diff(free.astype(np.int8), prepend=0, append=0)
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
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._refs[b] += 1

    def free(self, blocks: Sequence[int]) -> None:
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
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is free; only owned blocks can be cached")
        if h in self._block_of or block in self._hash_of:
            return
        self._hash_of[block] = h
        self._block_of[h] = block
        self._tokens_of[block] = tuple(tokens)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def check(self) -> None:
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
