"""Decode routing policies over a ``ReplicaTable``, run by the Ray Serve routers and by the
simulator (``bench/router_sim.py``) alike."""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from cluster.routing.score import (
    Outlook,
    ReplicaStep,
    ReplicaSteps,
    placement,
    placement_outlook,
)
from cluster.routing.table import BoolArray, ReplicaTable
from speculation.goodput import expected_tokens

FloatArray = npt.NDArray[np.float64]
Ranks = list[list[int]]
WAIT_PENALTY_S = 1e3  # added to the cost of a replica that would queue the request: last resort
SLO_MISS_S = 1.0  # added per request a placement predicts above the TPOT SLO (slo_aware)


@dataclass(frozen=True)
class RouteRequest:
    alpha: float  # acceptance estimate: prefill's probe, or a prior from the sampling params
    prompt_tokens: int
    greedy: bool = False  # drafts a tree where the replica runs them (RoutingStats.tree_width)


class RoutingPolicy(ABC):
    """Ranks replicas (table rows) for one request, best first, each rank a list of rows; the
    caller sends it to the first rank with a replica that accepts it, then calls ``routed``.
    ``rank`` runs for every request: it reads only the table and the policy's own state."""

    name: ClassVar[str]

    @abstractmethod
    def rank(self, req: RouteRequest, table: ReplicaTable, now: float) -> Ranks: ...

    def routed(self, req: RouteRequest, table: ReplicaTable, row: int, now: float) -> None:
        record_routed(req, table, row, now)

    def fresh_rows(self, table: ReplicaTable, now: float) -> BoolArray | None:
        """The rows whose stats ``rank`` would score now; None for a policy that reads none."""
        return None


def record_routed(req: RouteRequest, table: ReplicaTable, row: int, now: float) -> None:
    """Add the request to the row's overlay with the k its engine is predicted to grant."""
    k = 0
    width = int(max(table.tree_width[row], 1)) if req.greedy else 1
    mid = int(table.model_id[row])
    if mid >= 0 and table.has_stats[row]:
        replica = ReplicaStep(
            step_tokens=int(table.eff_tokens[row]),
            tpot_weight=float(table.eff_weight[row]),
            step_emitted=float(table.eff_emitted[row]),
            adaptive=bool(table.adaptive[row]),
            step_max_k=int(table.eff_max_k[row]),
            draft_round_s=float(table.draft_round_s[row]),
            draft_token_s=float(table.draft_token_s[row]),
        )
        k = placement(req.alpha, int(table.k_max[row]), replica, table.steps[mid], width).k
    blocks = math.ceil((req.prompt_tokens + 1) / max(int(table.block_size[row]), 1))
    joins = bool(table.eff_slots[row] > 0)
    table.add_routed(row, k, expected_tokens(req.alpha, k), blocks, joins, now, width)


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def rank(self, req: RouteRequest, table: ReplicaTable, now: float) -> Ranks:
        rows = np.flatnonzero(table.alive).tolist()
        if not rows:
            return []
        i = self._next % len(rows)
        self._next += 1
        return [[rows[i]]] + ([[rows[(i + 1) % len(rows)]]] if len(rows) > 1 else [])


