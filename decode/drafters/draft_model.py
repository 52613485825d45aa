"""An independent small causal LM that shares the target's tokenizer, with its own KV group."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decode.drafters.base import Drafter, DraftProposal
from decode.drafters.device_rounds import RoundsClock, gather_rounds
from decode.processing import Span, process_spans
from models.device_copy import to_device
from models.request import Request
from models.sampling import Stream, sample_logits
from runtime.runner import LocalRunner, ModelRunner, SeqInput
from speculation.draft_cost import DraftRounds


class DraftModelDrafter(Drafter):
    """One forward per position; the first catches the draft's KV up, so no draft prefill runs."""

    uses_kv = True
    rounds: DraftRounds

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._fed = 0
        self.rounds = DraftRounds()
        self.clock = RoundsClock(self.rounds)

    @property
    def tokens_fed(self) -> int:
        return self._fed

    def settle(self) -> None:
        self.clock.settle()

    def propose(self, reqs: Sequence[Request], widths: Sequence[int]) -> list[DraftProposal]:
        if isinstance(self.runner, LocalRunner) and not any(r.sampling.processes for r in reqs):
            return self._on_device(self.runner, reqs, widths)
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

    def _on_device(
        self, runner: LocalRunner, reqs: Sequence[Request], widths: Sequence[int]
    ) -> list[DraftProposal]:
        """Rounds that feed each other's tokens on the device, left there for the verification
        to read: where no processor needs them on the host between rounds."""
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        drawn_at: list[tuple[list[int], torch.Tensor]] = []  # per round: its rows, [B_j]
        live: list[int] = []
        drawn = torch.empty(0)
        t0 = self.clock.mark(runner.model.device)
        for j in range(max(widths, default=0)):
            keep = [row for row, i in enumerate(live) if widths[i] > j]
            live = [i for i, w in enumerate(widths) if w > j]
            batch = []
            for i in live:
                r = reqs[i]
                n = r.num_tokens - r.num_draft_computed if j == 0 else 1
                feed = r.token_slice(r.num_draft_computed, r.num_tokens) if j == 0 else [0] * n
                batch.append(SeqInput(r.block_table, r.num_draft_computed, feed, [n - 1]))
                r.num_draft_computed += n
                self._fed += n
            if j == 0:
                out = runner.run(batch)
            else:
                ids = drawn if len(keep) == len(drawn) else drawn[to_device(keep, drawn.device)]
                out = runner.run(batch, ids)
            params = [reqs[i].sampling for i in live]
            positions = [len(reqs[i].output_token_ids) + j for i in live]
            drawn, q = sample_logits(out.logits, params, positions, Stream.DRAFT)  # [B_j]
            drawn_at.append((live, drawn))
            rows = iter(range(q.shape[0] if q is not None else 0))
            for i in live:
                if q is not None and not reqs[i].sampling.greedy:
                    probs[i].append(q[next(rows)])
        self.clock.close(t0, runner.model.device, len(drawn_at))
        tokens = gather_rounds(drawn_at, len(reqs))
        return [
            DraftProposal((), torch.stack(p) if p else None, unread=t)
            if t.shape[0]
            else _proposal((), p)
            for t, p in zip(tokens, probs, strict=True)
        ]


def _proposal(tokens: Sequence[int], probs: Sequence[torch.Tensor]) -> DraftProposal:
    return DraftProposal(tuple(tokens), torch.stack(list(probs)) if probs else None)
