"""What every pre-quantized checkpoint format gives the loader: its tensors under their dense
names (quantized weights dequantized as read), and the activation quantization each matmul's
input needs. ``open_weights`` picks the format from ``quantization_config``."""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from models.weights import Sliceable, open_checkpoint

InputQuantizer = Callable[[torch.Tensor], torch.Tensor]  # [T, in] -> [T, in]


class PrequantizedCheckpoint(Mapping[str, Sliceable]):
    quantized: frozenset[str]  # the HF modules stored quantized, e.g. model.layers.0.mlp.up_proj

    @abstractmethod
    def quantizes_input(self, module: str) -> bool:
        """Whether HF matmul ``module``'s format quantizes its input."""

    @abstractmethod
    def input_quant(self, layer_prefix: str, matmul: str) -> InputQuantizer | None:
        """That of tandem matmul ``matmul`` (qkv_proj, o_proj, gate_up_proj, down_proj)."""


def open_weights(folder: Path) -> Mapping[str, Sliceable]:
    """A checkpoint's tensors by dense name: pre-quantized ones dequantized as read."""
    from models.block_fp8 import BlockFp8Checkpoint
    from models.compressed import CompressedCheckpoint
    from models.gptq import GptqCheckpoint

    qcfg = json.loads((folder / "config.json").read_text()).get("quantization_config")
    if qcfg is None:
        return open_checkpoint(folder)
    if qcfg.get("quant_method") == "fp8":
        return BlockFp8Checkpoint(folder, qcfg)
    if qcfg.get("quant_method") in ("gptq", "awq"):
        return GptqCheckpoint(folder, qcfg)
    return CompressedCheckpoint(folder, qcfg)


def whole_tensor(t: Sliceable) -> torch.Tensor:
    return t.narrow(0, 0, t.shape[0])
