"""The prefill pool in the simulator: P first-come-first-served replicas with prefix caches,
placed by ``cluster.routing.prefix.PrefixAffinity`` (the policy the prefill router runs).

Prefill does not depend on decode, so the whole pool is simulated first, request by request:
each replica serves prompts in order at ``prefill_base_s + prefill_per_token_s * uncached``
seconds, where the cached part is the request's shared prefix when the replica prefilled the
same prefix recently (an LRU of ``cache_groups`` prefixes per replica). Requests are identified
to the router by two hashes (prefix group, then the request itself), standing in for the
prompt's chained block hashes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from bench.routersim.profiles import Profile
from bench.routersim.workload import Workload
from cluster.routing.prefix import PrefixAffinity

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class PrefillResult:
    first_token_s: FloatArray  # prefill done: the first token is sent to the client
    cached_tokens: npt.NDArray[np.int64]  # prompt tokens served from a prefix cache
    busy_fraction: float  # mean utilisation of the prefill replicas


def prefill_replicas_for(w: Workload, p: Profile, utilisation: float = 0.7) -> int:
    """Enough replicas to keep prefill at ``utilisation`` with no cache hits."""
    service = p.prefill_base_s + p.prefill_per_token_s * float(w.prompt.mean())
    span = float(w.arrival_s[-1] - w.arrival_s[0]) or 1.0
    return max(1, int(np.ceil(w.size / span * service / utilisation)))


def simulate_prefill(
    w: Workload, p: Profile, replicas: int, *, cache_groups: int = 64, seed: int = 0
) -> PrefillResult:
    policy = PrefixAffinity(imbalance=4.0, seed=seed)
    policy.set_rows(range(replicas))
    free_at = [0.0] * replicas
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]
    mean_service = p.prefill_base_s + p.prefill_per_token_s * float(w.prompt.mean())
    first = np.empty(w.size)
    cached = np.zeros(w.size, dtype=np.int64)
    busy = 0.0
    arrival, group = w.arrival_s.tolist(), w.group.tolist()
    prompt, prefix = w.prompt.tolist(), w.prefix.tolist()
    for i in range(w.size):
        now, g = arrival[i], group[i]
        own = f"req{i}".encode()  # stand-ins for block keys: a group's shared prefix, then its own
        hashes = [f"group{g}".encode(), own] if g >= 0 else [own]

        def load(r: int, now: float = now) -> float:
            return max(free_at[r] - now, 0.0) / mean_service

        ranks = policy.rank(hashes, load)
        row = min(ranks[0], key=load)
        cache = caches[row]
        hit = g >= 0 and g in cache
        if g >= 0:
            cache[g] = None
            cache.move_to_end(g)
            if len(cache) > cache_groups:
                cache.popitem(last=False)
        cached[i] = prefix[i] if hit else 0
        service = p.prefill_base_s + p.prefill_per_token_s * (prompt[i] - cached[i])
        start = max(now, free_at[row])
        free_at[row] = start + service
        first[i] = start + service
        busy += service
        policy.routed(hashes, row)
    span = float(first.max() - w.arrival_s[0]) or 1.0
    return PrefillResult(first, cached, busy / (replicas * span))
