"""Ray Serve request routers running the ``cluster.routing`` policies: decode routers keep a
``ReplicaTable`` fed by the replicas' ``routing_stats``; ``PrefixAffinityRouter`` places prefill."""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from typing import Any, ClassVar

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster.routing.observe import RouterMetrics, basis_of
from cluster.routing.policies import RouteRequest, RoutingPolicy, make_policy, two_choices
from cluster.routing.prefix import PrefixAffinity
from cluster.routing.request_info import release_of, request_of, route_request
from cluster.routing.table import ReplicaTable
from kvtransfer.allocator import block_hashes
from speculation.calibration import CalibrationPool
from speculation.routing_stats import RoutingStats

log = logging.getLogger(__name__)
REMEMBERED = 4096  # decisions kept until Ray Serve reports where the request went


class _Rows:
    """Replica id <-> table row, reusing the rows of replicas that left."""

    def __init__(self) -> None:
        self.row_of: dict[ReplicaID, int] = {}
        self.replica_at: dict[int, RunningReplica] = {}
        self._free: list[int] = []

    def sync(self, replicas: list[RunningReplica]) -> tuple[list[int], list[int]]:
        """(rows of all live replicas in order, rows that were freed)."""
        live = {r.replica_id for r in replicas}
        gone = [rid for rid in self.row_of if rid not in live]
        freed = []
        for rid in gone:
            row = self.row_of.pop(rid)
            self.replica_at.pop(row, None)
            self._free.append(row)
            freed.append(row)
        rows = []
        for r in replicas:
            known = self.row_of.get(r.replica_id)
            row = (
                known
                if known is not None
                else (self._free.pop() if self._free else len(self.row_of))
            )
            self.row_of[r.replica_id] = row
            self.replica_at[row] = r
            rows.append(row)
        return rows, freed

    def replicas(self, ranks: list[list[int]]) -> list[list[RunningReplica]]:
        out = [[self.replica_at[i] for i in rank if i in self.replica_at] for rank in ranks]
        return [rank for rank in out if rank]


def _since(start: float, cpu: float) -> tuple[float, float]:
    return time.perf_counter() - start, time.thread_time() - cpu


def _deployment_name(router: RequestRouter) -> str:
    dep = getattr(router, "_deployment_id", None)
    return str(getattr(dep, "name", "")) if dep is not None else ""


class _DecodeRouter(RequestRouter):
    policy: ClassVar[str]

    def initialize_state(self, **kwargs: Any) -> None:
        """``request_router_kwargs``: ``max_staleness_s`` (stats older than this are not used;
        default 5), ``seed``, ``tpot_slo_s`` (slo_aware: the TPOT SLO)."""
        self._setup(**kwargs)

    def _setup(
        self, max_staleness_s: float = 5.0, seed: int | None = None, tpot_slo_s: float | None = None
    ) -> None:
        self._table = ReplicaTable()
        self._calibration = CalibrationPool()
        self._rows = _Rows()
        self._policy: RoutingPolicy = make_policy(self.policy, max_staleness_s, seed, tpot_slo_s)
        self._seen: dict[int, float] = {}  # row -> time of the snapshot last applied
        self._decided: OrderedDict[str, RouteRequest] = OrderedDict()
        self._rng = random.Random(seed)
        self.metrics = RouterMetrics(_deployment_name(self), self.policy)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._sync(replicas)

    def _sync(self, replicas: list[RunningReplica]) -> None:
        now = time.time()
        rows, freed = self._rows.sync(replicas)
        for row in freed:
            self._table.clear(row)
            self._calibration.clear(row)
            self._seen.pop(row, None)
        for row, replica in zip(rows, replicas, strict=True):
            stats = replica.routing_stats or {}
            stamp = stats.get("time")
            if stamp is None or self._seen.get(row) == stamp:
                if not self._table.size > row or not self._table.alive[row]:
                    self._table.mark_alive(row)
                continue
            try:
                parsed = RoutingStats.from_dict(stats)
                self._table.set_stats(row, parsed, now)
                self._calibration.put(row, parsed.calibration)
            except ValueError as e:
                log.warning("ignoring routing stats of %s: %s", replica.replica_id, e)
                self.metrics.rejected()
                self._table.mark_alive(row)
            self._seen[row] = stamp

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        start, cpu = time.perf_counter(), time.thread_time()
        if len(candidate_replicas) != len(self._rows.row_of):
            self._sync(candidate_replicas)
        req = (
            route_request(pending_request.args, pending_request.kwargs, self._calibration)
            if pending_request
            else None
        )
        if req is None:
            self.metrics.decided("other_call", *_since(start, cpu))
            return self._random_pair(candidate_replicas)
        now = time.time()
        chosen = self._rows.replicas(self._policy.rank(req, self._table, now))
        fresh = self._policy.fresh_rows(self._table, now)
        live = int(self._table.alive.sum())
        count = None if fresh is None else int(fresh.sum())
        basis = basis_of(live, count) if chosen else "fallback"
        self.metrics.decided(basis, *_since(start, cpu))
        if not chosen:
            return self._random_pair(candidate_replicas)
        assert pending_request is not None
        self._decided[pending_request.metadata.internal_request_id] = req
        while len(self._decided) > REMEMBERED:
            self._decided.popitem(last=False)
        return chosen

    def _random_pair(self, replicas: list[RunningReplica]) -> list[list[RunningReplica]]:
        ranks = two_choices(list(range(len(replicas))), self._rng)  # type: ignore[arg-type]
        return [[replicas[i] for i in rank] for rank in ranks]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        req = self._decided.pop(pending_request.metadata.internal_request_id, None)
        row = self._rows.row_of.get(replica_id)
        if req is not None:
            self.metrics.estimate(req.alpha, req.greedy)
        if req is not None and row is not None:
            self._policy.routed(req, self._table, row, time.time())


