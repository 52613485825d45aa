"""The flex kernel's int32 guard: on CUDA, a layer's view of a block-major pool past 2**31
elements (Llama-8B's KV shape past ~2,048 blocks) is not read in place, where Triton's int32
row offsets would wrap; its steps gather, logged once and counted. Whether a torch's templates
need the guard is measured on a GPU (tests/gpu)."""

from __future__ import annotations

from dataclasses import replace

import torch

from models.attention.flex_kernel import INT32_ELEMENTS, FlexKernel
from models.attention.flex_plan import QUERY_BLOCK, key_chunks
from models.attention.metadata import AttentionSpec, SeqSlice
from tests.models.attention.cases import layer_spec


def _spec_8b(num_blocks: int, device: str) -> AttentionSpec:
    # 8 KV heads of 128, 32 layers block-major: 512 chunks of 16 rows between blocks
    small = layer_spec(torch.zeros(4, 2, 8, 16, 128), group_size=4)
    return replace(
        small, num_blocks=num_blocks, block_chunks=32 * 2 * 8, device=torch.device(device)
    )


def test_a_cuda_pool_past_int32_offsets_gathers_and_is_counted() -> None:
    fits, past = _spec_8b(2048, "cuda"), _spec_8b(2049, "cuda")
    assert key_chunks(fits) * 16 * 128 <= INT32_ELEMENTS < key_chunks(past) * 16 * 128
    kernel = FlexKernel(min_context_tokens=0)
    assert kernel.reachable(fits) and kernel.fallbacks == 0
    tables = torch.arange(2000, 2049).view(1, -1)
    plan = kernel.plan([SeqSlice(tables[0].tolist(), 780, 1)], tables, past, QUERY_BLOCK)
    assert plan is None  # before any device work: the step gathers
    assert kernel.too_large == 1 and kernel.fallbacks == 1 and kernel.failed is None
    assert not kernel.reachable(past) and kernel.too_large == 2
    # off CUDA (inductor's CPU code indexes in 64 bits), or with the guard lifted, it reads
    assert kernel.reachable(_spec_8b(4096, "cpu"))
    assert FlexKernel(max_view_elements=None).reachable(past)
