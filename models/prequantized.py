"""What every pre-quantized checkpoint format gives the loader: its tensors under their dense
names (quantized weights dequantized as read), and the activation quantization each matmul's
input needs (``models.checkpoint.open_weights`` picks the format)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping

import torch

from models.quant import Quant
from models.weights import Sliceable

InputQuantizer = Callable[[torch.Tensor], torch.Tensor]  # [T, in] -> [T, in]


class PrequantizedCheckpoint(Mapping[str, Sliceable]):
    quantized: frozenset[str]  # the HF modules stored quantized, e.g. model.layers.0.mlp.up_proj

    @abstractmethod
    def quantizes_input(self, module: str) -> bool:
        """Whether HF matmul ``module``'s format quantizes its input."""

    @abstractmethod
    def input_quant(self, layer_prefix: str, matmul: str) -> InputQuantizer | None:
        """That of tandem matmul ``matmul`` (qkv_proj, o_proj, gate_up_proj, down_proj)."""

    def kernel_quant(self) -> Quant:
        """The kind tandem's own kernels serve this format in on a GPU (the dequantized weights
        quantized again per output channel give the stored values back), or NONE: dequantized
        weights at the model's dtype."""
        return Quant.NONE


def whole_tensor(t: Sliceable) -> torch.Tensor:
    return t.narrow(0, 0, t.shape[0])
