"""The router's acceptance calibration: every decode replica's cells, summed.

Replicas of one deployment run the same target and drafter, so what a cell's requests accepted
on one replica predicts what they accept on another. The pool keeps each replica's last
published cells (``RoutingStats.calibration``) and their per-cell sums, updated when a
snapshot arrives or a replica leaves, and calibrates with the replicas' own rule
(``decode.calibration.calibrated``).
"""

from __future__ import annotations

from decode.calibration import Cell, calibrated


class CalibrationPool:
    def __init__(self) -> None:
        self._by_row: dict[int, tuple[Cell, ...]] = {}
        self._sums: dict[tuple[int, int], tuple[float, float]] = {}

    def put(self, row: int, cells: tuple[Cell, ...]) -> None:
        """Row ``row`` published ``cells`` (replacing what it published before)."""
        self._add(self._by_row.get(row, ()), -1.0)
        self._by_row[row] = cells
        self._add(cells, 1.0)

    def clear(self, row: int) -> None:
        """The replica at ``row`` left."""
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
        """The cells some replica has published counts for."""
        return set(self._sums)

    def estimate(self, key: tuple[int, int], fallback: float) -> float:
        """The acceptance estimate of a request of cell ``key`` (``fallback``: uncalibrated)."""
        d, a = self._sums.get(key, (0.0, 0.0))
        return calibrated(d, a, fallback)
