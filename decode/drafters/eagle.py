"""The EAGLE drafter: a head caught up on the target's features, then fed its own predicted ones,
whose KV is provisional (``num_draft_computed`` counts true-feature positions only)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decode.drafters.base import Drafter, DraftProposal
from decode.drafters.device_rounds import RoundsClock, gather_rounds
from decode.drafters.eagle_tree import grow_trees
from decode.processing import Span, process_spans
from models.device_copy import to_device
from models.request import Request
from models.sampling import Stream, sample_logits
from runtime.runner import EagleRunner, SeqInput, StepResult
from speculation.draft_cost import DraftRounds


class EagleDrafter(Drafter):
    uses_kv = True
    needs_features = True
    step_dependent = True
    rounds: DraftRounds

    def __init__(self, runner: EagleRunner, tree_width: int = 1) -> None:
        self.runner = runner
        self.tree_width = tree_width
        self._features: dict[str, torch.Tensor] = {}  # request id -> [n, H] not yet fed
        self._fed = 0
        self.rounds = DraftRounds()  # head forwards after the catch-up
        self.clock = RoundsClock(self.rounds)
        self._stop_below = 0.0  # a chain ends where its tokens' probabilities' product is under it
        self._stopped = 0

    @property
    def tokens_fed(self) -> int:
        return self._fed

    def stop_chains_below(self, cutoff: float) -> None:
        self._stop_below = cutoff

    @property
    def positions_stopped(self) -> int:
        return self._stopped

    def observe(self, req: Request, features: torch.Tensor) -> None:
        old = self._features.get(req.request_id)
        self._features[req.request_id] = features if old is None else torch.cat([old, features])

    def forget(self, request_id: str) -> None:
        self._features.pop(request_id, None)

    def settle(self) -> None:
        self.clock.settle()

    def propose(self, reqs: Sequence[Request], widths: Sequence[int]) -> list[DraftProposal]:
        out = [DraftProposal((), None)] * len(reqs)
        live = [i for i, w in enumerate(widths) if w > 0]
        if not live:
            return out
        first = self._catch_up([reqs[i] for i in live])
        tree = [
            row
            for row, i in enumerate(live)
            if self.tree_width > 1
            and reqs[i].sampling.greedy
            and not reqs[i].sampling.processes
            and widths[i] > 1
        ]
        chain = sorted(set(range(len(live))) - set(tree))
        if tree:
            tokens, parents, fed = grow_trees(
                self.runner,
                [reqs[live[row]] for row in tree],
                [widths[live[row]] - 1 for row in tree],
                first.hidden[tree],
                first.logits[tree],
                self.tree_width,
                self.rounds,
            )
            self._fed += fed
            for row, toks, par in zip(tree, tokens, parents, strict=True):
                out[live[row]] = DraftProposal(toks, None, par)
        if chain:
            idx = [live[row] for row in chain]
            got = self._chains(
                [reqs[i] for i in idx],
                [widths[i] for i in idx],
                first.hidden[chain],
                first.logits[chain],
            )
            for i, prop in zip(idx, got, strict=True):
                out[i] = prop
        for i in live:  # only the true-feature positions stay: the rest is provisional
            reqs[i].num_draft_computed = reqs[i].num_computed
        return out

    def _stop_chains(
        self,
        logits: torch.Tensor,
        drawn: torch.Tensor,
        live: list[int],
        j: int,
        ends: list[int],
        confidence: list[float],
    ) -> None:
        """End the chains whose tokens' product of head probabilities fell under the cutoff."""
        # logits: [B_j, V]; drawn: [B_j]
        p = torch.softmax(logits.float(), -1).gather(1, drawn.view(-1, 1)).view(-1).tolist()
        for row, b in enumerate(live):
            confidence[b] *= p[row]
            if confidence[b] < self._stop_below and ends[b] > j + 1:
                self._stopped += ends[b] - (j + 1)
                ends[b] = j + 1

    def _catch_up(self, reqs: Sequence[Request]) -> StepResult:
        """Feed head positions ``num_draft_computed .. num_computed - 1`` (t reads f_t, x_{t+1})."""
        batch, feats = [], []
        for r in reqs:
            f = self._features.pop(r.request_id)
            ids = r.token_slice(r.num_draft_computed + 1, r.num_computed + 1)
            if len(ids) != f.shape[0]:
                raise RuntimeError(
                    f"{r.request_id}: {f.shape[0]} features for {len(ids)} head positions"
                )
            batch.append(SeqInput(r.block_table, r.num_draft_computed, ids, [len(ids) - 1]))
            feats.append(f)
            self._fed += len(ids)
        return self.runner.run(batch, torch.cat(feats))

    def _chains(
        self,
        reqs: Sequence[Request],
        widths: Sequence[int],
        hidden: torch.Tensor,
        logits: torch.Tensor,
    ) -> list[DraftProposal]:
        if self._stop_below > 0 or any(r.sampling.processes for r in reqs):
            return self._chains_on_host(reqs, widths, hidden, logits)
        return self._chains_on_device(reqs, widths, hidden, logits)

    def _chains_on_device(
        self,
        reqs: Sequence[Request],
        widths: Sequence[int],
        hidden: torch.Tensor,
        logits: torch.Tensor,
    ) -> list[DraftProposal]:
        """Chains whose rounds feed each other's tokens on the device, left there for the
        verification to read: where nothing needs them on the host between rounds (no
        processors, no early stop)."""
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        live = list(range(len(reqs)))
        drawn_at: list[tuple[list[int], torch.Tensor]] = []  # per round: its chains, [B_j]
        drawn = torch.empty(0)
        t0 = self.clock.mark(logits.device)
        for j in range(max(widths)):
            if j > 0:
                keep = [row for row, b in enumerate(live) if widths[b] > j]
                if not keep:
                    break
                if len(keep) < len(live):
                    rows = to_device(keep, drawn.device)
                    drawn, hidden = drawn[rows], hidden[rows]
                    live = [live[row] for row in keep]
                batch = [
                    SeqInput(reqs[b].block_table, reqs[b].num_computed + j - 1, [0], [0])
                    for b in live
                ]
                self._fed += len(batch)
                step = self.runner.run(batch, hidden, False, ids=drawn)
                hidden, logits = step.hidden, step.logits
            params = [reqs[b].sampling for b in live]
            positions = [len(reqs[b].output_token_ids) + j for b in live]
            drawn, q = sample_logits(logits, params, positions, Stream.DRAFT)  # [B_j]
            drawn_at.append((live, drawn))
            sampled = iter(range(q.shape[0] if q is not None else 0))
            for b in live:
                if q is not None and not reqs[b].sampling.greedy:
                    probs[b].append(q[next(sampled)])
        self.clock.close(t0, logits.device, len(drawn_at))
        tokens = gather_rounds(drawn_at, len(reqs))
        return [
            DraftProposal((), torch.stack(p) if p else None, unread=t)
            for t, p in zip(tokens, probs, strict=True)
        ]

    def _chains_on_host(
        self,
        reqs: Sequence[Request],
        widths: Sequence[int],
        hidden: torch.Tensor,
        logits: torch.Tensor,
    ) -> list[DraftProposal]:
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        last = [hidden[b : b + 1] for b in range(len(reqs))]
        live = list(range(len(reqs)))
        ends = list(widths)  # where each chain ends: its grant, or where its confidence fell
        confidence = [1.0] * len(reqs)
        for j in range(max(widths)):
            if j > 0:
                live = [b for b in live if ends[b] > j]
                if not live:
                    break
                self.rounds.start()
                batch = [
                    SeqInput(
                        reqs[b].block_table, reqs[b].num_computed + j - 1, [tokens[b][-1]], [0]
                    )
                    for b in live
                ]
                self._fed += len(batch)
                step = self.runner.run(batch, torch.cat([last[b] for b in live]), False)
                hidden, logits = step.hidden, step.logits
            params = [reqs[b].sampling for b in live]
            positions = [len(reqs[b].output_token_ids) + j for b in live]
            spans = [Span(reqs[b], row, tuple(tokens[b]), j) for row, b in enumerate(live)]
            logits = process_spans(logits, spans)
            drawn, q = sample_logits(logits, params, positions, Stream.DRAFT)  # [B_j]
            rows = iter(range(q.shape[0] if q is not None else 0))
            for row, (b, token) in enumerate(zip(live, drawn.tolist(), strict=True)):
                last[b] = hidden[row : row + 1]
                tokens[b].append(token)
                if q is not None and not reqs[b].sampling.greedy:
                    probs[b].append(q[next(rows)])
            if self._stop_below > 0:
                self._stop_chains(logits, drawn, live, j, ends, confidence)
            if j > 0:
                self.rounds.stop()
        return [
            DraftProposal(tuple(t), torch.stack(p) if p else None)
            for t, p in zip(tokens, probs, strict=True)
        ]
