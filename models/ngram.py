"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the suffix."""

from __future__ import annotations

from collections.abc import Sequence


def ngram_lookup(tokens: Sequence[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier match of the longest suffix.

    Tries suffix lengths ``max_n`` down to ``min_n``; returns ``[]`` when no suffix recurs.
    """
    size = len(tokens)
    if k <= 0 or size < 2:
        return []
    seq = list(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = seq[size - n :]
        # Scan right to left, skipping the suffix itself, for the latest earlier occurrence.
        for start in range(size - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                follow = seq[start + n : start + n + k]
                if follow:
                    return follow
    return []
