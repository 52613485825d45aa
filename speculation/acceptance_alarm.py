"""Acceptance collapse: a cell realising under ``ratio`` times the acceptance its requests'
starting estimates predicted; reported on /health, its new requests start from the realised rate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Collapse:
    temperature_bin: int
    probe_bin: int
    drafted: float
    realised: float
    expected: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "temperature_bin": self.temperature_bin,
            "probe_bin": self.probe_bin,
            "drafted": round(self.drafted, 1),
            "realised": round(self.realised, 4),
            "expected": round(self.expected, 4),
        }


class AcceptanceAlarm:
    def __init__(self, ratio: float, window_tokens: float) -> None:
        if not 0.0 < ratio < 1.0 or window_tokens <= 0:
            raise ValueError(
                f"acceptance alarm: ratio must lie in (0, 1) and the window be positive "
                f"(got {ratio}, {window_tokens})"
            )
        self.ratio = ratio
        self.window_tokens = float(window_tokens)
        # cell -> (drafted, accepted, predicted accepted), decayed to the window
        self._cells: dict[tuple[int, int], tuple[float, float, float]] = {}

    def record(self, key: tuple[int, int], estimate: float, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        d, a, e = self._cells.get(key, (0.0, 0.0, 0.0))
        d, a, e = d + drafted, a + accepted, e + estimate * drafted
        if d > self.window_tokens:
            scale = self.window_tokens / d
            d, a, e = self.window_tokens, a * scale, e * scale
        self._cells[key] = (d, a, e)

    def _collapsed(self, key: tuple[int, int]) -> Collapse | None:
        d, a, e = self._cells.get(key, (0.0, 0.0, 0.0))
        if d < self.window_tokens / 2 or a >= self.ratio * e:
            return None
        return Collapse(key[0], key[1], d, a / d, e / d)

    def collapsed(self) -> tuple[Collapse, ...]:
        out = (self._collapsed(k) for k in sorted(self._cells))
        return tuple(c for c in out if c is not None)

    def backoff(self, key: tuple[int, int], estimate: float) -> float:
        """``estimate``, or the cell's realised rate where lower while the cell is collapsed."""
        c = self._collapsed(key)
        return estimate if c is None else min(estimate, c.realised)
