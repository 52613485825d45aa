"""Chunked prefill: first come, first served, at most ``budget`` tokens per forward."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int
    end: int


def plan_chunks(remaining: Sequence[tuple[int, int]], budget: int) -> list[Chunk]:
    """``remaining``: per queued prompt ``(num_computed, prompt_len)``, in arrival order."""
    out: list[Chunk] = []
    for i, (done, total) in enumerate(remaining):
        if budget <= 0:
            break
        take = min(total - done, budget)
        if take > 0:
            out.append(Chunk(i, done, done + take))
            budget -= take
    return out


def window_rows(chunk: Chunk, prompt_len: int, window: int) -> list[int]:
    """Offsets inside ``chunk`` of the probe window (the prompt's last ``window`` positions)."""
    lo = max(prompt_len - window, chunk.start)
    return [p - chunk.start for p in range(lo, chunk.end)]
