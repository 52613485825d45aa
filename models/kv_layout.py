"""How a model sees its KV pool, and how a pool is laid out in memory.

The model reads and writes the pool as ``[num_layers, num_blocks, 2, num_kv_heads, block_size,
head_dim]``: ``pool[l]`` is one layer's paged cache in FlashInfer's "HND" order, ``[pages,
K/V, heads, page size, head dim]``. What the kernels need of it is that each block of a layer
be one contiguous *slab* (its K of every head, then its V of every head; inside each, one
head's ``block_size * head_dim`` values are a contiguous *chunk*). How far apart the slabs are
is free: the kernels take the layer and block strides.

A worker's pool (``kvtransfer.pool``) is allocated **block-major**, ``[num_blocks, num_layers,
2, heads, block_size, head_dim]``, and handed to the model as the transposed view: a block's
slabs of every layer are then one contiguous range, so a transfer moves a block, or a run of
consecutive blocks, in one descriptor, where a layer-major pool needs one per layer. A
contiguous layer-major tensor of ``kv_pool_shape`` is a valid pool too (tests build those).
"""

from __future__ import annotations

import math

import torch

from models.host_memory import huge_page_mapping


def kv_pool_shape(
    num_blocks: int, num_kv_heads: int, num_layers: int, block_size: int, head_dim: int
) -> tuple[int, int, int, int, int, int]:
    """The shape the model expects of a KV pool (see the module docstring)."""
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
    """A zeroed block-major pool, as the model sees it: [L, NB, 2, Hkv, BS, D], a view of
    contiguous [NB, L, 2, Hkv, BS, D] memory (``pool.transpose(0, 1)`` gives it back). In host
    memory, on transparent huge pages where the system gives them (``models.host_memory``)."""
    shape = (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim)
    numel = math.prod(shape)
    if torch.device(device).type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device).transpose(0, 1)
    mapping = huge_page_mapping(numel * torch.empty((), dtype=dtype).element_size())
    memory = torch.frombuffer(mapping, dtype=dtype, count=numel)  # keeps the mapping alive
    # [NB, L, 2, Hkv, BS, D]; written now, so the pages are the pool's from the start
    return memory.view(shape).zero_().transpose(0, 1)


def slabs_in_place(layer_kv: torch.Tensor) -> bool:
    """Whether each block of ``layer_kv`` [NB, 2, Hkv, BS, D] (one layer of a pool) is one
    contiguous slab, the blocks at least a slab apart: what the in-place kernels read."""
    _nb, two, h, bs, d = layer_kv.shape
    slab = two * h * bs * d
    return layer_kv.stride()[1:] == (h * bs * d, bs * d, d, 1) and layer_kv.stride(0) >= slab


def block_chunks(layer_kv: torch.Tensor) -> int:
    """How many chunks (``block_size * head_dim`` values) apart consecutive blocks of a layer
    are: ``2 * Hkv`` in a layer-major pool, ``num_layers * 2 * Hkv`` in a block-major one."""
    _nb, _two, _h, bs, d = layer_kv.shape
    if not slabs_in_place(layer_kv) or layer_kv.stride(0) % (bs * d):
        raise ValueError(f"a pool layer of strides {layer_kv.stride()} has no whole-chunk stride")
    return layer_kv.stride(0) // (bs * d)
