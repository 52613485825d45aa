"""The layer program (``models.cpu.program``): a CPU step's decoder layers in one C call, bit for
bit what the modules compute, for the steps and models it takes; the rest run the modules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.cpu.attention import CpuAttentionBackend
from models.cpu.backend import CpuBackend
from models.cpu.linear import PanelUse
from models.cpu.paged import CpuPagedAttention
from models.cpu.program import LayerProgram, c_layout, py_layout
from models.cpu.row_ops import CpuRowOps
from models.kv_layout import kv_pool_shape, new_kv_pool
from models.quant import Quant
from models.spec import ModelSpec
from models.tree import TreeSpan
from runtime.backends import exact_attention, model_attention_spec
from runtime.runner import LocalRunner, SeqInput, StepResult
from tests.helpers import make_tiny_checkpoint

BS = 16
BLOCKS = 96


def _served(
    folder: Path, dtype: str, quant: Quant = Quant.NONE, max_new_tokens: int | None = None
) -> CpuBackend:
    """The model as a CPU replica serves it (``CpuBackend.apply``), over pools of BLOCKS."""
    model = ModelSpec(str(folder), dtype, quantization=quant.value).load(ops=CpuRowOps())
    c = model.cfg
    pool = torch.zeros(kv_pool_shape(BLOCKS, c.num_kv_heads, c.num_layers, BS, c.head_dim))
    spec = model_attention_spec(model, pool, BS)
    kernel = CpuPagedAttention(spec.group_size, spec.head_dim, max_new_tokens)
    attention = CpuAttentionBackend(spec, exact_attention(model), kernel)
    served = CpuBackend.apply(model, attention, PanelUse.ALWAYS)
    assert served.packed
    return served


def _steps(vocab: int) -> list[list[SeqInput]]:
    """Prompts, decodes of three sequences side by side, a k = 4 verification beside a decode,
    a draft tree, and a step with a 300-token prompt chunk beside a decode."""
    g = torch.Generator().manual_seed(7)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    tables = [list(range(i * 24, (i + 1) * 24)) for i in range(4)]
    steps = [[SeqInput(tables[i], 0, ids(40 + 17 * i), [39 + 17 * i]) for i in range(3)]]
    ctx = [40, 57, 74]
    for _ in range(3):
        steps.append([SeqInput(tables[i], ctx[i], ids(1), [0]) for i in range(3)])
        ctx = [c + 1 for c in ctx]
    steps.append(
        [
            SeqInput(tables[0], ctx[0], ids(5), list(range(5))),
            SeqInput(tables[1], ctx[1], ids(1), [0]),
        ]
    )
    tree = TreeSpan(ctx[2], (-1, 0, 0, 1, 2))  # 5 nodes after the context
    steps.append([SeqInput(tables[2], ctx[2], ids(5), list(range(5)), tree=tree)])
    steps.append(
        [SeqInput(tables[3], 0, ids(300), [299]), SeqInput(tables[0], ctx[0] + 5, ids(1), [0])]
    )
    return steps


def _run(
    served: CpuBackend, use: bool, block_major: bool = False
) -> tuple[list[StepResult], torch.Tensor]:
    model, program = served.model, served.program
    c = model.cfg
    shape = (BLOCKS, c.num_kv_heads, c.num_layers, BS, c.head_dim)
    pool = (
        new_kv_pool(*shape, model.dtype)
        if block_major
        else torch.zeros(kv_pool_shape(*shape), dtype=model.dtype)
    )
    served.program = program if use else None
    try:
        runner = LocalRunner(model, pool, BS, served)
        results = [runner.run(batch) for batch in _steps(c.vocab_size)]
    finally:
        served.program = program
    return results, pool


@pytest.fixture(scope="module")
def folder(embedded_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("program") / "m",
        embedded_folder,
        seed=11,
        num_layers=3,
        hidden=128,
        heads=4,
        kv_heads=2,
        vocab_size=512,
    )


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.cpu_bf16)])
def test_a_block_major_pool_gives_the_bits_of_a_layer_major_one(folder: Path, dtype: str) -> None:
    """Workers' pools are block-major (``kvtransfer.pool``): the program and the modules read
    and write one through its strides, with the bits a contiguous layer-major pool gives."""
    served = _served(folder, dtype)
    program = served.program
    assert program is not None, served.layers_path()
    want, pool_want = _run(served, True)
    for use in (True, False):
        steps, declined = program.steps, program.declined
        got, pool = _run(served, use, block_major=True)
        assert not pool.is_contiguous() and pool.transpose(0, 1).is_contiguous()
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a.logits, b.logits), f"step {i}, program {use}"
            assert torch.equal(a.all_hidden, b.all_hidden), f"step {i}, program {use}"
        assert torch.equal(pool, pool_want)
        assert program.steps - steps == (len(got) if use else 0)
        assert program.declined == declined


def test_fetching_the_next_layers_kv_changes_no_bit(folder: Path) -> None:
    """The program can bring each next layer's KV into cache while the MLP computes (prefetches
    through ``tandem_panel_linear_side``): the steps and the pool are those without it."""
    served = _served(folder, "float32")
    program = served.program
    assert program is not None, served.layers_path()
    program.fetch_next_kv = False
    want, pool_want = _run(served, True, block_major=True)
    program.fetch_next_kv = True
    got, pool = _run(served, True, block_major=True)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a.logits, b.logits), f"step {i}"
    assert torch.equal(pool, pool_want)


@pytest.mark.parametrize(
    ("dtype", "quant"),
    [
        ("float32", Quant.NONE),
        pytest.param("bfloat16", Quant.NONE, marks=pytest.mark.cpu_bf16),
        ("float32", Quant.INT8),
        pytest.param("bfloat16", Quant.INT8, marks=pytest.mark.cpu_bf16),
    ],
)
@pytest.mark.parametrize("max_new_tokens", [None, 256])  # 256: the 300-token chunk gathers
def test_the_program_gives_the_modules_bits(
    folder: Path, dtype: str, quant: Quant, max_new_tokens: int | None
) -> None:
    served = _served(folder, dtype, quant, max_new_tokens)
    program = served.program
    assert program is not None, served.layers_path()
    with_program, pool = _run(served, True)
    modules, pool_modules = _run(served, False)
    for i, (a, b) in enumerate(zip(with_program, modules, strict=True)):
        assert torch.equal(a.logits, b.logits), f"step {i}"
        assert torch.equal(a.all_hidden, b.all_hidden), f"step {i}"
    assert torch.equal(pool, pool_modules)  # the same keys and values written
    # every step is one in-place group, but where the long chunk gathers: that step it declines
    gathers = max_new_tokens is not None
    assert program.steps == len(with_program) - gathers
    assert program.declined == gathers


@pytest.mark.cpu_bf16  # a bf16 model: its matmuls take the panel kernel's bf16 kind
def test_a_verified_row_keeps_its_decode_bits_through_the_program(
    embedded_folder: Path, tmp_path: Path
) -> None:
    """What greedy speculation needs of the program: verifying k + 1 tokens gives each row the
    logits a one-token decode gives it (both run as programs)."""
    from tests.helpers import assert_verification_equals_decodes

    folder = make_tiny_checkpoint(
        tmp_path / "m",
        embedded_folder,
        seed=5,
        num_layers=2,
        hidden=128,
        heads=4,
        kv_heads=2,
        vocab_size=512,
    )
    served = _served(folder, "bfloat16", Quant.INT8)
    assert served.program is not None
    assert_verification_equals_decodes(served.model, n=20, k=15, blocks=4, backend=served)
    assert served.program.steps >= 16


def test_models_it_does_not_take_run_their_modules(folder: Path) -> None:
    served = _served(folder, "float32")
    model, attention = served.model, served.attention
    assert isinstance(attention, CpuAttentionBackend)
    assert LayerProgram.why_not(model, attention.kernel, packed=True) is None
    model.cfg = model.cfg.__class__(**{**model.cfg.__dict__, "qkv_bias": True})
    assert LayerProgram.why_not(model, attention.kernel, packed=True) == "attention biases"
    plain = ModelSpec(str(folder), "float32").load()  # not packed for the CPU
    assert LayerProgram.build(plain, attention.kernel, served.packer.kernel) is None
    assert "not packed for the CPU" in str(LayerProgram.why_not(plain, attention.kernel, False))


def test_a_drafter_reading_inner_layers_runs_the_modules(folder: Path) -> None:
    """An EAGLE-3 head reads the residual streams of inner layers: the program does not keep
    them, so those steps run the modules."""
    served = _served(folder, "float32")
    model, program = served.model, served.program
    assert program is not None
    model.feature_layers = (0, 2)
    c = model.cfg
    pool = torch.zeros(kv_pool_shape(BLOCKS, c.num_kv_heads, c.num_layers, BS, c.head_dim))
    runner = LocalRunner(model, pool, BS, served)
    out = runner.run([SeqInput(list(range(8)), 0, [5, 6, 7], [2])])
    assert out.all_hidden.shape == (3, 2 * c.hidden_size)
    assert program.steps == 0
    assert runner.describe()["layers"] == "modules (the drafter reads inner layers)"
    model.feature_layers = ()
    assert runner.describe()["layers"] == "program"


def test_the_ctypes_structs_mirror_the_c_side(folder: Path) -> None:
    """The structs ``models.cpu.program`` hands the C side have its sizes and field offsets
    (``tandem_layer_program_layout``): a field added on one side only fails here."""
    served = _served(folder, "float32")
    assert served.program is not None and served.program._lib is not None
    got = c_layout(served.program._lib)
    assert len(got) == len(py_layout()) > 4
    assert got == py_layout()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_product_is_silu_times_up(dtype: torch.dtype) -> None:
    ops = CpuRowOps()
    assert ops.ready()
    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(7, 2 * 300, generator=g) * 4).to(dtype)
    got = ops.silu_mul(gate_up, 300)
    want = (
        torch.nn.functional.silu(gate_up[:, :300].float()).to(dtype).float()
        * gate_up[:, 300:].float()
    )
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(got.float(), want, **tol)
    # each row alike whatever the row count
    for r in range(7):
        assert torch.equal(ops.silu_mul(gate_up[r : r + 1], 300)[0], got[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_products_vector_lanes_have_the_scalar_loops_bits(dtype: torch.dtype) -> None:
    """The SiLU runs 16 lanes at a time by hand where the CPU has AVX-512 and the rest of a row
    one value at a time: each row here repeats one gate value over 33 columns (two vectors and
    a one-value tail), so every column of a row must come out the same, whatever the value:
    ordinary, huge, past the clamps, subnormal, zero of either sign, infinite."""
    ops = CpuRowOps()
    assert ops.ready()
    g = torch.Generator().manual_seed(3)
    values = torch.cat(
        [
            torch.randn(64, generator=g) * 6,
            torch.tensor([1e-40, -1e-40, 0.0, -0.0, 87.0, -87.0, 88.5, -88.5, 300.0, -300.0]),
            torch.tensor([3e38, -3e38, float("inf"), -float("inf")]),
        ]
    )
    inter = 33
    gate = values[:, None].expand(-1, inter)
    up = torch.full_like(gate, 1.5)
    got = ops.silu_mul(torch.cat([gate, up], 1).contiguous().to(dtype), inter)
    assert torch.equal(got, got[:, -1:].expand(-1, inter))
    # and NaN stays NaN in every column
    nan = ops.silu_mul(torch.full((1, 2 * inter), float("nan")).to(dtype), inter)
    assert bool(nan.isnan().all())
