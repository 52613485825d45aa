"""The panel matmul kernel (``models.cpu.linear``): every row computed as a one-row call
computes it, bit for bit, in fp32, bf16 and int8; results match ``F.linear``; and where the
kernel cannot be built, weights take oneDNN, named and counted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.cpu.greedy_head import GreedyHead
from models.cpu.linear import (
    CpuLinear,
    CpuPacker,
    PanelKind,
    PanelUse,
    PanelWeight,
    pack_panels,
)
from models.cpu.onednn import PackedWeight
from models.cpu.row_ops import CpuRowOps
from models.quant import Quant, quantize, row_absmax
from models.spec import ModelSpec
from tests.helpers import assert_verification_equals_decodes, make_tiny_checkpoint, serve_on_cpu

# (out, in): odd widths (a partial last panel, an odd reduction) and the embedded model's
SHAPES = [(37, 50), (960, 576), (576, 1536), (100, 64)]
# rows: tile edges (8 rows a tile in fp32 and int8, 6 in bf16), a verification step's rows,
# the start of fp32's K-blocked path (4 rows), and a prompt chunk past one block of rows (192)
ROWS = (2, 3, 4, 5, 6, 7, 8, 9, 13, 33, 64, 160, 192, 200)


def _kinds() -> list[torch.dtype]:
    bf16 = CpuLinear().kind_for(torch.bfloat16) is PanelKind.BF16
    return [torch.float32, torch.bfloat16] if bf16 else [torch.float32]


def _data(shape: tuple[int, int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = shape
    g = torch.Generator().manual_seed(out * 7 + inp)
    w = (torch.randn(out, inp, generator=g) * 0.05).to(dtype)  # [out, in]
    x = torch.randn(max(ROWS), inp, generator=g).to(dtype)  # [M, in]
    return w, x


def _assert_rows_alike(packed: PanelWeight, x: torch.Tensor) -> None:
    one_row = torch.cat([packed.matmul(x[i : i + 1]) for i in range(40)])  # [40, out]
    last = torch.cat([packed.matmul(x[i : i + 1]) for i in range(190, 200)])  # [10, out]
    for m in ROWS:
        got = packed.matmul(x[:m])
        assert torch.equal(got[:40], one_row[: min(m, 40)]), f"{m} rows"
        if m == max(ROWS):  # the rows on both sides of the first block's end
            assert torch.equal(got[190:], last), f"{m} rows, second block"


def test_the_kernel_builds_here() -> None:
    """CI's machine has a C compiler: the kernel must load (else every other test here would
    test the fallback), and it runs bf16 exactly where the CPU has the dot product (which
    decides the `cpu_bf16` tier)."""
    kernel = CpuLinear()
    assert kernel.ready(), kernel.failed
    assert kernel.kind_for(torch.float32) is PanelKind.F32
    flags = next(
        (
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ),
        "",
    ).split()
    want = PanelKind.BF16 if "avx512_bf16" in flags else None
    assert kernel.kind_for(torch.bfloat16) is want


def test_replicas_take_the_panel_kernel_only_with_its_vector_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Built without AVX-512F, the kernel's 16-float tiles spill (1.8-17x slower than oneDNN,
    bench.panel_fallback): a replica's packer then takes oneDNN and says why; ``never`` and
    ``always`` ($TANDEM_CPU_PANEL) override, and every path computes the same product."""
    flags = next(
        (ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")),
        "",
    ).split()
    assert CpuLinear().vector() == ("avx512f" in flags)
    w, x = _data((576, 1536), torch.float32)
    want = torch.nn.functional.linear(x, w)
    auto = CpuPacker(use=PanelUse.AUTO)
    packed = auto.pack(w)
    assert isinstance(packed, PanelWeight) == ("avx512f" in flags)
    if "avx512f" not in flags:
        assert auto.describe() == (
            "onednn (cpu_panel has no vector tiles on this CPU: it needs AVX-512F)"
        )
        assert auto.fallbacks == 1
    monkeypatch.setenv("TANDEM_CPU_PANEL", "never")
    never = CpuPacker()
    assert isinstance(never.pack(w), PackedWeight)
    assert never.describe() == "onednn (TANDEM_CPU_PANEL=never)"
    monkeypatch.setenv("TANDEM_CPU_PANEL", "always")
    always = CpuPacker()
    forced = always.pack(w)
    assert isinstance(forced, PanelWeight) and always.describe() == "cpu_panel"
    for p in (packed, forced):
        assert p is not None
        torch.testing.assert_close(p.matmul(x), want, atol=1e-4, rtol=1e-4)
    monkeypatch.setenv("TANDEM_CPU_PANEL", "sometimes")
    with pytest.raises(ValueError, match="sometimes"):
        CpuPacker()


@pytest.mark.parametrize("dtype", _kinds())
@pytest.mark.parametrize("shape", SHAPES)
def test_every_row_is_computed_as_a_one_row_call(
    dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    if dtype == torch.bfloat16 and shape[1] % 2:
        shape = (shape[0], shape[1] + 1)  # bf16 reduces in pairs
    w, x = _data(shape, dtype)
    packed = CpuPacker(use=PanelUse.ALWAYS).pack(w)
    assert isinstance(packed, PanelWeight)
    _assert_rows_alike(packed, x)
    bias = torch.randn(shape[0]).to(dtype)
    want = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    got = packed.matmul(x, bias)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_an_fp32_head_is_screened_exactly_where_the_kernel_has_bf16() -> None:
    """Where the kernel has no bf16 kind, an fp32 head gets no screen (its argmax is the full
    logits'): ``build`` says so rather than screening at the wrong precision."""
    w = torch.randn(64, 32)
    exact = CpuPacker(use=PanelUse.ALWAYS).pack(w)
    assert isinstance(exact, PanelWeight)
    has = CpuLinear().kind_for(torch.bfloat16) is PanelKind.BF16
    assert (GreedyHead.build(w, exact) is not None) == has


def test_strided_rows_and_no_rows() -> None:
    w, x = _data((960, 576), torch.float32)
    packed = CpuPacker(use=PanelUse.ALWAYS).pack(w)
    assert packed is not None
    wide = torch.cat([x, x], dim=1)[:, :576]  # rows 1,152 floats apart
    assert torch.equal(packed.matmul(wide[:9]), packed.matmul(x[:9]))
    assert packed.matmul(x[:0]).shape == (0, 960)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_alike_and_near_the_dequantized_weight(dtype: torch.dtype) -> None:
    w, x = _data((576, 1536), dtype)
    q = quantize(w, Quant.INT8, row_absmax(w))
    packed = CpuPacker(use=PanelUse.ALWAYS).pack_quantized(q)
    # a bf16 model multiplies by digits where the CPU has the int8 dot-product instruction
    digits = dtype == torch.bfloat16 and CpuLinear().int8_kind(dtype) is PanelKind.INT8_DIGITS
    assert packed is not None and packed.kind is (
        PanelKind.INT8_DIGITS if digits else PanelKind.INT8
    )
    _assert_rows_alike(packed, x)
    got = packed.matmul(x[:9])
    assert got.dtype == dtype
    want = x[:9].float() @ q.dequantized().T  # [9, 576]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def _int8_panel(kind: PanelKind, q: torch.Tensor, scale: torch.Tensor) -> PanelWeight:
    """int8 weights ``q`` [N, K] with per-column ``scale`` [N], packed as ``kind`` for a bf16
    model (any K: the kernel pads; ``quantize`` itself asks for multiples of 16)."""
    n = q.shape[0]
    padded = torch.zeros(-(-n // 16) * 16)
    padded[:n] = scale
    kernel = CpuLinear()
    assert kernel.ready(), kernel.failed
    return PanelWeight(kernel, kind, pack_panels(q, kind), padded, n, torch.bfloat16)


@pytest.mark.parametrize("shape", [(37, 50), (576, 1536), (100, 64)])
def test_int8_by_digits_is_the_integer_product_rounded_once(shape: tuple[int, int]) -> None:
    """Kind INT8_DIGITS writes each bf16 row as 16-bit integers (two int8 digits) relative to
    its largest value and multiplies exactly: every output is the exact product of the weights
    and that integer row rounded once to bf16, so within that rounding and the integers' own
    rounding (half a step per entry) of the product with the row itself; rows alike at every
    row count; a zero row gives zeros and a NaN stays in its row. Without the instruction the
    kernel refuses the kind by name."""
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)  # [N, K]
    scale = torch.rand(n, generator=g) * 0.01 + 1e-3  # [N]
    x = (torch.randn(max(ROWS), k, generator=g) * torch.rand(max(ROWS), 1, generator=g) * 4).to(
        torch.bfloat16
    )  # [M, K], rows of different magnitudes
    x[1, : k // 2] = 0  # a row with small and zero entries beside the others
    x[2] = 0
    packed = _int8_panel(PanelKind.INT8_DIGITS, q, scale)
    if CpuLinear().int8_kind(torch.bfloat16) is not PanelKind.INT8_DIGITS:
        with pytest.raises(ValueError, match="INT8_DIGITS"):
            packed.matmul(x[:1])
        return
    _assert_rows_alike(packed, x)
    got = packed.matmul(x).double()  # [M, N]
    w = q.double() * scale.double()[:, None]  # [N, K]
    xd = x.double()
    amax = xd.abs().amax(1, keepdim=True)  # [M, 1]
    step = amax / (127 * 256)
    # 32,512 / max|x| as the kernel takes it: one correctly rounded division (torch divides a
    # scalar by a tensor through a reciprocal, an ulp off at times, which moves ties)
    inv = torch.tensor(
        [[(127 * 256) / a if a else 0.0] for a in amax.flatten().tolist()], dtype=torch.float64
    )
    as_ints = torch.round(xd * inv) * step  # [M, K]
    ulp = lambda v: 2.0 ** (torch.floor(torch.log2(v.abs().clamp_min(1e-30))) - 7)  # noqa: E731
    exact_int = as_ints @ w.T
    assert ((got - exact_int).abs() <= ulp(exact_int) / 2 * 1.0001).all()
    # against x itself: x moved by at most step / 2 per entry, so the product by at most
    # step / 2 times the column's sum of |w|, before the one rounding
    exact = xd @ w.T
    moved = step / 2 * w.abs().sum(1)[None, :]  # [M, N]
    assert ((got - exact).abs() <= moved + ulp(exact_int) / 2 * 1.0001).all()
    assert torch.equal(got[2], torch.zeros(n, dtype=torch.float64))
    x[3, k // 3] = float("nan")
    nan_out = packed.matmul(x[:5])
    assert nan_out[3].isnan().all() and not nan_out[[0, 1, 2, 4]].isnan().any()


def test_fp8_keeps_its_own_matmul() -> None:
    w, _ = _data((64, 64), torch.float32)
    assert CpuPacker().pack_quantized(quantize(w, Quant.FP8, row_absmax(w))) is None


def test_without_a_compiler_weights_take_onednn_named_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path / "cache"))
    w, x = _data((576, 1536), torch.float32)
    packer = CpuPacker()
    packed = packer.pack(w)
    assert isinstance(packed, PackedWeight)  # the oneDNN reordering (models.cpu.onednn)
    assert packer.fallbacks == 1
    assert packer.kernel.failed is not None and "no-such-cc" in packer.kernel.failed
    assert packer.describe().startswith("onednn (cpu_panel unavailable")
    assert packer.pack_quantized(quantize(w, Quant.INT8, row_absmax(w))) is None
    want = torch.nn.functional.linear(x, w)
    torch.testing.assert_close(packed.matmul(x), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.cpu_bf16)])
@pytest.mark.parametrize("quant", [Quant.NONE, Quant.INT8])
def test_verification_rows_equal_one_token_decodes(
    embedded_folder: Path, tmp_path: Path, dtype: str, quant: Quant
) -> None:
    """A model served as on a CPU (weights packed for the kernel): verifying k + 1 tokens gives
    each row the logits a one-token decode gives it, bit for bit."""
    folder = make_tiny_checkpoint(
        tmp_path / "m",
        embedded_folder,
        seed=5,
        num_layers=2,
        hidden=576,
        heads=9,
        kv_heads=3,
        vocab_size=512,
        intermediate=1536,
    )
    model = ModelSpec(str(folder), dtype, quantization=quant.value).load(ops=CpuRowOps())
    served = serve_on_cpu(model)
    assert served.packed
    if dtype == "float32" or torch.bfloat16 in _kinds():
        assert served.matmul_path().startswith("cpu_panel")
    assert_verification_equals_decodes(model, n=100, k=15, blocks=8, backend=served)
