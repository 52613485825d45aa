"""Greedy verification of a draft tree: walk down it as long as a child is the target's token.

For a greedy request the target's token after each verified node is fixed (the argmax of its
distribution there). Starting at the root (the newest known token), the walk moves to the child
whose token is the target's and stops where none is; the target's token at the last node
reached follows the accepted ones. Every emitted token is thus the target's greedy token after
the tokens before it, as decoding one token per forward would give.
"""

from __future__ import annotations

from collections.abc import Sequence

from models.tree import children


def accept_greedy_path(
    target: Sequence[int], tokens: Sequence[int], parents: Sequence[int]
) -> tuple[list[int], int]:
    """The accepted nodes (root first) and the token that follows them.

    ``target[0]`` is the target's token after the root, ``target[1 + n]`` after node ``n``;
    ``tokens[n]`` and ``parents[n]`` are node ``n``'s (``models.tree``; -1: the root).
    """
    path: list[int] = []
    node = -1
    while True:
        want = target[node + 1]
        match = [c for c in children(parents, node) if tokens[c] == want]
        if not match:
            return path, want
        node = match[0]
        path.append(node)
