"""What a prefill worker or decode engine computes with: its *shard* of the cluster.

A shard is the target model over every tensor-parallel rank of the replica, the draft model or
EAGLE head (co-hosted on rank 0), rank 0's KV pool, and a transport that covers every rank's
pool. With ``tp_size == 1`` everything lives in this process; with more, ranks 1.. are Ray
actors (``runtime.tp_group``) and the same interfaces hide them. ``runtime.build.build_shard``
makes either.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvtransfer.pool import KVPool, pool_spec_for
from kvtransfer.transport import KVTransport
from models.backend import ModelBackend
from models.config import DTYPES
from models.cpu.backend import CpuBackend, pack_eagle_head
from models.eagle import EagleConfig, load_eagle
from models.parallel import TPContext
from models.quant import check_supported
from models.spec import DraftKind, DraftSpec, ModelSpec
from runtime.backends import model_backend, row_ops_for
from runtime.bucketed import BucketedRunner
from runtime.runner import EagleRunner, LocalRunner, ModelRunner

log = logging.getLogger(__name__)


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
    # sys.setswitchinterval in each rank's process (None keeps the interpreter's): the step's
    # thread takes the GIL back after every torch op, and waits up to this long each time
    # another thread of the process (Serve's event loop, Ray's) is running Python
    switch_interval_s: float | None = None
    transport: str = "auto"  # "auto" | "nixl" | "object_store" (kvtransfer.select)
    buckets: BucketSpec | None = None  # the target's bucketed steps (None: ragged only)

    def configure_process(self) -> None:
        """Apply the process-wide settings of a rank's process: torch's CPU threads and the
        interpreter's switch interval."""
        if self.num_threads > 0:
            torch.set_num_threads(self.num_threads)
        if self.switch_interval_s is not None:
            sys.setswitchinterval(self.switch_interval_s)


@dataclass(frozen=True)
class BucketSpec:
    """The largest bucket of a bucketed target (``runtime.bucketed``), and whether a GPU
    captures each bucket as a CUDA graph."""

    max_seqs: int
    max_query: int  # new tokens per sequence: a chain's k + 1
    max_blocks: int  # KV blocks per sequence: the context limit over the block size
    graphs: bool


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


def _kv_shape(model: ModelSpec) -> tuple[int, int, int, str]:
    c = model.config()
    return (c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)


def rank_pool(spec: ShardSpec, rank: int) -> KVPool:
    """Rank ``rank``'s KV pool: its heads of the target and, on rank 0, the draft's group."""
    draft = spec.draft.model
    draft_shape = _kv_shape(draft) if rank == 0 and draft is not None else None
    layout = pool_spec_for(
        spec.num_blocks, spec.block_size, _kv_shape(spec.target), draft_shape, spec.tp_size
    )
    return KVPool(layout, spec.device)


def feature_layers(spec: ShardSpec) -> tuple[int, ...]:
    """The target residual streams the co-hosted drafter reads as features: an EAGLE-3 head's
    three (``models.eagle``); none (the final hidden state) for any other drafter."""
    d = spec.draft
    if d.kind is not DraftKind.EAGLE or d.model is None:
        return ()
    head = EagleConfig.from_folder(Path(d.model.folder)).for_target(spec.target.config())
    return head.aux_layers or ()


def rank_target(spec: ShardSpec, pool: KVPool, tp: TPContext | None = None) -> LocalRunner:
    """This rank's shard of the target (``tp`` None: the whole model) over its pool, with its
    backends chosen once (``runtime.backends``), returning the features its drafter reads."""
    model = spec.target.load(spec.device, tp, row_ops_for(spec.device))
    model.feature_layers = feature_layers(spec)
    kv = pool.tensor("target")
    backend = _served(model_backend(model, kv, spec.block_size), "target")
    b = spec.buckets
    if b is None:
        return LocalRunner(model, kv, spec.block_size, backend)
    return BucketedRunner(
        model,
        kv,
        spec.block_size,
        b.max_seqs,
        b.max_query,
        b.max_blocks,
        b.graphs,
        backend,
    )


def load_draft(spec: ShardSpec, pool: KVPool) -> ModelRunner | EagleRunner | None:
    """The co-hosted drafter's model over the pool's "draft" group (rank 0)."""
    d = spec.draft
    if d.model is None:
        return None
    ops = row_ops_for(spec.device)
    kv = pool.tensor("draft")
    if d.kind is DraftKind.EAGLE:
        check_supported(d.model.quant, spec.device)
        head = load_eagle(
            Path(d.model.folder),
            Path(spec.target.folder),
            DTYPES[d.model.dtype],
            spec.device,
            d.model.quant,
            ops,
        )
        if head.device.type == "cpu" and not pack_eagle_head(head):
            _no_packed_matmul("EAGLE head", head.dtype)
        return EagleRunner(head, kv, spec.block_size)
    model = d.model.load(spec.device, ops=ops)
    return LocalRunner(
        model, kv, spec.block_size, _served(model_backend(model, kv, spec.block_size), "draft")
    )


def _served(backend: ModelBackend, what: str) -> ModelBackend:
    """``backend``, having said once where a CPU has no packed matmul for the model's dtype
    (it then runs on the plain matmul)."""
    if isinstance(backend, CpuBackend) and not backend.packed:
        _no_packed_matmul(what, backend.model.dtype)
    return backend


def _no_packed_matmul(what: str, dtype: torch.dtype) -> None:
    log.warning("%s: no packed matmul for %s on this CPU; plain matmuls", what, dtype)
