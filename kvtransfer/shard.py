"""What a prefill worker or decode engine computes with: its *shard* of the cluster.

A shard is the target model over every tensor-parallel rank of the replica, the draft model
(co-hosted on rank 0), rank 0's KV pool, and a transport that covers every rank's pool. With
``tp_size == 1`` everything lives in this process; with more, ranks 1.. are Ray actors
(``kvtransfer.tp_group``) and the same interfaces hide them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvtransfer.pool import KVPool, pool_spec_for
from kvtransfer.select import make_transport
from kvtransfer.transport import KVTransport
from models.config import DTYPES
from models.eagle import EagleRunner, load_eagle
from models.runner import LocalRunner, ModelRunner
from models.spec import DraftKind, DraftSpec, ModelSpec


@dataclass(frozen=True)
class ShardSpec:
    role: str  # "prefill" or "decode": names agents and logs
    target: ModelSpec
    draft: DraftSpec  # its checkpoint (draft model or EAGLE head) is co-hosted on rank 0
    num_blocks: int
    block_size: int
    device: str = "cpu"
    tp_size: int = 1
    num_threads: int = 0  # torch CPU threads per rank; 0 keeps torch's default
    transport: str = "auto"  # "auto" | "nixl" | "object_store" (kvtransfer.select)


@dataclass
class Shard:
    target: ModelRunner  # the target over every rank
    draft: ModelRunner | EagleRunner | None  # the draft model or EAGLE head, on rank 0
    pool: KVPool  # rank 0's pool: its heads of the target, and the draft
    transport: KVTransport  # every rank's pool
    tp_size: int
    fallback_reason: str | None = None  # why the transport is not NIXL (None when it is)
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for close in self.closers:
            close()
        self.transport.close()


def draft_shape(model: ModelSpec | None) -> tuple[int, int, int, str] | None:
    if model is None:
        return None
    c = model.config()
    return (c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)


def target_shape(model: ModelSpec) -> tuple[int, int, int, str]:
    c = model.config()
    return (c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)


def build_shard(spec: ShardSpec) -> Shard:
    """Load the models and allocate and register the pools: locally, or over a TP group."""
    if spec.num_threads > 0:
        torch.set_num_threads(spec.num_threads)
    if spec.tp_size > 1:
        from kvtransfer.tp_group import build_tp_shard

        return build_tp_shard(spec)
    pool = KVPool(
        pool_spec_for(
            spec.num_blocks,
            spec.block_size,
            target_shape(spec.target),
            draft_shape(spec.draft.model),
        ),
        spec.device,
    )
    target = LocalRunner(spec.target.load(spec.device), pool.tensor("target"), spec.block_size)
    draft = load_draft(spec, pool)
    transport, why = make_transport(spec.transport, pool, spec.role)
    return Shard(target, draft, pool, transport, tp_size=1, fallback_reason=why)


def load_draft(spec: ShardSpec, pool: KVPool) -> ModelRunner | EagleRunner | None:
    """The co-hosted drafter's model over the pool's "draft" group (rank 0)."""
    d = spec.draft
    if d.model is None:
        return None
    if d.kind is DraftKind.EAGLE:
        head = load_eagle(
            Path(d.model.folder), Path(spec.target.folder), DTYPES[d.model.dtype], spec.device
        )
        return EagleRunner(head, pool.tensor("draft"), spec.block_size)
    return LocalRunner(d.model.load(spec.device), pool.tensor("draft"), spec.block_size)
