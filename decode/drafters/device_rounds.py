"""Draft rounds whose tokens stay on the device: gathered per request there, read with the
step's verification, and each round's share of the rounds' time recorded once that read has
waited for them (no round ends in a read of its own to time it by)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from decode.drafters.base import DraftProposal
from models.device_copy import to_device
from speculation.draft_cost import DraftRounds


def gather_rounds(
    drawn_at: Sequence[tuple[Sequence[int], torch.Tensor]], num_reqs: int
) -> list[torch.Tensor]:
    """Per request [n_i] its drafted tokens, on the device. ``drawn_at``: per round, the
    requests it drafted for and their tokens [B_j]."""
    index: list[list[int]] = [[] for _ in range(num_reqs)]
    at = 0
    for reqs, drawn in drawn_at:
        for row, i in enumerate(reqs):
            index[i].append(at + row)
        at += drawn.shape[0]
    if not drawn_at:
        return [torch.empty(0, dtype=torch.long) for _ in index]
    flat = torch.cat([d for _, d in drawn_at])  # [sum B_j]
    order = to_device([j for idx in index for j in idx], flat.device, torch.long)
    return list(torch.split(flat[order], [len(idx) for idx in index]))


def read_proposals(proposals: Sequence[DraftProposal]) -> list[DraftProposal]:
    """``proposals`` with their unread tokens read, in one copy (a step that cannot take its
    drafts from the device)."""
    unread = [p.unread for p in proposals if p.unread is not None]
    if not unread:
        return list(proposals)
    flat = iter(torch.cat(unread).tolist())
    return [
        p
        if p.unread is None
        else replace(p, tokens=tuple(next(flat) for _ in range(p.size)), unread=None)
        for p in proposals
    ]


@dataclass(frozen=True)
class _Span:
    start: float | torch.cuda.Event
    end: float | torch.cuda.Event
    rounds: int  # rounds after the first, each charged an equal share


class RoundsClock:
    """Times rounds that end without a read: CUDA events on a GPU, whose elapsed time is known
    once the step's read has waited on them; the wall clock elsewhere (ops finish as they run)."""

    def __init__(self, rounds: DraftRounds) -> None:
        self.rounds = rounds
        self._open: list[_Span] = []

    @staticmethod
    def mark(device: torch.device) -> float | torch.cuda.Event:
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def close(self, start: float | torch.cuda.Event, device: torch.device, rounds: int) -> None:
        """``rounds`` rounds (the first, sampling the catch-up's logits, included) ran since
        ``start``: each but the first is charged an equal share of the time."""
        if rounds > 1:
            self._open.append(_Span(start, self.mark(device), rounds))

    def settle(self) -> None:
        for span in self._open:
            if isinstance(span.start, float) and isinstance(span.end, float):
                seconds = span.end - span.start
            else:
                assert isinstance(span.start, torch.cuda.Event)
                assert isinstance(span.end, torch.cuda.Event)
                span.end.synchronize()  # done already after the step's read: no wait
                seconds = span.start.elapsed_time(span.end) / 1000
            for _ in range(span.rounds - 1):
                self.rounds.observe(seconds / span.rounds)
        self._open.clear()
