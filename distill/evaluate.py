"""Teacher-forced acceptance of an EAGLE head on held-out conversations: at depth ``d`` the head
drafts from its own predictions, accepted with chance ``sum_x min(p(x), q(x))``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from distill.data import Corpus, check_streams
from distill.objective import teacher_forced_overlap, unrolled_forward
from models.eagle import EagleHead
from speculation.goodput import expected_tokens


@dataclass(frozen=True)
class Acceptance:
    temperature: float
    per_depth: tuple[float, ...]  # mean acceptance probability of the d-th draft token
    positions: int

    def expected_tokens(self, k: int) -> float:
        """Tokens per target forward with ``k`` drafts, every depth at the depth-1 rate."""
        return expected_tokens(self.per_depth[0], k)

    def chain_tokens(self, k: int) -> float:
        """``1 + sum_d prod_{j <= d} a_j``: the per-depth rates taken as independent."""
        total, run = 1.0, 1.0
        for a in self.per_depth[:k]:
            run *= a
            total += run
        return total


@torch.no_grad()
def held_out_drafts(
    head: EagleHead, corpus: Corpus, target_lm: torch.Tensor, depth: int, rows: int | None = None
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Per row and depth ``d`` (0-based): head and target logits [n, V] at the held-out positions
    whose next-but-one token the assistant generated. target_lm: [V, H], the full LM head."""
    dev = head.device
    lm = target_lm.to(dev, torch.float32)
    check_streams(head, corpus)
    for r in range(corpus.num_rows if rows is None else min(rows, corpus.num_rows)):
        f, x, gen = corpus.row(r)
        t = x.shape[0] - 1  # head positions s = 0 .. t - 1
        f = f.to(dev, torch.float32)
        inp = corpus.inputs(r, head.cfg.eagle3)[:-1].to(dev, torch.float32)
        outs = unrolled_forward(head, x[1:].unsqueeze(0).to(dev), inp.unsqueeze(0), depth)
        s = torch.arange(t)
        labelled = torch.zeros(t, dtype=torch.bool)
        labelled[: t - 1] = gen[2:]  # x_{s+2} is a generated token of the transcript
        target_logits = f[1:] @ lm.t()  # [t, V] the target's distribution of x_{s+2}
        for d, g in enumerate(outs):
            keep = (labelled & (s >= d)).to(dev)
            if bool(keep.any()):
                yield d, head.logits(g[0][keep]), target_logits[keep]


@torch.no_grad()
def evaluate(
    head: EagleHead,
    corpus: Corpus,
    target_lm: torch.Tensor,
    depth: int,
    temperatures: Sequence[float],
    rows: int | None = None,
) -> list[Acceptance]:
    sums = torch.zeros(len(temperatures), depth, dtype=torch.float64)
    counts = torch.zeros(depth, dtype=torch.float64)
    for d, draft, target in held_out_drafts(head, corpus, target_lm, depth, rows):
        counts[d] += draft.shape[0]
        for i, temp in enumerate(temperatures):
            sums[i, d] += float(teacher_forced_overlap(draft, target, temp).sum())
    means = sums / counts.clamp_min(1.0)
    return [
        Acceptance(temp, tuple(float(v) for v in means[i]), int(counts[0]))
        for i, temp in enumerate(temperatures)
    ]
