"""Decode autoscaling on predicted capacity within the TPOT SLO (Ray Serve custom policy).

Each decode replica reports, as Ray Serve custom autoscaling metrics
(``DecodeServer.record_autoscaling_stats``), the goodput it delivered (``goodput_tok_s``:
output tokens per second) and the goodput it predicts it can deliver with its slowest stream
within ``decode.routing_tpot_slo_s`` at its current traffic mix (``capacity_tok_s``, from
``speculation.capacity``; at least what one stream of the mix gets, so a replica whose SLO is
out of reach still counts what it can do), with its streams and their capacity in streams for
the dashboards. Serve's controller averages each over the look-back window and calls
``GoodputPolicy`` with them:

- the pool's **utilization** is its delivered goodput over its replicas' summed capacity;
- above ``target_utilization`` it scales out, below ``downscale_utilization`` in, in either case
  to the replicas that put the goodput at ``target_utilization`` of the mean replica's
  capacity; in between it holds (hysteresis). Serve applies the pool's bounds and its
  ``upscale_delay_s`` / ``downscale_delay_s`` around the decision, as for its own policy;
- while no replica reports a capacity (none has measured its steps yet), it falls back to
  streams over the deployment's ``target_ongoing_requests`` per replica (Serve's request-count
  rule), logged once per policy instance and counted in its state (``fallback_decisions``).

Why tokens per second and not streams: the demand in tokens per second is the traffic's (its
arrival rate times its output lengths) whatever the pool's size, while streams are not
conserved when the pool resizes: a replica holding fewer streams runs each faster (a shorter
step, deeper drafts), so a pool scaled in on streams finds more of them per replica than it
planned for, and overshoots. In ``bench/autoscale_sim.py`` the streams form of this rule saved
3 % of replica-hours over Ray Serve's request-count rule at the same SLO attainment, the tokens
form 20 %.

Ray Serve counts a deployment's policy and its arguments in the application's code version, so
changing the utilization bands restarts the pool's replicas; the fallback target is read from
the deployment's own autoscaling config at each call, so resizing the pool does not.

Runs in the Serve controller: it imports nothing beyond the standard library, Ray and the
metric names it shares with the replicas (``serving.autoscaling_metrics``).
"""

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
    """The pool's desired replica count from each replica's averaged ``delivered`` goodput
    and ``capacity`` (tokens per second; module doc); on the fallback, from its ``streams``."""
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
