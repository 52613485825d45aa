"""A bound, not a router: the class-split oracle of the simulator.

``ClassSplit(share, cut)`` sends every request whose acceptance estimate is below ``cut`` to the
first ``share`` of the decode replicas and every other request to the rest, power of two
choices within each part. With the default mix and cut (creative requests at acceptance 0.3,
chat at 0.6, the probe's noise 0.08) that is, for 97 % of requests, a split by true class with a
split share fixed in advance: what perfect knowledge of the classes plus a hand-tuned pool
split can buy, swept over ``share`` (``router_sim --split-shares``). No deployable router knows
the right share; this measures how much there is to win.
"""

from __future__ import annotations

import random

import numpy as np

from cluster.routing.policies import Ranks, RouteRequest, RoutingPolicy, two_choices
from cluster.routing.table import ReplicaTable

PREFIX = "class_split@"


class ClassSplit(RoutingPolicy):
    """Estimates below ``cut`` to the first ``share`` of the live replicas, the rest to the
    others; two at random within the part."""

    name = "class_split"

    def __init__(self, share: float, cut: float = 0.45, seed: int | None = None) -> None:
        if not 0 < share < 1:
            raise ValueError(f"class split share must lie in (0, 1), got {share}")
        self.share, self.cut = share, cut
        self.rng = random.Random(seed)

    def rank(self, req: RouteRequest, table: ReplicaTable, now: float) -> Ranks:
        rows = np.flatnonzero(table.alive)
        n_low = min(max(round(self.share * rows.size), 1), rows.size - 1)
        return two_choices(rows[:n_low] if req.alpha < self.cut else rows[n_low:], self.rng)


def split_policy(name: str, seed: int | None) -> ClassSplit | None:
    """``class_split@<share>`` as a policy; None for any other name."""
    if not name.startswith(PREFIX):
        return None
    return ClassSplit(float(name.removeprefix(PREFIX)), seed=seed)
