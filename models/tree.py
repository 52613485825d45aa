"""Token trees in a paged KV cache, verified in one forward. A tree fills slots ``base, ...`` in
topological order (``parents[n]``: relative to base, -1 before it). Node n sits at position
``base + depth(n)`` and sees the slots before base, its ancestors and itself, so each path computes
what it would as a chain; ``path_moves`` compacts the accepted path into chain layout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeSpan:
    base: int
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        for n, p in enumerate(self.parents):
            if not -1 <= p < n:
                raise ValueError(f"tree node {n} has parent {p}: parents must come first")

    @property
    def size(self) -> int:
        return len(self.parents)

    def depths(self) -> list[int]:
        out: list[int] = []
        for p in self.parents:
            out.append(0 if p < 0 else out[p] + 1)
        return out

    def ancestors(self) -> torch.Tensor:
        """[N, N] bool: ``[n, m]`` is True where node ``m`` is ``n`` or one of its ancestors."""
        n = self.size
        anc = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                anc[i] |= anc[p]
        return anc


def chain_parents(n: int, first: int = -1) -> tuple[int, ...]:
    return (first, *list(range(n - 1))) if n else ()


def children(parents: Sequence[int], node: int) -> list[int]:
    return [n for n, p in enumerate(parents) if p == node]


def path_moves(base: int, path: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Slot copies ``(src, dst)`` putting ``path``'s node at depth d into slot ``base + d``."""
    return tuple((base + n, base + d) for d, n in enumerate(path) if n != d)


def move_slots(
    pool: torch.Tensor,
    block_table: Sequence[int],
    moves: Sequence[tuple[int, int]],
    block_size: int,
) -> None:
    """Copy K/V slot src to dst for each ``(src, dst)`` in ``moves``, all read before any is
    written; pool: [layers, NB, 2, Hkv, BS, D]."""
    if not moves:
        return
    table = torch.tensor(list(block_table), dtype=torch.long)
    src = torch.tensor([m[0] for m in moves], dtype=torch.long)
    dst = torch.tensor([m[1] for m in moves], dtype=torch.long)
    dev = pool.device
    sb, so = (
        table[src // block_size].to(dev, non_blocking=True),
        (src % block_size).to(dev, non_blocking=True),
    )
    db, do = (
        table[dst // block_size].to(dev, non_blocking=True),
        (dst % block_size).to(dev, non_blocking=True),
    )
    pool[:, db, :, :, do] = pool[:, sb, :, :, so]
