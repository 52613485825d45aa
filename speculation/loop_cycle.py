"""What a decode replica's served loop adds to each step beyond the step's own forward passes:
scheduling, sampling bookkeeping, handing outputs to the server, and waiting on a shared CPU.

The start-up calibration times forwards alone; a client waits a whole loop cycle per step. The
capacity within a TPOT SLO (``speculation.capacity``) adds this overhead, measured while
serving: the median, over the last ``window`` back-to-back busy cycles, of the cycle's wall time
less the step's own (0 until ``min_samples`` are in: the calibration is the prior)."""

from __future__ import annotations

import statistics
from collections import deque


class CycleOverhead:
    def __init__(self, window: int = 64, min_samples: int = 8) -> None:
        self.min_samples = min_samples
        self._gaps: deque[float] = deque(maxlen=window)

    def observe(self, cycle_s: float, step_s: float) -> None:
        """One busy cycle: ``cycle_s`` from a step's start to the next's, ``step_s`` the step."""
        if cycle_s > 0 and step_s > 0:
            self._gaps.append(max(cycle_s - step_s, 0.0))

    @property
    def seconds(self) -> float:
        if len(self._gaps) < self.min_samples:
            return 0.0
        return statistics.median(self._gaps)

    @property
    def samples(self) -> int:
        return len(self._gaps)
