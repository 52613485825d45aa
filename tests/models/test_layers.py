"""The rotary embedding's fused form against the textbook "rotate half" form."""

from __future__ import annotations

import pytest
import torch

from models.layers import RotaryEmbedding, rotary_tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rotation_is_bit_identical_to_rotate_half(dtype: torch.dtype) -> None:
    d, heads, t = 64, 12, 7
    rope = RotaryEmbedding(d, 4096, 10000.0, torch.device("cpu"))
    positions = torch.tensor([0, 1, 5, 99, 100, 2047, 4095])  # [T]
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, heads * d + 3 * d, generator=g).to(dtype)  # a wider row: a strided view
    x = qkv[:, : heads * d].view(t, heads, d)
    cos, sin = rotary_tables(rope.cos, rope.sin, positions)  # [T, 1, 2, D / 2] each
    got = rope(cos, sin, x)
    c, s = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)  # [T, 1, D / 2]
    x1, x2 = x.float().chunk(2, dim=-1)
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(dtype)
    assert got.dtype == dtype and got.shape == (t, heads, d)
    assert torch.equal(got, want)
    # position 0 is the identity rotation
    assert torch.equal(got[0], x[0])
