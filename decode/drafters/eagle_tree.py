"""Draft trees from an EAGLE head, for greedy requests: several candidates per depth.

A chain drafts the head's top token at each depth, so one miss ends the step's gain. A tree
keeps the ``width`` most likely nodes at every depth instead (by the head's cumulative log
probability, as EAGLE-2's dynamic trees do), each the parent of the next depth's candidates, and
the target verifies all of them in one forward (``models.tree``). For a greedy request the
target's token at each accepted node is fixed, so at most one child can match it and the walk
down the tree accepts exactly the tokens the target would have produced one by one.

The head runs one forward per depth over every request's newest nodes. A node at depth ``d``
reads its parent's predicted feature and its own token, sits at head position
``num_computed + d`` (its parent's plus one) and attends, in the head's own provisional KV, to
the true-feature positions and its ancestors only.
"""

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
    """One request's tree while it grows (node ids in creation order: parents first)."""

    req: Request
    depth: int  # levels of nodes to draft
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # cumulative head log probability
    frontier: list[int] = field(default_factory=list)  # the newest level's nodes
    features: list[torch.Tensor] = field(default_factory=list)  # [1, H] input of each frontier node

    def extend(self, logp: torch.Tensor, parents: Sequence[int], width: int) -> None:
        """Add the next level: logp [F, V] the head's log probabilities after each of
        ``parents`` (-1: the root); the ``width`` best children by cumulative score."""
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
    """Each request's tree of ``depths[i]`` levels of ``width`` nodes: (tokens, parents) per
    request and the tokens fed to the head. root_hidden [B, H] and root_logits [B, V] are the
    head's output at each request's newest true-feature position (its catch-up). Each level
    after the root is one round of head forwards, timed by ``rounds``."""
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
        out = runner.run(batch, torch.cat(feats), False)  # the head's own predictions
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
