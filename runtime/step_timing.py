"""Measuring a worker's step-time model (``speculation.step_time``) at start-up, cached on disk."""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtransfer.allocator import BlockAllocator
from runtime.runner import ModelRunner, SeqInput, synchronize
from speculation.step_time import StepTimeModel, isotonic

log = logging.getLogger(__name__)
CONTEXT = 128
# bumped when measurement, fit or the step's cost change, so cached models are re-measured
METHOD = 7


def calibration_points(max_batch: int, max_width: int, token_budget: int) -> list[tuple[int, int]]:
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
    device: str = "cpu",
) -> StepTimeModel:
    """Fastest of ``repeats`` per shape, interleaved: a load burst inflates a sample only."""
    per_seq = math.ceil((CONTEXT + max(w for _, w in shapes)) / block_size)
    shapes = [s for s in shapes if s[0] * per_seq <= allocator.num_free] or [(1, 1)]
    largest = max(b for b, _ in shapes)
    blocks = allocator.allocate(largest * per_seq)
    try:
        tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(largest)]
        runner.run([SeqInput(t, 0, [1] * CONTEXT, []) for t in tables])
        fastest: dict[tuple[int, int], float] = {}
        for _ in range(repeats):
            for batch, width in shapes:
                step = [
                    SeqInput(t, CONTEXT, [1] * width, list(range(width))) for t in tables[:batch]
                ]
                synchronize(device)
                t0 = time.perf_counter()
                runner.run(step)
                synchronize(device)
                dt = time.perf_counter() - t0
                fastest[(batch, width)] = min(dt, fastest.get((batch, width), math.inf))
    finally:
        allocator.free(blocks)
    by_tokens: dict[int, list[float]] = {}
    for (batch, width), dt in fastest.items():
        by_tokens.setdefault(batch * width, []).append(dt)
    points = [(n, statistics.mean(v)) for n, v in sorted(by_tokens.items())]
    return StepTimeModel(isotonic(points))


def cached_step_time(path: Path | None, measure: Callable[[], StepTimeModel]) -> StepTimeModel:
    if path is not None and path.exists():
        pts = json.loads(path.read_text())
        return StepTimeModel(tuple((int(n), float(t)) for n, t in pts))
    model = measure()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(model.points))
    log.info("step-time model: %s", model.points)
    return model
