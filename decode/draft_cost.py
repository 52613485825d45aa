"""What one more draft token costs a decode step at a given batch size, learned from the steps
the replica runs.

The step-time model is a function of the tokens a forward scores; across its calibration
shapes a token is sometimes a new sequence and sometimes a draft, and on a CPU a sequence
costs more (its own KV gather and attention) while real steps also draft, sample and attend
over longer contexts than the calibration did. Its local slope can therefore misprice drafts
(measured on the 2-core CPU at batch ~26: 3.3 ms per draft token in real steps, 1.7-2.4 ms by
the calibrated curve). ``DraftCost`` fits, per batch-size group, ``seconds = a + c * drafts``
by least squares over recent decode steps (older steps exponentially forgotten); ``c`` is the
cost of a draft token at that batch size, known once the group has seen enough steps whose
draft counts differ. Adaptive speculation charges drafts the larger of ``c`` and the model's
slope.
"""

from __future__ import annotations

import math


class _Sums:
    """Exponentially weighted sums for a one-variable least-squares fit."""

    __slots__ = ("w", "x", "xx", "xy", "y")

    def __init__(self) -> None:
        self.w = self.x = self.xx = self.y = self.xy = 0.0

    def add(self, x: float, y: float, decay: float) -> None:
        self.w = decay * self.w + 1.0
        self.x = decay * self.x + x
        self.xx = decay * self.xx + x * x
        self.y = decay * self.y + y
        self.xy = decay * self.xy + x * y


class DraftCost:
    """Seconds per draft token by batch size (sequences in the step), from observed steps."""

    def __init__(self, decay: float = 0.98, min_weight: float = 8.0, min_var: float = 1.0):
        self.decay = decay
        self.min_weight = min_weight  # effective steps a group needs
        self.min_var = min_var  # variance of its draft counts (tokens^2)
        self._groups: dict[int, _Sums] = {}

    @staticmethod
    def _group(seqs: int) -> int:
        return seqs if seqs <= 4 else 4 + round(4 * math.log2(seqs / 4))

    def observe(self, seqs: int, drafts: int, seconds: float) -> None:
        """A decode step of ``seqs`` sequences that verified ``drafts`` draft tokens."""
        if seqs <= 0 or seconds <= 0:
            return
        self._groups.setdefault(self._group(seqs), _Sums()).add(drafts, seconds, self.decay)

    def per_draft(self, seqs: int) -> float | None:
        """Seconds one more draft token adds at this batch size; None until it is known."""
        s = self._groups.get(self._group(seqs))
        if s is None or s.w < self.min_weight:
            return None
        mx, my = s.x / s.w, s.y / s.w
        var = s.xx / s.w - mx * mx
        if var < self.min_var:
            return None
        return max((s.xy / s.w - mx * my) / var, 0.0)
