"""Ray Serve autoscaling of one pool's deployment, with defaults that suit its phase: prefill
scales on queued prompts, quickly; decode on streams per replica, slowly (docs/deploy.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Ray Serve's interval between replicas' load reports; the look-back window must exceed it.
METRICS_INTERVAL_S = 10.0
GOODPUT_POLICY = "cluster.capacity_policy:GoodputPolicy"


class AutoscalingConfig(BaseModel):
    """Bounds and targets of Ray Serve's autoscaler for one deployment."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_replicas: int = Field(
        1,
        ge=0,
        description="Fewest replicas kept running; 0 lets the pool scale to zero when idle (the "
        "first request then waits for a replica to load the model).",
    )
    max_replicas: int = Field(
        ...,
        ge=1,
        description="Most replicas; each needs `tp` units of the pool's Ray resource, so the "
        "cluster's pool nodes must offer max_replicas * tp of it.",
    )
    initial_replicas: int | None = Field(
        None,
        ge=0,
        description="Replicas started on first deploy, between min and max; default min_replicas.",
    )
    target_ongoing_requests: float = Field(
        2.0,
        gt=0,
        description="Requests (running plus queued) per replica the autoscaler steers towards.",
    )
    upscale_delay_s: float = Field(
        30.0, ge=0, description="How long load must stay above target before adding replicas."
    )
    downscale_delay_s: float = Field(
        600.0, ge=0, description="How long load must stay below target before removing replicas."
    )
    look_back_period_s: float = Field(
        30.0,
        gt=METRICS_INTERVAL_S,
        description="Window over which ongoing requests are averaged; longer than the "
        f"{METRICS_INTERVAL_S:g} s at which replicas report them.",
    )
    upscaling_factor: float | None = Field(
        None,
        gt=0,
        description="Multiplier on each upscaling step (>1 scales faster); default Serve's (1).",
    )
    downscaling_factor: float | None = Field(
        None,
        gt=0,
        description="Multiplier on each downscaling step (<1 scales down more gently); default "
        "Serve's (1).",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling.min_replicas ({self.min_replicas}) exceeds autoscaling.max_replicas "
                f"({self.max_replicas})"
            )
        initial = self.initial_replicas
        if initial is not None and not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(
                f"autoscaling.initial_replicas ({initial}) must lie between min_replicas "
                f"({self.min_replicas}) and max_replicas ({self.max_replicas})"
            )
        return self

    def serve_options(self) -> dict[str, Any]:
        """Ray Serve's ``autoscaling_config`` for this deployment (unset optionals left out)."""
        return self.model_dump(mode="json", exclude_none=True)


class PrefillAutoscalingConfig(AutoscalingConfig):
    """Prefill: scale out as soon as prompts queue, since each queued prompt adds to TTFT."""

    target_ongoing_requests: float = Field(
        2.0,
        gt=0,
        description="Prompts (one running, the rest queued) per prefill replica to steer "
        "towards; keep it small, each queued prompt waits a whole prefill.",
    )
    upscale_delay_s: float = Field(
        10.0, ge=0, description="How long prompts must queue before adding prefill replicas."
    )
    downscale_delay_s: float = Field(
        300.0, ge=0, description="How long load must stay low before removing prefill replicas."
    )
    look_back_period_s: float = Field(
        15.0,
        gt=METRICS_INTERVAL_S,
        description="Window over which queued prompts are averaged (short, to catch bursts).",
    )


class DecodeAutoscalingConfig(AutoscalingConfig):
    """Decode: scale on streams per replica, below the batch size so admission never queues."""

    target_ongoing_requests: float = Field(
        32.0,
        gt=0,
        description="Streams per decode replica to steer towards; at most decode.max_batch_size "
        "(half to three quarters of it leaves room for bursts).",
    )
    upscale_delay_s: float = Field(
        30.0, ge=0, description="How long streams must exceed target before adding replicas."
    )
    downscale_delay_s: float = Field(
        600.0,
        ge=0,
        description="How long streams must stay below target before removing decode replicas "
        "(long: streams last minutes, and a replica reloads its model when scaled back up).",
    )
    look_back_period_s: float = Field(
        30.0, gt=METRICS_INTERVAL_S, description="Window over which ongoing streams are averaged."
    )
    policy: Literal["requests", "goodput"] = Field(
        "requests",
        description="requests: Ray Serve's policy on ongoing streams per replica "
        "(target_ongoing_requests). goodput: tandem's policy on the capacity each replica "
        "predicts within decode.routing_tpot_slo_s for the traffic it is serving "
        "(speculation/capacity.py, cluster/capacity_policy.py): copy-heavy traffic that accepts "
        "many drafts gets more tokens per second out of a replica within the SLO than creative "
        "traffic, and the pool scales on the goodput it delivers against that capacity.",
    )
    target_utilization: float = Field(
        0.8,
        gt=0,
        le=1,
        description="goodput policy: the share of the pool's predicted capacity (tokens per "
        "second within the SLO) its delivered goodput is steered to; above it the pool scales "
        "out.",
    )
    downscale_utilization: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="goodput policy: below this share of the pool's capacity it scales in (to "
        "target_utilization); between the two it holds (hysteresis).",
    )

    @model_validator(mode="after")
    def _bands(self) -> DecodeAutoscalingConfig:
        if self.downscale_utilization >= self.target_utilization:
            raise ValueError(
                f"decode.autoscaling.downscale_utilization ({self.downscale_utilization:g}) must "
                f"be below target_utilization ({self.target_utilization:g}): between the two "
                "the pool holds its size"
            )
        return self

    def serve_options(self) -> dict[str, Any]:
        """Ray Serve's ``autoscaling_config``; the goodput policy is imported by the controller,
        so tandem must be installed where it runs (the head node)."""
        own = {"policy", "target_utilization", "downscale_utilization"}
        out = self.model_dump(mode="json", exclude_none=True, exclude=own)
        if self.policy == "goodput":
            out["policy"] = {
                "policy_function": GOODPUT_POLICY,
                "policy_kwargs": {
                    "target_utilization": self.target_utilization,
                    "downscale_utilization": self.downscale_utilization,
                },
            }
        return out


def serve_scaling(replicas: int, autoscaling: AutoscalingConfig | None) -> dict[str, Any]:
    """``serve.deployment`` sizing of a pool: fixed ``num_replicas`` or ``autoscaling_config``."""
    if autoscaling is None:
        return {"num_replicas": replicas}
    return {"autoscaling_config": autoscaling.serve_options()}
