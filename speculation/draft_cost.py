"""What drafting costs a decode step: per draft token (``DraftCost``) and per draft round of a
model drafter (``DraftRounds``: per step, so kept out of the step-time model)."""

from __future__ import annotations

import math
import time


class _Sums:
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
    """Seconds per draft token by batch size: ``seconds = a + c * drafts`` fitted to its steps."""

    def __init__(self, decay: float = 0.98, min_weight: float = 8.0, min_var: float = 1.0):
        self.decay = decay
        self.min_weight = min_weight
        self.min_var = min_var
        self._groups: dict[int, _Sums] = {}

    @staticmethod
    def _group(seqs: int) -> int:
        return seqs if seqs <= 4 else 4 + round(4 * math.log2(seqs / 4))

    def observe(self, seqs: int, drafts: int, seconds: float) -> None:
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


class DraftRounds:
    def __init__(self, ema: float = 0.1) -> None:
        self.ema = ema
        self.round_s = 0.0
        self.rounds = 0
        self._spent_s = 0.0
        self._t0: float | None = None

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        """Ends the round; its drafts are read on the host, so GPU time includes its kernels."""
        if self._t0 is None:
            raise RuntimeError("DraftRounds.stop without start")
        self.observe(time.perf_counter() - self._t0)
        self._t0 = None

    def observe(self, seconds: float) -> None:
        self.round_s = (
            seconds if self.rounds == 0 else (1 - self.ema) * self.round_s + (self.ema * seconds)
        )
        self.rounds += 1
        self._spent_s += seconds

    def take_spent(self) -> float:
        """Seconds spent in rounds since the last call (the engine's step subtracts them)."""
        spent, self._spent_s = self._spent_s, 0.0
        return spent
