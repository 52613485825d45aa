"""Acceptance calibration per (temperature bin, probe bin) cell: a request starts from its cell's
realised rate shrunk toward the probe or prior by ``PRIOR_TOKENS``; routers sum replicas' cells."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

TEMPERATURE_EDGES = (0.5, 1.0)  # bins: greedy | (0, 0.5] | (0.5, 1.0] | above 1.0
PROBE_BINS = 5  # probe bins of width 1/5; bin 0 holds requests without a probe
PRIOR_TOKENS = 32.0
WINDOW_TOKENS = 4096.0
DEFAULT_ACCEPTANCE = 0.5


@dataclass(frozen=True)
class Cell:
    temperature_bin: int
    probe_bin: int
    drafted: float
    accepted: float

    @property
    def key(self) -> tuple[int, int]:
        return (self.temperature_bin, self.probe_bin)


def calibration_key(probe: float | None, temperature: float) -> tuple[int, int]:
    """Cell of a request with prefill ``probe`` (None: none ran) at ``temperature`` (0: greedy)."""
    t_bin = 0 if temperature <= 0.0 else 1 + sum(temperature > e for e in TEMPERATURE_EDGES)
    p_bin = 0 if probe is None else 1 + min(int(max(probe, 0.0) * PROBE_BINS), PROBE_BINS - 1)
    return (t_bin, p_bin)


def calibrated(drafted: float, accepted: float, fallback: float) -> float:
    if drafted <= 0.0:
        return fallback
    return (accepted + PRIOR_TOKENS * fallback) / (drafted + PRIOR_TOKENS)


class AcceptanceCalibration:
    def __init__(self) -> None:
        self._counts: dict[tuple[int, int], tuple[float, float]] = {}

    def record(self, key: tuple[int, int], drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        d0, a0 = self._counts.get(key, (0.0, 0.0))
        d, a = d0 + drafted, a0 + accepted
        if d > WINDOW_TOKENS:
            d, a = WINDOW_TOKENS, a * WINDOW_TOKENS / d
        self._counts[key] = (d, a)

    def estimate(self, key: tuple[int, int], fallback: float) -> float:
        d, a = self._counts.get(key, (0.0, 0.0))
        return calibrated(d, a, fallback)

    def cells(self) -> tuple[Cell, ...]:
        return tuple(Cell(t, p, d, a) for (t, p), (d, a) in sorted(self._counts.items()))

    def seed(self, cells: Iterable[Cell]) -> float:
        """Seed from peers' summed cells, at most ``WINDOW_TOKENS`` each; returns tokens seeded."""
        total = 0.0
        for c in cells:
            if c.drafted <= 0:
                continue
            scale = min(1.0, WINDOW_TOKENS / c.drafted)
            d, a = c.drafted * scale, c.accepted * scale
            d0, a0 = self._counts.get(c.key, (0.0, 0.0))
            self._counts[c.key] = (d0 + d, a0 + a)
            total += d
        return total


def cells_from(rows: Iterable[Iterable[float]]) -> tuple[Cell, ...]:
    out = []
    for row in rows:
        t, p, d, a = row
        out.append(Cell(int(t), int(p), float(d), float(a)))
    return tuple(out)


class CalibrationPool:
    def __init__(self) -> None:
        self._by_row: dict[int, tuple[Cell, ...]] = {}
        self._sums: dict[tuple[int, int], tuple[float, float]] = {}

    def put(self, row: int, cells: tuple[Cell, ...]) -> None:
        self._add(self._by_row.get(row, ()), -1.0)
        self._by_row[row] = cells
        self._add(cells, 1.0)

    def clear(self, row: int) -> None:
        self._add(self._by_row.pop(row, ()), -1.0)

    def _add(self, cells: tuple[Cell, ...], sign: float) -> None:
        for c in cells:
            d, a = self._sums.get(c.key, (0.0, 0.0))
            d, a = d + sign * c.drafted, a + sign * c.accepted
            if d <= 1e-9:
                self._sums.pop(c.key, None)
            else:
                self._sums[c.key] = (d, max(a, 0.0))

    def keys(self) -> set[tuple[int, int]]:
        return set(self._sums)

    def estimate(self, key: tuple[int, int], fallback: float) -> float:
        d, a = self._sums.get(key, (0.0, 0.0))
        return calibrated(d, a, fallback)

    def cells(self) -> tuple[Cell, ...]:
        return tuple(Cell(t, p, d, a) for (t, p), (d, a) in sorted(self._sums.items()))
