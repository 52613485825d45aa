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


def serve_refilling(engine: DecodeEngine, reqs: Sequence[Request], concurrency: int) -> float:
    """Serve ``reqs`` with at most ``concurrency`` in flight, starting the next one as soon as
    one finishes (a closed loop of ``concurrency`` clients): the batch stays full until the
    queue runs dry. Returns the wall seconds from the first admission to the last finish,
    prompts included."""
    queue = list(reqs)[::-1]
    live: list[Request] = []
    t0 = time.perf_counter()
    while queue or live:
        while queue and len(live) < concurrency:
            live.append(queue.pop())
            engine.add(live[-1], None)
        engine.step()
        live = [r for r in live if not r.is_finished]
    return time.perf_counter() - t0
