"""Draft rounds whose tokens stay on the device until the last one: read in one copy, and each
round's share of the rounds' time recorded (no round ends in a read of its own to time it by)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from speculation.draft_cost import DraftRounds


def read_rounds(
    drawn_at: Sequence[tuple[Sequence[int], torch.Tensor]],
    num_reqs: int,
    rounds: DraftRounds,
    started: float,
) -> list[list[int]]:
    """Per request its drafted tokens. ``drawn_at``: per round, the requests it drafted for
    and their tokens [B_j] on the device; round 0 samples the catch-up's logits, the rest are
    the head's or draft model's forwards, timed from ``started`` (a ``perf_counter``)."""
    tokens: list[list[int]] = [[] for _ in range(num_reqs)]
    if not drawn_at:
        return tokens
    flat = iter(torch.cat([d for _, d in drawn_at]).tolist())  # the drafts' one read
    for reqs, _ in drawn_at:
        for i in reqs:
            tokens[i].append(next(flat))
    if len(drawn_at) > 1:  # each round's share, the read included
        spent = (time.perf_counter() - started) / len(drawn_at)
        for _ in range(len(drawn_at) - 1):
            rounds.observe(spent)
    return tokens
