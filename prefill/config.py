"""What a prefill worker is built from (filled in by ``cluster.builder``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.spec import DraftSpec, ModelSpec


@dataclass(frozen=True)
class PrefillWorkerConfig:
    model_name: str
    target: ModelSpec
    draft: DraftSpec = field(default_factory=DraftSpec)
    device: str = "cpu"
    tp_size: int = 1
    transport: str = (
        "auto"  # KV transport: auto (NIXL, else the object store) | nixl | object_store
    )
    kv_fabric: str = "auto"  # kv.fabric
    path_check: bool = False  # kv.path_check (the app turns it on)
    min_path_gbps: float = 0.0  # kv.min_path_gbps
    num_blocks: int = 512  # with gpu_memory_utilization: the least the pool may hold
    gpu_memory_utilization: float | None = None  # size the pool from GPU memory
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    probe_window: int = 16  # prompt positions the acceptance probe averages over
    lease_seconds: float = 30.0
    # an expired lease's blocks are reused only this much later: decode's longest pull
    lease_grace_s: float = 11.0
    num_threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    switch_interval_s: float | None = None
