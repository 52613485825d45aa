"""Prompt lookup first, a model drafter where lookup finds nothing. Chosen once per request and
step, so it is ``step_dependent``; choosing per position would run the model for copying text."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decode.drafters.base import Drafter, DraftProposal
from decode.drafters.ngram import NgramDrafter
from models.request import Request


class LookupFirstDrafter(Drafter):
    def __init__(self, lookup: NgramDrafter, model: Drafter) -> None:
        self.lookup = lookup
        self.model = model
        self.uses_kv = model.uses_kv
        self.needs_features = model.needs_features
        self.step_dependent = True
        self.rounds = model.rounds
        self._looked_up = 0
        self._modelled = 0
        self._by_lookup: dict[str, bool] = {}  # request id -> lookup answered its last proposal

    @property
    def tokens_fed(self) -> int:
        return self.model.tokens_fed

    @property
    def lookup_share(self) -> float | None:
        n = self._looked_up + self._modelled
        return self._looked_up / n if n else None

    def pays_rounds(self, req: Request) -> bool:
        """Whether the model drafts for ``req``: as last time, so copying is not charged rounds."""
        return self.rounds is not None and not self._by_lookup.get(req.request_id, False)

    def propose(self, reqs: Sequence[Request], widths: Sequence[int]) -> list[DraftProposal]:
        looked = self.lookup.propose(reqs, widths)
        for r, p, w in zip(reqs, looked, widths, strict=True):
            if w:
                self._by_lookup[r.request_id] = bool(p.tokens)
        rest = [0 if p.tokens else w for p, w in zip(looked, widths, strict=True)]
        self._looked_up += sum(1 for p, w in zip(looked, widths, strict=True) if w and p.tokens)
        self._modelled += sum(1 for w in rest if w)
        if not any(rest):
            return looked
        modelled = self.model.propose(reqs, rest)
        return [p if p.tokens else m for p, m in zip(looked, modelled, strict=True)]

    def stop_chains_below(self, cutoff: float) -> None:
        self.model.stop_chains_below(cutoff)

    @property
    def positions_stopped(self) -> int:
        return self.model.positions_stopped

    def propose_free(self, reqs: Sequence[Request], widths: Sequence[int]) -> list[DraftProposal]:
        looked = self.lookup.propose(reqs, widths)
        for r, p, w in zip(reqs, looked, widths, strict=True):
            if w and p.tokens:
                self._by_lookup[r.request_id] = True
                self._looked_up += 1
        return looked

    def observe(self, req: Request, features: torch.Tensor) -> None:
        self.model.observe(req, features)

    def settle(self) -> None:
        self.model.settle()

    def forget(self, request_id: str) -> None:
        self._by_lookup.pop(request_id, None)
        self.lookup.forget(request_id)
        self.model.forget(request_id)