class PowerOfTwo(RoutingPolicy):
    """Two replicas at random; the caller takes the one with the shorter queue."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def rank(self, req: RouteRequest, table: ReplicaTable, now: float) -> Ranks:
        return two_choices(np.flatnonzero(table.alive), self.rng)


def two_choices(rows: np.ndarray, rng: random.Random) -> Ranks:
    n = len(rows)
    if n == 0:
        return []
    if n == 1:
        return [[int(rows[0])]]
    i = rng.randrange(n)
    j = rng.randrange(n - 1)
    j += j >= i
    return [[int(rows[i]), int(rows[j])]]


class LeastKV(RoutingPolicy):
    """The most free KV blocks (as a fraction); power of two when no snapshot is fresh."""

    name = "least_kv"

    def __init__(self, max_staleness_s: float, seed: int | None = None, top: int = 3) -> None:
        self.max_staleness_s = max_staleness_s
        self.top = top
        self.fallback = PowerOfTwo(seed)

    def fresh_rows(self, table: ReplicaTable, now: float) -> BoolArray:
        fresh: BoolArray = (
            table.alive & table.has_stats & (now - table.received_at <= self.max_staleness_s)
        )
        return fresh

    def rank(self, req: RouteRequest, table: ReplicaTable, now: float) -> Ranks:
        fresh = self.fresh_rows(table, now)
        if not fresh.any():
            return self.fallback.rank(req, table, now)
        free = table.eff_free / np.maximum(table.num_blocks, 1)
        return _best(np.where(fresh, -free, np.inf), self.top) + _stale_rank(
            table, fresh, self.fallback
        )


class AcceptanceAware(RoutingPolicy):
    """Where the request adds least to the sum of all TPOTs, among replicas with fresh stats
    (power of two choices when none has); replicas that would queue it come last."""

    name = "acceptance_aware"

    def __init__(self, max_staleness_s: float, seed: int | None = None, top: int = 3) -> None:
        self.max_staleness_s = max_staleness_s
        self.top = top
        self.fallback = PowerOfTwo(seed)

    def fresh_rows(self, table: ReplicaTable, now: float) -> BoolArray:
        return table.fresh(now, self.max_staleness_s)

    def rank(self, req: RouteRequest, table: ReplicaTable, now: float) -> Ranks:
        fresh = self.fresh_rows(table, now)
        if not fresh.any():
            return self.fallback.rank(req, table, now)
        cost = np.where(fresh, self.costs(req, table), np.inf)
        return _best(cost, self.top) + _stale_rank(table, fresh, self.fallback)

    def costs(self, req: RouteRequest, table: ReplicaTable) -> FloatArray:
        """The request's cost on every row (meaningful where the row has stats and a model);
        rows that would queue it cost ``WAIT_PENALTY_S`` more."""
        cost = self.score(self.outlook(req, table), table)
        admit = table.can_admit(req.prompt_tokens)
        if admit.all():
            return cost
        backlog = (1 - table.eff_slots) / np.maximum(table.max_batch, 1)
        out: FloatArray = np.where(admit, cost, WAIT_PENALTY_S * (1 + backlog))
        return out

    def score(self, o: Outlook, table: ReplicaTable) -> FloatArray:
        return o.cost_s

    def outlook(self, req: RouteRequest, table: ReplicaTable) -> Outlook:
        k_max = table.k_cap()
        width = np.maximum(table.tree_width, 1.0) if req.greedy else None
        if len(table.steps) == 1:  # one model for the whole pool (the simulator's case)
            only = next(iter(table.steps.values()))
            return placement_outlook(req.alpha, k_max, _replica_steps(table, None), only, width)
        n = table.size
        inf = np.full(n, np.inf)
        out = Outlook(np.zeros(n, np.int64), inf.copy(), inf.copy(), np.ones(n), inf.copy())
        for mid, steps in table.steps.items():
            s = table.model_id == mid
            w = None if width is None else width[s]
            part = placement_outlook(req.alpha, k_max, _replica_steps(table, s), steps, w)
            for name in ("k", "step_s", "base_s", "expected", "cost_s"):
                getattr(out, name)[s] = getattr(part, name)
        return out


def _replica_steps(table: ReplicaTable, rows: BoolArray | None) -> ReplicaSteps:
    sel = slice(None) if rows is None else rows
    return ReplicaSteps(
        step_tokens=table.eff_tokens[sel],
        tpot_weight=table.eff_weight[sel],
        step_emitted=table.eff_emitted[sel],
        adaptive=table.adaptive_mask()[sel],
        step_max_k=table.eff_max_k[sel],
        draft_round_s=table.draft_round_s[sel],
        draft_token_s=table.draft_token_s[sel],
    )


class SloAware(AcceptanceAware):
    """Acceptance-aware placement that first keeps requests within a TPOT SLO: a row costs
    ``SLO_MISS_S`` more if the request's TPOT there, or the slowest running one's pushed by the
    longer step, passes ``tpot_slo_s``; among rows that miss alike, the acceptance-aware cost."""

    name = "slo_aware"

    def __init__(
        self, tpot_slo_s: float, max_staleness_s: float, seed: int | None = None, top: int = 3
    ) -> None:
        if not tpot_slo_s > 0:
            raise ValueError(f"slo_aware routing needs a TPOT SLO above 0 s, got {tpot_slo_s!r}")
        super().__init__(max_staleness_s, seed, top)
        self.tpot_slo_s = tpot_slo_s

    def score(self, o: Outlook, table: ReplicaTable) -> FloatArray:
        slo, slowest = self.tpot_slo_s, table.eff_slowest
        pushed = (o.step_s * slowest > slo) & (o.base_s * slowest <= slo)
        misses = (o.tpot_s > slo).astype(np.float64) + pushed
        return o.cost_s + SLO_MISS_S * misses


def _best(key: np.ndarray, top: int) -> Ranks:
    """The ``top`` rows of smallest finite ``key``, best first, one per rank."""
    if key.size > top:
        part = np.argpartition(key, top)[:top]
        order = part[np.argsort(key[part], kind="stable")]
    else:
        order = np.argsort(key, kind="stable")
    return [[int(i)] for i in order if np.isfinite(key[i])]


def _stale_rank(table: ReplicaTable, fresh: np.ndarray, fallback: PowerOfTwo) -> Ranks:
    """A last rank of two replicas without fresh stats, so none is unreachable."""
    if table.all_fresh(fresh):
        return []
    stale = np.flatnonzero(table.alive & ~fresh)
    return two_choices(stale, fallback.rng) if stale.size else []


def make_policy(
    name: str, max_staleness_s: float, seed: int | None = None, tpot_slo_s: float | None = None
) -> RoutingPolicy:
    if name == "round_robin":
        return RoundRobin()
    if name == "power_of_two":
        return PowerOfTwo(seed)
    if name == "least_kv":
        return LeastKV(max_staleness_s, seed)
    if name == "acceptance_aware":
        return AcceptanceAware(max_staleness_s, seed)
    if name == "slo_aware":
        if tpot_slo_s is None:
            raise ValueError("slo_aware routing needs a TPOT SLO (decode.routing_tpot_slo_s)")
        return SloAware(tpot_slo_s, max_staleness_s, seed)
    raise ValueError(f"unknown decode routing policy {name!r}")
