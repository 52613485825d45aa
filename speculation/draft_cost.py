"""What drafting costs a decode step, learned from the steps a replica runs.

Two costs, priced apart because they scale differently:

- **per draft token** (``DraftCost``): what one more token verified adds to the target's step
  at a given batch size. The step-time model is a function of tokens only, and across its
  calibration shapes a token is sometimes a new sequence and sometimes a draft; a sequence
  costs more (its own KV read and attention), so the model's local slope can misprice drafts.
  ``DraftCost`` fits, per batch-size group, ``seconds = a + c * drafts`` by least squares over
  recent decode steps (older ones exponentially forgotten); ``c`` is known once the group has
  seen enough steps whose draft counts differ. Adaptive speculation charges drafts the larger
  of ``c`` and the model's slope.
- **per draft round** (``DraftRounds``): a model drafter (an EAGLE head, a draft model)
  proposes ``k`` tokens in ``k`` sequential forwards over every request still drafting, so a
  step whose longest speculation is ``m`` pays ``m`` rounds whoever drafts in them. That cost
  is per step, not per token; the router needs it apart from the target's step time to see it
  (``RoutingStats.draft_round_s``), and the engine leaves the rounds out of what its step-time
  model learns (``take_spent``), so that model stays the target's forward.
"""

from __future__ import annotations

import math
import time


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


class DraftRounds:
    """Timing of a drafter's rounds (``start`` then ``stop`` around each)."""

    def __init__(self, ema: float = 0.1) -> None:
        self.ema = ema
        self.round_s = 0.0  # moving average of a round's seconds; 0.0: none timed yet
        self.rounds = 0  # rounds timed in all
        self._spent_s = 0.0  # seconds in rounds since the last take_spent
        self._t0: float | None = None

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        """The round begun by ``start`` has ended (its drafts are sampled, which reads them on
        the host: on a GPU the time includes the round's kernels, not only their launch)."""
        if self._t0 is None:
            raise RuntimeError("DraftRounds.stop without start")
        self.observe(time.perf_counter() - self._t0)
        self._t0 = None

    def observe(self, seconds: float) -> None:
        """One round took ``seconds``."""
        self.round_s = (
            seconds if self.rounds == 0 else (1 - self.ema) * self.round_s + (self.ema * seconds)
        )
        self.rounds += 1
        self._spent_s += seconds

    def take_spent(self) -> float:
        """Seconds spent in rounds since the last call (the engine's step subtracts them)."""
        spent, self._spent_s = self._spent_s, 0.0
        return spent
