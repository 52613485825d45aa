"""Block-wise fp8 checkpoints (``quant_method: fp8``, Qwen's and DeepSeek's ``-FP8`` format),
written by hand (``bench.quantized_checkpoints``), against a reference written here: each
weight the stored e4m3 values times its block's scale, each matmul's input quantized to e4m3
per token in groups of the block's width; also over TP = 2; and the variants tandem does not
load refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from bench.quantized_checkpoints import block_fp8_checkpoint
from models.config import LlamaConfig
from models.spec import ModelSpec
from tests.models.test_compressed import IDS, _ours
from tests.models.test_tensor_parallel import check_tp2_matches_tp1

BLOCK = 32


def _group_fp8(x: torch.Tensor) -> torch.Tensor:
    g = x.view(*x.shape[:-1], -1, BLOCK)
    s = g.abs().amax(-1, keepdim=True) / 448.0
    return ((g / s).to(torch.float8_e4m3fn).float() * s).view_as(x)


def test_block_fp8_matches_its_reference(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = block_fp8_checkpoint(tmp_path / "fp8", "qwen3", (BLOCK, BLOCK))
    [file] = sorted(folder.glob("*.safetensors"))
    stored = load_file(str(file))
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config
    ref = AutoModelForCausalLM.from_config(config).float().eval()
    weights: dict[str, torch.Tensor] = {}
    for name, t in stored.items():
        if name.endswith("_scale_inv"):
            continue
        scale = stored.get(name + "_scale_inv")
        if scale is None:
            weights[name] = t.float()
        else:  # one scale per BLOCK x BLOCK
            weights[name] = t.float() * scale.repeat_interleave(BLOCK, 0).repeat_interleave(
                BLOCK, 1
            )
    assert len([n for n in stored if n.endswith("_scale_inv")]) == 14
    assert not ref.load_state_dict(weights, strict=False).unexpected_keys

    def quantize_input(_m: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        return (_group_fp8(args[0]),)

    for name, m in ref.named_modules():
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            m.register_forward_pre_hook(quantize_input)
    with torch.no_grad():
        want = ref(torch.tensor([IDS])).logits[0]
    assert (_ours(folder) - want).abs().max().item() <= 1e-4


def test_block_fp8_splits_over_tp2(tmp_path: Path) -> None:
    check_tp2_matches_tp1(
        ModelSpec(str(block_fp8_checkpoint(tmp_path / "q", "qwen3", (BLOCK, BLOCK))))
    )


BASE = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip


@pytest.mark.parametrize(
    ("quant", "named"),
    [
        ({"activation_scheme": "static", "weight_block_size": [128, 128]}, "activation_scheme"),
        ({"fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
        ({"activation_scheme": "dynamic"}, "weight_block_size None"),
    ],
)
def test_what_tandem_does_not_load_is_refused_by_name(quant: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError) as e:
        LlamaConfig.from_hf_dict({**BASE, "quantization_config": {"quant_method": "fp8", **quant}})
    assert named in str(e.value)
