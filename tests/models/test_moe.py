"""Mixture-of-experts targets on the CPU as served: a verification of 15 tokens gives every row
the bits of its one-token decode (what keeps greedy speculation token-identical), in fp32,
bf16 and int8, for Qwen3-MoE (a dense first layer, 8 experts, top 2 renormalized) and Mixtral;
the router is served like any matmul but never quantized. Against transformers:
``tests/models/test_families.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.family_checkpoints import family_checkpoint
from models.kv_layout import kv_pool_shape
from models.llama import LlamaMLP
from models.moe import Router, SparseMoE
from models.spec import ModelSpec
from runtime.backends import model_backend
from tests.helpers import assert_verification_equals_decodes


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
@pytest.mark.parametrize(
    ("dtype", "quant"), [("float32", "none"), ("bfloat16", "none"), ("float32", "int8")]
)
def test_verification_equals_decodes_bit_for_bit(
    tmp_path: Path, family: str, dtype: str, quant: str
) -> None:
    model = ModelSpec(str(family_checkpoint(tmp_path / family, family)), dtype, quant).load()
    c = model.cfg
    kinds = [type(layer.mlp) for layer in model.layers]
    assert kinds == ([LlamaMLP, SparseMoE] if family == "qwen3-moe" else [SparseMoE, SparseMoE])
    # before packing: int8 experts hold a quantized kernel, the routers their own weights
    routers = [m for m in model.modules() if isinstance(m, Router)]
    assert routers and all(r.kernel is None and r.weight.dtype == model.dtype for r in routers)
    experts = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert all((e.experts[0].down_proj.kernel is not None) == (quant == "int8") for e in experts)
    pool = torch.zeros(kv_pool_shape(8, c.num_kv_heads, c.num_layers, 16, c.head_dim))
    served = model_backend(model, pool.to(model.dtype), 16)
    assert "mixture of experts" in str(served.describe()["layers"])
    assert_verification_equals_decodes(model, n=60, k=15, blocks=8, backend=served)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_experts_compute_what_the_per_expert_loop_does(tmp_path: Path, dtype: str) -> None:
    """The GPU's path (stacked experts, two ``torch._grouped_mm`` calls, no host sync), run here
    on the CPU, against each expert over its own tokens: the same logits to the dtype's
    rounding, over a prompt and decodes."""
    from models.backend import TorchBackend
    from runtime.backends import model_attention
    from runtime.runner import LocalRunner, SeqInput

    folder = family_checkpoint(tmp_path / "moe", "qwen3-moe")
    ids = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(4)).tolist()

    def logits(stacked: bool) -> torch.Tensor:
        model = ModelSpec(str(folder), dtype).load()
        blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
        if stacked:
            for m in blocks:
                m.stack_experts()
        assert all((m.gate_up is not None) == stacked for m in blocks)
        c = model.cfg
        pool = torch.zeros(
            kv_pool_shape(8, c.num_kv_heads, c.num_layers, 16, c.head_dim), dtype=model.dtype
        )
        backend = TorchBackend(model, model_attention(model, pool, 16))
        run = LocalRunner(model, pool, 16, backend).run
        table = list(range(1, 7))
        out = [run([SeqInput(table, 0, ids[:70], list(range(70)))]).logits]
        for p in range(70, 80):
            out.append(run([SeqInput(table, p, ids[p : p + 1], [0])]).logits)
        return torch.cat(out)

    tol = 1e-5 if dtype == "float32" else 3e-2
    torch.testing.assert_close(logits(True), logits(False), atol=tol, rtol=tol)
