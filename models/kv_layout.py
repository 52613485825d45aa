"""How a model sees its KV pool, ``[layers, NB, 2, Hkv, BS, D]``: each block of a layer one
contiguous slab (K then V, a ``BS * D`` chunk per head), the slabs' strides free. Workers allocate
it block-major, so a block of every layer is one range, one transfer descriptor."""

from __future__ import annotations

import math

import torch

from models.host_memory import huge_page_mapping


def kv_pool_shape(
    num_blocks: int, num_kv_heads: int, num_layers: int, block_size: int, head_dim: int
) -> tuple[int, int, int, int, int, int]:
    return (num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim)


def new_kv_pool(
    num_blocks: int,
    num_kv_heads: int,
    num_layers: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A zeroed [L, NB, 2, Hkv, BS, D] view of contiguous [NB, L, ...] memory."""
    shape = (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim)
    numel = math.prod(shape)
    if torch.device(device).type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device).transpose(0, 1)
    mapping = huge_page_mapping(numel * torch.empty((), dtype=dtype).element_size())
    memory = torch.frombuffer(mapping, dtype=dtype, count=numel)  # keeps the mapping alive
    # written now, so the pages are the pool's from the start
    return memory.view(shape).zero_().transpose(0, 1)


def slabs_in_place(layer_kv: torch.Tensor) -> bool:
    _nb, two, h, bs, d = layer_kv.shape
    slab = two * h * bs * d
    return layer_kv.stride()[1:] == (h * bs * d, bs * d, d, 1) and layer_kv.stride(0) >= slab


def block_chunks(layer_kv: torch.Tensor) -> int:
    """Chunks between a layer's consecutive blocks: ``2 * Hkv``, or ``L * 2 * Hkv`` block-major."""
    _nb, _two, _h, bs, d = layer_kv.shape
    if not slabs_in_place(layer_kv) or layer_kv.stride(0) % (bs * d):
        raise ValueError(f"a pool layer of strides {layer_kv.stride()} has no whole-chunk stride")
    return layer_kv.stride(0) // (bs * d)
