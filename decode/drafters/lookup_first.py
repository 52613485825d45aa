"""Prompt lookup first, a model drafter where lookup finds nothing.

Copy-heavy text (code edits, quoting, summaries of the prompt) is drafted best by n-gram lookup:
free to propose and accepted most of the time. Open text has no earlier match, and there a
model drafter (the distilled EAGLE head, or a draft model) still guesses. Per request and step
this drafter proposes lookup's tokens when it finds any, and otherwise asks the model drafter;
the model drafter is asked for nothing on the other requests and catches up on their tokens the
next time it drafts for them (both model drafters catch up from ``num_draft_computed``).

Which of the two proposes is decided once per request and step, at the step's first
position, so the proposal at a later position depends on where the step began (lookup's
continuation of a match found earlier, or the model's guess where a step starting there finds
no match). The drafter therefore declares itself ``step_dependent``: a client-seeded sampled
request is held at its cap (``decode.speculation.SpeculationPolicy.held``) and its tokens do not
depend on the batch. Deciding per position instead would run the model's rounds over lookup's
tokens for every request, the cost this drafter exists to avoid for copying requests.
"""

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
        self.step_dependent = True  # see the module docstring
        self.rounds = model.rounds
        self._looked_up = 0  # proposals made by lookup
        self._modelled = 0  # proposals asked of the model drafter
        self._by_lookup: dict[str, bool] = {}  # request id -> lookup answered its last proposal

    @property
    def tokens_fed(self) -> int:
        return self.model.tokens_fed

    @property
    def lookup_share(self) -> float | None:
        """Of the proposals asked for so far, the share lookup answered."""
        n = self._looked_up + self._modelled
        return self._looked_up / n if n else None

    def pays_rounds(self, req: Request) -> bool:
        """Whether the model drafts for ``req``: as last time (lookup found a match for it then,
        or not), so a copying request is not charged rounds it does not run."""
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

    def propose_free(self, reqs: Sequence[Request], widths: Sequence[int]) -> list[DraftProposal]:
        """Lookup's proposals alone: the model is not run."""
        looked = self.lookup.propose(reqs, widths)
        for r, p, w in zip(reqs, looked, widths, strict=True):
            if w and p.tokens:
                self._by_lookup[r.request_id] = True
                self._looked_up += 1
        return looked

    def observe(self, req: Request, features: torch.Tensor) -> None:
        self.model.observe(req, features)

    def forget(self, request_id: str) -> None:
        self._by_lookup.pop(request_id, None)
        self.lookup.forget(request_id)
        self.model.forget(request_id)
