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
    group: str
    base_address: int
    chunk_bytes: int
    num_blocks: int
    num_layers: int
    num_heads: int
    mem_type: str
    device_id: int

    @property
    def slab_bytes(self) -> int:
        return 2 * self.num_heads * self.chunk_bytes

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.slab_bytes


@dataclass(frozen=True)
class KVSource:
    transport: str
    agent_name: str
    version: int
    metadata: bytes
    regions: tuple[KVRegion, ...]


@dataclass(frozen=True)
class KVCompat:
    model: str
    dtype: str
    block_size: int
    kv_layout: str
    tp_size: int
    draft: str
    transport: str

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())


def kv_compat(
    target: ModelSpec, block_size: int, tp_size: int, draft: str, transport: str
) -> KVCompat:
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
    if replace(local, tp_size=0) != replace(remote, tp_size=0):
        raise KVCompatError(
            f"KV layouts differ: this side has ({local.describe()}), "
            f"the source has ({remote.describe()})"
        )


@dataclass(frozen=True)
class KVHandoff:
    """A prompt's KV ready on a prefill replica; its lease is a duration, never an instant."""

    request_id: str
    sources: tuple[KVSource, ...]
    block_ids: tuple[int, ...]
    groups: tuple[str, ...]
    num_tokens: int
    first_token: int
    compat: KVCompat
    lease_seconds: float
    acceptance_probe: float | None = None
    draft_computed: int = 0
    hidden_state: torch.Tensor | None = None
    finish_reason: str | None = None
    first_logprob: TokenLogprob | None = None
    payload: Any = None
    version: int = HANDOFF_VERSION

    @property
    def has_blocks(self) -> bool:
        return bool(self.block_ids)
