"""Chunked prefill scheduling: which prompt tokens go into the next forward.

Prompts are served first come, first served; each forward carries at most ``budget`` tokens,
taken from as many prompts as fit, so a long prompt is split over several forwards and never
holds the pool or the step hostage, while short prompts behind it still make progress.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    index: int  # position of the prompt in the queue
    start: int  # first prompt position computed in this forward
    end: int  # one past the last


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
    """Offsets inside ``chunk`` of the prompt positions in the probe window (the last ``window``
    positions; the very last one also gives the first token's distribution)."""
    lo = max(prompt_len - window, chunk.start)
    return [p - chunk.start for p in range(lo, chunk.end)]
