"""N-gram prompt lookup: propose what followed the latest earlier match of the suffix."""

from __future__ import annotations

from collections.abc import Sequence

from decode.drafters.base import Drafter, DraftProposal
from models.ngram import NgramIndex
from models.request import Request


class NgramDrafter(Drafter):
    """One-hot proposals; each request's ``NgramIndex`` is fed only new tokens."""

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        self.max_n = max_n
        self.min_n = min_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, reqs: Sequence[Request], widths: Sequence[int]) -> list[DraftProposal]:
        out = []
        for r, w in zip(reqs, widths, strict=True):
            index = self._indexes.get(r.request_id)
            if index is None:
                index = self._indexes[r.request_id] = NgramIndex(self.max_n, self.min_n)
            index.sync(r.prompt_token_ids, r.output_token_ids)
            out.append(DraftProposal(tuple(index.propose(w)), None))
        return out

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
