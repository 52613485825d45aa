"""How long a handoff has been on its way, read from its wall-clock stamp on a host whose wall
clock may disagree with the stamping host's. The smallest delay seen over recent handoffs is
taken as the clocks' offset (plus the fastest transit, milliseconds): a host an hour ahead sees
every handoff an hour late and corrects by that hour, while a handoff that sat in a router's
queue still shows its wait above the others'."""

from __future__ import annotations

from collections import deque

RECENT = 64  # handoffs the offset is the minimum over: an NTP step is forgotten within as many


class LeaseClock:
    def __init__(self, recent: int = RECENT) -> None:
        self._delays: deque[float] = deque(maxlen=recent)

    def transit(self, stamped_at: float, now: float) -> float:
        """Seconds since ``stamped_at`` (the stamping host's ``time.time()``) at this host's
        ``now``, less the clocks' estimated offset; 0 for an unstamped handoff."""
        if not stamped_at:
            return 0.0
        delay = now - stamped_at
        self._delays.append(delay)
        return max(0.0, delay - min(self._delays))
