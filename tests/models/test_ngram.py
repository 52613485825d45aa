"""The n-gram index answers every lookup as a scan of the whole context would."""

from __future__ import annotations

import random

import pytest

from models.ngram import NgramIndex


def _scan(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Prompt lookup by brute force: the latest earlier occurrence of the longest suffix."""
    size = len(tokens)
    if k <= 0 or size < 2:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[size - n :]:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize("seed", range(3))
def test_the_index_equals_a_scan_at_every_length_and_width(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(100):
        vocab, max_n = rng.choice([2, 3, 5, 20]), rng.randint(1, 5)
        min_n = rng.randint(1, max_n)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
        index = NgramIndex(max_n, min_n)
        for size in range(len(tokens) + 1):
            index.extend(tokens[len(index) : size])
            assert index.follow(3) == _scan(tokens[:size], 3, max_n, min_n)
            width, seq, want = rng.randint(0, 5), tokens[:size], []
            for _ in range(width):  # position by position, earlier proposals taken
                nxt = _scan(seq, 1, max_n, min_n)
                if not nxt:
                    break
                want.append(nxt[0])
                seq = [*seq, nxt[0]]
            assert index.propose(width) == want


def test_sync_follows_a_request_and_refuses_a_shrinking_one() -> None:
    index = NgramIndex()
    index.sync([1, 2, 3], [])
    index.sync([1, 2, 3], [1, 2])
    assert index.tokens == [1, 2, 3, 1, 2] and index.propose(2) == [3, 1]
    with pytest.raises(ValueError, match="grows"):
        index.sync([1, 2, 3], [])
