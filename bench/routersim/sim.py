"""One simulated run: a workload through prefill, then routed onto the decode pool by a policy.

The decode router runs ``cluster.routing.policies`` on a ``ReplicaTable`` exactly as the Ray
Serve router does: replicas publish their routing stats every ``stats_period_s`` (the table's
snapshot; the router's own decisions since then are its overlay), and the request goes to the
first rank holding a replica below ``max_ongoing`` requests — within a rank, the one with the
fewest (Ray Serve's queue-length probe, which is current). Each decision (``rank`` + ``routed``)
is timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from bench.routersim.decode import DecodePool
from bench.routersim.oracle import split_policy
from bench.routersim.peers import PrefixedRequest, PrefixTrees, peer_policy
from bench.routersim.prefill import PrefillResult
from bench.routersim.profiles import Profile
from bench.routersim.workload import Workload
from cluster.routing.policies import make_policy
from cluster.routing.table import ReplicaTable
from speculation.goodput import GUARD_MAX_LOSS

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class SimConfig:
    profile: Profile
    decode_replicas: int
    policy: str
    stats_period_s: float = 0.5
    max_staleness_s: float = 2.0
    max_ongoing: int = 0  # 0: twice max_batch
    tpot_slo_s: float | None = None  # what slo_aware keeps requests within
    engine_tpot_slo_s: float | None = None  # what the replicas' adaptive speculation keeps to
    engine_slo_max_loss: float = GUARD_MAX_LOSS  # the most goodput keeping to it gives up
    seed: int = 0


@dataclass(frozen=True)
class DecodeOutcome:
    finish_s: FloatArray  # when each request's last token was emitted
    decision_s: FloatArray  # wall time of each routing decision
    replica: npt.NDArray[np.int64]
    emitted_tokens: int  # tokens decode emitted, over all requests
    steps: int
    memo_entries: int
    wall_s: float
    prefix_hits: int  # requests placed where a prefix tree would hold their prefix (peers.py)


def choose(ranks: list[list[int]], pool: DecodePool, max_ongoing: int) -> int:
    """Ray Serve's rule: the first rank with a replica that accepts; in it, the least busy."""
    for rank in ranks:
        ok = [r for r in rank if pool.ongoing(r) < max_ongoing]
        if ok:
            return min(ok, key=pool.ongoing)
    return min(ranks[0], key=pool.ongoing)


def simulate_decode(
    w: Workload,
    pre: PrefillResult,
    cfg: SimConfig,
    observe: Callable[[DecodePool, float], None] | None = None,
) -> DecodeOutcome:
    """Route and decode ``w``; ``observe(pool, now)`` sees the pool at every stats push."""
    p, d = cfg.profile, cfg.decode_replicas
    t_start = time.perf_counter()
    route_at = pre.first_token_s
    ready = route_at + p.transfer_base_s + p.transfer_per_token_s * w.prompt
    pool = DecodePool(
        p,
        d,
        w.alphas,
        w.cls.astype(np.int64),
        w.prompt + w.output,
        w.output - 1,
        ready,
        cfg.seed,
        cfg.engine_tpot_slo_s,
        cfg.engine_slo_max_loss,
    )
    table = ReplicaTable(d)
    table.configure(
        range(d), p.step_time, p.kv_tokens // 16, 16, p.max_batch, p.k_max, True, p.draft_round_s
    )
    policy = (
        split_policy(cfg.policy, cfg.seed)
        or peer_policy(cfg.policy, d, lambda: pool.n_active + pool.qlen, cfg.seed)
        or make_policy(cfg.policy, cfg.max_staleness_s, cfg.seed, cfg.tpot_slo_s)
    )
    trees, hits = PrefixTrees(d, 400_000), 0
    max_ongoing = cfg.max_ongoing or 2 * p.max_batch
    order = np.argsort(route_at, kind="stable")
    times, alphas, prompts = route_at[order].tolist(), w.alpha_probe.tolist(), w.prompt.tolist()
    groups, prefixes = w.group.tolist(), w.prefix.tolist()
    decision = np.empty(w.size)
    replica = np.empty(w.size, dtype=np.int64)
    n, idx = w.size, 0
    t = times[0]
    next_publish = t
    while idx < n or np.isfinite(pool.next_event()):
        t_end = t + p.tick_s
        if t >= next_publish:
            pool.publish(table, t)
            if observe is not None:
                observe(pool, t)
            next_publish = t + cfg.stats_period_s
        while idx < n and times[idx] < t_end:
            i, now = int(order[idx]), times[idx]
            req = PrefixedRequest(alphas[i], prompts[i], group=groups[i], prefix_tokens=prefixes[i])
            c0 = time.perf_counter()
            ranks = policy.rank(req, table, now)
            row = choose(ranks, pool, max_ongoing)
            policy.routed(req, table, row, now)
            decision[i] = time.perf_counter() - c0
            hits += trees.holds(row, req)
            trees.insert(row, req)
            replica[i] = row
            pool.enqueue(row, i)
            idx += 1
        pool.advance(t_end)
        upcoming = min(pool.next_event(), times[idx] if idx < n else np.inf)
        t = max(t_end, upcoming) if np.isfinite(upcoming) else t_end
    return DecodeOutcome(
        pool.finish,
        decision,
        replica,
        pool.emitted,
        pool.step_count,
        len(pool.memo),
        time.perf_counter() - t_start,
        hits,
    )
