"""The goodput model: what a decode step costs and what it yields (the speculation lengths that
make the most of it: ``decode.draft_plan``).

One model serves the engine's adaptive speculation length, the acceptance-aware router and the
router simulator, so all three agree on what a replica can do:

- a sequence with per-token acceptance rate ``a`` that verifies ``k`` draft tokens (a step of
  width ``k + 1``) emits on average ``(1 - a^(k+1)) / (1 - a)`` tokens;
- a step costs ``StepTimeModel.predict(tokens)`` seconds, where ``tokens`` is what the target
  scores in one forward (every running sequence's ``1 + k``);
- goodput is emitted tokens per second: the sum of the first over the second.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens one step emits for a sequence verifying ``k`` drafts."""
    a = min(max(alpha, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


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
        in one call): the same interpolation, clamping and extrapolation."""
        x = np.asarray(tokens, dtype=np.float64)
        xs, ys = self._arrays
        (x0, y0), (x1, y1) = self.points[-2] if len(self.points) > 1 else (0, 0.0), self.points[-1]
        slope = (y1 - y0) / (x1 - x0)
        out: npt.NDArray[np.float64] = np.interp(x, xs, ys) + slope * np.maximum(x - x1, 0.0)
        return out

    @functools.cached_property
    def _xs(self) -> tuple[int, ...]:
        return tuple(p[0] for p in self.points)

    @functools.cached_property
    def _arrays(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        xs = np.array([p[0] for p in self.points], dtype=np.float64)
        return xs, np.array([p[1] for p in self.points], dtype=np.float64)


def goodput(alphas: Sequence[float], ks: Sequence[int], model: StepTimeModel) -> float:
    """Emitted tokens per second of one step over the batch."""
    tokens = sum(1 + k for k in ks)
    if tokens == 0:
        return 0.0
    emitted = sum(expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True))
    return emitted / model.predict(tokens)
