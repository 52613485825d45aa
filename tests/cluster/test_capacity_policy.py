"""Decode autoscaling on predicted capacity within the SLO: the decision rule, the policy as
Ray Serve calls it (a real ``AutoscalingContext``), and the config that selects it."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig
from ray.serve.config import AutoscalingContext

from cluster.capacity_policy import CAPACITY, STREAMS, GoodputPolicy, decide
from cluster.config import TandemConfig

DEPLOYMENT = DeploymentID(name="decode", app_name="tandem")


def test_it_scales_out_above_the_target_in_below_the_floor_and_holds_between() -> None:
    caps = {"a": 40.0, "b": 40.0}  # 80 streams within the SLO over the pool
    up = decide(2, {"a": 38.0, "b": 34.0}, caps, 0.8, 0.5, 32)  # 90 %
    assert up.replicas == 3 and up.utilization == pytest.approx(0.9)  # 72 / (40 * 0.8) -> 3
    hold = decide(2, {"a": 30.0, "b": 20.0}, caps, 0.8, 0.5, 32)  # 62.5 %
    assert hold.replicas == 2 and not hold.fallback
    down = decide(2, {"a": 10.0, "b": 10.0}, caps, 0.8, 0.5, 32)  # 25 %
    assert down.replicas == 1


def test_the_same_streams_need_fewer_replicas_when_they_are_well_predicted() -> None:
    streams = {"a": 60.0, "b": 60.0}
    creative = decide(2, streams, {"a": 40.0, "b": 40.0}, 0.8, 0.5, 32)
    copy_heavy = decide(2, streams, {"a": 100.0, "b": 100.0}, 0.8, 0.5, 32)
    assert creative.replicas == 4 and copy_heavy.replicas == 2


def test_without_capacities_it_falls_back_to_streams_per_replica() -> None:
    d = decide(2, {"a": 50.0, "b": 40.0}, {}, 0.8, 0.5, 32)
    assert d.fallback and d.utilization is None and d.replicas == 3  # ceil(90 / 32)
    # a replica that has not reported counts at the mean of those that have
    partial = decide(3, {"a": 30.0, "b": 30.0, "c": 30.0}, {"a": 40.0}, 0.8, 0.5, 32)
    assert partial.utilization == pytest.approx(90 / 120) and partial.replicas == 3


def _context(metrics: dict[str, dict[Any, float]], state: dict[str, Any]) -> AutoscalingContext:
    replicas = [ReplicaID(unique_id=str(i), deployment_id=DEPLOYMENT) for i in range(2)]
    return AutoscalingContext(
        deployment_id=DEPLOYMENT,
        deployment_name="decode",
        app_name="tandem",
        current_num_replicas=2,
        target_num_replicas=2,
        running_replicas=replicas,
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics={
            name: dict(zip(replicas, v.values(), strict=True)) for name, v in metrics.items()
        },
        raw_metrics=None,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=8,
        policy_state=state,
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=ServeAutoscalingConfig(max_replicas=8, target_ongoing_requests=16),
    )


def test_the_policy_reads_serves_context_and_counts_its_fallbacks() -> None:
    policy = GoodputPolicy(target_utilization=0.8, downscale_utilization=0.5)
    n, state = policy(_context({STREAMS: {0: 40.0, 1: 40.0}, CAPACITY: {0: 40.0, 1: 40.0}}, {}))
    assert n == 3 and state["fallback_decisions"] == 0 and state["utilization"] == 1.0
    n, state = policy(_context({STREAMS: {0: 40.0, 1: 40.0}}, state))
    assert n == 5 and state["fallback_decisions"] == 1 and state["utilization"] is None


def test_the_config_selects_it_and_serve_accepts_what_it_renders() -> None:
    cfg = TandemConfig.model_validate(
        {
            "draft": {"kind": "ngram"},
            "decode": {
                "routing_tpot_slo_s": 0.05,
                "autoscaling": {"max_replicas": 4, "policy": "goodput", "target_utilization": 0.7},
            },
        }
    )
    options = cfg.decode.scaling_options()["autoscaling_config"]
    assert options["policy"] == {
        "policy_function": "cluster.capacity_policy:GoodputPolicy",
        "policy_kwargs": {
            "target_utilization": 0.7,
            "downscale_utilization": 0.5,
        },
    }
    serve = ServeAutoscalingConfig(**options)  # Ray Serve imports the policy by its path
    assert serve.policy.policy_kwargs["target_utilization"] == 0.7
    assert "target_utilization" not in options  # tandem's own fields stay out of Serve's


GOODPUT = {"policy": "goodput", "max_replicas": 4}
SLO = {"routing_tpot_slo_s": 0.05}


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"decode": {"autoscaling": GOODPUT}}, "routing_tpot_slo_s is not set"),
        (
            {"draft": {"adaptive": False}, "decode": {**SLO, "autoscaling": GOODPUT}},
            "speculation is not adaptive",
        ),
        (
            {"decode": {**SLO, "autoscaling": {**GOODPUT, "downscale_utilization": 0.9}}},
            r"downscale_utilization \(0.9\) must be below target_utilization \(0.8\)",
        ),
    ],
)
def test_goodput_scaling_without_its_model_is_refused(data: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        TandemConfig.model_validate(data)
