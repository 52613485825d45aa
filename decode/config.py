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
    transport: str = (
        "auto"  # KV transport: auto (NIXL, else the object store) | nixl | object_store
    )
    num_blocks: int = 1024
    block_size: int = 16
    max_batch_size: int = 64  # sequences per forward step
    max_num_batched_tokens: int = 2048  # tokens per step: decodes, drafts and prompt chunks
    max_model_len: int = 8192  # prompt plus output tokens of one request
    num_threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    switch_interval_s: float | None = None  # the process's GIL switch interval (ShardSpec)
    pull_margin_s: float = 1.0  # refuse to start a pull whose lease ends sooner than this
    pull_timeout_s: float = 10.0  # a pull still running after this has failed
    kv_failure_policy: str = "recompute"  # on a failed pull: "recompute" the prompt, or "fail"
    kv_health_window: int = 64  # recent handoffs whose failed share /health reports
    max_stalled_preemptions: int = 4  # preempted this often in a row, no token between: an error
    speculation_tpot_slo_s: float | None = None  # adaptive drafts push no request's TPOT past it
    speculation_tpot_slo_max_loss: float = GUARD_MAX_LOSS  # the most goodput that guard gives up
    acceptance_alarm_ratio: float = 0.5  # realised below this share of predicted: collapsed
    acceptance_alarm_window_tokens: int = 1024  # draft tokens per cell the alarm compares over
    stream_interval_s: float = 0.0  # hold a stream's messages to the ingress this long (stream)
    # "bucketed": decode and verification steps at fixed shapes, CUDA graphs on a GPU
    # (runtime.bucketed); "ragged": every step laid out as it comes; "auto": bucketed on CUDA
    step_shapes: str = "auto"

    def bucketed(self) -> bool:
        """Whether the target runs its decode and verification steps bucketed."""
        if self.step_shapes == "auto":
            return self.device.startswith("cuda")
        return self.step_shapes == "bucketed"
