"""EAGLE-2-style draft trees for greedy requests: the ``width`` best nodes per depth, every
tree's level chosen on the device at once and read in one copy (the next level's attention is
planned on the host from the chosen parents)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from models.device_copy import to_device
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

    def extend(self, chosen: Sequence[tuple[int, float, int]], parents: Sequence[int]) -> None:
        """Add the level ``_choose`` picked: (candidate, score, token), the candidate
        ``f * width + j`` being the j-th best child of ``parents[f]``."""
        width = len(chosen)
        self.frontier = []
        for cand, score, token in chosen:
            self.frontier.append(len(self.tokens))
            self.tokens.append(token)
            self.parents.append(parents[cand // width])
            self.scores.append(score)


def _choose(
    logits: torch.Tensor, base: Sequence[float], trees: int, width: int
) -> list[list[tuple[int, float, int]]]:
    """Per tree its ``width`` best children of its F frontier nodes by cumulative log
    probability, in one read: logits [trees * F, V], base [trees * F] the nodes' scores."""
    logp = torch.log_softmax(logits, dim=-1)
    top, ids = logp.topk(width, dim=-1)  # [trees * F, width]
    scores = to_device(list(base), top.device, torch.float32).unsqueeze(1)
    total = (scores + top.float()).view(trees, -1)  # [trees, F * width]
    best, cand = total.topk(width, dim=-1)  # [trees, width]
    token = ids.view(trees, -1).gather(1, cand)
    # one read: candidates and tokens are exact in float64, and so are float32 scores
    got = torch.stack([cand.double(), best.double(), token.double()], -1).tolist()
    return [[(int(c), s, int(t)) for c, s, t in row] for row in got]


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
    roots = _choose(root_logits, [0.0] * len(trees), len(trees), width)
    for b, (t, chosen) in enumerate(zip(trees, roots, strict=True)):
        t.extend(chosen, [-1])
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
        base = [t.scores[n] for t in live for n in t.frontier]
        row = 0
        for t, chosen in zip(live, _choose(out.logits, base, len(live), width), strict=True):
            parents, hidden = t.frontier, out.hidden[row : row + len(t.frontier)]  # [F, H]
            t.extend(chosen, parents)
            t.features = [hidden[parents.index(t.parents[c])].unsqueeze(0) for c in t.frontier]
            row += len(parents)
        if rounds is not None:
            rounds.stop()
    return [tuple(t.tokens) for t in trees], [tuple(t.parents) for t in trees], fed
