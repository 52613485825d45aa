"""Driving a decode engine in-process for benchmarks."""

from __future__ import annotations

import time
from collections.abc import Sequence

from decode.engine import DecodeEngine
from models.request import Request


def decode_after_first(engine: DecodeEngine, reqs: Sequence[Request]) -> float:
    """Run ``reqs`` together to the end; returns the seconds spent after every request has its
    first token (decode time, prompts excluded)."""
    for r in reqs:
        engine.add(r, None)
    while any(not r.output_token_ids and not r.is_finished for r in reqs):
        engine.step()
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
    return time.perf_counter() - t0
