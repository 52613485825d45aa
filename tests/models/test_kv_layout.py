"""models.kv_layout: a worker's pool is block-major behind the model's layer-major view, its
blocks' strides are what the kernels are told, and its host memory asks for huge pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.host_memory import HUGE_PAGE, anon_huge_bytes
from models.kv_layout import block_chunks, kv_pool_shape, new_kv_pool, slabs_in_place

NB, H, L, BS, D = 12, 3, 5, 16, 8


def test_a_new_pool_is_block_major_behind_the_models_view() -> None:
    pool = new_kv_pool(NB, H, L, BS, D, torch.float32)
    assert pool.shape == kv_pool_shape(NB, H, L, BS, D)
    memory = pool.transpose(0, 1)  # [NB, L, 2, H, BS, D]
    assert memory.is_contiguous() and not pool.is_contiguous()
    assert not pool.any()
    pool[2, 7].fill_(1.0)  # block 7 of layer 2 ...
    flat = memory.reshape(-1)
    slab = 2 * H * BS * D
    at = (7 * L + 2) * slab  # ... is the slab at (block * L + layer) of the memory
    assert flat[at : at + slab].eq(1).all() and flat.sum() == slab
    assert all(slabs_in_place(pool[layer]) for layer in range(L))
    assert block_chunks(pool[0]) == L * 2 * H
    empty = new_kv_pool(0, H, L, BS, D, torch.float32)
    assert empty.shape == kv_pool_shape(0, H, L, BS, D)


def test_strides_the_kernels_cannot_read_are_named() -> None:
    layer_major = torch.zeros(kv_pool_shape(NB, H, L, BS, D))
    assert block_chunks(layer_major[1]) == 2 * H
    heads_apart = torch.zeros(NB, 2, BS, H, D).transpose(2, 3)  # a head's tokens not adjacent
    assert not slabs_in_place(heads_apart)
    with pytest.raises(ValueError, match="no whole-chunk stride"):
        block_chunks(heads_apart)


def test_a_host_pool_asks_for_huge_pages() -> None:
    """The pool's memory is a mapping of its own, advised before it is touched, so where the
    system gives huge pages on request the pool gets them, even in a process whose heap holds
    freed memory (this one, after the other tests)."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    before = anon_huge_bytes()
    pool = new_kv_pool(256, 4, 8, 16, 64, torch.float32)  # 64 MiB
    gained = anon_huge_bytes() - before
    if "[never]" in mode:
        assert gained == 0
    else:
        assert gained >= 16 * HUGE_PAGE, f"{gained} bytes of huge pages under {mode.strip()}"
    assert not pool.any()
    del pool
