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

from models.logprobs import TokenLogprob
from models.spec import ModelSpec

HANDOFF_VERSION = 2


@dataclass(frozen=True)
class KVRegion:
    """One registered pool tensor of the source (one KV group), as ``kvtransfer.pool`` lays it
    out: ``num_blocks * num_layers`` slabs of ``2 * num_heads`` chunks; block ``b`` of layer
    ``l`` starts at ``base_address + (b * num_layers + l) * slab_bytes``."""

    group: str
    base_address: int
    chunk_bytes: int  # one head's block_size tokens of K (or V) in one layer
    num_blocks: int
    num_layers: int
    num_heads: int  # KV heads this rank holds of the group
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int

    @property
    def slab_bytes(self) -> int:
        """One block of one layer: K and V of every head."""
        return 2 * self.num_heads * self.chunk_bytes

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.slab_bytes


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
    transport: str  # the KV transport this side chose ("nixl", "object_store")

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())


def kv_compat(
    target: ModelSpec, block_size: int, tp_size: int, draft: str, transport: str
) -> KVCompat:
    """This side's compatibility record. The transport is in it because each side chooses its
    own (``kv.transport: auto`` falls back where NIXL fails its self-check): a NIXL prefill
    and an object-store decode cannot move a block, and must say so rather than fail every
    pull and recompute every prompt on decode."""
    from kvtransfer.pool import KV_LAYOUT

    return KVCompat(
        model=target.fingerprint(),
        dtype=target.dtype,
        block_size=block_size,
        kv_layout=KV_LAYOUT,
        tp_size=tp_size,
        draft=draft,
        transport=transport,
    )


class KVCompatError(RuntimeError):
    """The two sides of a transfer disagree on model, dtype, layout or transport."""


def check_compat(local: KVCompat, remote: KVCompat) -> None:
    """Everything must match but the TP sizes: ranks re-shard heads (``kvtransfer.resharding``)."""
    if replace(local, tp_size=0) != replace(remote, tp_size=0):
        raise KVCompatError(
            f"KV layouts differ: this side has ({local.describe()}), "
            f"the source has ({remote.describe()})"
        )


@dataclass(frozen=True)
class KVHandoff:
    """A prompt's KV cache, ready on a prefill replica, under a lease of ``lease_seconds``.

    The lease is a duration, never an instant: the source ends it on its own monotonic clock,
    and a reader counts it from when the handoff reached it (less its pull margin, which covers
    the trip here), so clocks that disagree across hosts cannot make a read land in reused
    blocks."""

    request_id: str
    sources: tuple[KVSource, ...]  # one per TP rank of the source, in rank order
    block_ids: tuple[int, ...]  # shared by every group and rank of the source pool
    groups: tuple[str, ...]  # KV groups shipped, e.g. ("target", "draft")
    num_tokens: int  # tokens whose KV the blocks hold (the prompt)
    first_token: int  # sampled by prefill, not yet in the cache
    compat: KVCompat
    lease_seconds: float  # from when the source issued this, it may reuse the blocks after
    acceptance_probe: float | None = None
    draft_computed: int = 0  # prompt positions whose draft KV the blocks hold
    hidden_state: torch.Tensor | None = None  # [F] the last prompt position's target features
    finish_reason: str | None = None  # set when the first token already ends the request
    first_logprob: TokenLogprob | None = None  # the first token's, when the request asks
    payload: Any = None  # what the transport's export gave (e.g. an object store reference)
    version: int = HANDOFF_VERSION

    @property
    def has_blocks(self) -> bool:
        return bool(self.block_ids)
