"""RMSNorm and rotary embedding in one C call each (``models.cpu.row_ops``): the rotation bit for
bit as PyTorch's ops, the norm to float rounding, every row alike whatever the row count, and
PyTorch's ops where the kernel cannot be built."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.cpu.row_ops import CpuRowOps
from models.layers import RMSNorm, RotaryEmbedding, rotary_tables

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]


def _ops() -> CpuRowOps:
    ops = CpuRowOps()
    assert ops.ready(), ops.failed  # CI's machine has a C compiler
    return ops


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_reference_and_rows_are_alike(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    plain = RMSNorm(576, 1e-5, dtype, CPU)
    plain.weight.data.copy_(torch.rand(576, generator=g) + 0.5)
    norm = RMSNorm(576, 1e-5, dtype, CPU, _ops())
    norm.weight.data.copy_(plain.weight.data)
    wide = torch.randn(40, 1152, generator=g).to(dtype)
    x = wide[:, :576]  # rows 1,152 apart, as a slice of a wider activation
    want = plain(x)
    assert isinstance(norm.ops, CpuRowOps) and norm.ops.takes(x)
    got = norm(x)
    assert got.dtype == dtype and got.shape == (40, 576)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # the row sum's order may differ: at most one bf16 rounding step apart
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)
    one_row = torch.cat([norm(x[i : i + 1]) for i in range(40)])
    assert torch.equal(got, one_row)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_is_bit_identical_to_the_torch_ops(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    plain = RotaryEmbedding(64, 4096, 10000.0, CPU)
    rope = RotaryEmbedding(64, 4096, 10000.0, CPU, ops=_ops())
    positions = torch.randint(0, 4096, (37,), generator=g)
    cos, sin = rotary_tables(rope.cos, rope.sin, positions)
    qkv = torch.randn(37, 15 * 64, generator=g).to(dtype)
    x = qkv[:, : 12 * 64].view(37, 12, 64)  # query and key heads of a fused projection
    want = plain(cos, sin, x)
    got = rope(cos, sin, x)
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, want)


def test_without_a_compiler_the_torch_ops_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path / "cache"))
    ops = CpuRowOps()
    norm = RMSNorm(64, 1e-5, torch.float32, CPU, ops)
    x = torch.randn(3, 64)
    assert not ops.ready() and not ops.takes(x)
    assert ops.failed is not None and "no-such-cc" in ops.failed
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (64,), eps=1e-5))
