"""An independent small causal LM that shares the target's tokenizer, with its own KV group."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decode.drafters.base import Drafter, DraftProposal
from decode.processing import Span, process_spans
from models.request import Request
from models.sampling import Stream, sample_logits
from runtime.runner import ModelRunner, SeqInput
from speculation.draft_cost import DraftRounds


class DraftModelDrafter(Drafter):
    """One forward per position; the first catches the draft's KV up, so no draft prefill runs."""

    uses_kv = True
    rounds: DraftRounds

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._fed = 0
        self.rounds = DraftRounds()

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
                feed = (
                    r.token_slice(r.num_draft_computed, r.num_tokens) if j == 0 else [tokens[i][-1]]
                )
                batch.append(SeqInput(r.block_table, r.num_draft_computed, feed, [len(feed) - 1]))
                self._fed += len(feed)
            out = self.runner.run(batch)
            params = [reqs[i].sampling for i in live]
            positions = [len(reqs[i].output_token_ids) + j for i in live]
            spans = [Span(reqs[i], row, tuple(tokens[i]), j) for row, i in enumerate(live)]
            logits = process_spans(out.logits, spans)
            drawn, q = sample_logits(logits, params, positions, Stream.DRAFT)  # [B_j]
            rows = iter(range(q.shape[0] if q is not None else 0))
            for row, (i, token) in enumerate(zip(live, drawn.tolist(), strict=True)):
                r = reqs[i]
                r.num_draft_computed += len(batch[row].token_ids)
                tokens[i].append(token)
                if q is not None and not r.sampling.greedy:
                    probs[i].append(q[next(rows)])
            if j > 0:
                self.rounds.stop()
        return [_proposal(t, p) for t, p in zip(tokens, probs, strict=True)]


def _proposal(tokens: Sequence[int], probs: Sequence[torch.Tensor]) -> DraftProposal:
    return DraftProposal(tuple(tokens), torch.stack(list(probs)) if probs else None)
