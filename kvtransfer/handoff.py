from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from models.logprobs import TokenLogprob
from models.spec import ModelSpec

HANDOFF_VERSION = 3


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
    """A prompt's KV ready on a prefill replica; its lease is a duration left at a stamp, and
    every hop (prefill, ingress) takes off what it held before passing it on."""

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
    # the stamping host's time.time() when ``lease_seconds`` was left (0: unstamped)
    lease_stamped_at: float = 0.0
    source_replica: str = ""  # the prefill Serve replica holding the lease ("" outside Serve)
    version: int = HANDOFF_VERSION

    @property
    def has_blocks(self) -> bool:
        return bool(self.block_ids)

    def held(self, seconds: float, now: float) -> KVHandoff:
        """This handoff after a hop held it ``seconds`` (on that hop's own monotonic clock),
        restamped at that hop's wall-clock ``now`` for the next to measure its transit from."""
        left = max(0.0, self.lease_seconds - max(0.0, seconds))
        return replace(self, lease_seconds=left, lease_stamped_at=now)


@dataclass(frozen=True)
class LeaseRelease:
    """The ingress gives a handoff back unused (decode refused it, the client left): the
    replica holding it frees its blocks at once instead of at the lease's end."""

    request_id: str
    replica: str

    @staticmethod
    def of(handoff: KVHandoff) -> LeaseRelease:
        return LeaseRelease(handoff.request_id, handoff.source_replica)
