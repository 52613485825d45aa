"""Greedy verification of a draft tree: walk down it as long as a child is the target's token."""

from __future__ import annotations

from collections.abc import Sequence

from models.tree import children


def accept_greedy_path(
    target: Sequence[int], tokens: Sequence[int], parents: Sequence[int]
) -> tuple[list[int], int]:
    """The accepted nodes and the token after them; ``target[1 + n]`` follows node ``n``."""
    path: list[int] = []
    node = -1
    while True:
        want = target[node + 1]
        match = [c for c in children(parents, node) if tokens[c] == want]
        if not match:
            return path, want
        node = match[0]
        path.append(node)
