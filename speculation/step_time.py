"""The step-time model: what a decode step costs as a function of the tokens it scores, and
how a replica keeps it current.

``StepTimeModel`` interpolates measured ``(tokens, seconds)`` points; the engine's adaptive
speculation, the router and the simulator all price steps with it. A replica measures one at
start-up (``runtime.step_timing``) and then refines it from the steps it runs
(``StepTimeTracker``). Every model is made non-decreasing in tokens (``isotonic``): noise must
never make a bigger step look cheaper.
"""

from __future__ import annotations

import bisect
import functools
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class StepTimeModel:
    """Step time as a function of tokens per forward, from measured points.

    ``points`` are ``(tokens, seconds)`` sorted by tokens; between points the time is linearly
    interpolated, beyond the last it grows with the last segment's slope (or proportionally,
    with a single point), below the first it is the first point's time.
    """

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a step-time model needs at least one measured point")
        if any(b[0] <= a[0] for a, b in zip(self.points, self.points[1:], strict=False)):
            raise ValueError("step-time points must have strictly increasing token counts")

    @classmethod
    def linear(cls, base_s: float, per_token_s: float, max_tokens: int = 4096) -> StepTimeModel:
        """``base + per_token * tokens`` (for analytical profiles, e.g. a GPU on paper)."""
        return cls(((1, base_s + per_token_s), (max_tokens, base_s + per_token_s * max_tokens)))

    def predict(self, tokens: int) -> float:
        pts = self.points
        if tokens <= pts[0][0]:
            return pts[0][1]
        i = bisect.bisect_left(self._xs, tokens)
        if i < len(pts):
            (x0, y0), (x1, y1) = pts[i - 1], pts[i]
            return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[-2] if len(pts) > 1 else (0, 0.0), pts[-1]
        return y1 + (y1 - y0) / (x1 - x0) * (tokens - x1)

    def predict_many(self, tokens: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """``predict`` over an array of token counts at once (the router scores every replica
        in one call, the planner every step size): the same arithmetic, so the same floats."""
        x = np.asarray(tokens, dtype=np.float64)
        xs, ys = self._arrays
        i = np.searchsorted(xs, x, side="left")  # bisect_left
        if xs.size > 1:
            j = np.clip(i, 1, xs.size - 1)
            x0, y0, x1, y1 = xs[j - 1], ys[j - 1], xs[j], ys[j]
        else:  # one point: proportional beyond it, as from the origin
            x0, y0, x1, y1 = np.zeros_like(x), np.zeros_like(x), xs[[0]], ys[[0]]
        inside = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        beyond = y1 + (y1 - y0) / (x1 - x0) * (x - x1)
        out: npt.NDArray[np.float64] = np.where(
            x <= xs[0], ys[0], np.where(i < xs.size, inside, beyond)
        )
        return out

    @functools.cached_property
    def _xs(self) -> tuple[int, ...]:
        return tuple(p[0] for p in self.points)

    @functools.cached_property
    def _arrays(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        xs = np.array([p[0] for p in self.points], dtype=np.float64)
        return xs, np.array([p[1] for p in self.points], dtype=np.float64)


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


class StepTimeTracker:
    """The start-up model, refined by the wall time of the steps this replica actually runs.

    ``observe`` after every step (its tokens scored, its seconds: forward, sampling and
    lookup, the draft rounds left out: ``speculation.draft_cost``);
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
