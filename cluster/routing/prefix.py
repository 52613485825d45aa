"""Prefill placement: power of two choices, unless the replica that last prefilled the longest
run of the prompt's leading block hashes is within ``imbalance`` requests of the lighter one."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from cluster.routing.policies import Ranks, two_choices
from kvtransfer.allocator import BlockKey


class PrefixIndex:
    """Block hash → the row (replica) that last prefilled a prompt with that block."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._row: OrderedDict[BlockKey, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._row)

    def match(self, hashes: Sequence[BlockKey]) -> tuple[int | None, int]:
        """(row, leading blocks it holds) for the longest recorded prefix of ``hashes``."""
        for i in range(len(hashes) - 1, -1, -1):
            row = self._row.get(hashes[i])
            if row is not None:
                return row, i + 1
        return None, 0

    def record(self, hashes: Sequence[BlockKey], row: int) -> None:
        for h in hashes:
            self._row[h] = row
            self._row.move_to_end(h)
        while len(self._row) > self.capacity:
            self._row.popitem(last=False)

    def forget(self, row: int) -> None:
        for h in [h for h, r in self._row.items() if r == row]:
            del self._row[h]


class PrefixAffinity:
    """Ranks prefill replicas (rows) for a prompt given as its block hashes."""

    name = "prefix_affinity"

    def __init__(
        self, imbalance: float = 4.0, seed: int | None = None, capacity: int = 200_000
    ) -> None:
        self.imbalance = imbalance
        self.index = PrefixIndex(capacity)
        self.rng = random.Random(seed)
        self._rows: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        self._live: frozenset[int] = frozenset()

    def set_rows(self, rows: Sequence[int]) -> None:
        """The live replicas' rows; a row that left is forgotten by the index too."""
        for gone in self._live - set(rows):
            self.index.forget(gone)
        self._rows = np.asarray(sorted(rows), dtype=np.int64)
        self._live = frozenset(rows)

    def rank(self, hashes: Sequence[BlockKey], load: Callable[[int], float]) -> Ranks:
        """``load(row)``: requests in flight on that replica."""
        pair = two_choices(self._rows, self.rng)
        if not pair:
            return []
        row, _ = self.index.match(hashes)
        if row is None or row not in self._live:
            return pair
        if load(row) > min(load(r) for r in pair[0]) + self.imbalance:
            return pair
        return [[row], *pair]

    def routed(self, hashes: Sequence[BlockKey], row: int) -> None:
        self.index.record(hashes, row)
