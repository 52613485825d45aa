"""GPTQ (v1, with and without act-order) and AWQ int4 checkpoints, packed by hand in each
format's layout (``bench.quantized_checkpoints.int4_checkpoint``): every matmul loads as the
weights the format means, (q - zero) * scale, and the model's logits equal those of the dense
model holding those weights; unsupported variants are refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bench.quantized_checkpoints import int4_checkpoint
from models.checkpoint import open_weights
from models.config import LlamaConfig
from tests.models.test_compressed import IDS, _ours


@pytest.mark.parametrize(("method", "act_order"), [("gptq", False), ("gptq", True), ("awq", False)])
def test_int4_layouts_load_as_the_weights_they_mean(
    tmp_path: Path, method: str, act_order: bool
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, meant = int4_checkpoint(tmp_path / method, "qwen3", method, act_order=act_order)
    weights = open_weights(folder)
    assert len(meant) == 14
    for name, want in meant.items():
        assert torch.equal(weights[name].narrow(0, 0, want.shape[0]), want), name
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config
    ref = AutoModelForCausalLM.from_config(config).float().eval()
    dense = {n: weights[n].narrow(0, 0, weights[n].shape[0]).float() for n in weights}
    assert not ref.load_state_dict(dense, strict=False).unexpected_keys
    with torch.no_grad():
        want_logits = ref(torch.tensor([IDS])).logits[0]
    assert (_ours(folder) - want_logits).abs().max().item() <= 1e-4


BASE = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip


@pytest.mark.parametrize(
    ("quant", "named"),
    [
        ({"quant_method": "gptq", "bits": 8}, "bits 8"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "'gemv'"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point false"),
    ],
)
def test_what_tandem_does_not_load_is_refused_by_name(quant: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError) as e:
        LlamaConfig.from_hf_dict({**BASE, "quantization_config": quant})
    assert named in str(e.value)


def test_the_packings_are_autoawqs_and_autogptqs() -> None:
    """Eight values 0..7 packed the way AutoAWQ's loop does (nibble i holds column
    [0, 2, 4, 6, 1, 3, 5, 7][i]) and AutoGPTQ's (nibble k holds row k) unpack in order."""
    from models.gptq import AWQ_READ, unpack_columns, unpack_rows

    awq = sum(v << (4 * i) for i, v in enumerate((0, 2, 4, 6, 1, 3, 5, 7)))
    got = unpack_columns(torch.tensor([[awq]], dtype=torch.int32), AWQ_READ)
    assert got.tolist() == [list(range(8))]
    gptq = sum(k << (4 * k) for k in range(8))
    assert unpack_rows(torch.tensor([[gptq]], dtype=torch.int32)).view(-1).tolist() == list(
        range(8)
    )
