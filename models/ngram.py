"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the suffix."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class NgramIndex:
    """The latest end of every n-gram of an append-only sequence, so a lookup costs O(max_n)
    probes, not a scan. Longest suffix first; "earlier" ends before the sequence does."""

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self.tokens: list[int] = []
        # per n (index n - min_n): n-gram -> the largest end e (exclusive) seen, e < indexed
        self._last: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self._indexed = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        have = len(self.tokens)
        if have > len(prompt) + len(output):
            raise ValueError("an n-gram index only follows a sequence that grows")
        if have < len(prompt):
            self.tokens.extend(prompt[have:])
            have = len(prompt)
        self.tokens.extend(output[have - len(prompt) :])

    def follow(self, k: int) -> list[int]:
        if k <= 0:
            return []
        self._index(self.tokens, len(self.tokens), self._last)
        end = self._match(self.tokens.__getitem__, len(self.tokens), ())
        return [] if end is None else self.tokens[end : end + k]

    def propose(self, width: int) -> list[int]:
        """Up to ``width`` tokens, each the lookup over those before it, earlier proposals taken
        as accepted (so a position's proposal never depends on ``width``)."""
        base = self.tokens
        self._index(base, len(base), self._last)
        extra: list[int] = []
        over: list[dict[tuple[int, ...], int]] = [{} for _ in self._last]

        def at(i: int) -> int:
            return base[i] if i < len(base) else extra[i - len(base)]

        for _ in range(width):
            size = len(base) + len(extra)
            end = self._match(at, size, over)
            if end is None:
                break
            extra.append(at(end))
            self._add_end(at, size, over)
        return extra

    def _index(
        self, tokens: Sequence[int], size: int, into: list[dict[tuple[int, ...], int]]
    ) -> None:
        for end in range(max(self._indexed, 1), size):
            self._add_end(tokens.__getitem__, end, into)
        self._indexed = max(self._indexed, size)

    def _add_end(
        self, at: Callable[[int], int], end: int, into: list[dict[tuple[int, ...], int]]
    ) -> None:
        for j, n in enumerate(range(self.min_n, self.max_n + 1)):
            if n > end:
                break
            into[j][tuple(at(i) for i in range(end - n, end))] = end

    def _match(
        self,
        at: Callable[[int], int],
        size: int,
        over: Sequence[dict[tuple[int, ...], int]],
    ) -> int | None:
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            gram = tuple(at(i) for i in range(size - n, size))
            j = n - self.min_n
            end = over[j].get(gram) if over else None
            if end is None:
                end = self._last[j].get(gram)
            if end is not None:
                return end
        return None


def ngram_lookup(tokens: Sequence[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    index = NgramIndex(max_n, min_n)
    index.extend(tokens)
    return index.follow(k)
