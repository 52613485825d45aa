"""The EAGLE drafter: an EAGLE-style head (``models.eagle``) drafting from the target's features.

Per request the drafter keeps the target features it has not yet fed to the head. A step first
catches the head up — head position ``t`` reads ``(f_t, x_{t+1})`` for every position the target
has computed since last time (one, after a plain step; the whole prompt when the prompt was
computed here) — and the head's output at the last of them proposes the next token; each
further draft feeds the head its own predicted feature and the token it just drafted. Head KV
computed from predicted features is provisional: ``num_draft_computed`` only counts positions
fed with the target's true features, so the next step overwrites the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decode.drafters.base import Drafter, DraftProposal
from models.eagle import EagleRunner
from models.request import Request
from models.runner import SeqInput
from models.sampling import Stream, probs_from_logits, sample_token


class EagleDrafter(Drafter):
    uses_kv = True
    needs_features = True
    step_dependent = True

    def __init__(self, runner: EagleRunner) -> None:
        self.runner = runner
        self._features: dict[str, torch.Tensor] = {}  # request id -> [n, H] not yet fed
        self._fed = 0

    @property
    def tokens_fed(self) -> int:
        return self._fed

    def observe(self, req: Request, features: torch.Tensor) -> None:
        old = self._features.get(req.request_id)
        self._features[req.request_id] = features if old is None else torch.cat([old, features])

    def forget(self, request_id: str) -> None:
        self._features.pop(request_id, None)

    def propose(self, reqs: Sequence[Request], widths: Sequence[int]) -> list[DraftProposal]:
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        last: list[torch.Tensor | None] = [None] * len(reqs)  # each request's predicted feature
        start: list[int] = [0] * len(reqs)  # head position of each request's next input
        for j in range(max(widths, default=0)):
            live = [i for i, w in enumerate(widths) if w > j]
            batch, feats = [], []
            for i in live:
                r = reqs[i]
                if j == 0:
                    # Catch up: positions num_draft_computed .. num_computed - 1, each with the
                    # token that follows it, the last being the pending (newest) token.
                    f = self._features.pop(r.request_id)
                    ids = r.all_token_ids[r.num_draft_computed + 1 : r.num_computed + 1]
                    if len(ids) != f.shape[0]:
                        raise RuntimeError(
                            f"{r.request_id}: {f.shape[0]} features for {len(ids)} head positions"
                        )
                    pos = r.num_draft_computed
                else:
                    f, ids, pos = last[i], [tokens[i][-1]], start[i]  # type: ignore[assignment]
                batch.append(SeqInput(r.block_table, pos, ids, [len(ids) - 1]))
                feats.append(f)
                start[i] = pos + len(ids)
                self._fed += len(ids)
            out = self.runner.run(batch, torch.cat(feats))
            q = probs_from_logits(out.logits, [reqs[i].sampling for i in live])  # [B_j, V]
            for row, i in enumerate(live):
                r = reqs[i]
                last[i] = out.hidden[row : row + 1]
                tokens[i].append(
                    sample_token(q[row], r.sampling, len(r.output_token_ids) + j, Stream.DRAFT)
                )
                probs[i].append(q[row])
        for i, w in enumerate(widths):
            if w > 0:  # only the true-feature positions stay: the rest is provisional
                reqs[i].num_draft_computed = reqs[i].num_computed
        return [
            DraftProposal(tuple(t), torch.stack(p)) if t else DraftProposal((), None)
            for t, p in zip(tokens, probs, strict=True)
        ]
