"""A worker's shard: the target over every TP rank, the drafter on rank 0, pools, transport."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtransfer.fabric import Fabric
from kvtransfer.fabric import apply as apply_fabric
from kvtransfer.fabric import resolve as resolve_fabric
from kvtransfer.path_check import PathProbe
from kvtransfer.pool import KVPool, pool_spec_for
from kvtransfer.transport import KVTransport
from models.backend import ModelBackend
from models.config import DTYPES
from models.cpu.backend import CpuBackend, pack_eagle_head
from models.eagle import EagleConfig, EagleHead, load_eagle
from models.llama import LlamaModel
from models.parallel import TPContext
from models.quant import check_supported
from models.spec import DraftKind, DraftSpec, ModelSpec
from runtime.backends import model_backend, row_ops_for
from runtime.bucketed import BucketedRunner
from runtime.bucketed_eagle import BucketedEagleRunner
from runtime.runner import EagleRunner, LocalRunner, ModelRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardSpec:
    role: str
    target: ModelSpec
    draft: DraftSpec
    num_blocks: int
    block_size: int
    device: str = "cpu"
    tp_size: int = 1
    num_threads: int = 0  # torch CPU threads per rank; 0 keeps torch's default
    # GIL switch interval per rank (None: the interpreter's); the step thread waits this long
    switch_interval_s: float | None = None
    transport: str = "auto"  # "auto" | "nixl" | "object_store" (kvtransfer.select)
    fabric: str = "auto"  # kv.fabric (kvtransfer/fabric.py)
    path_check: bool = False  # measure the KV path to another process at start-up
    min_path_gbps: float = 0.0  # below it the path check reports the replica degraded
    buckets: BucketSpec | None = None  # the target's bucketed steps (None: ragged only)
    # a GPU pool from this share of device memory, at least num_blocks (runtime.kv_sizing);
    # profiled at its largest steps: a prompt chunk of profile_tokens, and profile_seqs
    # sequences of profile_query tokens
    memory_utilization: float | None = None
    profile_tokens: int = 2048
    profile_seqs: int = 64
    profile_query: int = 1

    def resolve_fabric(self) -> Fabric:
        """This process's fabric, its environment set before any NIXL agent starts."""
        fabric = resolve_fabric(self.fabric, self.device.startswith("cuda"))
        apply_fabric(fabric)
        return fabric

    def configure_process(self) -> None:
        if self.num_threads > 0:
            torch.set_num_threads(self.num_threads)
        if self.switch_interval_s is not None:
            sys.setswitchinterval(self.switch_interval_s)


@dataclass(frozen=True)
class BucketSpec:
    max_seqs: int
    max_query: int  # new tokens per sequence: a chain's k + 1
    max_blocks: int
    graphs: bool


@dataclass
class Shard:
    target: ModelRunner
    draft: ModelRunner | EagleRunner | None
    pool: KVPool  # rank 0's: its heads of the target, and the draft
    transport: KVTransport
    tp_size: int
    fallback_reason: str | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)
    fabric: Fabric | None = None
    path: PathProbe | None = None  # the start-up check of the KV path (kv.path_check)

    def kv_path(self) -> dict[str, Any]:
        """For /health: the fabric and what the path check measured."""
        out: dict[str, Any] = {"fabric": self.fabric.describe() if self.fabric else None}
        if self.path is not None:
            out |= self.path.snapshot()
        return out

    def close(self) -> None:
        for close in self.closers:
            close()
        self.transport.close()


def _kv_shape(model: ModelSpec) -> tuple[int, int, int, str]:
    c = model.config()
    return (c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)


def rank_pool(spec: ShardSpec, rank: int) -> KVPool:
    draft = spec.draft.model
    draft_shape = _kv_shape(draft) if rank == 0 and draft is not None else None
    layout = pool_spec_for(
        spec.num_blocks, spec.block_size, _kv_shape(spec.target), draft_shape, spec.tp_size
    )
    return KVPool(layout, spec.device)


def feature_layers(spec: ShardSpec) -> tuple[int, ...]:
    """The residual streams an EAGLE-3 drafter reads; () (the final hidden state) otherwise."""
    d = spec.draft
    if d.kind is not DraftKind.EAGLE or d.model is None:
        return ()
    head = EagleConfig.from_folder(Path(d.model.folder)).for_target(spec.target.config())
    return head.aux_layers or ()


def load_target(spec: ShardSpec, tp: TPContext | None = None) -> LlamaModel:
    model = spec.target.load(spec.device, tp, row_ops_for(spec.device))
    model.feature_layers = feature_layers(spec)
    return model


def target_runner(spec: ShardSpec, model: LlamaModel, pool: KVPool) -> LocalRunner:
    """``model`` over ``pool`` as the spec runs it (bucketed or ragged)."""
    kv = pool.tensor("target")
    backend = _served(model_backend(model, kv, spec.block_size), "target")
    return _bucketed_or_ragged(spec, model, kv, backend)


def _bucketed_or_ragged(
    spec: ShardSpec, model: LlamaModel, kv: torch.Tensor, backend: ModelBackend
) -> LocalRunner:
    """``model`` over ``kv`` at the spec's buckets, or ragged. A draft model's rounds fit the
    target's buckets: a token a sequence (its catch-up at most k + 1), as many sequences."""
    b = spec.buckets
    if b is None:
        return LocalRunner(model, kv, spec.block_size, backend)
    return BucketedRunner(
        model, kv, spec.block_size, b.max_seqs, b.max_query, b.max_blocks, b.graphs, backend
    )


def load_draft(
    spec: ShardSpec, pool: KVPool, loaded: EagleHead | LlamaModel | None = None
) -> ModelRunner | EagleRunner | None:
    """The drafter over ``pool``: ``loaded`` (``load_draft_model``'s) or loaded here."""
    loaded = loaded if loaded is not None else load_draft_model(spec)
    if loaded is None:
        return None
    kv = pool.tensor("draft")
    if isinstance(loaded, EagleHead):
        b = spec.buckets
        if b is None:
            return EagleRunner(loaded, kv, spec.block_size)
        return BucketedEagleRunner(
            loaded, kv, spec.block_size, b.max_seqs, b.max_query, b.max_blocks, b.graphs
        )
    backend = _served(model_backend(loaded, kv, spec.block_size), "draft")
    return _bucketed_or_ragged(spec, loaded, kv, backend)


def load_draft_model(spec: ShardSpec) -> EagleHead | LlamaModel | None:
    d = spec.draft
    if d.model is None:
        return None
    ops = row_ops_for(spec.device)
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
        return head
    return d.model.load(spec.device, ops=ops)


def _served(backend: ModelBackend, what: str) -> ModelBackend:
    if isinstance(backend, CpuBackend) and not backend.packed:
        _no_packed_matmul(what, backend.model.dtype)
    return backend


def _no_packed_matmul(what: str, dtype: torch.dtype) -> None:
    log.warning("%s: no packed matmul for %s on this CPU; plain matmuls", what, dtype)
