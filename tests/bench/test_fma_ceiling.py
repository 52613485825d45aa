"""The multiply-add ceilings ``bench.panel_matmul`` divides the kernel's rate by: they build on
this CPU, and the fp32 one is at least what the panel kernel itself achieves (a ceiling below
the kernel would make its fractions meaningless)."""

from __future__ import annotations

import time

import torch

from bench.panel_matmul import fma_ceiling
from models.cpu.linear import CpuLinear, CpuPacker, PanelKind, PanelUse


def test_the_fp32_ceiling_is_above_the_kernel() -> None:
    ceiling = fma_ceiling(PanelKind.F32, iters=10_000_000)
    assert ceiling > 0
    kernel = CpuLinear()
    assert kernel.ready(), kernel.failed
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 576, generator=g)  # [out, in]
    x = torch.randn(96, 576, generator=g)  # [M, in]
    packed = CpuPacker(use=PanelUse.ALWAYS).pack(w)
    assert packed is not None
    packed.matmul(x)  # warm-up
    t0 = time.perf_counter()
    for _ in range(5):
        packed.matmul(x)
    rate = 5 * 96 * 1536 * 576 / (time.perf_counter() - t0)  # multiply-adds a second
    assert rate < ceiling, (rate, ceiling)


def test_the_bf16_ceiling_is_zero_only_without_the_instruction() -> None:
    bf16 = fma_ceiling(PanelKind.BF16, iters=1_000_000)
    has = CpuLinear().kind_for(torch.bfloat16) is PanelKind.BF16
    assert (bf16 > 0) == has
