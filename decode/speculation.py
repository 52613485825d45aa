"""How many tokens each request speculates this step: pinned, or chosen for goodput.

Adaptive mode picks ``k_i`` per request to maximise the step's expected goodput
(``decode.goodput``) from each request's acceptance estimate — prefill's probe at first, then
the running average of what it actually accepts — and a step-time model measured on this
replica at start-up. Pinned mode always asks for ``k``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

from decode.goodput import StepTimeModel, choose_ks
from kvtransfer.allocator import BlockAllocator
from models.request import Request
from models.runner import ModelRunner, SeqInput

log = logging.getLogger(__name__)
DEFAULT_ACCEPTANCE = 0.5  # before a request has a probe or any verified step
CONTEXT = 128  # tokens of context the calibration steps attend over


class SpeculationPolicy:
    def __init__(self, k_max: int, step_time: StepTimeModel | None) -> None:
        self.k_max = k_max
        self.step_time = step_time  # None: pinned k

    @property
    def adaptive(self) -> bool:
        return self.step_time is not None

    def choose(
        self, reqs: Sequence[Request], caps: Sequence[int], fixed_tokens: int, budget: int
    ) -> list[int]:
        """Per request, the draft tokens to verify (each at most its cap)."""
        caps = [min(c, self.k_max) for c in caps]
        if self.step_time is None:
            out, left = [], budget - len(reqs)
            for c in caps:
                k = max(0, min(c, left))
                out.append(k)
                left -= k
            return out
        alphas = [
            r.acceptance_estimate if r.acceptance_estimate is not None else DEFAULT_ACCEPTANCE
            for r in reqs
        ]
        return choose_ks(alphas, self.step_time, caps, budget, fixed_tokens)


def calibration_points(max_batch: int, max_width: int, token_budget: int) -> list[tuple[int, int]]:
    """(sequences, tokens each) shapes spanning the steps this replica will run."""
    shapes = set()
    batch = 1
    while batch <= max_batch:
        for width in (1, 2, 3, 5, max_width):
            if width <= max_width and batch * width <= token_budget:
                shapes.add((batch, width))
        batch *= 2
    return sorted(shapes, key=lambda s: s[0] * s[1])


def measure_step_time(
    runner: ModelRunner,
    allocator: BlockAllocator,
    block_size: int,
    shapes: Sequence[tuple[int, int]],
    repeats: int = 3,
) -> StepTimeModel:
    """Time the target's forward over each shape (median of ``repeats``), in scratch blocks;
    shapes whose KV would not fit in the free pool are left out."""
    per_seq = math.ceil((CONTEXT + max(w for _, w in shapes)) / block_size)
    shapes = [s for s in shapes if s[0] * per_seq <= allocator.num_free] or [(1, 1)]
    largest = max(b for b, _ in shapes)
    blocks = allocator.allocate(largest * per_seq)
    try:
        tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(largest)]
        runner.run([SeqInput(t, 0, [1] * CONTEXT, []) for t in tables])
        by_tokens: dict[int, list[float]] = {}
        for batch, width in shapes:
            step = [SeqInput(t, CONTEXT, [1] * width, list(range(width))) for t in tables[:batch]]
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                runner.run(step)
                times.append(time.perf_counter() - t0)
            by_tokens.setdefault(batch * width, []).append(sorted(times)[len(times) // 2])
    finally:
        allocator.free(blocks)
    points = tuple((n, sum(v) / len(v)) for n, v in sorted(by_tokens.items()))
    return StepTimeModel(_monotone(points))


def _monotone(points: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
    """Noise can make a bigger step look cheaper; a model must never reward that."""
    out, best = [], 0.0
    for n, t in points:
        best = max(best, t)
        out.append((n, best))
    return tuple(out)


def cached_step_time(path: Path | None, measure: object) -> StepTimeModel:
    """Load a measured model from ``path``, or measure (``measure()``) and store it there."""
    if path is not None and path.exists():
        pts = json.loads(path.read_text())
        return StepTimeModel(tuple((int(n), float(t)) for n, t in pts))
    assert callable(measure)
    model: StepTimeModel = measure()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(model.points))
    log.info("step-time model: %s", model.points)
    return model
