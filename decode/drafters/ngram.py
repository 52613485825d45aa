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

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[DraftProposal]:
        return [
            DraftProposal(tuple(ngram_lookup(r.all_token_ids, k, self.max_n, self.min_n)), None)
            for r, k in zip(reqs, ks, strict=True)
        ]
