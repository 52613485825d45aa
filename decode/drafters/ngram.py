"""N-gram prompt lookup: propose what followed the latest earlier match of the suffix."""

from __future__ import annotations

from collections.abc import Sequence

from decode.drafters.base import Drafter, DraftProposal
from models.ngram import ngram_lookup
from models.request import Request


class NgramDrafter(Drafter):
    """Deterministic proposals over prompt and output; its draft distribution is one-hot."""

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, reqs: Sequence[Request], widths: Sequence[int]) -> list[DraftProposal]:
        return [self._one(r.all_token_ids, w) for r, w in zip(reqs, widths, strict=True)]

    def _one(self, tokens: list[int], width: int) -> DraftProposal:
        # Position by position, each lookup over the tokens before it (earlier proposals
        # assumed accepted), so a position's proposal never depends on the width asked for.
        seq = list(tokens)
        out: list[int] = []
        for _ in range(width):
            nxt = ngram_lookup(seq, 1, self.max_n, self.min_n)
            if not nxt:
                break
            out.append(nxt[0])
            seq.append(nxt[0])
        return DraftProposal(tuple(out), None)
