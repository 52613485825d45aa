"""``KVHandoff``: what prefill returns and decode needs to pull a prompt's KV cache.

Typed, versioned and small: block ids and a reference to the source's agent, never the KV
bytes themselves (those move over the transport). Frozen, so it can be pickled through Ray
Serve handles unchanged.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from models.spec import ModelSpec

HANDOFF_VERSION = 1


@dataclass(frozen=True)
class KVRegion:
    """One registered pool tensor of the source (one KV group), as ``kvtransfer.pool`` lays it
    out: ``num_regions`` regions of ``num_blocks`` chunks each; block ``b`` of region ``r``
    starts at ``base_address + (r * num_blocks + b) * chunk_bytes``."""

    group: str
    base_address: int
    chunk_bytes: int
    num_blocks: int
    num_regions: int  # num_layers * 2 * num_heads
    num_heads: int  # KV heads this rank holds of the group
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int

    @property
    def block_bytes(self) -> int:
        return self.chunk_bytes * self.num_regions


@dataclass(frozen=True)
class KVSource:
    """Enough about a source agent to read its pool; ``version`` changes when it restarts."""

    transport: str  # the transport's name, e.g. "nixl"
    agent_name: str
    version: int
    metadata: bytes  # the transport's agent metadata (a few hundred bytes for NIXL)
    regions: tuple[KVRegion, ...]


@dataclass(frozen=True)
class KVCompat:
    """Everything both sides must agree on for the bytes of a block to mean the same thing."""

    model: str
    dtype: str
    block_size: int
    kv_layout: str
    tp_size: int
    draft: str

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())


def kv_compat(target: ModelSpec, block_size: int, tp_size: int, draft: str) -> KVCompat:
    """This side's compatibility record."""
    from kvtransfer.pool import KV_LAYOUT

    return KVCompat(
        model=target.fingerprint(),
        dtype=target.dtype,
        block_size=block_size,
        kv_layout=KV_LAYOUT,
        tp_size=tp_size,
        draft=draft,
    )


class KVCompatError(RuntimeError):
    """The two sides of a transfer disagree on model, dtype or layout."""


def check_compat(local: KVCompat, remote: KVCompat) -> None:
    """Everything must match but the TP sizes: ranks re-shard heads (``kvtransfer.resharding``)."""
    if replace(local, tp_size=0) != replace(remote, tp_size=0):
        raise KVCompatError(
            f"KV layouts differ: this side has ({local.describe()}), "
            f"the source has ({remote.describe()})"
        )


@dataclass(frozen=True)
class KVHandoff:
    """A prompt's KV cache, ready on a prefill replica, under a lease until ``lease_expiry``."""

    request_id: str
    sources: tuple[KVSource, ...]  # one per TP rank of the source, in rank order
    block_ids: tuple[int, ...]  # shared by every group and rank of the source pool
    groups: tuple[str, ...]  # KV groups shipped, e.g. ("target", "draft")
    num_tokens: int  # tokens whose KV the blocks hold (the prompt)
    first_token: int  # sampled by prefill, not yet in the cache
    compat: KVCompat
    lease_expiry: float  # unix time after which the source may reuse the blocks
    acceptance_probe: float | None = None
    draft_computed: int = 0  # prompt positions whose draft KV the blocks hold
    hidden_state: torch.Tensor | None = None  # [H] the last prompt position's target feature
    finish_reason: str | None = None  # set when the first token already ends the request
    payload: Any = None  # what the transport's export gave (e.g. an object store reference)
    version: int = HANDOFF_VERSION

    @property
    def has_blocks(self) -> bool:
        return bool(self.block_ids)
