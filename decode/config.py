"""What a decode engine is built from (filled in by ``cluster.config``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.spec import DraftSpec, ModelSpec
from speculation.goodput import GUARD_MAX_LOSS


@dataclass(frozen=True)
class DecodeEngineConfig:
    model_name: str
    target: ModelSpec
    draft: DraftSpec = field(default_factory=DraftSpec)
    device: str = "cpu"
    tp_size: int = 1
    transport: str = "auto"
    kv_fabric: str = "auto"  # kv.fabric
    path_check: bool = False  # kv.path_check (the app turns it on)
    min_path_gbps: float = 0.0  # kv.min_path_gbps
    num_blocks: int = 1024  # with gpu_memory_utilization: the least the pool may hold
    gpu_memory_utilization: float | None = None  # size the pool from GPU memory
    block_size: int = 16
    max_batch_size: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    num_threads: int = 0
    switch_interval_s: float | None = None
    pull_margin_s: float = 1.0
    pull_timeout_s: float = 10.0
    quarantine_timeout_s: float = 60.0
    max_queue_wait_s: float = 60.0
    watchdog_s: float = 120.0
    kv_failure_policy: str = "recompute"
    kv_health_window: int = 64
    max_stalled_preemptions: int = 4
    speculation_tpot_slo_s: float | None = None
    speculation_tpot_slo_max_loss: float = GUARD_MAX_LOSS
    acceptance_alarm_ratio: float = 0.5
    acceptance_alarm_window_tokens: int = 1024
    stream_interval_s: float = 0.0
    step_shapes: str = "auto"
    warm_up: str = "auto"  # "auto" (on a GPU) | "on" | "off": every bucket stepped at start-up
    overlap: str = "auto"  # "auto" (on a GPU) | "on" | "off": plan step n + 1 beside step n

    def bucketed(self) -> bool:
        if self.step_shapes == "auto":
            return self.device.startswith("cuda")
        return self.step_shapes == "bucketed"

    def warms_up(self) -> bool:
        if self.warm_up == "auto":
            return self.bucketed() and self.device.startswith("cuda")
        return self.bucketed() and self.warm_up == "on"

    def overlaps(self) -> bool:
        if self.overlap == "auto":
            return self.device.startswith("cuda")
        return self.overlap == "on"
