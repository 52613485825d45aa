"""Driving a decode engine in-process for benchmarks."""

from __future__ import annotations

import time
from collections.abc import Sequence

from decode.engine import DecodeEngine
from models.request import Request


def decode_after_first(
    engine: DecodeEngine, reqs: Sequence[Request], finish_s: dict[str, float] | None = None
) -> float:
    """Run ``reqs`` together to the end; returns the seconds spent after every request has its
    first token (decode time, prompts excluded). ``finish_s``, when given, receives each
    request's finish time on the same clock."""
    for r in reqs:
        engine.add(r, None)
    while any(not r.output_token_ids and not r.is_finished for r in reqs):
        engine.step()
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
        if finish_s is not None:
            now = time.perf_counter() - t0
            for r in reqs:
                if r.is_finished and r.request_id not in finish_s:
                    finish_s[r.request_id] = now
    return time.perf_counter() - t0
