"""Step-time model: seconds per decode step by tokens scored, made non-decreasing (``isotonic``)
so that noise never makes a bigger step look cheaper."""

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
    """Step time from measured ``(tokens, seconds)`` points sorted by tokens: linear between them,
    the last segment's slope beyond them (proportional with one point), flat below the first."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a step-time model needs at least one measured point")
        if any(b[0] <= a[0] for a, b in zip(self.points, self.points[1:], strict=False)):
            raise ValueError("step-time points must have strictly increasing token counts")

    @classmethod
    def linear(cls, base_s: float, per_token_s: float, max_tokens: int = 4096) -> StepTimeModel:
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
        """``predict`` over an array of token counts: the same arithmetic, so the same floats."""
        x = np.asarray(tokens, dtype=np.float64)
        xs, ys = self._arrays
        i = np.searchsorted(xs, x, side="left")
        if xs.size > 1:
            j = np.clip(i, 1, xs.size - 1)
            x0, y0, x1, y1 = xs[j - 1], ys[j - 1], xs[j], ys[j]
        else:
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
    """The non-decreasing least-squares fit of points sorted by tokens (pool adjacent violators)."""
    pools: list[tuple[float, int]] = []
    for _, t in points:
        mean, size = t, 1
        while pools and pools[-1][0] > mean:
            m, s = pools.pop()
            mean, size = (m * s + mean * size) / (s + size), s + size
        pools.append((mean, size))
    values = [m for m, s in pools for _ in range(s)]
    return tuple((n, v) for (n, _), v in zip(points, values, strict=True))


class StepTimeTracker:
    """The start-up model refined by observed steps (target forward only, draft rounds excluded);
    replaced only when a point moves over ``tolerance``, so routers see it change when it did."""

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
        self._recent: dict[int, deque[tuple[int, float]]] = {}
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