class AcceptanceAwareRouter(_DecodeRouter):
    """Places each request where its expected acceptance buys the most (``score``)."""

    policy = "acceptance_aware"


class SloAwareRouter(_DecodeRouter):
    """Within the TPOT SLO first, then where acceptance buys the most (``policies.SloAware``)."""

    policy = "slo_aware"


class LeastKVRouter(_DecodeRouter):
    policy = "least_kv"


class RoundRobinRouter(_DecodeRouter):
    policy = "round_robin"


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        """``request_router_kwargs``: ``block_size`` (the prefill KV block size, default 16),
        ``imbalance`` (requests in flight affinity may add over the lighter of two, default 4),
        ``seed``."""
        self._setup(**kwargs)

    def _setup(
        self,
        block_size: int = 16,
        imbalance: float = 4.0,
        seed: int | None = None,
        affinity: bool = True,
    ) -> None:
        self._block_size = block_size
        self._use_affinity = affinity  # off: power of two choices alone
        self._affinity = PrefixAffinity(imbalance, seed)
        self._rows = _Rows()
        self._inflight: dict[int, int] = {}
        self._where: OrderedDict[str, int] = OrderedDict()  # internal request id -> row
        self._hashes: OrderedDict[str, list[bytes]] = OrderedDict()
        self.metrics = RouterMetrics(_deployment_name(self), self._affinity.name)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._sync(replicas)

    def _sync(self, replicas: list[RunningReplica]) -> None:
        rows, freed = self._rows.sync(replicas)
        for row in freed:
            self._inflight.pop(row, None)
        self._affinity.set_rows(rows)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        start, cpu = time.perf_counter(), time.thread_time()
        if len(candidate_replicas) != len(self._rows.row_of):
            self._sync(candidate_replicas)
        args = (pending_request.args, pending_request.kwargs) if pending_request else ((), {})
        release = release_of(*args)
        if release is not None:  # to the replica holding the lease; gone: any (a no-op there)
            held = [r for r in candidate_replicas if r.replica_id.unique_id == release.replica]
            self.metrics.decided("release", *_since(start, cpu))
            return [held] if held else [candidate_replicas]
        req = request_of(*args)
        hashes = (
            block_hashes(req.prompt_token_ids, self._block_size, req.cache_salt.encode())
            if req and self._use_affinity
            else []
        )
        ranks = self._affinity.rank(hashes, lambda row: float(self._inflight.get(row, 0)))
        chosen = self._rows.replicas(ranks)
        basis = "other_call" if req is None else ("affinity" if len(ranks) > 1 else "two_choices")
        self.metrics.decided(basis, *_since(start, cpu))
        if pending_request is not None:
            self._hashes[pending_request.metadata.internal_request_id] = hashes
            while len(self._hashes) > REMEMBERED:
                self._hashes.popitem(last=False)
        return chosen

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        rid = pending_request.metadata.internal_request_id
        row = self._rows.row_of.get(replica_id)
        hashes = self._hashes.pop(rid, None)
        if row is None:
            return
        self._inflight[row] = self._inflight.get(row, 0) + 1
        self._where[rid] = row
        while len(self._where) > REMEMBERED:
            self._where.popitem(last=False)
        if hashes:
            self._affinity.routed(hashes, row)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        row = self._where.pop(internal_request_id, None)
        if row is not None and self._inflight.get(row, 0) > 0:
            self._inflight[row] -= 1
