"""One worker's KV pools: a block-major tensor per KV group, same block ids (docs/structure.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from models.config import DTYPES
from models.kv_layout import new_kv_pool


@dataclass(frozen=True)
class KVGroupSpec:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def chunk_bytes(self, block_size: int) -> int:
        elem = torch.empty((), dtype=DTYPES[self.dtype]).element_size()
        return block_size * self.head_dim * elem

    def block_bytes(self, block_size: int) -> int:
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
    def __init__(self, spec: KVPoolSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.tensors: Mapping[str, torch.Tensor] = {
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
        return self.tensors[group]

    def memory(self, group: str) -> torch.Tensor:
        out = self.tensors[group].transpose(0, 1)
        assert out.is_contiguous()
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def mem_type(self) -> str:
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
    groups = [group_spec("target", *target[:3], target[3], tp_size)]
    if draft is not None:
        groups.append(group_spec("draft", *draft[:3], draft[3]))
    return KVPoolSpec(num_blocks, block_size, tuple(groups))
