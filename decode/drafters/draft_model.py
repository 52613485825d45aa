"""An independent small causal LM that shares the target's tokenizer, with its own KV group."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decode.drafters.base import Drafter, DraftProposal
from models.request import Request
from models.sampling import Stream, probs_from_logits, sample_token
from runtime.runner import ModelRunner, SeqInput
from speculation.draft_cost import DraftRounds


class DraftModelDrafter(Drafter):
    """Runs the draft model autoregressively, one forward per proposed position, each over the
    whole batch.

    The first forward of a step also catches the draft's KV up on every token it has not seen
    (the previous step's bonus or recovered token, or the whole prompt when the prompt was
    computed locally), so the draft never needs a separate prefill on decode.
    """

    uses_kv = True
    rounds: DraftRounds

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner  # the draft model over the pool's "draft" group
        self._fed = 0
        self.rounds = DraftRounds()  # forwards after the first (which also catches up)

    @property
    def tokens_fed(self) -> int:
        return self._fed

    def propose(self, reqs: Sequence[Request], widths: Sequence[int]) -> list[DraftProposal]:
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        kmax = max(widths, default=0)
        for j in range(kmax):
            if j > 0:
                self.rounds.start()
            live = [i for i, w in enumerate(widths) if w > j]
            batch = []
            for i in live:
                r = reqs[i]
                feed = r.all_token_ids[r.num_draft_computed :] if j == 0 else [tokens[i][-1]]
                batch.append(SeqInput(r.block_table, r.num_draft_computed, feed, [len(feed) - 1]))
                self._fed += len(feed)
            out = self.runner.run(batch)
            q = probs_from_logits(out.logits, [reqs[i].sampling for i in live])  # [B_j, V]
            for row, i in enumerate(live):
                r = reqs[i]
                r.num_draft_computed += len(batch[row].token_ids)
                pos = len(r.output_token_ids) + j
                tokens[i].append(sample_token(q[row], r.sampling, pos, Stream.DRAFT))
                probs[i].append(q[row])
            if j > 0:
                self.rounds.stop()
        return [
            DraftProposal(tuple(t), torch.stack(p) if p else None) if t else DraftProposal((), None)
            for t, p in zip(tokens, probs, strict=True)
        ]
