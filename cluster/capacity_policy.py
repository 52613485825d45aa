"""Decode autoscaling on predicted capacity within the TPOT SLO, a Ray Serve custom policy (see
docs/deploy.md). It runs in the Serve controller: it imports only the standard library, Ray and
``serving.autoscaling_metrics``."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from serving.autoscaling_metrics import CAPACITY_TOK_S, GOODPUT_TOK_S, STREAMS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    replicas: int
    utilization: float | None  # delivered over summed capacity; None on the fallback
    fallback: bool


def decide(
    current: int,
    delivered: Mapping[Any, float],
    capacity: Mapping[Any, float],
    streams: Mapping[Any, float],
    target_utilization: float,
    downscale_utilization: float,
    fallback_streams: float,
) -> Decision:
    """The replicas that put the ``delivered`` goodput at ``target_utilization`` of the mean
    replica's ``capacity`` (tok/s), held between the bands; without capacities, by ``streams``."""
    caps = [c for c in capacity.values() if c > 0]
    if not caps:
        return Decision(math.ceil(sum(streams.values()) / fallback_streams), None, True)
    demand = sum(delivered.values())
    per_replica = sum(caps) / len(caps)
    # replicas that have not reported yet are counted at the mean of those that have
    pool = per_replica * max(current, len(caps))
    utilization = demand / pool
    if downscale_utilization <= utilization <= target_utilization:
        return Decision(current, utilization, False)
    return Decision(math.ceil(demand / (per_replica * target_utilization)), utilization, False)


class GoodputPolicy:
    """Ray Serve class-based autoscaling policy (``policy_function`` with ``policy_kwargs``)."""

    def __init__(self, target_utilization: float = 0.8, downscale_utilization: float = 0.5) -> None:
        self.target_utilization = target_utilization
        self.downscale_utilization = downscale_utilization
        self._warned = False

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """``ctx``: Ray Serve's ``AutoscalingContext``; returns (replicas, policy state)."""
        metrics = ctx.aggregated_metrics or {}
        fallback = float(ctx.config.target_ongoing_requests)
        d = decide(
            ctx.current_num_replicas,
            metrics.get(GOODPUT_TOK_S, {}),
            metrics.get(CAPACITY_TOK_S, {}),
            metrics.get(STREAMS, {}),
            self.target_utilization,
            self.downscale_utilization,
            fallback,
        )
        state = dict(ctx.policy_state)
        state["fallback_decisions"] = int(state.get("fallback_decisions", 0)) + d.fallback
        state["utilization"] = d.utilization
        if d.fallback and not self._warned:
            self._warned = True
            log.warning(
                "decode autoscaling (goodput policy): no replica reports its capacity yet (none "
                "has a step-time model); scaling on %g streams per replica until one does "
                "(counted in the policy state as fallback_decisions)",
                fallback,
            )
        return d.replicas, state
