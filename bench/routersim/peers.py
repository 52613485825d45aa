"""The peers' decode routers, as the simulator runs them beside tandem's policies.

- ``prefix_affinity``: Ray Serve LLM's ``PrefixCacheAffinityRouter`` (2.58+; its defaults as
  Ray 2.60 ships them): when the replicas' queue lengths differ by at most
  ``imbalanced_threshold`` (default: always), the candidates are the replicas whose prefix tree
  matches most of the prompt; below a 10 % match, the replicas with the smallest trees; the
  caller then takes the shortest queue among them. Each routed prompt enters its replica's tree,
  which evicts its oldest text past 400,000 characters.
- ``cache_aware``: SGLang's router (``cache_aware``): when loads are imbalanced (more than 64
  apart and the largest over 1.5× the smallest) the least loaded replica; otherwise the replica
  whose tree matches most of the prompt if over ``cache_threshold`` (0.3) of it, else the one
  with the smallest tree.

A prompt's text is its shared prefix (the workload's group) and a unique rest, about four
characters a token, so a tree matches a prompt's prefix where it still holds one of its group's
prompts. The pool's engines are tandem's, which share no prefix blocks across requests on
decode (prefill holds the prefix cache): a hit saves nothing here. The simulator counts, for
every policy, the requests placed where a 400,000-character tree would hold their prefix: what
an engine reusing prefixes on decode would skip pulling.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cluster.routing.policies import Ranks, RouteRequest, RoutingPolicy, two_choices
from cluster.routing.table import ReplicaTable

IntArray = npt.NDArray[np.int64]
CHARS_PER_TOKEN = 4
PEERS = ("prefix_affinity", "cache_aware")


@dataclass(frozen=True)
class PrefixedRequest(RouteRequest):
    group: int = -1  # the shared prefix's group (-1: none)
    prefix_tokens: int = 0


class PrefixTrees:
    """Each replica's prefix tree, as what it matches: the groups of the prompts it holds,
    oldest evicted first past ``limit_chars`` (0: never)."""

    def __init__(self, replicas: int, limit_chars: int) -> None:
        self.limit = limit_chars
        self.chars = np.zeros(replicas, dtype=np.int64)  # [replicas]
        self.held: list[deque[tuple[int, int]]] = [deque() for _ in range(replicas)]
        self.count: list[dict[int, int]] = [{} for _ in range(replicas)]
        self.holders: dict[int, OrderedDict[int, None]] = {}  # group -> rows, latest last

    def insert(self, row: int, req: PrefixedRequest) -> None:
        """The prompt's text enters the row's tree: its prefix once per tree, its rest always."""
        count = self.count[row]
        fresh = req.group >= 0 and req.group not in count
        chars = (req.prompt_tokens - (req.prefix_tokens if not fresh else 0)) * CHARS_PER_TOKEN
        self.held[row].append((req.group, chars))
        self.chars[row] += chars
        if req.group >= 0:
            count[req.group] = count.get(req.group, 0) + 1
            rows = self.holders.setdefault(req.group, OrderedDict())
            rows[row] = None
            rows.move_to_end(row)
        while self.limit and self.chars[row] > self.limit and len(self.held[row]) > 1:
            group, gone = self.held[row].popleft()
            self.chars[row] -= gone
            if group >= 0:
                count[group] -= 1
                if not count[group]:
                    del count[group]
                    self.holders[group].pop(row, None)

    def matching(self, req: PrefixedRequest) -> tuple[list[int], float]:
        """The rows whose tree holds the prompt's prefix, latest first, and the match rate."""
        rows = self.holders.get(req.group) if req.group >= 0 else None
        if not rows:
            return [], 0.0
        return list(reversed(rows)), req.prefix_tokens / max(req.prompt_tokens, 1)

    def holds(self, row: int, req: PrefixedRequest) -> bool:
        return req.group >= 0 and req.group in self.count[row]

    def smallest(self) -> list[int]:
        least = self.chars.min()
        return np.flatnonzero(self.chars == least).tolist()


class PrefixAffinity(RoutingPolicy):
    """Ray Serve LLM's ``PrefixCacheAffinityRouter`` (module doc)."""

    name = "prefix_affinity"

    def __init__(
        self,
        replicas: int,
        load: Callable[[], IntArray],
        imbalanced_threshold: float = float("inf"),
        match_rate_threshold: float = 0.1,
        eviction_chars: int = 400_000,
        seed: int | None = None,
    ) -> None:
        self.trees = PrefixTrees(replicas, eviction_chars)
        self.load = load  # [replicas] each replica's queue length, as its probe reports it
        self.imbalanced, self.min_rate = imbalanced_threshold, match_rate_threshold
        self.rng = random.Random(seed)

    def rank(self, req: RouteRequest, table: ReplicaTable, now: float) -> Ranks:
        assert isinstance(req, PrefixedRequest)
        fallback = two_choices(np.flatnonzero(table.alive), self.rng)
        load = self.load()
        if float(load.max() - load.min()) > self.imbalanced:
            return fallback
        rows, rate = self.trees.matching(req)
        chosen = rows if rows and rate >= self.min_rate else self.trees.smallest()
        return [chosen, *fallback]

    def routed(self, req: RouteRequest, table: ReplicaTable, row: int, now: float) -> None:
        assert isinstance(req, PrefixedRequest)
        self.trees.insert(row, req)


class CacheAware(RoutingPolicy):
    """SGLang's router, ``cache_aware`` (module doc)."""

    name = "cache_aware"

    def __init__(
        self,
        replicas: int,
        load: Callable[[], IntArray],
        balance_abs: float = 64,
        balance_rel: float = 1.5,
        cache_threshold: float = 0.3,
        seed: int | None = None,
    ) -> None:
        self.trees = PrefixTrees(replicas, 0)  # its tree evicts by a global size, rarely reached
        self.load = load
        self.abs, self.rel, self.threshold = balance_abs, balance_rel, cache_threshold
        self.rng = random.Random(seed)

    def rank(self, req: RouteRequest, table: ReplicaTable, now: float) -> Ranks:
        assert isinstance(req, PrefixedRequest)
        load = self.load()
        most, least = int(load.max()), int(load.min())
        if most - least > self.abs and most > least * self.rel:
            return [[int(load.argmin())]]
        rows, rate = self.trees.matching(req)
        if rows and rate > self.threshold:
            return [rows[:1], rows[1:]] if len(rows) > 1 else [rows]
        smallest = self.trees.smallest()
        return [[smallest[self.rng.randrange(len(smallest))]]]

    def routed(self, req: RouteRequest, table: ReplicaTable, row: int, now: float) -> None:
        assert isinstance(req, PrefixedRequest)
        self.trees.insert(row, req)


def peer_policy(
    name: str, replicas: int, load: Callable[[], IntArray], seed: int
) -> RoutingPolicy | None:
    """The peer router named ``name`` over ``load`` ([replicas]); None for any other name."""
    if name == PrefixAffinity.name:
        return PrefixAffinity(replicas, load, seed=seed)
    if name == CacheAware.name:
        return CacheAware(replicas, load, seed=seed)
    return None
