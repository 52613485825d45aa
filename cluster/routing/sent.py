"""What a router has sent each decode replica since that replica's last snapshot.

``ReplicaTable`` adds these requests on top of the snapshot (its overlay), so decisions between
two refreshes do not all see the same state; a newer snapshot counts the ones sent before it,
and they leave the log.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import NamedTuple


class Sent(NamedTuple):
    """A request this router sent a replica."""

    time: float  # when it was sent (router clock)
    k: int  # draft levels it is predicted to verify per step
    expected: float  # tokens it is predicted to emit per step
    blocks: int  # KV blocks its prompt takes
    joins: bool  # joins the batch (else the queue)
    width: int  # tokens per draft level (its tree's width, else 1)


class SentLog:
    """Per row, the requests sent since its snapshot, oldest first."""

    def __init__(self) -> None:
        self._rows: list[deque[Sent]] = []

    def grow(self, n: int) -> None:
        """Room for ``n`` more rows."""
        self._rows.extend(deque() for _ in range(n))

    def add(self, row: int, sent: Sent) -> None:
        self._rows[row].append(sent)

    def clear(self, row: int) -> None:
        self._rows[row].clear()

    def __contains__(self, row: int) -> bool:
        """Whether anything sent to ``row`` is not yet in its snapshot."""
        return bool(self._rows[row])

    def drop_until(self, row: int, snapshot_time: float) -> Iterator[Sent]:
        """Remove and yield the requests a snapshot taken at ``snapshot_time`` counts."""
        log = self._rows[row]
        while log and log[0].time <= snapshot_time:
            yield log.popleft()

    def joined_peaks(self, row: int) -> tuple[int, float]:
        """Among the requests still logged that joined the batch: the largest k and the largest
        ``1 / expected`` (the slowest one's TPOT per second of step time)."""
        joined = [s for s in self._rows[row] if s.joins]
        k = max((s.k for s in joined), default=0)
        return k, max((1 / s.expected for s in joined), default=0.0)
