"""Token trees in a paged KV cache: several candidate continuations verified in one forward.

A sequence's tree occupies consecutive KV slots ``base, base + 1, ...`` in topological order
(a node after its parent). ``parents[n]`` is the node (relative to ``base``) that node ``n``
continues, or ``-1`` when it continues the tokens before ``base``. Node ``n`` sits at position
``base + depth(n)`` (a root at ``base``) for the rotary embedding, and attends to every slot
before ``base`` and, inside the tree, to its ancestors and itself only: each root-to-node path
computes exactly what that path fed as a chain would. A chain is the tree whose parents are
``-1, 0, 1, ...``.

After verification the accepted path is compacted to the chain layout by :func:`path_moves`,
the KV slot copies that put its node at depth ``d`` into slot ``base + d``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeSpan:
    """A tree over KV slots ``base .. base + len(parents) - 1`` (see the module docstring)."""

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
        """Depth of every node, roots at 0."""
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
    """Parents of ``n`` nodes in a row, the first continuing ``first``."""
    return (first, *list(range(n - 1))) if n else ()


def children(parents: Sequence[int], node: int) -> list[int]:
    """The nodes whose parent is ``node`` (``-1``: the roots), in order."""
    return [n for n, p in enumerate(parents) if p == node]


def path_moves(base: int, path: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Slot copies ``(src, dst)`` putting the nodes of ``path`` (root first, each the child of
    the one before) into the chain layout: the node at depth ``d`` into slot ``base + d``."""
    return tuple((base + n, base + d) for d, n in enumerate(path) if n != d)


def move_slots(
    pool: torch.Tensor,
    block_table: Sequence[int],
    moves: Sequence[tuple[int, int]],
    block_size: int,
) -> None:
    """Copy the K/V of slot ``src`` to slot ``dst`` of one sequence, every layer and head, for
    each ``(src, dst)`` in ``moves`` (all read before any is written).

    pool: [num_layers, num_blocks, 2, Hkv, block_size, head_dim] (``models.kv_layout``).
    """
    if not moves:
        return
    table = torch.tensor(list(block_table), dtype=torch.long)
    src = torch.tensor([m[0] for m in moves], dtype=torch.long)  # [m]
    dst = torch.tensor([m[1] for m in moves], dtype=torch.long)  # [m]
    dev = pool.device
    sb, so = table[src // block_size].to(dev), (src % block_size).to(dev)
    db, do = table[dst // block_size].to(dev), (dst % block_size).to(dev)
    pool[:, db, :, :, do] = pool[:, sb, :, :, so]  # [m, L, 2, Hkv, D], gathered first
