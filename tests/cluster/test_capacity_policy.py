"""Decode autoscaling on predicted capacity within the SLO: the decision rule, the policy as
Ray Serve calls it (a real ``AutoscalingContext``), and the config that selects it."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig
from ray.serve.config import AutoscalingContext

from cluster.capacity_policy import GoodputPolicy, decide
from cluster.config import TandemConfig
from serving.autoscaling_metrics import CAPACITY_TOK_S, GOODPUT_TOK_S, STREAMS

DEPLOYMENT = DeploymentID(name="decode", app_name="tandem")


NO_STREAMS: dict[str, float] = {}


def test_it_scales_out_above_the_target_in_below_the_floor_and_holds_between() -> None:
    caps = {"a": 4000.0, "b": 4000.0}  # tokens/s within the SLO: 8,000 over the pool
    up = decide(2, {"a": 3800.0, "b": 3400.0}, caps, NO_STREAMS, 0.8, 0.5, 32)  # 90 %
    assert up.replicas == 3 and up.utilization == pytest.approx(0.9)  # 7,200 / 3,200 -> 3
    hold = decide(2, {"a": 3000.0, "b": 2000.0}, caps, NO_STREAMS, 0.8, 0.5, 32)  # 62.5 %
    assert hold.replicas == 2 and not hold.fallback
    down = decide(2, {"a": 1000.0, "b": 1000.0}, caps, NO_STREAMS, 0.8, 0.5, 32)  # 25 %
    assert down.replicas == 1


def test_the_same_goodput_needs_fewer_replicas_when_it_is_well_predicted() -> None:
    """A replica delivers more tokens within the SLO where drafts are accepted: the same
    traffic needs fewer of them."""
    delivered = {"a": 6000.0, "b": 6000.0}
    creative = decide(2, delivered, {"a": 4000.0, "b": 4000.0}, NO_STREAMS, 0.8, 0.5, 32)
    copy_heavy = decide(2, delivered, {"a": 10000.0, "b": 10000.0}, NO_STREAMS, 0.8, 0.5, 32)
    assert creative.replicas == 4 and copy_heavy.replicas == 2


def test_without_capacities_it_falls_back_to_streams_per_replica() -> None:
    streams = {"a": 50.0, "b": 40.0}
    d = decide(2, {"a": 900.0, "b": 800.0}, {}, streams, 0.8, 0.5, 32)
    assert d.fallback and d.utilization is None and d.replicas == 3  # ceil(90 / 32)
    zero = decide(2, {"a": 900.0}, {"a": 0.0, "b": 0.0}, streams, 0.8, 0.5, 32)
    assert zero.fallback and zero.replicas == 3
    # a replica that has not reported counts at the mean of those that have
    three = {"a": 3000.0, "b": 3000.0, "c": 3000.0}
    partial = decide(3, three, {"a": 4000.0}, NO_STREAMS, 0.8, 0.5, 32)
    assert partial.utilization == pytest.approx(9000 / 12000) and partial.replicas == 3


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
    streams = {0: 40.0, 1: 40.0}
    full = {GOODPUT_TOK_S: {0: 4000.0, 1: 4000.0}, CAPACITY_TOK_S: {0: 4000.0, 1: 4000.0}}
    n, state = policy(_context({**full, STREAMS: streams}, {}))
    assert n == 3 and state["fallback_decisions"] == 0 and state["utilization"] == 1.0
    n, state = policy(_context({STREAMS: streams}, state))  # no replica has measured its steps
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
