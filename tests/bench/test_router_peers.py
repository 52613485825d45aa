"""The peers' routers in the simulator behave as their sources say: Ray Serve LLM's prefix
affinity sends a prompt to the replicas whose trees hold its prefix (the caller then takes the
shortest queue among them) and to the smallest trees under a 10 % match; SGLang's cache-aware
router goes to the least loaded replica once loads are imbalanced; trees evict oldest first."""

from __future__ import annotations

import numpy as np

from bench.routersim.peers import CacheAware, PrefixAffinity, PrefixedRequest, PrefixTrees
from cluster.routing.table import ReplicaTable


def _table(n: int) -> ReplicaTable:
    table = ReplicaTable(n)
    for row in range(n):
        table.mark_alive(row)
    return table


def _req(group: int, prompt: int = 1000, prefix: int = 512) -> PrefixedRequest:
    return PrefixedRequest(0.6, prompt, group=group, prefix_tokens=prefix)


def test_prefix_affinity_prefers_the_prefix_holders_and_else_the_smallest_trees() -> None:
    load = np.zeros(4, dtype=np.int64)
    policy, table = PrefixAffinity(4, lambda: load, seed=0), _table(4)
    policy.routed(_req(7), table, 2, 0.0)
    policy.routed(_req(7), table, 3, 0.0)
    assert sorted(policy.rank(_req(7), table, 0.0)[0]) == [2, 3]  # the holders, first rank
    # a prompt of another group: the replicas whose trees are smallest (the two still empty)
    assert sorted(policy.rank(_req(8), table, 0.0)[0]) == [0, 1]
    # a prefix under 10 % of the prompt matches too little: the smallest trees again
    assert sorted(policy.rank(_req(7, prompt=10_000, prefix=512), table, 0.0)[0]) == [0, 1]
    assert len(policy.rank(_req(7), table, 0.0)) == 2  # the holders, then power of two
    imbalanced = PrefixAffinity(4, lambda: np.array([0, 0, 30, 0]), imbalanced_threshold=10)
    imbalanced.routed(_req(7), table, 2, 0.0)
    assert len(imbalanced.rank(_req(7), table, 0.0)) == 1  # power of two alone


def test_cache_aware_balances_first_then_follows_the_cache() -> None:
    load = np.array([10, 10, 10, 10])
    policy, table = CacheAware(4, lambda: load, seed=0), _table(4)
    policy.routed(_req(5), table, 1, 0.0)
    assert policy.rank(_req(5), table, 0.0)[0] == [1]  # 51 % match, over its 0.3
    load[:] = [200, 10, 100, 100]  # 190 apart and 20x: imbalanced
    assert policy.rank(_req(5), table, 0.0) == [[1]]
    load[:] = [200, 300, 100, 100]
    assert policy.rank(_req(5), table, 0.0) == [[2]]  # the least loaded, not the holder


def test_trees_evict_their_oldest_prompts_past_the_limit() -> None:
    trees = PrefixTrees(1, 10_000)  # 2,500 tokens at 4 characters each
    trees.insert(0, _req(1, prompt=1000, prefix=500))
    trees.insert(0, _req(2, prompt=1000, prefix=500))
    assert trees.holds(0, _req(1)) and trees.holds(0, _req(2))
    trees.insert(0, _req(3, prompt=1000, prefix=500))  # 12,000 characters: the first goes
    assert not trees.holds(0, _req(1)) and trees.holds(0, _req(3))
    assert trees.matching(_req(1)) == ([], 0.0)
