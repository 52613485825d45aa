"""Where a replica's step-time model comes from: measured at start-up, refined while serving.

At start-up (``measure_step_time``) the target's forward is timed over a grid of shapes
(sequences x tokens each); the shapes are interleaved across repeats and each keeps its
fastest run, so a burst of load from another process inflates one sample, not one shape.
The result is cached on disk per model, dtype, device, TP size and thread count.

A cached or start-up model can still be wrong for the hours that follow: it may have been
measured while the machine was busy, contexts grow, and a real step also drafts and samples.
``StepTimeTracker`` records every decode step the replica runs (steps carrying a prompt chunk
are left out: a chunk's tokens cost less each than one token of each of many sequences, and
the model prices drafts) and rebuilds the model from them every few steps: token counts seen
often enough take the median of their recent wall times;
start-up points not seen are scaled by how far the seen ones moved (the calibration's shape,
today's level). Every model is made non-decreasing in tokens (a least-squares isotonic fit):
noise must never make a bigger step look cheaper.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from decode.goodput import StepTimeModel
from kvtransfer.allocator import BlockAllocator
from models.runner import ModelRunner, SeqInput

log = logging.getLogger(__name__)
CONTEXT = 128  # tokens of context the calibration steps attend over
METHOD = 4  # bumped when measurement or fit change, so cached models are re-measured


def isotonic(points: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """The non-decreasing least-squares fit of ``(tokens, seconds)`` points sorted by tokens
    (pool adjacent violators): a dip between two slower points is averaged away, not kept."""
    pools: list[tuple[float, int]] = []  # (mean seconds, points pooled)
    for _, t in points:
        mean, size = t, 1
        while pools and pools[-1][0] > mean:
            m, s = pools.pop()
            mean, size = (m * s + mean * size) / (s + size), s + size
        pools.append((mean, size))
    values = [m for m, s in pools for _ in range(s)]
    return tuple((n, v) for (n, _), v in zip(points, values, strict=True))


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
    """Time the target's forward over each shape (fastest of ``repeats``, shapes interleaved),
    in scratch blocks; shapes whose KV would not fit in the free pool are left out."""
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
                t0 = time.perf_counter()
                runner.run(step)
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
    """Load a measured model from ``path``, or measure (``measure()``) and store it there."""
    if path is not None and path.exists():
        pts = json.loads(path.read_text())
        return StepTimeModel(tuple((int(n), float(t)) for n, t in pts))
    model = measure()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(model.points))
    log.info("step-time model: %s", model.points)
    return model


class StepTimeTracker:
    """The start-up model, refined by the wall time of the steps this replica actually runs.

    ``observe`` after every step (its tokens scored, its seconds: forward, sampling and
    lookup, the draft rounds left out: ``decode.draft_rounds``);
    ``model`` is rebuilt every ``refit_every`` observations, and replaced only when some point
    moved by more than ``tolerance`` (relative): the model is published to the routers, which
    tabulate each distinct one, so it changes when the replica did, not with every jitter.
    Steps are grouped by token count (exactly up to 16 tokens, in eighths of an octave above,
    where prompt chunks make every count rare); a group needs ``min_samples`` recent steps
    (the last ``window`` are kept) before its medians override the start-up model; counts never
    seen keep the start-up shape, scaled by the median ratio of
    seen to predicted times. Unseen wide steps stay at their (scaled) calibrated cost, so a
    stale model that overprices speculation only makes it cautious, and one that underprices
    it is corrected by the very steps it causes.
    """

    def __init__(
        self,
        base: StepTimeModel,
        refit_every: int = 16,
        min_samples: int = 3,
        window: int = 16,
        tolerance: float = 0.05,
    ) -> None:
        self.base = base
        self.model = base
        self.refit_every = refit_every
        self.min_samples = min_samples
        self.window = window
        self.tolerance = tolerance
        self._recent: dict[int, deque[tuple[int, float]]] = {}  # group -> (tokens, seconds)
        self._since_refit = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        group = tokens if tokens <= 16 else round(8 * math.log2(tokens))
        self._recent.setdefault(group, deque(maxlen=self.window)).append((tokens, seconds))
        self._since_refit += 1
        if self._since_refit >= self.refit_every:
            self._since_refit = 0
            new = self._refit()
            if _moved(self.model, new, self.tolerance):
                self.model = new

    def _refit(self) -> StepTimeModel:
        seen = {
            round(statistics.median(n for n, _ in d)): statistics.median(t for _, t in d)
            for d in self._recent.values()
            if len(d) >= self.min_samples
        }
        if not seen:
            return self.model
        scale = statistics.median(t / self.base.predict(n) for n, t in seen.items())
        points = {n: t * scale for n, t in self.base.points}
        points.update(seen)
        return StepTimeModel(isotonic(sorted(points.items())))


def _moved(old: StepTimeModel, new: StepTimeModel, tolerance: float) -> bool:
    if [n for n, _ in old.points] != [n for n, _ in new.points]:
        return True
    return any(
        abs(b - a) > tolerance * a for (_, a), (_, b) in zip(old.points, new.points, strict=True)
    )
