"""The acceptance-aware router on a real local Ray cluster: two decode replicas publishing
routing stats, requests of both kinds served through it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from ray import serve
from ray.serve._private.build_app import build_app as serve_build_app

from bench.router_metrics import Samples, scrape
from cluster.builder import build_app
from cluster.config import TandemConfig
from cluster.routing.deploy import decode_router_options, prefill_router_options
from cluster.routing.policies import SloAware
from cluster.routing.ray_routers import AcceptanceAwareRouter, PrefixAffinityRouter, SloAwareRouter
from speculation.calibration import calibration_key
from speculation.goodput import GUARD_MAX_LOSS
from speculation.routing_stats import RoutingStats
from tests.cluster.conftest import running_app
from tests.helpers import wait_until


def config(model: Path) -> TandemConfig:
    return TandemConfig.model_validate(
        {
            "mode": "colocated",
            "model": {"source": str(model)},
            "auth": {"required": False},
            "draft": {"kind": "ngram", "num_speculative_tokens": 3},
            "decode": {
                "replicas": 2,
                "num_blocks": 64,
                "max_batch_size": 8,
                "num_threads": 1,
                "routing": "acceptance_aware",
                "routing_stats_period_s": 0.5,
            },
            "limits": {"max_model_len": 512},
        }
    )


def test_builder_installs_the_configured_routers(tiny_folder: Path) -> None:
    cfg = config(tiny_folder)
    rc = decode_router_options(cfg.decode)["request_router_config"]
    path = f"{AcceptanceAwareRouter.__module__}.{AcceptanceAwareRouter.__qualname__}"
    assert rc.request_router_class == path  # Serve imports it in the ingress replica
    assert rc.request_routing_stats_period_s == 0.5
    assert rc.request_router_kwargs == {"max_staleness_s": 5.0}
    slo_cfg = {"routing": "slo_aware", "routing_tpot_slo_s": 0.05}
    slo = decode_router_options(cfg.decode.model_validate(cfg.decode.model_dump() | slo_cfg))
    assert slo["request_router_config"].request_router_class.endswith(SloAwareRouter.__qualname__)
    assert slo["request_router_config"].request_router_kwargs == {
        "max_staleness_s": 5.0,
        "tpot_slo_s": 0.05,
    }
    pow2 = decode_router_options(cfg.decode.model_copy(update={"routing": "power_of_two"}))
    assert pow2["request_router_config"].request_router_class.endswith(
        "PowerOfTwoChoicesRequestRouter"
    )
    prc = prefill_router_options(cfg.prefill, 16)["request_router_config"]
    assert prc.request_router_class.endswith(PrefixAffinityRouter.__qualname__)
    assert prc.request_router_kwargs == {"block_size": 16, "imbalance": 4.0, "affinity": True}
    pow2_prefill = prefill_router_options(
        cfg.prefill.model_copy(update={"routing": "power_of_two"}), 16
    )
    # still ours: a dropped handoff's release must reach the replica that holds its lease
    assert pow2_prefill["request_router_config"].request_router_kwargs["affinity"] is False


def test_the_decode_engine_gets_the_speculation_slo(tiny_folder: Path) -> None:
    sets = {"decode.speculation_tpot_slo_s": 0.05, "decode.speculation_tpot_slo_max_loss": 0.3}
    cfg = config(tiny_folder).with_overrides(**sets)
    built = serve_build_app(build_app(cfg), name="tandem")
    decode = next(d for d in built.deployments if d.name == "decode")
    assert decode.init_args[0].speculation_tpot_slo_s == 0.05
    assert decode.init_args[0].speculation_tpot_slo_max_loss == 0.3
    plain = serve_build_app(build_app(config(tiny_folder)), name="tandem")
    unguarded = next(d for d in plain.deployments if d.name == "decode").init_args[0]
    assert unguarded.speculation_tpot_slo_s is None  # unset: throughput alone decides
    assert unguarded.speculation_tpot_slo_max_loss == GUARD_MAX_LOSS
    guarded = replace(unguarded, speculation_tpot_slo_s=0.05, speculation_tpot_slo_max_loss=0.3)
    assert guarded == decode.init_args[0]


def test_replicas_reserve_their_share_of_a_gpu(tiny_folder: Path) -> None:
    """``gpu_fraction``: three replicas at 0.3 fit one GPU; the default takes a whole one."""
    shared = config(tiny_folder).with_overrides(
        **{"decode.device": "cuda", "decode.gpu_fraction": 0.3}
    )
    built = serve_build_app(build_app(shared), name="tandem")
    decode = next(d for d in built.deployments if d.name == "decode")
    assert decode.ray_actor_options["num_gpus"] == 0.3
    assert decode.ray_actor_options["resources"] == {"decode_pool": 0.3}  # 1 a GPU, shared too
    whole = serve_build_app(
        build_app(config(tiny_folder).with_overrides(**{"decode.device": "cuda"})), name="tandem"
    )
    assert (
        next(d for d in whole.deployments if d.name == "decode").ray_actor_options["num_gpus"]
        == 1.0
    )
    on_cpu = next(
        d
        for d in serve_build_app(build_app(config(tiny_folder)), name="tandem").deployments
        if d.name == "decode"
    )
    assert "num_gpus" not in on_cpu.ray_actor_options


def test_the_slo_aware_router_takes_its_slo_from_the_router_kwargs() -> None:
    """What Serve does with ``request_router_kwargs``: ``initialize_state(**kwargs)``."""
    router = SloAwareRouter.__new__(SloAwareRouter)  # Serve's constructor needs a deployment
    router.initialize_state(max_staleness_s=5.0, tpot_slo_s=0.05)
    policy = router._policy
    assert isinstance(policy, SloAware) and policy.tpot_slo_s == 0.05
    with pytest.raises(ValueError, match="TPOT SLO"):
        SloAwareRouter.__new__(SloAwareRouter).initialize_state(max_staleness_s=5.0)


@pytest.fixture(scope="module")
def base(tiny_folder: Path) -> Iterator[str]:
    with running_app(config(tiny_folder)) as url:
        yield url


async def _chat(
    client: httpx.AsyncClient, model: str, text: str, temperature: float
) -> dict[str, object]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 12,
        "temperature": temperature,
        "seed": 1,
    }
    r = await client.post("/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, object] = r.json()
    return out


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_requests_flow_through_the_acceptance_aware_router(base: str) -> None:
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]

    async def run() -> list[dict[str, object]]:
        async with httpx.AsyncClient(base_url=base) as client:
            copy = "Repeat exactly: one two three four five six seven eight nine ten"
            jobs = [_chat(client, model, copy, 0.0) for _ in range(4)]
            jobs += [_chat(client, model, "Tell me a story.", 1.0) for _ in range(4)]
            return await asyncio.gather(*jobs)

    replies = asyncio.run(run())
    assert len(replies) == 8
    assert all(r["usage"]["completion_tokens"] >= 1 for r in replies)  # type: ignore[index]
    decode = serve.get_deployment_handle("decode", app_name="tandem")
    seen = [RoutingStats.from_dict(decode.record_routing_stats.remote().result()) for _ in range(4)]
    for s in seen:
        assert s.num_blocks == 64 and s.max_batch_size == 8 and s.k_max == 3
        assert s.adaptive and s.step_time, "adaptive speculation publishes its step-time model"
        assert s.running == 0 and s.free_blocks == 64  # everything finished and freed
    # This handle routes with the deployment's router too: both replicas' stats reach its
    # table (Ray Serve 2.60's handle internals, pinned in pyproject.toml).
    handle_router: Any = decode._router
    router = handle_router._asyncio_router._request_router
    assert isinstance(router, AcceptanceAwareRouter)
    # this handle placed only those four calls, none of them a generate
    assert router.metrics.totals.decisions.get("other_call", 0) >= 4
    assert set(router.metrics.totals.decisions) == {"other_call"}
    table = router._table
    wait_until(lambda: table.has_stats.sum() >= 2, 15, "both replicas' stats", interval_s=0.2)
    # a replica that refined its step-time model from its own steps (speculation.step_time)
    # publishes its own; replicas publishing equal models share one entry
    assert table.size == 2 and table.has_stats.all() and 1 <= len(table.models) <= 2
    assert table.fresh(time.time(), 5.0).all()  # scored by acceptance, not the fallback
    # The replicas' acceptance cells reach the router too: every request here finished, and
    # those that drafted calibrate the next ones of their (temperature, probe) cell.
    usages: list[Any] = [r["usage"] for r in replies]
    drafted = sum(u.get("speculative", {}).get("draft_tokens", 0) for u in usages)
    assert drafted > 0
    wait_until(router._calibration.keys, 15, "the replicas' acceptance cells", interval_s=0.2)
    assert router._calibration.keys() <= {calibration_key(None, 0.0), calibration_key(None, 1.0)}
    assert router._calibration.keys()  # colocated: no probe, so cells by temperature alone


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_router_reports_its_decisions_to_prometheus(base: str) -> None:
    """Three greedy and one sampled request, placed while every replica's stats are fresh:
    the ingress's decode router exports one estimate per request, by sampling, and decisions
    taken on the replicas' stats."""
    port = int(ray.nodes()[0]["MetricsExportPort"])
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    # Every replica's snapshot is fresh: Serve's controller hands each one to the ingress's
    # router as it does to this process's handle (whose router starts on a first call).
    decode = serve.get_deployment_handle("decode", app_name="tandem")
    decode.record_routing_stats.remote().result()
    handle_router: Any = decode._router
    table = handle_router._asyncio_router._request_router._table

    def fresh() -> bool:
        return table.size == 2 and bool(table.fresh(time.time(), 5.0).all())

    wait_until(fresh, 30, "every decode replica's routing stats fresh", interval_s=0.2)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=base) as client:
            copy = "Repeat exactly: one two three four five six seven eight nine ten"
            await asyncio.gather(
                *(_chat(client, model, copy, 0.0) for _ in range(3)),
                _chat(client, model, "Tell me a story.", 1.0),
            )

    asyncio.run(run())
    estimates = "ray_tandem_router_acceptance_estimate_count"

    def exported() -> Samples:
        got = scrape(port, "decode")
        greedy = got.get((estimates, "", "greedy"), 0.0)
        assert greedy >= 3 and greedy - got.get((estimates, "", "sampled"), 0.0) == 2, got
        return got

    # Ray exports every few seconds; earlier tests in this module placed 4 + 4
    got = wait_until(exported, 60, "the four requests' estimates exported", interval_s=1)
    greedy = got.get((estimates, "", "greedy"), 0.0)
    sampled = got.get((estimates, "", "sampled"), 0.0)
    decisions = "ray_tandem_router_decisions_total"
    assert got.get((decisions, "stats", ""), 0.0) >= 4, got
    assert got.get((decisions, "fallback", ""), 0.0) <= greedy + sampled - 4, got
    seconds = got[("ray_tandem_router_decision_seconds_count", "", "")]
    assert seconds == sum(v for (name, _, _), v in got.items() if name == decisions)
    assert got[("ray_tandem_router_decision_cpu_seconds_count", "", "")] == seconds
    assert got[("ray_tandem_router_decision_cpu_seconds_sum", "", "")] > 0
