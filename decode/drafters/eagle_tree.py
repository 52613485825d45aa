"""EAGLE-2-style draft trees for greedy requests: the ``width`` best nodes per depth."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from models.request import Request
from models.tree import TreeSpan
from runtime.runner import EagleRunner, SeqInput
from speculation.draft_cost import DraftRounds


@dataclass
class _Tree:
    req: Request
    depth: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    frontier: list[int] = field(default_factory=list)  # the newest level's nodes
    features: list[torch.Tensor] = field(default_factory=list)  # [1, H] input of each frontier node

    def extend(self, logp: torch.Tensor, parents: Sequence[int], width: int) -> None:
        """Add the ``width`` best children of ``parents`` by cumulative score; logp: [F, V]."""
        base = torch.tensor([self.scores[p] if p >= 0 else 0.0 for p in parents])  # [F]
        top, ids = logp.topk(width, dim=-1)  # [F, width]
        total = (base.unsqueeze(1) + top.cpu()).view(-1)  # [F * width]
        best = total.topk(min(width, total.numel())).indices.tolist()
        flat_ids = ids.cpu().view(-1)
        self.frontier = []
        for j in best:
            self.frontier.append(len(self.tokens))
            self.tokens.append(int(flat_ids[j]))
            self.parents.append(parents[j // width])
            self.scores.append(float(total[j]))


def grow_trees(
    runner: EagleRunner,
    reqs: Sequence[Request],
    depths: Sequence[int],
    root_hidden: torch.Tensor,
    root_logits: torch.Tensor,
    width: int,
    rounds: DraftRounds | None = None,
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], int]:
    """Per request (tokens, parents), and the tokens fed; root_hidden [B, H], root_logits [B, V]."""
    trees = [_Tree(r, d) for r, d in zip(reqs, depths, strict=True)]
    for b, t in enumerate(trees):
        t.extend(torch.log_softmax(root_logits[b : b + 1], dim=-1), [-1], width)
        t.features = [root_hidden[b : b + 1]] * len(t.frontier)
    fed = 0
    for level in range(1, max(depths, default=0)):
        live = [t for t in trees if t.depth > level]
        if not live:
            break
        if rounds is not None:
            rounds.start()
        batch, feats = [], []
        for t in live:
            first = t.frontier[0]
            span = TreeSpan(t.req.num_computed, tuple(t.parents[: first + len(t.frontier)]))
            ids = [t.tokens[n] for n in t.frontier]
            batch.append(
                SeqInput(t.req.block_table, t.req.num_computed + first, ids, range(len(ids)), span)
            )
            feats.extend(t.features)
            fed += len(ids)
        out = runner.run(batch, torch.cat(feats), False)
        logp = torch.log_softmax(out.logits, dim=-1)  # [sum F, V]
        row = 0
        for t in live:
            n = len(t.frontier)
            parents, hidden = t.frontier, out.hidden[row : row + n]  # [F, H]
            t.extend(logp[row : row + n], parents, width)
            t.features = [hidden[parents.index(t.parents[c])].unsqueeze(0) for c in t.frontier]
            row += n
        if rounds is not None:
            rounds.stop()
    return [tuple(t.tokens) for t in trees], [tuple(t.parents) for t in trees], fed
