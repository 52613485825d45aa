"""oneDNN-reordered weights (the CPU's fallback where the panel kernel of ``models.cpu.linear``
cannot be built) compute each row as a one-row matmul does, bit for bit, so that verification
rows equal one-token decodes (greedy speculation token-identical to plain decoding) on a bf16
model too."""

from __future__ import annotations

from itertools import accumulate, pairwise

import pytest
import torch

from models.cpu.onednn import RowInvariance, onednn_pack


def _bf16_packs() -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), 8)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(576, 1536), (960, 576), (256, 4096)])
def test_every_row_is_computed_as_a_one_row_matmul(
    dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    out, inp = shape
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out, inp, generator=g) * 0.05).to(dtype)  # [out, in]
    x = torch.randn(160, inp, generator=g).to(dtype)  # [M, in]
    packed = onednn_pack(w, RowInvariance())
    if packed is None:  # only where this CPU's oneDNN has no kernel for the dtype
        assert dtype == torch.bfloat16 and not _bf16_packs()
        return
    one_row = torch.cat([packed.matmul(x[i : i + 1]) for i in range(40)])  # [40, out]
    for m in (2, 8, 9, 33, 160):
        assert torch.equal(packed.matmul(x[:m])[:40], one_row[: min(m, 40)]), m
    bias = torch.randn(out, generator=g).to(dtype)
    want = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    got = packed.matmul(x, bias).float()
    if dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
        return
    # bf16: each chunk's product, each running sum of them and the bias add round to bf16 (a
    # relative error of 2^-8 at most each, first order), so the bound grows with the chunks
    # this CPU's oneDNN needs (one where it reduces alike at every row count)
    parts = [x[:, a:b].float() @ w[:, a:b].float().T for a, b in pairwise(packed.bounds)]
    sums = list(accumulate(parts))
    rounded = [*parts, *sums[1:], sums[-1] + bias.float()]  # every value rounded to bf16
    bound = 1.05 * 2.0**-8 * sum(v.abs() for v in rounded) + 1e-3
    assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() / bound).max())


def test_a_long_reduction_is_probed_and_chunked_consistently() -> None:
    inv = RowInvariance()
    width = inv.chunk_width(torch.float32, 1536, 576)
    assert 0 < width <= 1536 and (width == 1536 or width % 64 == 0)
    assert inv.chunk_width(torch.float32, 1536, 576) == width  # remembered
    packed = onednn_pack(torch.randn(576, 1536), inv)
    assert packed is not None
    assert packed.bounds[0] == 0 and packed.bounds[-1] == 1536
    assert all(b - a <= width for a, b in zip(packed.bounds, packed.bounds[1:], strict=False))
