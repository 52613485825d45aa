"""The KV block pools of one worker: one tensor per KV group (target, draft), same block ids.

Every group's memory is **block-major** (``models.kv_layout``)::

    [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]

and the model reads it through the transposed view ``[num_layers, num_blocks, ...]``. Block
``b`` of layer ``l`` is one contiguous *slab* of ``2 * num_kv_heads`` *chunks* (K of every
head, then V of every head; a chunk is one head's ``block_size`` tokens), at ``(b * num_layers
+ l) * slab_bytes``: a block of every layer is one contiguous range of ``block_bytes``, and a
run of consecutive blocks one range too. A transfer that moves every head therefore takes one
descriptor per block, or per run of blocks; one that moves a contiguous run of the heads, as a
rank of a different TP size does, takes two per layer and block (the K part and the V part).
Target and draft share block ids: a sequence has one block table, and the draft group simply
has fewer, smaller slabs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from models.config import DTYPES
from models.kv_layout import new_kv_pool


@dataclass(frozen=True)
class KVGroupSpec:
    """Shape of one model's KV cache on one rank."""

    name: str  # "target" or "draft"
    num_layers: int
    num_kv_heads: int  # heads held by this rank
    head_dim: int
    dtype: str  # a key of models.config.DTYPES

    def chunk_bytes(self, block_size: int) -> int:
        """Bytes of one chunk: ``block_size`` tokens of one head's K (or V) in one layer."""
        elem = torch.empty((), dtype=DTYPES[self.dtype]).element_size()
        return block_size * self.head_dim * elem

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block across every layer of the group (its K and V, every head)."""
        return self.num_layers * 2 * self.num_kv_heads * self.chunk_bytes(block_size)


@dataclass(frozen=True)
class KVPoolSpec:
    num_blocks: int
    block_size: int
    groups: tuple[KVGroupSpec, ...]

    def group(self, name: str) -> KVGroupSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no KV group {name!r}")

    @property
    def bytes_per_token(self) -> int:
        return sum(g.block_bytes(self.block_size) for g in self.groups) // self.block_size


class KVPool:
    """Allocated KV tensors of one worker, one per group, on one device."""

    def __init__(self, spec: KVPoolSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.tensors: Mapping[str, torch.Tensor] = {  # as the model sees them
            g.name: new_kv_pool(
                spec.num_blocks,
                g.num_kv_heads,
                g.num_layers,
                spec.block_size,
                g.head_dim,
                DTYPES[g.dtype],
                self.device,
            )
            for g in spec.groups
        }

    def tensor(self, group: str) -> torch.Tensor:
        """The group's pool as the model reads it: [L, NB, 2, Hkv, BS, D], block-major."""
        return self.tensors[group]

    def memory(self, group: str) -> torch.Tensor:
        """The group's memory as it lies: [NB, L, 2, Hkv, BS, D], contiguous (what a transport
        registers)."""
        out = self.tensors[group].transpose(0, 1)
        assert out.is_contiguous()
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def mem_type(self) -> str:
        """NIXL's name for where the pool lives."""
        return "VRAM" if self.device.type == "cuda" else "DRAM"

    @property
    def device_id(self) -> int:
        if self.device.type != "cuda":
            return 0
        return self.device.index or 0


KV_LAYOUT = "blocks,layers,kv,kv_heads,block_size,head_dim"


def group_spec(
    name: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, tp_size: int = 1
) -> KVGroupSpec:
    """The KV group of a model whose KV heads are split over ``tp_size`` ranks."""
    if num_kv_heads % tp_size:
        raise ValueError(f"{name}: {num_kv_heads} KV heads cannot be split over TP={tp_size}")
    return KVGroupSpec(name, num_layers, num_kv_heads // tp_size, head_dim, dtype)


def pool_spec_for(
    num_blocks: int,
    block_size: int,
    target: tuple[int, int, int, str],
    draft: tuple[int, int, int, str] | None = None,
    tp_size: int = 1,
) -> KVPoolSpec:
    """A pool with a "target" group (and a "draft" group when given).

    ``target`` and ``draft`` are ``(num_layers, num_kv_heads, head_dim, dtype)`` of each model;
    the target's heads are split over ``tp_size`` ranks, the draft lives whole on one rank.
    """
    groups = [group_spec("target", *target[:3], target[3], tp_size)]
    if draft is not None:
        groups.append(group_spec("draft", *draft[:3], draft[3]))
    return KVPoolSpec(num_blocks, block_size, tuple(groups))
