"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the suffix.

``NgramIndex`` keeps, for a growing token sequence, where each n-gram (``min_n <= n <=
max_n``) last ended, so a lookup costs ``O(max_n)`` dictionary probes and appending a token
``O(max_n)`` updates, instead of a scan of the whole context per lookup. Decode keeps one per
running request and feeds it the tokens as they become known.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class NgramIndex:
    """The latest end of every n-gram of an append-only token sequence.

    The rule (that of prompt lookup decoding): for suffix lengths ``max_n`` down to ``min_n``,
    find the latest earlier occurrence of the sequence's last ``n`` tokens; what followed it
    is the proposal. "Earlier" means ending before the sequence does, so the suffix never
    matches itself.
    """

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self.tokens: list[int] = []
        # per n (index n - min_n): n-gram -> the largest end e (exclusive) seen, e < indexed
        self._last: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self._indexed = 0  # every end e < _indexed is in _last

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` (the sequence only grows)."""
        self.tokens.extend(tokens)

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Catch up with a request whose known tokens are ``prompt + output`` (a sequence that
        only grows, of which this index has seen a prefix)."""
        have = len(self.tokens)
        if have > len(prompt) + len(output):
            raise ValueError("an n-gram index only follows a sequence that grows")
        if have < len(prompt):
            self.tokens.extend(prompt[have:])
            have = len(prompt)
        self.tokens.extend(output[have - len(prompt) :])

    def follow(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier match of the longest suffix
        (``[]`` when no suffix recurs)."""
        if k <= 0:
            return []
        self._index(self.tokens, len(self.tokens), self._last)
        end = self._match(self.tokens.__getitem__, len(self.tokens), ())
        return [] if end is None else self.tokens[end : end + k]

    def propose(self, width: int) -> list[int]:
        """Up to ``width`` tokens, position by position: each the lookup over the tokens before
        it, earlier proposals taken as accepted (so a position's proposal never depends on how
        many were asked for). Stops where a lookup finds nothing."""
        base = self.tokens
        self._index(base, len(base), self._last)
        extra: list[int] = []
        over: list[dict[tuple[int, ...], int]] = [{} for _ in self._last]  # speculative ends

        def at(i: int) -> int:
            return base[i] if i < len(base) else extra[i - len(base)]

        for _ in range(width):
            size = len(base) + len(extra)
            end = self._match(at, size, over)
            if end is None:
                break
            extra.append(at(end))
            self._add_end(at, size, over)  # the suffix just matched is now an earlier n-gram
        return extra

    def _index(
        self, tokens: Sequence[int], size: int, into: list[dict[tuple[int, ...], int]]
    ) -> None:
        """Record every end up to ``size - 1`` not yet recorded."""
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
        """The end of the latest earlier occurrence of the longest suffix of ``size`` tokens;
        ``over`` holds ends later than the index's (speculative tokens)."""
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
    """Up to ``k`` tokens that followed the most recent earlier match of the longest suffix of
    ``tokens`` (a one-off lookup; keep an ``NgramIndex`` for a sequence that grows)."""
    index = NgramIndex(max_n, min_n)
    index.extend(tokens)
    return index.follow(k)
