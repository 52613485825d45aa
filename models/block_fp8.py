"""Block-wise fp8 checkpoints (``quant_method: fp8``, as Qwen3's and DeepSeek's ``-FP8`` models
ship): e4m3 weights with one ``weight_scale_inv`` per ``weight_block_size`` block, dequantized as
read; activations quantized per token in groups of the block's input width (``dynamic``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.prequantized import PrequantizedCheckpoint, whole_tensor
from models.weights import Sliceable, lazy_tensors

FP8_MAX = 448.0


def check_config(qcfg: dict[str, Any]) -> tuple[int, int]:
    """The (out, in) block; ValueError naming what tandem does not load."""
    if qcfg.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"unsupported quantization_config.fmt {qcfg['fmt']!r}: e4m3 only")
    if qcfg.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"unsupported quantization_config.activation_scheme {qcfg['activation_scheme']!r}: "
            "dynamic only"
        )
    block = qcfg.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(int(b) > 0 for b in block)):
        raise ValueError(
            f"unsupported quantization_config.weight_block_size {block!r}: fp8 checkpoints load "
            "block-wise ([out, in]) only"
        )
    return int(block[0]), int(block[1])


@dataclass(frozen=True)
class GroupFp8Input:
    """Each token's input in groups of ``group`` columns, each scaled to e4m3's range."""

    group: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t, n = x.shape
        g = x.float().view(t, n // self.group, self.group)
        s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        return ((g / s).to(torch.float8_e4m3fn).float() * s).view(t, n).to(x.dtype)


class BlockFp8Checkpoint(PrequantizedCheckpoint):
    def __init__(self, folder: Path, qcfg: dict[str, Any]) -> None:
        self.block = check_config(qcfg)
        self.skip = tuple(qcfg.get("modules_to_not_convert") or ())
        self._raw = lazy_tensors(folder)
        suffix = ".weight_scale_inv"
        self.quantized = frozenset(n.removesuffix(suffix) for n in self._raw if n.endswith(suffix))

    def __getitem__(self, name: str) -> Sliceable:
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in self.quantized:
            return self._dequantized(module)
        if name.endswith(".weight_scale_inv"):
            raise KeyError(name)
        return self._raw[name]

    def __iter__(self) -> Iterator[str]:
        return (n for n in sorted(self._raw) if not n.endswith(".weight_scale_inv"))

    def __len__(self) -> int:
        return len(self._raw) - len(self.quantized)

    def _dequantized(self, module: str) -> torch.Tensor:
        w = whole_tensor(self._raw[module + ".weight"]).float()  # [out, in] from e4m3
        s = whole_tensor(self._raw[module + ".weight_scale_inv"]).float()  # [out/bo, in/bi]
        bo, bi = self.block
        out, n = w.shape
        if s.shape != (-(-out // bo), -(-n // bi)):
            raise ValueError(f"{module}.weight_scale_inv is {tuple(s.shape)}, not per {bo}x{bi}")
        return w * s.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :n]

    def quantizes_input(self, module: str) -> bool:
        return module in self.quantized and not any(k in module for k in self.skip)

    def input_quant(self, layer_prefix: str, matmul: str) -> GroupFp8Input | None:
        parts = {
            "qkv_proj": ("self_attn.q_proj", "self_attn.qkv_proj"),
            "o_proj": ("self_attn.o_proj",),
            "gate_up_proj": ("mlp.gate_proj", "mlp.gate_up_proj"),
            "down_proj": ("mlp.down_proj",),
        }[matmul]
        if any(self.quantizes_input(layer_prefix + p) for p in parts):
            return GroupFp8Input(self.block[1])
        return None
