"""Serve deployment options that install the configured routers (used by ``cluster.builder``)."""

from __future__ import annotations

from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import RequestRouter

from cluster.config import DecodeConfig, PrefillConfig
from cluster.routing.ray_routers import (
    AcceptanceAwareRouter,
    LeastKVRouter,
    PrefixAffinityRouter,
    RoundRobinRouter,
    SloAwareRouter,
)

DECODE_ROUTERS: dict[str, type[RequestRouter]] = {
    "acceptance_aware": AcceptanceAwareRouter,
    "least_kv": LeastKVRouter,
    "round_robin": RoundRobinRouter,
    "slo_aware": SloAwareRouter,
}  # power_of_two: Ray Serve's default router


def decode_router_options(d: DecodeConfig) -> dict[str, Any]:
    """``request_router_config`` for the decode deployment."""
    router = DECODE_ROUTERS.get(d.routing)
    fields: dict[str, Any] = {"request_routing_stats_period_s": d.routing_stats_period_s}
    if router is not None:
        fields["request_router_class"] = router
        kwargs: dict[str, Any] = {"max_staleness_s": d.routing_max_staleness_s}
        if d.routing == "slo_aware":
            kwargs["tpot_slo_s"] = d.routing_tpot_slo_s
        fields["request_router_kwargs"] = kwargs
    return {"request_router_config": RequestRouterConfig(**fields)}


def prefill_router_options(p: PrefillConfig, block_size: int) -> dict[str, Any]:
    """``request_router_config`` for the prefill deployment: prefix affinity, or power of two
    choices alone; either sends a lease's release to the replica holding it."""
    kwargs = {
        "block_size": block_size,
        "imbalance": p.routing_imbalance,
        "affinity": p.routing == "prefix_affinity",
    }
    fields: dict[str, Any] = {
        "request_router_class": PrefixAffinityRouter,
        "request_router_kwargs": kwargs,
    }
    return {"request_router_config": RequestRouterConfig(**fields)}
