"""Routing policies on hand-made replica states: which replica each one picks, and when the
acceptance-aware policy falls back to power of two choices."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from cluster.routing.observe import basis_of
from cluster.routing.policies import (
    AcceptanceAware,
    LeastKV,
    PowerOfTwo,
    RoundRobin,
    RouteRequest,
    RoutingPolicy,
    SloAware,
    make_policy,
)
from cluster.routing.prefix import PrefixAffinity, PrefixIndex
from cluster.routing.request_info import acceptance_prior, route_request
from cluster.routing.score import ReplicaStep, placement
from cluster.routing.table import ReplicaTable
from kvtransfer.allocator import block_hashes
from kvtransfer.handoff import KVCompat, KVHandoff
from models.request import Request
from models.sampling import SamplingParams
from speculation.goodput import expected_tokens
from speculation.routing_stats import (
    ReplicaLoad,
    RoutingStats,
    SpeculationState,
    collect_routing_stats,
)
from speculation.step_time import StepTimeModel

MODEL = StepTimeModel.linear(0.010, 0.0005)
NOW = 100.0


def stats(
    alphas: Sequence[float],
    ks: Sequence[int],
    free: int = 1000,
    queued: int = 0,
    at: float = NOW,
    round_s: float = 0.002,
) -> RoutingStats:
    return collect_routing_stats(
        alphas,
        ks,
        ReplicaLoad(queued, free, num_blocks=1000, block_size=16, max_batch_size=64),
        SpeculationState(k_max=4, adaptive=True, step_time=MODEL, draft_round_s=round_s),
        now=at,
    )


def table(*snapshots: RoutingStats, received: float = NOW) -> ReplicaTable:
    t = ReplicaTable()
    for row, s in enumerate(snapshots):
        t.set_stats(row, s, received)
    return t


def first(ranks: list[list[int]]) -> int:
    assert len(ranks[0]) == 1
    return ranks[0][0]


def test_acceptance_aware_keeps_like_acceptance_together() -> None:
    """Equal loads; one replica runs creative requests (nobody drafts), the other copy-heavy
    ones drafting 4 tokens. A creative request goes where no draft rounds stall it; a copy
    request, where rounds are cheap enough that the creative replica's engine would draft for
    it, goes where its drafts do not slow 16 requests that cannot use them."""
    p = AcceptanceAware(max_staleness_s=5.0, seed=0)
    for round_s in (0.0005, 0.002):
        t = table(
            stats([0.3] * 16, [0] * 16, round_s=round_s),
            stats([0.85] * 16, [4] * 16, round_s=round_s),
        )
        assert first(p.rank(RouteRequest(0.3, 100), t, NOW + 0.5)) == 0
    cheap = table(
        stats([0.3] * 16, [0] * 16, round_s=0.0005), stats([0.85] * 16, [4] * 16, round_s=0.0005)
    )
    assert first(p.rank(RouteRequest(0.85, 100), cheap, NOW + 0.5)) == 1


def test_a_request_that_would_not_draft_beside_others_costs_them_no_rounds() -> None:
    """Where a round costs 2 ms on an 18 ms step, the creative replica's engine would give a
    copy request no drafts (its rounds would cost the batch more than they yield), so there it
    slows nobody by rounds, and the router predicts just that."""
    dear = table(stats([0.3] * 16, [0] * 16), stats([0.85] * 16, [4] * 16))
    p = AcceptanceAware(max_staleness_s=5.0, seed=0)
    copy = RouteRequest(0.85, 100)
    assert first(p.rank(copy, dear, NOW + 0.5)) == 0
    p.routed(copy, dear, 0, NOW + 0.5)
    assert dear.eff_max_k[0] == 0 and dear.eff_tokens[0] == 17  # no drafts predicted there


def test_acceptance_aware_prefers_the_shorter_step_for_like_requests() -> None:
    t = table(stats([0.6] * 30, [2] * 30), stats([0.6] * 5, [2] * 5), stats([0.6] * 18, [2] * 18))
    ranks = AcceptanceAware(5.0, seed=0).rank(RouteRequest(0.6, 100), t, NOW)
    assert ranks == [[1], [2], [0]]


def test_refined_step_time_models_replace_each_other_and_mixed_pools_score() -> None:
    """Replicas republish their step-time model as they refine it: the table keeps one per
    distinct model in use (not one per snapshot ever seen), and scores rows of different
    models each by its own."""
    t = table(stats([0.5] * 8, [2] * 8), stats([0.5] * 8, [2] * 8))
    assert len(t.models) == 1
    for i in range(50):  # replica 0 refines its model 50 times
        slower = StepTimeModel.linear(0.010 * (1 + i / 10), 0.0005)
        s = collect_routing_stats(
            [0.5] * 8,
            [2] * 8,
            ReplicaLoad(0, 1000, num_blocks=1000, block_size=16, max_batch_size=64),
            SpeculationState(k_max=4, adaptive=True, step_time=slower, draft_round_s=0.002),
            now=NOW,
        )
        t.set_stats(0, s, NOW)
    assert len(t.models) == len(t.steps) == 2  # replica 0's latest, replica 1's
    p = AcceptanceAware(max_staleness_s=5.0, seed=0)
    assert first(p.rank(RouteRequest(0.5, 100), t, NOW + 0.5)) == 1  # replica 0 is 5.9x slower
    t.clear(1)
    assert len(t.models) == 1
    t.clear(0)
    assert not t.models and not t.steps


def test_slo_aware_places_a_request_where_its_tpot_fits() -> None:
    """Six creative requests on a short step, one copy request drafting 4 deep (two rounds'
    worth of step more): acceptance-aware sends a new creative request beside the lone copy one,
    where it slows fewer requests, but its own TPOT there (16.5 ms) misses a 15 ms SLO; beside
    the creative ones it gets 13.5 ms and keeps theirs within it."""
    t = table(stats([0.3] * 6, [0] * 6), stats([0.9], [4]))
    req = RouteRequest(0.3, 100)
    assert first(AcceptanceAware(5.0, seed=0).rank(req, t, NOW)) == 1
    slo = SloAware(0.015, 5.0, seed=0)
    o = slo.outlook(req, t)
    assert o.tpot_s[1] > 0.015 >= o.tpot_s[0] and o.step_s[0] * t.eff_slowest[0] <= 0.015
    assert first(slo.rank(req, t, NOW)) == 0


def test_slo_aware_does_not_push_running_requests_over_the_slo() -> None:
    """Eight creative requests at exactly a 14 ms step: one more pushes them all over a 14 ms
    SLO. The new request misses it anywhere, so it goes beside the copy requests, whose TPOT
    (the step over the tokens each emits) stays far below it."""
    t = table(stats([0.3] * 8, [0] * 8), stats([0.9] * 3, [4] * 3))
    req = RouteRequest(0.3, 100)
    assert first(AcceptanceAware(5.0, seed=0).rank(req, t, NOW)) == 0
    slo = SloAware(0.014, 5.0, seed=0)
    o = slo.outlook(req, t)
    assert (o.tpot_s > 0.014).all()
    assert o.base_s[0] * t.eff_slowest[0] <= 0.014 < o.step_s[0] * t.eff_slowest[0]
    assert o.step_s[1] * t.eff_slowest[1] < 0.014
    assert first(slo.rank(req, t, NOW)) == 1


def test_the_slowest_request_counts_what_was_sent_since_the_snapshot() -> None:
    t = table(stats([0.9] * 2, [4] * 2), stats([], []))
    assert t.eff_slowest[1] == 0.0
    p = SloAware(0.05, 5.0, seed=0)
    req = RouteRequest(0.3, 100)
    p.routed(req, t, 1, NOW + 0.01)
    k = int(t.eff_max_k[1])
    assert t.eff_slowest[1] == pytest.approx(1 / expected_tokens(0.3, k))
    assert t.eff_slowest[0] == pytest.approx(1 / expected_tokens(0.9, 4))
    p.routed(RouteRequest(0.9, 100), t, 0, NOW + 0.01)
    assert t.eff_slowest[0] == pytest.approx(1 / expected_tokens(0.9, 4))  # not the slowest
    t.set_stats(1, stats([], [], at=NOW + 0.1), NOW + 0.1)  # it finished: the overlay is gone
    assert t.eff_slowest[1] == 0.0


def test_slo_aware_routing_needs_an_slo() -> None:
    with pytest.raises(ValueError, match="TPOT SLO"):
        make_policy("slo_aware", 5.0)
    with pytest.raises(ValueError, match="above 0"):
        make_policy("slo_aware", 5.0, tpot_slo_s=0.0)
    assert isinstance(make_policy("slo_aware", 5.0, tpot_slo_s=0.05), SloAware)


def test_a_replica_that_would_queue_the_request_comes_last() -> None:
    full = stats([0.6] * 2, [2] * 2, free=3)  # a 100-token prompt needs 7 blocks
    t = table(full, stats([0.6] * 40, [2] * 40))
    assert AcceptanceAware(5.0, seed=0).rank(RouteRequest(0.6, 100), t, NOW) == [[1], [0]]


def test_routed_requests_count_until_the_next_snapshot_includes_them() -> None:
    t = table(stats([0.6] * 4, [2] * 4), stats([0.6] * 4, [2] * 4))
    p = AcceptanceAware(5.0, seed=0)
    picks = []
    for i in range(6):
        req = RouteRequest(0.6, 100)
        row = first(p.rank(req, t, NOW + 0.01 * i))
        p.routed(req, t, row, NOW + 0.01 * i)
        picks.append(row)
    assert sorted(picks) == [0, 0, 0, 1, 1, 1]  # the overlay spreads them, not all on one
    assert t.o_running.tolist() == [3.0, 3.0]
    t.set_stats(0, stats([0.6] * 7, [2] * 7, at=NOW + 0.1), NOW + 0.1)  # covers all of row 0's
    assert t.o_running.tolist() == [0.0, 3.0] and t.eff_tokens[0] == 21


def test_stale_or_missing_stats_fall_back_to_power_of_two() -> None:
    p = AcceptanceAware(max_staleness_s=2.0, seed=0)
    t = table(stats([0.6] * 4, [2] * 4), stats([0.6] * 4, [2] * 4), stats([0.6], [2]))
    req = RouteRequest(0.6, 100)

    def basis(policy: RoutingPolicy, now: float) -> str:  # what the router's metrics report
        fresh = policy.fresh_rows(t, now)
        return basis_of(int(t.alive.sum()), None if fresh is None else int(fresh.sum()))

    assert all(len(rank) == 1 for rank in p.rank(req, t, NOW + 1.0))  # fresh: scored
    assert basis(p, NOW + 1.0) == "stats"
    ranks = p.rank(req, t, NOW + 3.0)  # every snapshot 3 s old: two random replicas
    assert len(ranks) == 1 and len(set(ranks[0])) == 2
    assert basis(p, NOW + 3.0) == "fallback" and basis(LeastKV(2.0), NOW + 3.0) == "fallback"
    t.set_stats(2, stats([0.6], [2], at=NOW + 2.9), NOW + 2.9)  # one fresh: it is scored,
    ranks = p.rank(req, t, NOW + 3.0)  # the stale ones stay reachable in a last rank
    assert ranks[0] == [2] and sorted(ranks[-1]) == [0, 1]
    assert basis(p, NOW + 3.0) == "partial" and basis(PowerOfTwo(), NOW + 3.0) == "stats_free"
    empty = ReplicaTable()
    for row in range(3):
        empty.mark_alive(row)
    assert len(p.rank(req, empty, NOW)[0]) == 2  # no stats yet at all


def test_round_robin_power_of_two_and_least_kv() -> None:
    t = table(stats([0.6], [2], free=500), stats([0.6], [2], free=900), stats([0.6], [2], free=10))
    rr = RoundRobin()
    assert [first(rr.rank(RouteRequest(0.6, 10), t, NOW)) for _ in range(4)] == [0, 1, 2, 0]
    assert LeastKV(5.0).rank(RouteRequest(0.6, 10), t, NOW) == [[1], [0], [2]]
    pairs = {
        tuple(sorted(PowerOfTwo(seed=s).rank(RouteRequest(0.6, 10), t, NOW)[0])) for s in range(20)
    }
    assert pairs == {(0, 1), (0, 2), (1, 2)}


def test_prefix_affinity_follows_the_prompt_unless_that_replica_is_busier() -> None:
    prompt = list(range(100, 164))  # four full blocks
    hashes = block_hashes(prompt, 16)
    index = PrefixIndex(capacity=100)
    index.record(hashes[:2], 5)
    assert index.match(hashes) == (5, 2)
    assert index.match(block_hashes([1] * 64, 16)) == (None, 0)
    policy = PrefixAffinity(imbalance=2.0, seed=0)
    policy.set_rows(range(4))
    policy.routed(hashes, 3)
    light = {0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0}
    assert policy.rank(hashes, light.__getitem__)[0] == [3]
    busy = {0: 1.0, 1: 1.0, 2: 1.0, 3: 9.0}
    assert 3 not in policy.rank(hashes, busy.__getitem__)[0]
    policy.set_rows([0, 1, 2])  # replica 3 left: its cache is gone
    assert index.match(hashes) == (5, 2) and policy.index.match(hashes) == (None, 0)


def test_the_router_reads_the_probe_then_the_estimate_then_a_prior() -> None:
    req = Request("r", list(range(40)), SamplingParams(temperature=1.0, max_tokens=8))
    assert route_request([req, None], {}) == RouteRequest(acceptance_prior(1.0), 40)
    assert acceptance_prior(0.0) == 2 * acceptance_prior(1.0)
    req.acceptance_estimate = 0.7
    assert route_request([req, None], {}) == RouteRequest(0.7, 40)
    compat = KVCompat("m", "float32", 16, "layout", 1, "ngram", "nixl")
    handoff = KVHandoff("r", (), (1, 2, 3), ("target",), 40, 7, compat, 0.0, acceptance_probe=0.9)
    assert route_request([req], {"handoff": handoff}) == RouteRequest(0.9, 40)
    assert route_request([], {}) is None
    assert np.isclose(acceptance_prior(0.5), 0.75 * acceptance_prior(0.0))


def test_a_greedy_request_is_priced_as_the_tree_it_will_draft() -> None:
    """Two replicas alike but for draft trees 4 wide on replica 1: a greedy request there puts
    4 tokens per draft level in the step, a sampled one a chain, and the overlay counts what
    each will score. (Pinned k, so that both place the same drafts.)"""

    def snapshot(width: int) -> RoutingStats:
        return collect_routing_stats(
            [0.6] * 8,
            [2] * 8,
            ReplicaLoad(0, 1000, num_blocks=1000, block_size=16, max_batch_size=64),
            SpeculationState(
                k_max=4, adaptive=False, step_time=MODEL, draft_round_s=0.002, tree_width=width
            ),
            now=NOW,
        )

    chains, trees = snapshot(1), snapshot(4)
    assert trees.tree_width == 4 and trees.step_tokens == chains.step_tokens  # sampled batch
    t = table(chains, trees)
    p = AcceptanceAware(5.0, seed=0)
    greedy, sampled = RouteRequest(0.8, 100, greedy=True), RouteRequest(0.8, 100)
    g_costs, s_costs = p.costs(greedy, t), p.costs(sampled, t)
    assert g_costs[0] == s_costs[0] == s_costs[1]  # chains wherever it runs them
    replica = ReplicaStep(24, trees.tpot_weight, trees.step_emitted, False, 2, 0.002)
    want = placement(0.8, 4, replica, MODEL, width=4)
    assert g_costs[1] == pytest.approx(want.cost_s) and g_costs[1] > g_costs[0]
    for req, tokens in ((sampled, 1 + 4), (greedy, 1 + 4 * 4)):
        before = float(t.eff_tokens[1])
        p.routed(req, t, 1, NOW + 0.01)
        assert t.eff_tokens[1] - before == tokens


def test_the_router_knows_a_greedy_request() -> None:
    req = Request("r", list(range(40)), SamplingParams(temperature=0.0, max_tokens=8))
    assert route_request([req], {}).greedy  # type: ignore[union-attr]
    req = Request("s", list(range(40)), SamplingParams(temperature=0.7, max_tokens=8))
    assert not route_request([req], {}).greedy  # type: ignore[union-attr]
