"""Acceptance calibration: what requests like this one actually accepted.

Prefill's probe scores the drafter on the prompt's last positions (mostly the chat template),
so on its own it says little about whether the *output* will copy; the sampling temperature
says more, and the two together say most. A replica therefore keeps, per **cell**
(temperature bin x probe bin), the draft tokens its finished requests drafted and had accepted
(``AcceptanceCalibration``), and a new request's estimate is its cell's realised rate, shrunk
toward the uncalibrated estimate (the probe, or the prior) by ``PRIOR_TOKENS`` draft tokens of
weight. A cell forgets gradually: it keeps about ``WINDOW_TOKENS`` draft tokens, so it follows
a workload that changes.

Replicas publish their cells in ``RoutingStats``; a router sums them over replicas
(``CalibrationPool``) and calibrates with the same rule (``calibrated``), so the router and the
engine start a request from the same estimate. Replicas also publish them, with the version of
their drafter, on their pool's health board; a replica that starts while others serve seeds its
cells from theirs (``AcceptanceCalibration.seed``), so it plans well from its first request
instead of from the prior. The version is the drafter's and target's weights (a new head starts
fresh).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

TEMPERATURE_EDGES = (0.5, 1.0)  # bins: greedy | (0, 0.5] | (0.5, 1.0] | above 1.0
PROBE_BINS = 5  # probe bins of width 1/5; bin 0 holds requests without a probe
PRIOR_TOKENS = 32.0  # weight of the uncalibrated estimate, in draft tokens
WINDOW_TOKENS = 4096.0  # draft tokens a cell remembers (older ones fade proportionally)
DEFAULT_ACCEPTANCE = 0.5  # a replica's prior before it has verified anything


@dataclass(frozen=True)
class Cell:
    """One cell's counts: what its requests drafted and had accepted (decayed, so floats)."""

    temperature_bin: int
    probe_bin: int
    drafted: float
    accepted: float

    @property
    def key(self) -> tuple[int, int]:
        return (self.temperature_bin, self.probe_bin)


def calibration_key(probe: float | None, temperature: float) -> tuple[int, int]:
    """The cell of a request with prefill probe ``probe`` (None: no probe ran) sampled at
    ``temperature`` (0: greedy)."""
    t_bin = 0 if temperature <= 0.0 else 1 + sum(temperature > e for e in TEMPERATURE_EDGES)
    p_bin = 0 if probe is None else 1 + min(int(max(probe, 0.0) * PROBE_BINS), PROBE_BINS - 1)
    return (t_bin, p_bin)


def calibrated(drafted: float, accepted: float, fallback: float) -> float:
    """A cell's realised rate ``accepted / drafted`` shrunk toward ``fallback``."""
    if drafted <= 0.0:
        return fallback
    return (accepted + PRIOR_TOKENS * fallback) / (drafted + PRIOR_TOKENS)


class AcceptanceCalibration:
    """One replica's cells, fed by its finished requests."""

    def __init__(self) -> None:
        self._counts: dict[tuple[int, int], tuple[float, float]] = {}

    def record(self, key: tuple[int, int], drafted: int, accepted: int) -> None:
        """A request of cell ``key`` finished having ``accepted`` of ``drafted`` drafts accepted."""
        if drafted <= 0:
            return
        d0, a0 = self._counts.get(key, (0.0, 0.0))
        d, a = d0 + drafted, a0 + accepted
        if d > WINDOW_TOKENS:
            d, a = WINDOW_TOKENS, a * WINDOW_TOKENS / d
        self._counts[key] = (d, a)

    def estimate(self, key: tuple[int, int], fallback: float) -> float:
        """The starting estimate of a request of cell ``key`` (``fallback`` if none finished)."""
        d, a = self._counts.get(key, (0.0, 0.0))
        return calibrated(d, a, fallback)

    def cells(self) -> tuple[Cell, ...]:
        return tuple(Cell(t, p, d, a) for (t, p), (d, a) in sorted(self._counts.items()))

    def seed(self, cells: Iterable[Cell]) -> float:
        """Start from what other replicas of the same drafter realised (``cells``, their
        sums): each cell keeps at most ``WINDOW_TOKENS`` of them, so this replica's own
        requests take over as they finish. Returns the draft tokens seeded."""
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
    """Parse published ``[temperature_bin, probe_bin, drafted, accepted]`` rows."""
    out = []
    for row in rows:
        t, p, d, a = row
        out.append(Cell(int(t), int(p), float(d), float(a)))
    return tuple(out)


class CalibrationPool:
    """Every replica's cells, summed (a router's view of a deployment).

    Replicas of one deployment run the same target and drafter, so what a cell's requests
    accepted on one replica predicts what they accept on another. The pool keeps each
    replica's last published cells and their per-cell sums, updated when a snapshot arrives or
    a replica leaves."""

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

    def cells(self) -> tuple[Cell, ...]:
        """The summed cells."""
        return tuple(Cell(t, p, d, a) for (t, p), (d, a) in sorted(self._sums.items()))
