"""Acceptance collapse: a replica notices when its drafts are accepted far less than it planned.

Adaptive speculation plans each request's drafts from an acceptance estimate (its calibration
cell's realised rate, shrunk toward the probe or the prior: ``speculation.calibration``). When
the drafter stops matching the traffic (a head rolled out for another target revision, a
workload the drafter never saw), realised acceptance drops while the cell's estimate still
remembers the old rate: drafts are planned that will not be accepted, and time per output
token rises before anybody has looked at a dashboard.

``AcceptanceAlarm`` keeps, per cell, the draft tokens finished requests verified, how many were
accepted, and how many their starting estimates predicted, over about ``window_tokens`` draft
tokens (older ones fade proportionally, as calibration's do). A cell **collapses** when it has
at least half a window of evidence and its realised acceptance is below ``ratio`` times what
was predicted. While it does:

- the replica reports it (``/health``, the ``tandem_acceptance_collapsed_cells`` gauge), naming
  the cell, the drafter, the realised and the expected rates;
- adaptive speculation backs off for that cell: a new request of it starts from the cell's
  realised rate in the window (not the calibrated estimate, which is still catching up), so
  it is granted the drafts that rate pays for, often none.

It clears once predictions and outcomes agree again (calibration has caught up, or the drafter
recovered).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Collapse:
    """One cell whose realised acceptance fell below the alarm's share of the predicted."""

    temperature_bin: int
    probe_bin: int
    drafted: float  # draft tokens in the window
    realised: float  # accepted / drafted in the window
    expected: float  # what the requests' starting estimates predicted, per draft token

    def to_dict(self) -> dict[str, Any]:
        return {
            "temperature_bin": self.temperature_bin,
            "probe_bin": self.probe_bin,
            "drafted": round(self.drafted, 1),
            "realised": round(self.realised, 4),
            "expected": round(self.expected, 4),
        }


class AcceptanceAlarm:
    """One replica's per-cell comparison of realised with predicted acceptance (module doc)."""

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
        """A request of cell ``key`` that started from ``estimate`` finished having
        ``accepted`` of its ``drafted`` draft tokens accepted."""
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
        """The cells collapsed now."""
        out = (self._collapsed(k) for k in sorted(self._cells))
        return tuple(c for c in out if c is not None)

    def backoff(self, key: tuple[int, int], estimate: float) -> float:
        """A new request's starting estimate in cell ``key``: ``estimate``, or the cell's
        realised rate while the cell is collapsed (whichever is lower)."""
        c = self._collapsed(key)
        return estimate if c is None else min(estimate, c.realised)
