"""What one draft round costs: a model drafter's sequential forward over the batch.

A model drafter (an EAGLE head, a draft model) proposes ``k`` tokens in ``k`` sequential
forwards, each over every request still drafting: a step whose longest speculation is ``m``
pays ``m`` rounds whoever drafts in them, so a request that drafts nothing still waits for the
rounds of the requests beside it. That cost is per step, not per draft token, and the router
needs it apart from the target's step time to see it (``cluster.routing.score``):
``DraftRounds`` times each round as it runs and keeps

- ``round_s``: an exponential moving average of a round's seconds (0.0 until one has run),
  which the replica publishes as ``RoutingStats.draft_round_s``;
- the seconds spent in rounds since the engine last asked (``take_spent``), which the engine
  leaves out of what its step-time model learns, so that model stays the target's forward.

A round ends with the drafts sampled from its logits, which reads them on the host, so on a
GPU the time measured includes the forward's kernels, not only their launch.
"""

from __future__ import annotations

import time


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
        """The round begun by ``start`` has ended (its drafts are sampled)."""
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
